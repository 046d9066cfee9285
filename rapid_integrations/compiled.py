"""The draft's decode passes through torch.compile (`RapidEngine(compile_draft=True)`).

A draft pass of a small model on a CPU is mostly not arithmetic: for SmolLM2-135M in int4 on
a 75-token context, eager, about 6 of its 19 ms are Python (transformers' module calls) and
4 more are a few hundred small elementwise operations; inductor runs the pass as one graph
with those operations fused (docs/performance.md, "A compiled draft"). Only the draft is
compiled, and only its decode passes: prefill chunks stay eager (a long chunk is arithmetic,
and its attention is the engine's own prefill kernel). At eta = 0 the target alone decides
every emitted token (docs/algorithm.md section 4), so a compiled draft changes how fast drafts
come, never what is emitted; with eta > 0 the emitted law reads the draft's q (section 2.3),
which the graph rounds as any other kernel would.

The graphs are built when the engine is (`warm`), where a compile error is the caller's to
see: for SmolLM2-135M on two CPU cores 136 s the first time, 68 s once inductor's on-disk
cache holds the kernels (dynamo still traces the model). Dynamo keeps one graph for a pass of one token and one for passes of several
(`dynamic=True`, lengths symbolic), so neither the cache's growth nor the drafts' count
recompiles.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from .errors import RapidConfigError
from .kv import KVState

REGISTRY = "_CAN_RECORD_REGISTRY"
"""transformers' dict of model classes (`utils/output_capturing.py`), read by every forward."""

WARM_PROMPT = 8
"""Tokens the warm-up prefills: more than one, so no cache length is compiled as a constant
(dynamo specializes sizes 0 and 1)."""


class CompiledDecode(torch.nn.Module):
    """`model`'s forward compiled for decode passes, called as the model is (`KVState.decode`).

    A module of its own so that forward hooks see its passes (the bench's probe hooks it beside
    the models): the compiled forward bypasses the model's `__call__`, where its hooks run."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self._compiled = torch.compile(
            model.forward, dynamic=True, options={"guard_filter_fn": _without_registry_guards}
        )

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        # A fresh tensor [1, t]: the ids are often views into the prompt or the drafts, and
        # dynamo would guard on their storage offset (one more graph for offsets 0 and 1).
        return self._compiled(input_ids=input_ids.clone(), **kwargs)


def compile_decode(model: PreTrainedModel, vocab: int) -> CompiledDecode:
    """`model`'s forward compiled for decode passes, its graphs built now (`warm`).

    Raises `RapidConfigError("compile_draft")` when torch cannot compile the model here (no
    C++ compiler for inductor, an operation dynamo cannot trace), with the reason."""
    decode = CompiledDecode(model)
    try:
        warm(decode, vocab)
    except Exception as exc:  # dynamo and inductor raise many kinds; all mean "cannot"
        raise RapidConfigError(
            "compile_draft",
            f"torch.compile could not compile the draft model here ({type(exc).__name__}: "
            f"{exc}); build the engine without compile_draft",
        ) from exc
    return decode


def _without_registry_guards(entries: list[Any]) -> list[bool]:
    """Which of dynamo's guards to keep: all but those on transformers' registry of model
    classes (`_CAN_RECORD_REGISTRY`), which the forward reads for its own class and which
    grows whenever another model class is built (the retriever's embedder, loaded at the
    first retrieval): each growth would recompile both graphs."""
    return [REGISTRY not in entry.name for entry in entries]


@torch.inference_mode()  # as every call decodes (a tensor's mode is part of dynamo's guards)
def warm(decode: CompiledDecode, vocab: int) -> None:
    """Build `decode`'s graphs: a decode pass of one token, then one of two, on a scratch
    cache of `WARM_PROMPT` tokens of its model, as the engine's own draft passes run
    (`KVState.feed`)."""
    model, ids = decode.model, list(range(WARM_PROMPT))
    state = KVState.start(model, ids, vocab, WARM_PROMPT, WARM_PROMPT + 3, decode=decode)
    state.feed()
    state.feed(torch.tensor(ids[:2], device=model.device))
