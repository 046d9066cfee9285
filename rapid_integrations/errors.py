"""Errors the package raises on purpose. Everything derives from `RapidError`."""

from __future__ import annotations


class RapidError(Exception):
    """Base class of every error rapid-integrations raises on purpose."""


class RapidConfigError(RapidError, ValueError):
    """An invalid configuration value. `field` names the offending `RapidConfig` field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class RapidInputError(RapidError, ValueError):
    """A prompt, message list or argument the engine cannot use (empty, wrong type, bad role)."""


WINDOW_REMEDIES = """
To read a longer document, put only its relevant passages in the prompt (a retriever or query
engine in front of the model; mode 'rapid' already gives the draft a retrieved context C^S of
the prompt, docs/retrieval.md), or keep the prompt's head and tail with truncation='head_tail':
  engine:     engine.generate(prompt, truncation='head_tail'), or RapidConfig(truncation=...)
  LangChain:  ChatRapid(rapid_config={'truncation': 'head_tail'}), or .invoke(..., truncation=...)
  LlamaIndex: RapidLLM(rapid_config={'truncation': 'head_tail'}), or .complete(..., truncation=...)
  server:     extra_body={'truncation': 'head_tail'} (a top-level field of the request)
  CLI:        rapid ask/chat --truncation head_tail"""
"""Where `truncation` goes in each entry point, appended to `ContextWindowExceededError`."""


class ContextWindowExceededError(RapidError):
    """A prompt longer than the model's context window (sizes in tokens).

    Deliberately not a `ValueError`: LlamaIndex's refine / compact synthesizers catch
    `ValueError` from the LLM as an output-parsing failure and answer "Empty Response", which
    would hide the overrun.
    """

    def __init__(self, prompt_tokens: int, context_window: int, model: str = "target") -> None:
        super().__init__(
            f"the {model} prompt has {prompt_tokens} tokens but the {model} model's context "
            f"window is {context_window} tokens (at least one token must be left to generate)."
            + WINDOW_REMEDIES
        )
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window


class VocabularyMismatchError(RapidError, ValueError):
    """Draft and target do not share token ids, so draft tokens cannot be verified."""


class ModelNotFoundError(RapidError, FileNotFoundError):
    """A model (or the embedded default) is not where it was asked for; the message says how to get it."""


class DeviceOutOfMemoryError(RapidError, MemoryError):
    """A model ran out of memory (GPU or CPU) during a call; the original error is `__cause__`.

    The engine stays usable: the failed call's caches are freed (even while this error is
    held) and the cross-call prefix cache is emptied. The message says what to lower.
    """


class NumericalError(RapidError, FloatingPointError):
    """A model produced NaN or infinite logits; nothing is sampled from them."""


class RetrievalError(RapidError):
    """A retriever failed and the configured fallback is to raise."""


class GrammarError(RapidError, ValueError):
    """A grammar, JSON schema or tool spec that cannot be enforced (invalid, or a feature the
    grammar library cannot compile); the message names the cause."""
