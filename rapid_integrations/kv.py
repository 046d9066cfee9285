"""One model's KV cache for one call: chunked prefill, feeding tokens, and rollback."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass
class KVState:
    """A sequence being decoded by one model.

    Invariant: `cache` holds every token of the sequence except `pending`, the committed tokens
    the model has not read yet (the last prompt token at first, then the last emitted token).
    `vocab` is the shared vocabulary width; logits are cut to it so padded heads agree.
    """

    model: PreTrainedModel
    cache: DynamicCache
    pending: torch.Tensor  # [k] int64 on the model's device
    vocab: int
    forward_passes: int = 0

    @classmethod
    def start(cls, model: PreTrainedModel, prompt: list[int], vocab: int, chunk: int) -> KVState:
        """Prefill all but the last prompt token in chunks of `chunk`, keeping no logits."""
        device = model.device
        ids = torch.tensor(prompt, dtype=torch.long, device=device)
        state = cls(model, DynamicCache(config=model.config), ids[-1:], vocab)
        for start in range(0, len(prompt) - 1, chunk):
            part = ids[start : min(start + chunk, len(prompt) - 1)]
            # logits_to_keep=1: the prompt's full-vocabulary logits are never materialized.
            model(input_ids=part[None], **_cache_arg(model, state.cache), logits_to_keep=1)
        return state

    @property
    def length(self) -> int:
        """Tokens in the sequence, pending included."""
        return self.cache.get_seq_length() + int(self.pending.numel())

    def feed(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Read `pending` then `tokens` ([k] ids); return their logits, shape [len, vocab]."""
        ids = (
            self.pending
            if tokens is None
            else torch.cat([self.pending, tokens.to(self.pending.device)])
        )
        out = self.model(input_ids=ids[None], **_cache_arg(self.model, self.cache))
        self.pending = ids[:0]
        self.forward_passes += 1
        return out.logits[0, :, : self.vocab]

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens read (rejected drafts)."""
        if n > 0:
            self.cache.crop(-n)  # transformers 5: a negative count removes tokens

    def append(self, tokens: torch.Tensor) -> None:
        """Commit `tokens` ([k] ids) as pending: they are read on the next `feed`."""
        self.pending = torch.cat([self.pending, tokens.to(self.pending.device)])


@functools.cache
def _cache_param(model_type: type) -> str:
    # transformers renamed `past_key_values` to `cache` during 5.x; use whichever forward takes.
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_arg(model: PreTrainedModel, cache: DynamicCache) -> dict[str, Any]:
    return {_cache_param(type(model)): cache, "use_cache": True}
