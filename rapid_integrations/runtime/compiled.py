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
see: for SmolLM2-135M on two CPU cores the engine took 106 s to build the first time, 84 s
once inductor's on-disk cache held the kernels (2026-12-05). There are two, compiled ahead
of time (`aot_compile`, lengths symbolic): one for a pass of one token and one for passes of
several, so neither the cache's growth nor the drafts' count recompiles. A pass does not go
through dynamo's guard check, which cost SmolLM2's draft 1.9 of its 16 ms a pass: the guards
are checked on a sequence's first pass through each graph, and what changes between its
passes (its length, the pass's width) on every pass (`CompiledDecode.graph_for`); a pass
outside them runs the model itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch._dynamo.config
from transformers import DynamicCache, PreTrainedModel

from rapid_integrations.errors import RapidConfigError
from rapid_integrations.runtime.kv import BufferedLayer, KVState, cache_param

REGISTRY = "_CAN_RECORD_REGISTRY"
"""transformers' dict of model classes (`utils/output_capturing.py`), read by every forward."""

WARM_PROMPT = 8
"""Tokens the warm-up prefills: more than one, so no cache length is compiled as a constant
(dynamo specializes sizes 0 and 1)."""

KEPT_GUARDS = ("TENSOR_MATCH", "SHAPE_ENV", "EQUALS_MATCH", "NONE_MATCH", "DICT_LENGTH")
"""The kinds of dynamo's guards a graph keeps (`_kept_guards`)."""

MIN_LENGTH = 2
"""The shortest cache a graph reads: dynamo specializes sizes 0 and 1, so the graphs hold for
lengths from 2 only (one of their guards)."""


class CompiledDecode(torch.nn.Module):
    """`model`'s forward compiled for decode passes, called as the model is (`KVState.decode`).

    A module of its own so that forward hooks see its passes (the bench's probe hooks it beside
    the models): the compiled forward bypasses the model's `__call__`, where its hooks run."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.graphs: dict[bool, Any] = {}  # torch's AOTCompiledFunction, by "several tokens"
        # Per cache, the graphs whose guards it passed (True) or failed (False).
        self.checked: weakref.WeakKeyDictionary[DynamicCache, dict[bool, bool]] = (
            weakref.WeakKeyDictionary()
        )
        # mypy takes a class for unhashable here (python/mypy#20409); classes hash by identity.
        self._param = cache_param(type(model))  # type: ignore[arg-type]

    def build(self, state: KVState, several: bool) -> None:
        """Compile the graph for passes of several tokens (`several`) or one, tracing a pass
        of two or one on `state` (the pass is traced, not run)."""
        ids = torch.zeros((1, 1 + several), dtype=torch.long, device=self.model.device)
        step: Any = torch.compile(  # its ahead-of-time compile is not in torch's stubs
            _step(self.model, self._param),
            dynamic=True,
            fullgraph=True,
            options={"guard_filter_fn": _kept_guards},
        )
        # A float the model reads (its norms' epsilon) would otherwise become a tensor, whose
        # restart of the analysis an ahead-of-time compile does not take.
        with torch._dynamo.config.patch(specialize_float=True):
            graph = step.aot_compile(((ids, state.cache), {}))
        graph.disable_guard_check()  # checked in `graph_for`
        self.graphs[several] = graph

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        cache = kwargs.get(self._param)
        # The graphs take the ids and the cache alone: any other argument is the model's.
        plain = kwargs.keys() <= {self._param, "use_cache", "logits_to_keep"}
        if plain and cache is not None and kwargs.get("use_cache", True):
            graph = self.graph_for(input_ids, cache, kwargs.get("logits_to_keep", 0))
        else:
            graph = None
        if graph is None:
            return self.model(input_ids=input_ids, **kwargs)
        # A fresh tensor [1, t]: the ids are often views into the prompt or the drafts, at
        # storage offsets the graph was not traced with.
        return graph(input_ids.clone(), cache)

    def graph_for(self, input_ids: torch.Tensor, cache: DynamicCache, keep: int) -> Any:
        """The graph that runs this pass ([1, t] ids on `cache`, `keep` logit rows), or None
        for the model itself: a pass of at least one token keeping every row, on full-attention
        buffers with room for the ids, at least `MIN_LENGTH` long, whose cache passed the
        graph's guards."""
        if keep != 0 or not cache.layers:
            return None
        if not all(type(layer) is BufferedLayer for layer in cache.layers):
            return None
        first = cast(BufferedLayer, cache.layers[0])
        length, width = first.length, input_ids.shape[-1]
        if length < MIN_LENGTH or width < 1 or length + width > first.capacity:
            return None
        several = width > 1
        graph = self.graphs[several]
        passed = self.checked.setdefault(cache, {})
        if several not in passed:
            passed[several] = graph.guard_check(input_ids.clone(), cache)
        return graph if passed[several] else None


def compile_decode(model: PreTrainedModel, vocab: int) -> CompiledDecode:
    """`model`'s forward compiled for decode passes, its graphs built now (`warm`).

    Raises `RapidConfigError("compile_draft")` when torch cannot compile the model here (no
    C++ compiler for inductor, an operation dynamo cannot trace, a torch without ahead-of-time
    compiles), with the reason."""
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


def _step(model: PreTrainedModel, param: str) -> Callable[[torch.Tensor, DynamicCache], Any]:
    """`model`'s decode pass as a function of the ids and the cache alone, passed as `param`
    (a closure: an ahead-of-time compile would otherwise record the module it is a method
    of)."""

    def step(input_ids: torch.Tensor, cache: DynamicCache) -> Any:
        return model.forward(
            input_ids=input_ids, **{param: cache}, use_cache=True, logits_to_keep=0
        )

    return step


def _kept_guards(entries: list[Any]) -> list[bool]:
    """Which of dynamo's guards to keep: those on tensors (dtype, device, shape, strides), on
    the sizes' relations and on plain values (an ahead-of-time compile saves its guards, and
    one naming a class defined in a function, as transformers' forwards hold, cannot be
    saved), but those on transformers' registry of model classes (`_CAN_RECORD_REGISTRY`),
    which the forward reads for its own class and which grows whenever another model class
    is built (the retriever's embedder, loaded at the first retrieval)."""
    return [
        REGISTRY not in entry.name and not entry.is_global and entry.guard_type in KEPT_GUARDS
        for entry in entries
    ]


@torch.inference_mode()  # as every call decodes
def warm(decode: CompiledDecode, vocab: int) -> None:
    """Build `decode`'s graphs on a scratch cache of `WARM_PROMPT` tokens of its model, then
    run a pass of one token and one of two through them, as the engine's own draft passes
    run (`KVState.feed`)."""
    model, ids = decode.model, list(range(WARM_PROMPT))
    state = KVState.start(model, ids, vocab, WARM_PROMPT, WARM_PROMPT + 3, decode=decode)
    for several in (False, True):
        decode.build(state, several)
    state.feed()
    state.feed(torch.tensor(ids[:2], device=model.device))
