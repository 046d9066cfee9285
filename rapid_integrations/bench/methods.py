"""The contenders and how one generation of each is measured.

Engine methods (`lc`, `rag`, `sd`, `rapid`, and `magicdec`: the target drafting for itself over
the attention sinks and recent window of its prompt, `bench/magicdec.py`) run through
`RapidEngine.generate`; the baselines a user would reach for run through transformers
`generate` on the target: greedy (`hf`) and prompt-lookup decoding (`hf-pld`); and, opt-in,
llama.cpp on the GGUF the embedded model ships as, greedy (`llama.cpp`) and with its prompt
lookup (`llama.cpp-lookup`), through llama-cpp-python (`bench/llamacpp.py`). Every measurement
returns the same fields, so one results record layout covers all of them (see `Measurement`).

Timing definitions (seconds): prefill_seconds is the prompt's prefill (for transformers, the
time to the first token, which includes it); time_to_first_token is from the call to the
first generated token; decode_seconds covers the tokens after prefill, and
decode_tokens_per_second = new tokens / decode_seconds (for transformers and llama.cpp: tokens
after the first / time after the first; llama.cpp's prefill_seconds is its eval of the prompt);
call_seconds is from the call to its return, the whole answer (llama.cpp: to its last token,
the model's load excluded). The record's `end_to_end_seconds` adds what the call did not do
itself (`bench/runner.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from rapid_integrations.config import Mode
from rapid_integrations.engine.rapid_engine import RapidEngine
from rapid_integrations.output.outputs import RapidStats
from rapid_integrations.tokens import Detokenizer, encode_prompt

from . import llamacpp, magicdec
from .probe import (
    DecodeTimings,
    ForwardProbe,
    current_memory_bytes,
    peak_memory_bytes,
    reset_peak_memory,
)

ENGINE_METHODS = ("lc", "rag", "sd", "rapid", "magicdec")
HF_METHODS = ("hf", "hf-pld")
LLAMA_METHODS = ("llama.cpp", "llama.cpp-lookup")
METHODS = ENGINE_METHODS + HF_METHODS + LLAMA_METHODS
OPT_IN_METHODS = ("magicdec", *LLAMA_METHODS)
"""Methods a run includes only when named (`--methods`; magicdec also in the `--long` preset):
a self-draft of the full target on every QA task costs more than it tells there, and the
llama.cpp methods need an optional extra that compiles from source."""
DEFAULT_METHODS = tuple(m for m in METHODS if m not in OPT_IN_METHODS)
PROMPT_LOOKUP_TOKENS = 10
"""Draft length of transformers' prompt-lookup decoding (the value its docs suggest)."""


@dataclass(frozen=True)
class Method:
    """One contender: a name from `METHODS`, eta for `rapid`, and optionally a named variant
    with its `RapidConfig` overrides (e.g. "gamma=4" with (("gamma", 4),)). `magicdec`'s
    eta (0) and overrides are its own (`Method.of`)."""

    name: str
    eta: float | None = None
    variant: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name: str) -> Method:
        """The method `name` with its own settings: `magicdec` at eta 0 without copies."""
        return cls(name, 0.0, options=magicdec.OPTIONS) if name == "magicdec" else cls(name)

    @property
    def label(self) -> str:
        base = f"rapid eta={self.eta:g}" if self.name == "rapid" else self.name
        return f"{base} {self.variant}" if self.variant else base

    @property
    def retrieves(self) -> bool:
        """True when the method's draft reads the retrieved context C^S."""
        return self.name in ("rag", "rapid")


@dataclass(frozen=True)
class Measurement:
    """What one generation produced and cost (tokens, seconds, bytes; None: not applicable)."""

    answer: str
    finish_reason: str
    context_tokens: int
    draft_context_tokens: int
    new_tokens: int
    prefill_seconds: float
    time_to_first_token: float
    decode_seconds: float
    decode_tokens_per_second: float | None
    call_seconds: float
    gamma: int | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float | None = None
    mean_accepted_per_pass: float | None = None
    target_forward_passes: int = 0
    draft_forward_passes: int = 0
    cached_prefix_tokens: int = 0
    forward_seconds: float | None = None
    outside_forward_fraction: float | None = None
    main_step_seconds: float | None = None
    verify_step_seconds: float | None = None
    draft_step_seconds: float | None = None
    peak_memory_bytes: int | None = None
    baseline_memory_bytes: int | None = None
    engine_stats: dict[str, Any] | None = None
    """Everything `RapidStats` reported, for figures this layout does not name yet."""


def measure_engine(
    engine: RapidEngine,
    method: Method,
    prompt: Any,
    draft_prompt: Any,
    probe: ForwardProbe,
    *,
    cold: bool = True,
    draft_cold: bool = False,
    **overrides: Any,
) -> Measurement:
    """One `engine.generate` call of `method` (mode = method name; eta for rapid).

    cold: forget the engine's stored prompt KV first, so the call pays its whole prefill
    (side-by-side runs on one document must not inherit each other's prefill); False measures
    reuse, as a user's next question on the same document would see it. draft_cold: forget
    the draft model's stored KV alone (a separate draft's), so that a call whose target reuses
    the prompt an earlier method stored (and is charged its prefill) still pays the draft's
    read of its C^S, which an earlier method with the same C^S may have stored.
    """
    if method.eta is not None:
        overrides["eta"] = method.eta
    overrides.update(method.options)
    mode = cast(Mode, method.name)  # one of ENGINE_METHODS; the engine checks it
    if method.name == "magicdec":  # mode "rapid": the target drafts on its streaming cache
        engine, mode = magicdec.self_drafting(engine), "rapid"
        ids = encode_prompt(prompt, engine.tokenizer, engine.vocab_size)
        draft_prompt = magicdec.streaming_ids(ids)
    if cold:
        engine.prefix_cache.clear()
    elif draft_cold and engine.draft is not engine.target:
        engine.prefix_cache.forget(engine.draft)
    device = engine.target.device
    probe.reset()
    reset_peak_memory(device)
    baseline = current_memory_bytes(device)
    start = time.perf_counter()
    out = engine.generate(prompt, draft_prompt, mode=mode, **overrides)
    call_seconds = time.perf_counter() - start
    timings = probe.decode_timings(
        start + out.stats.prefill_seconds, main_passes=out.stats.target_forward_passes
    )
    return Measurement(
        answer=out.text,
        finish_reason=out.finish_reason,
        peak_memory_bytes=peak_memory_bytes(device),
        baseline_memory_bytes=baseline,
        engine_stats=out.stats.to_dict(),
        call_seconds=call_seconds,
        **_stats_fields(out.stats),
        **_timing_fields(timings, out.stats.decode_seconds),
    )


def _stats_fields(stats: RapidStats) -> dict[str, Any]:
    drafted = stats.drafted_tokens > 0
    return {
        "context_tokens": stats.target_context_tokens,
        "draft_context_tokens": stats.draft_context_tokens,
        "new_tokens": stats.new_tokens,
        "prefill_seconds": stats.prefill_seconds,
        "time_to_first_token": stats.time_to_first_token,
        "decode_seconds": stats.decode_seconds,
        "decode_tokens_per_second": stats.decode_tokens_per_second or None,
        "gamma": stats.gamma if drafted else None,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate if drafted else None,
        "mean_accepted_per_pass": stats.mean_accepted_per_pass if drafted else None,
        "target_forward_passes": stats.target_forward_passes,
        "draft_forward_passes": stats.draft_forward_passes,
        "cached_prefix_tokens": stats.cached_prefix_tokens,
    }


def _timing_fields(timings: DecodeTimings, decode_seconds: float) -> dict[str, Any]:
    outside = None
    if decode_seconds > 0:
        outside = max(0.0, decode_seconds - timings.forward_seconds) / decode_seconds
    return {
        "forward_seconds": timings.forward_seconds,
        "outside_forward_fraction": outside,
        "main_step_seconds": timings.main_step_seconds,
        "verify_step_seconds": timings.verify_step_seconds,
        "draft_step_seconds": timings.draft_step_seconds,
    }


class _FirstTokenClock(BaseStreamer):
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1  # the first put is the prompt itself
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        """Nothing to flush: only the arrival time matters."""


def measure_transformers(
    engine: RapidEngine,
    method: Method,
    prompt_ids: list[int],
    probe: ForwardProbe,
    *,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
) -> Measurement:
    """Greedy transformers `generate` on the engine's target (prompt lookup for hf-pld).
    `ignore_eos`: decode `max_new_tokens` whatever comes, as the engine's speed runs do (an
    empty eos list is what makes `generate` never stop on one)."""
    model, tokenizer = engine.target, engine.tokenizer
    eos = sorted(engine.eos_token_ids)
    stops = [] if ignore_eos else eos
    extra: dict[str, Any] = {"stop_strings": list(stop), "tokenizer": tokenizer} if stop else {}
    if method.name == "hf-pld":
        extra["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    ids = torch.tensor([prompt_ids], device=model.device)
    clock = _FirstTokenClock()
    probe.reset()
    reset_peak_memory(model.device)
    baseline = current_memory_bytes(model.device)
    start = time.perf_counter()
    # A causal LM: a subclass of the generation mixin, which PreTrainedModel is not.
    out = cast(GenerationMixin, model).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=eos[0],
        streamer=clock,
        **extra,
    )
    total = time.perf_counter() - start
    first = (clock.first or start + total) - start
    generated = _until_eos(out[0, len(prompt_ids) :].tolist(), frozenset(stops))
    passes = sum(1 for c in probe.calls if c.start >= start + first)
    return Measurement(
        answer=_text(tokenizer, generated, stop),
        finish_reason="length" if len(generated) >= max_new_tokens else "eos",
        context_tokens=len(prompt_ids),
        draft_context_tokens=0,
        new_tokens=len(generated),
        prefill_seconds=first,
        **_rate_fields(len(generated), first, total),
        target_forward_passes=passes + 1,
        peak_memory_bytes=peak_memory_bytes(model.device),
        baseline_memory_bytes=baseline,
        **_timing_fields(probe.decode_timings(start + first), total - first),
    )


def _rate_fields(new_tokens: int, first: float, total: float) -> dict[str, Any]:
    """Time to the first of `new_tokens`, the decode rate of the others and the call's
    whole time, from the seconds of a call to its first token and to its end (a library's
    `generate` that hides its prefill: transformers, llama.cpp)."""
    decode = total - first
    rate = (new_tokens - 1) / decode if new_tokens > 1 and decode > 0 else None
    return {
        "time_to_first_token": first,
        "decode_seconds": decode,
        "decode_tokens_per_second": rate,
        "call_seconds": total,
    }


CPU = torch.device("cpu")
"""Where llama.cpp runs and its memory is read: the process's resident set."""


def measure_llamacpp(
    engine: RapidEngine,
    method: Method,
    prompt_ids: list[int],
    gguf: Path,
    *,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
    library: Any = None,
) -> Measurement:
    """Greedy llama.cpp on `gguf` from the engine's prompt ids (`bench/llamacpp.py`), with
    its prompt lookup for `llama.cpp-lookup`: the engine's eos ids, stop strings, answer cap,
    window and RoPE scaling; its thread count is torch's as the engine set it. Loading the
    model is not timed; its memory counts in the peak. `library`: the llama_cpp module
    (imported when None; tests pass a fake)."""
    lookup = PROMPT_LOOKUP_TOKENS if method.name == "llama.cpp-lookup" else 0
    context = llamacpp.context_size(len(prompt_ids), max_new_tokens, engine.context_window)
    rope = engine.target.config.rope_parameters or {}
    reset_peak_memory(CPU)
    baseline = current_memory_bytes(CPU)
    threads = torch.get_num_threads()  # the engine's thread policy's pick: the same cores
    llama = llamacpp.load(gguf, context, threads, rope, lookup, library)
    try:
        llamacpp.check_vocabulary(llama, engine.tokenizer, engine.vocab_size)
        run = llamacpp.generate(
            llama,
            prompt_ids,
            engine.tokenizer,
            max_new_tokens=context - len(prompt_ids),
            eos=frozenset() if ignore_eos else engine.eos_token_ids,
            stop=stop,
        )
    finally:
        llama.close()
    drafted = run.drafted > 0
    return Measurement(
        answer=run.text,
        finish_reason=run.finish_reason,
        context_tokens=len(prompt_ids),
        draft_context_tokens=0,
        new_tokens=len(run.tokens),
        prefill_seconds=run.prefill_seconds,
        **_rate_fields(len(run.tokens), run.first_token_seconds, run.total_seconds),
        drafted_tokens=run.drafted,
        accepted_tokens=run.accepted,
        acceptance_rate=run.accepted / run.drafted if drafted else None,
        mean_accepted_per_pass=run.accepted / run.passes if drafted else None,
        target_forward_passes=run.passes,
        peak_memory_bytes=peak_memory_bytes(CPU),
        baseline_memory_bytes=baseline,
    )


def _until_eos(ids: list[int], eos: frozenset[int]) -> list[int]:
    cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    return ids[:cut]


def _text(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: tuple[str, ...]) -> str:
    """The decoded text cut before the first stop string, as the engine would emit it."""
    detok = Detokenizer(tokenizer, stop)
    for token in ids:
        detok.push(token)
        if detok.stopped:
            break
    detok.finish()
    return detok.text


def warm_up(
    engine: RapidEngine, methods: list[Method], probe: ForwardProbe, gguf: Path | None = None
) -> None:
    """One tiny call per method kind, so one-time costs (kernel selection, allocator growth,
    llama.cpp's backend start on `gguf`) stay out of the first measurement."""
    prompt = [{"role": "user", "content": "Say hello."}]
    ids = encode_prompt(prompt, engine.tokenizer, engine.vocab_size)
    for method in {m.name: m for m in methods}.values():
        if method.name in HF_METHODS:
            measure_transformers(engine, method, ids, probe, max_new_tokens=4)
        elif method.name in LLAMA_METHODS:
            assert gguf is not None  # BenchSettings refuses these methods without a GGUF
            measure_llamacpp(engine, method, ids, gguf, max_new_tokens=4)
        else:
            measure_engine(engine, method, prompt, prompt, probe, max_new_tokens=4)


def model_name(model: PreTrainedModel) -> str:
    """A short name for a results record: the config's name, else its size."""
    name = str(getattr(model.config, "_name_or_path", "") or "")
    if name:
        return name.rstrip("/").rsplit("/", 1)[-1]
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    return f"random-llama-{layers}x{hidden}"
