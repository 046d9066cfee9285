"""`EngineHandle`: the one engine of an adapter instance, given ready or built on first use.

Both adapters (LangChain's `ChatRapid` / `RapidLLM`, LlamaIndex's `RapidLLM`) hold one: it
builds the engine from a `LoadSpec` once, even under concurrent first calls, and answers what
a framework asks before any call (the tokenizer, for counting tokens or reading the chat
template; the context window; the model's name) without loading weights. Framework-free.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rapid_integrations.adapters.params import LoadSpec, check_engine_alone, model_name
from rapid_integrations.adapters.timeouts import TimedRun
from rapid_integrations.batching.batcher import batched_stream
from rapid_integrations.engine.call_options import CallOptions
from rapid_integrations.tokens import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rapid_integrations.engine.rapid_engine import RapidEngine


class EngineHandle:
    """A ready `engine`, or the engine that `loading` (`LoadSpec`'s fields) builds on first
    use, once, under a lock. Everything is checked here, before any weights load: an engine
    with any model or loading argument raises `RapidConfigError` (field "engine"), since the
    engine brings its own models.
    """

    def __init__(self, engine: RapidEngine | None, loading: Mapping[str, Any]) -> None:
        check_engine_alone(engine, loading)
        self.spec = LoadSpec(**loading)
        self.given = engine
        self._engine = engine
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._lock = threading.Lock()

    @property
    def built(self) -> RapidEngine | None:
        """The engine if it exists yet (given, or built by an earlier call), else None."""
        return self._engine

    def get(self) -> RapidEngine:
        """The engine, loading the weights on first use."""
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    # A tokenizer loaded already (for counting) is not loaded twice.
                    self._engine = self.spec.build(self._tokenizer)
        return self._engine

    def stream(self, prompt: Prompt, options: CallOptions, timeout: float | None) -> TimedRun:
        """One call in the engine's batch (`batcher.batched_stream`: calls made at the same
        time decode together, each getting the answer it gets alone), under `timeout`."""
        return TimedRun(batched_stream(self.get(), prompt, options), timeout)

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The target's tokenizer: the engine's once it exists, else loaded alone (no weights)
        and kept for the build."""
        if self._engine is not None:
            return self._engine.tokenizer
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self.spec.load_tokenizer()
            return self._tokenizer

    def context_window(self) -> int:
        """The target's window in tokens, read from its config when no engine exists yet."""
        if self._engine is not None:
            return self._engine.context_window
        return self.spec.context_window()

    @property
    def label(self) -> str:
        """The target model's name for metadata and tracing, known without loading anything:
        a given engine's model, else the name `model` was given as."""
        return model_name(self.given.model_name) if self.given is not None else self.spec.label
