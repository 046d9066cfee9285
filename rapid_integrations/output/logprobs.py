"""Log probabilities of the emitted tokens (docs/algorithm.md section 12); their OpenAI shapes
are in `openai_logprobs` (torch-free, for the server and the adapters).

`LogprobScorer` reads, after each verdict, only the rows of the tokens the pass committed:
one log-softmax per committed row, a gather, and `torch.topk` when alternatives are asked
for. Calls that do not ask for log probabilities never make one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from rapid_integrations.config import RapidConfig
from rapid_integrations.output.outputs import TokenLogprob
from rapid_integrations.sample.verify import p_hat_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def token_bytes(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[bytes]:
    """Each token id's exact bytes, [vocab_size]: xgrammar's decoded vocabulary (byte-level
    BPE, byte fallback and plain vocabularies alike). Without xgrammar (the `grammar` extra),
    each token decoded on its own, where a part of a character becomes U+FFFD."""
    try:
        import xgrammar as xgr
    except ImportError:
        return [
            cast(str, tokenizer.decode([i], skip_special_tokens=False)).encode()
            for i in range(vocab_size)
        ]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return list(info.decoded_vocab[:vocab_size])


class LogprobScorer:
    """The `TokenLogprob`s of one call, in the order tokens are committed.

    `score` runs once per target pass on its committed rows; `commit` then hands out one entry
    per token as the engine commits it, keeping those that entered the output (`kept`: not
    the end-of-sequence token).
    """

    def __init__(self, cfg: RapidConfig, vocab: Sequence[bytes]) -> None:
        self._cfg = cfg
        self._vocab = vocab
        self._scored: deque[TokenLogprob] = deque()
        self.kept: list[TokenLogprob] = []

    def score(
        self,
        logits: torch.Tensor,
        shaped: torch.Tensor,
        q: torch.Tensor | None,
        end_ids: torch.Tensor | None,
        tokens: list[int],
        lean: torch.Tensor | None = None,
    ) -> None:
        """Score the k `tokens` one pass committed. logits: the model's raw rows [>= k, V]
        (row i predicts token i); shaped: the same rows as the verdict read them (grammar,
        repetition penalty); q: the draft's rows [<= k, V] or None; lean: the verdict's rows
        that leaned ([len(q)] bool, None: all)."""
        rows = len(tokens)
        logp = torch.log_softmax(logits[:rows].to(_wide(logits.dtype)), dim=-1)
        ids = torch.tensor(tokens, device=logp.device)[:, None]
        chosen = logp.gather(1, ids)[:, 0].tolist()
        p_hat: list[float | None] = [None] * rows
        if self._cfg.logprobs_p_hat:
            rows_p_hat = p_hat_rows(shaped[:rows], q, self._cfg, end_ids, lean)
            p_hat = rows_p_hat.gather(1, ids.to(rows_p_hat.device))[:, 0].log().tolist()
        top_values: list[list[float]] = [[]] * rows
        top_ids: list[list[int]] = [[]] * rows
        if self._cfg.top_logprobs:
            top = logp.topk(self._cfg.top_logprobs, dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for token, lp, lq, values, alternatives in zip(
            tokens, chosen, p_hat, top_values, top_ids, strict=True
        ):
            top_entries = tuple(
                self._entry(t, v) for t, v in zip(alternatives, values, strict=True)
            )
            self._scored.append(self._entry(token, lp, lq, top_entries))

    def _entry(
        self,
        token: int,
        logprob: float,
        p_hat: float | None = None,
        top: tuple[TokenLogprob, ...] = (),
    ) -> TokenLogprob:
        raw = self._vocab[token]
        return TokenLogprob(token, raw.decode("utf-8", errors="replace"), raw, logprob, p_hat, top)

    def commit(self, kept: bool) -> tuple[TokenLogprob, ...]:
        """The next committed token's entry: (entry,) if it entered the output, else ()."""
        entry = self._scored.popleft()
        if not kept:
            return ()
        self.kept.append(entry)
        return (entry,)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)
