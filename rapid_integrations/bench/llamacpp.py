"""llama.cpp as a bench contender, through llama-cpp-python.

The methods `llama.cpp` (greedy) and `llama.cpp-lookup` (its prompt-lookup drafting,
`LlamaPromptLookupDecoding`) run the very GGUF the engine's default model is converted from
(`models.default_gguf_path`, or `--model FILE.gguf`) on the very prompt ids the engine gets, so
prefill and decode rates compare like for like. llama-cpp-python is an optional extra
(`pip install "rapid-integrations[llamacpp]"`): it compiles llama.cpp from source, so where it
is missing the methods are skipped with one log line and the run goes on.

Settings that make the comparison fair: greedy (temperature 0, top-k 1, no repeat penalty),
threads = the count the engine's torch runs with (`threads.configure_torch_threads`),
llama.cpp's default batch sizes (what its users get), RoPE scaled as the engine's target is
(`rope_kwargs`: none within SmolLM2's 8K window; linear or YaRN past it, both expressible in
llama.cpp), and a context just large enough for the prompt and the answer. The library runs
on the CPU whatever device the engine is on (a source build without a GPU backend).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rapid_integrations.errors import (
    ContextWindowExceededError,
    RapidConfigError,
    VocabularyMismatchError,
)
from rapid_integrations.models.loading import default_gguf_path
from rapid_integrations.tokens import Detokenizer

log = logging.getLogger(__name__)

LIBRARY = "llama_cpp"
INSTALL = 'pip install "rapid-integrations[llamacpp]"'
BUILD_TIME = "about 18 minutes on 2 cores"
"""How long pip takes to compile llama-cpp-python 0.3.36 from source (docs/benchmarks.md)."""
LOOKUP_NGRAM = 2
"""The longest n-gram the prompt lookup matches: llama-cpp-python's default, and transformers'
(`max_matching_ngram_size`), as hf-pld uses."""
ROPE_SCALING = {"linear": 1, "yarn": 2}
"""llama.cpp's `llama_rope_scaling_type` values (llama.h) for the transformers RoPE types it
can express the same way."""
YARN_KEYS = {"rope_theta", "rope_type", "factor", "original_max_position_embeddings"}
YARN_BETAS = {"beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}
"""transformers' YaRN parameters with a llama.cpp argument of the same meaning; llama.cpp applies
YaRN's attention scaling (0.1 ln(factor) + 1) itself, as transformers does by default, so a
config giving its own `attention_factor` or `mscale` is refused."""
VOCAB_PROBE = (
    "<|im_start|>user\nHello, World!  Tabs\tand 1234567 digits, naïve café, 日本語, "
    "def f(x):\n    return x**2  # ok<|im_end|>\n"
)
"""Text both tokenizers must split into the same ids: chat markup, digits, accents, CJK, code."""


class LlamaLike(Protocol):
    """The part of `llama_cpp.Llama` the methods use (tests pass a fake of the same shape)."""

    def n_vocab(self) -> int: ...
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]: ...
    def reset(self) -> None: ...
    def eval(self, tokens: Sequence[int]) -> None: ...
    def generate(self, tokens: Sequence[int], **sampling: Any) -> Generator[int, Any, None]: ...
    def close(self) -> None: ...


@functools.cache
def available() -> bool:
    """Whether llama-cpp-python is installed; logs once per process when it is not."""
    if importlib.util.find_spec(LIBRARY) is not None:
        return True
    log.warning(
        "skipping the llama.cpp bench methods: llama-cpp-python is not installed; "
        "%s (it compiles llama.cpp from source, %s)",
        INSTALL,
        BUILD_TIME,
    )
    return False


def gguf_file(model: str | None) -> Path | None:
    """The GGUF llama.cpp runs for the bench's `--model`: the embedded default's file when none
    is given, the file itself when it is a .gguf; None when the model is not a GGUF."""
    if model is None:
        return default_gguf_path()
    return Path(model).expanduser() if str(model).endswith(".gguf") else None


def rope_kwargs(rope: Mapping[str, Any]) -> dict[str, Any]:
    """llama.cpp's context arguments for the transformers `rope_parameters` of the engine's
    target: nothing for its native RoPE (the GGUF's base frequency is the same), the same
    stretch for linear and YaRN scaling; `RapidConfigError` for what llama.cpp cannot express."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return {}
    if kind not in ROPE_SCALING:
        raise RapidConfigError(
            "methods", f"llama.cpp cannot run RoPE scaling {kind!r} as transformers does"
        )
    factor = float(rope["factor"])
    args: dict[str, Any] = {
        "rope_scaling_type": ROPE_SCALING[kind],
        "rope_freq_scale": 1 / factor,
    }
    if kind == "yarn":
        extra = set(rope) - YARN_KEYS - YARN_BETAS.keys()
        if extra:
            raise RapidConfigError(
                "methods", f"llama.cpp cannot express YaRN's {sorted(extra)} as transformers does"
            )
        args["yarn_orig_ctx"] = int(rope["original_max_position_embeddings"])
        args |= {arg: float(rope[key]) for key, arg in YARN_BETAS.items() if key in rope}
    return args


def llama_kwargs(
    gguf: Path,
    context: int,
    threads: int,
    rope: Mapping[str, Any],
    lookup_tokens: int = 0,
) -> dict[str, Any]:
    """`llama_cpp.Llama`'s arguments but the draft model: the GGUF, a context of `context`
    tokens (prompt and answer, `context_size`) and room for one pass of `lookup_tokens` drafts
    past it, `threads` for prefill and decode alike, the target's RoPE scaling; quiet."""
    return {
        "model_path": str(gguf),
        "n_ctx": context + lookup_tokens,
        "n_threads": threads,
        "n_threads_batch": threads,
        # With a draft model, llama-cpp-python 0.3 keeps every position's logits but sizes
        # their array by this argument: left False, it holds one batch (512 rows) and the
        # eval of a longer prompt fails ("could not broadcast ... into shape (0,)").
        "logits_all": lookup_tokens > 0,
        "verbose": False,
        **rope_kwargs(rope),
    }


def load(
    gguf: Path,
    context: int,
    threads: int,
    rope: Mapping[str, Any],
    lookup_tokens: int = 0,
    library: Any = None,
) -> LlamaLike:
    """A `Llama` on `gguf` (`llama_kwargs`), with the prompt-lookup draft model when
    `lookup_tokens` > 0. `library`: the llama_cpp module (imported when None)."""
    lib = library or importlib.import_module(LIBRARY)
    args = llama_kwargs(gguf, context, threads, rope, lookup_tokens)
    if lookup_tokens:
        speculative = lib.llama_speculative
        args["draft_model"] = speculative.LlamaPromptLookupDecoding(
            max_ngram_size=LOOKUP_NGRAM, num_pred_tokens=lookup_tokens
        )
    llama: LlamaLike = lib.Llama(**args)
    return llama


def check_vocabulary(llama: LlamaLike, tokenizer: Any, vocab_size: int) -> None:
    """Raise `VocabularyMismatchError` unless the GGUF's vocabulary is the engine's: the same
    size, and `VOCAB_PROBE` split into the same ids (else llama.cpp would read other tokens)."""
    theirs = llama.n_vocab()
    if theirs != vocab_size:
        raise VocabularyMismatchError(
            f"llama.cpp's vocabulary has {theirs} tokens, the engine's {vocab_size}: the GGUF "
            "is not the engine's model"
        )
    mine = tokenizer.encode(VOCAB_PROBE, add_special_tokens=False)
    got = llama.tokenize(VOCAB_PROBE.encode(), add_bos=False, special=True)
    if got != mine:
        raise VocabularyMismatchError(
            f"llama.cpp splits a probe text into other token ids than the engine's tokenizer "
            f"({got[:12]} against {mine[:12]}): the GGUF is not the engine's model"
        )


def context_size(prompt_tokens: int, max_new_tokens: int, window: int) -> int:
    """Tokens of context a call needs: the prompt and its answer, the answer cut at the
    target's `window` as the engine cuts it; `ContextWindowExceededError` when the prompt
    alone fills the window (the engine's own rule)."""
    if prompt_tokens >= window:
        raise ContextWindowExceededError(prompt_tokens, window, "llama.cpp")
    return prompt_tokens + min(max_new_tokens, window - prompt_tokens)


@dataclass(frozen=True)
class Generation:
    """One timed greedy generation (seconds from the start of the call).

    tokens: the answer's ids, without the end-of-sequence id; prefill_seconds: the eval of
    the prompt; first_token_seconds: to the first generated token (the prompt's eval and its
    sampling); total_seconds: to the last kept token; passes: evals (the prompt's counts
    once); drafted: lookup tokens sent to evals; yielded: tokens the library produced
    (the answer, plus an end-of-sequence id it ended at)."""

    tokens: list[int]
    text: str
    finish_reason: str
    prefill_seconds: float
    first_token_seconds: float
    total_seconds: float
    passes: int
    drafted: int
    yielded: int

    @property
    def accepted(self) -> int:
        """Drafted tokens the library kept: each pass emits one token of its own and the
        drafts it confirmed."""
        return max(0, self.yielded - self.passes)


class _EvalClock:
    """Wraps a Llama's `eval` (instance attribute: `generate` calls `self.eval`) to count the
    passes and their drafts and to time the first, the prompt's."""

    def __init__(self, llama: LlamaLike, clock: Callable[[], float]) -> None:
        self.sizes: list[int] = []
        self.prompt_end: float | None = None
        self._eval, self._clock = llama.eval, clock
        llama.eval = self  # type: ignore[method-assign]  # counted from now on

    def __call__(self, tokens: Sequence[int]) -> None:
        self._eval(tokens)
        self.sizes.append(len(tokens))
        if self.prompt_end is None:
            self.prompt_end = self._clock()


def generate(
    llama: LlamaLike,
    ids: Sequence[int],
    tokenizer: Any,
    *,
    max_new_tokens: int,
    eos: frozenset[int],
    stop: Sequence[str] = (),
    clock: Callable[[], float] = time.perf_counter,
) -> Generation:
    """Greedy generation from an empty cache on `ids`, ended as the engine ends it: at an id
    of `eos`, at a stop string (the text cut before it), or after `max_new_tokens`."""
    evals = _EvalClock(llama, clock)
    detok = Detokenizer(tokenizer, stop)
    tokens: list[int] = []
    first: float | None = None
    reason, yielded = "length", 0
    llama.reset()  # a cold call: the prompt is evaluated in full
    start = clock()
    stream = llama.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    try:
        for token in stream:
            yielded += 1
            first = clock() if first is None else first
            if token in eos:
                reason = "eos"
                break
            tokens.append(token)
            detok.push(token)
            if detok.stopped or len(tokens) >= max_new_tokens:
                reason = "stop" if detok.stopped else "length"
                break
    finally:
        stream.close()  # frees the generator's frame, which holds the sampler
    end = clock()
    detok.finish()
    return Generation(
        tokens=tokens,
        text=detok.text,
        finish_reason=reason,
        prefill_seconds=(evals.prompt_end or end) - start,
        first_token_seconds=(first or end) - start,
        total_seconds=end - start,
        passes=len(evals.sizes),
        drafted=sum(size - 1 for size in evals.sizes[1:]),
        yielded=yielded,
    )
