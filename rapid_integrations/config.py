"""`RapidConfig`: every knob of a RAPID call, validated on construction."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from rapid_integrations.errors import RapidConfigError

# Each list of choices is written once, here, as a Literal (for type hints and pydantic
# fields); the tuples below are derived from it for checks, CLI choices and messages.
Mode = Literal["rapid", "sd", "lc", "rag"]
Residual = Literal["paper", "exact"]
TailGuard = Literal["paper", "draft", "none"]
EtaRule = Literal["fixed", "draft-confidence", "grounded"]
Truncation = Literal["error", "head_tail"]
RetrievalFallback = Literal["builtin", "lc", "raise"]
DtypeName = Literal["auto", "bfloat16", "float16", "float32"]
DraftCopy = Literal["bfloat16", "float16", "int8", "int8-weight", "int4-weight", "bf16-weight"]
DraftPrecision = Literal["auto", "none", DraftCopy]
TargetPrecision = Literal["auto", "none", "int4-weight"]
MODES: tuple[str, ...] = get_args(Mode)
RESIDUALS: tuple[str, ...] = get_args(Residual)
TAIL_GUARDS: tuple[str, ...] = get_args(TailGuard)
ETA_RULES: tuple[str, ...] = get_args(EtaRule)
TRUNCATIONS: tuple[str, ...] = get_args(Truncation)
RETRIEVAL_FALLBACKS: tuple[str, ...] = get_args(RetrievalFallback)
DTYPES: tuple[str, ...] = get_args(DtypeName)
DRAFT_COPIES: tuple[str, ...] = get_args(DraftCopy)
DRAFT_PRECISIONS: tuple[str, ...] = get_args(DraftPrecision)
TARGET_PRECISIONS: tuple[str, ...] = get_args(TargetPrecision)
MAX_TOP_LOGPROBS = 20
"""The most alternatives `top_logprobs` may ask for per token (OpenAI's own cap)."""
SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds a call takes (inclusive): a signed 64-bit integer, OpenAI's range for `seed`.
`torch.Generator.manual_seed` refuses integers beyond 64 bits, so a wider seed is refused
here, by name, rather than failing inside the generator."""
DRAWN_SEEDS = 2**53
"""An unseeded call draws its seed from [0, DRAWN_SEEDS): JavaScript numbers hold every such
integer exactly, so a client in any language can send a reported seed back to replay a call."""


def one_of(choices: tuple[str, ...]) -> str:
    """ "must be 'a', 'b' or 'c'": the message of a failed choice check."""
    *head, last = (repr(c) for c in choices)
    return f"must be {', '.join(head)} or {last}" if head else f"must be {last}"


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise `RapidConfigError(name)` unless `value` is one of `choices`."""
    if value not in choices:
        raise RapidConfigError(name, f"{one_of(choices)}, got {value!r}")


def check_mode(mode: object) -> None:
    """Raise `RapidConfigError` unless `mode` is one of `MODES`."""
    check_choice("mode", mode, MODES)


@dataclass(frozen=True)
class RapidConfig:
    """Decoding and retrieval settings. Every field can be overridden per call.

    Algorithm fields follow docs/algorithm.md section 2 (paper notation):
      eta         transfer strength of p_hat = softmax(z/T + eta (q - p)); 0 gives plain
                  speculative decoding, whose output follows the target exactly.
      gamma       draft tokens proposed per target verify pass.
      residual    "paper": norm(max(p - p_hat, p - q, 0)) (the paper's rule);
                  "exact": norm(max(p_hat - q, 0)), under which every token follows p_hat.
      tail_guard  "paper" (default): tokens with p_hat(v) < tail_ratio * max p_hat keep p(v);
                  "draft" (the authors' code): the shift is applied only where
                  q(v) >= tail_ratio * max q; "none": no guard.
      eta_rule    "fixed" (default): every row shifts by eta; "draft-confidence": row i by
                  eta * max_v q_i(v), strong where the draft is sure of its token, weak where
                  it guesses; "grounded": row i by eta where the draft's top token continues
                  a run of C^S (the two tokens before it and it occur there), else 0
                  (docs/algorithm.md section 2.3).
      top_k, min_p, repetition_penalty  transformers' sampling options (0, 0 and 1 = off),
                  applied identically to p and q (docs/algorithm.md section 9).
    end_guard   where the target's most likely token is end-of-sequence, p_hat = p (not in the
                paper: a draft on a short context would otherwise talk the target out of
                stopping; see sampling.end_guard).
    confidence_guard  where the target is at least as sure as the draft (max p >= max q),
                p_hat = p (not in the paper; docs/algorithm.md section 2.4: measured, it keeps
                RAPID's QA accuracy at least max(lc, rag) at every eta tried; False gives the
                paper's p_hat).
    prefix_cache_bytes bounds the KV kept across calls for prompts that share a prefix (the
    next question on the same document, the next chat turn); 0 disables reuse for the call.
    """

    eta: float = 5.0
    gamma: int = 8
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    residual: Residual = "paper"
    tail_guard: TailGuard = "paper"
    eta_rule: EtaRule = "fixed"
    tail_ratio: float = 0.1
    end_guard: bool = True
    confidence_guard: bool = True
    ignore_eos: bool = False
    prefill_chunk_size: int = 1024
    truncation: Truncation = "error"
    retrieval_budget: int | None = None
    retrieval_chunk_tokens: int = 512
    retrieval_threshold: float = 0.3
    retrieval_top_k: int | None = None
    retrieval_fallback: RetrievalFallback = "builtin"
    retrieval_timeout: float | None = 30.0
    query_fn: Callable[[str], str] | None = field(default=None, compare=False)
    prefix_cache_bytes: int = 1 << 30
    # The built-in retriever's embedder: a sentence-transformers name or local path (e.g.
    # "BAAI/bge-m3"), an object with `embed(texts) -> unit vectors`, or None (bundled MiniLM).
    retrieval_embedder: Any = field(default=None, compare=False)
    # Adaptive drafting and the lookup proposer (docs/algorithm.md sections 2.9 and 2.10):
    # draft_confidence_threshold  the draft stops proposing after a token whose draft
    #     probability q(x) is below it (0 = off; transformers' assistant_confidence_threshold);
    # adaptive_gamma  gamma starts at `gamma` and moves with acceptance: +2 after a pass that
    #     accepted all it asked for, -1 after a rejection, within [1, gamma_max]; "measured"
    #     picks, after every pass, the gamma of most expected tokens per second from the
    #     call's own timed plain step, draft steps, verify passes, recent acceptance and the
    #     copies recent picks brought;
    # speculate_min_context  prompts of fewer target tokens are decoded by the target alone
    #     (mode "lc": below some length a draft step costs too much to pay off; 0 = never);
    #     "auto" measures it on each call instead: one plain target step is timed, and the
    #     call stops drafting once 4 passes in a row are expected to emit tokens below 0.95x
    #     that rate; the engine's next calls at that length start where it ended
    #     (docs/algorithm.md section 2.11);
    # lookup_ngram  > 0 offers copies: the continuation of the latest earlier occurrence of
    #     the last n tokens (n = lookup_ngram down to 2) in C^S, the prompt and the output
    #     (0 = off; a single token would match nearly always). The draft vets them as it
    #     drafts, keeping those its own drafting would give: the output is unchanged, only
    #     faster;
    # lookup_tokens  the most copies one proposal holds (transformers'
    #     prompt_lookup_num_tokens): unlike the model's gamma drafts, copies cost no draft steps;
    #     on the CPU the draft reads only those measured to pay (docs/algorithm.md 2.10).
    draft_confidence_threshold: float = 0.0
    adaptive_gamma: bool | Literal["measured"] = False
    gamma_max: int = 32
    speculate_min_context: int | Literal["auto"] = 0
    lookup_ngram: int = 3
    lookup_tokens: int = 10
    # Log probabilities of the emitted tokens (docs/algorithm.md section 12), computed only
    # when asked: `RapidOutput.logprobs` and `Delta.logprobs` hold one entry per token id.
    # logprobs        the deciding model's raw log-softmax of each emitted token;
    # top_logprobs    that many most likely alternatives per token under the same law
    #     (0 to MAX_TOP_LOGPROBS; needs logprobs);
    # logprobs_p_hat  also log p_hat(token), the law the verdict decided with (needs logprobs).
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_p_hat: bool = False
    # Reasoning sections (docs/algorithm.md section 13): the text between the markers goes to
    # `RapidOutput.reasoning`, and grammars and tools apply only after the end marker.
    # reasoning             None: on when the tokenizer's chat template has the start marker;
    #     True: on; False: the markers are plain text;
    # reasoning_markers     the (start, end) marker strings, matched as the token ids the
    #     tokenizer encodes them to;
    # max_reasoning_tokens  the most tokens between the markers (None: no limit); when they
    #     are reached the engine commits the end marker itself and the answer begins.
    reasoning: bool | None = None
    reasoning_markers: tuple[str, str] = ("<think>", "</think>")
    max_reasoning_tokens: int | None = None
    # deterministic  every token's logits computed by kernel calls whose shape does not
    #     depend on the pass that reads it (runtime/invariant.py), so that a greedy answer,
    #     and a seeded sampled one, is the same whatever the thread count, the prefix cache,
    #     the drafts' lengths or the other calls in a batch (docs/algorithm.md section 8).
    #     A bf16 model on the CPU only; it costs speed and the shared prefix's memory
    #     (docs/performance.md, "Other figures").
    deterministic: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.reasoning_markers, list):  # JSON and YAML give lists
            object.__setattr__(self, "reasoning_markers", tuple(self.reasoning_markers))
        for name, check, message in (*_CHECKS, *_DRAFTING_CHECKS):
            if not check(getattr(self, name)):
                raise RapidConfigError(name, f"{message}, got {getattr(self, name)!r}")
        for name, combined, message in _COMBINED_CHECKS:
            if not combined(self):
                raise RapidConfigError(name, f"{message}, got {getattr(self, name)!r}")

    def replace(self, **overrides: Any) -> RapidConfig:
        """A copy with `overrides` applied; unknown names raise `RapidConfigError`."""
        for name in overrides:
            if name not in FIELD_NAMES:
                raise RapidConfigError(
                    name, f"unknown RapidConfig field; known: {sorted(FIELD_NAMES)}"
                )
        return dataclasses.replace(self, **overrides)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


FIELD_NAMES: frozenset[str] = frozenset(f.name for f in dataclasses.fields(RapidConfig))
"""Every `RapidConfig` field's name, read from the class: a field added there is known to
every entry point that checks names (call options, adapter arguments, transformers names)."""


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("eta", lambda v: _real(v) and v >= 0, "must be a finite number >= 0"),
    ("gamma", lambda v: _int(v) and 1 <= v <= 64, "must be an integer in [1, 64]"),
    ("temperature", lambda v: _real(v) and v >= 0, "must be a finite number >= 0"),
    ("top_p", lambda v: _real(v) and 0 < v <= 1, "must be in (0, 1]"),
    ("top_k", lambda v: _int(v) and v >= 0, "must be an integer >= 0 (0 disables)"),
    ("min_p", lambda v: _real(v) and 0 <= v <= 1, "must be in [0, 1] (0 disables)"),
    (
        "repetition_penalty",
        lambda v: _real(v) and v > 0,
        "must be a finite number > 0 (1 disables)",
    ),
    ("max_new_tokens", lambda v: _int(v) and v >= 1, "must be an integer >= 1"),
    (
        "stop",
        lambda v: isinstance(v, tuple) and all(isinstance(s, str) and s for s in v),
        "must be a string or a sequence of non-empty strings",
    ),
    (
        "seed",
        _optional(lambda v: _int(v) and SEED_RANGE[0] <= v <= SEED_RANGE[1]),
        "must be None or an integer in [-2**63, 2**63 - 1]",
    ),
    ("residual", lambda v: v in RESIDUALS, one_of(RESIDUALS)),
    ("tail_guard", lambda v: v in TAIL_GUARDS, one_of(TAIL_GUARDS)),
    ("eta_rule", lambda v: v in ETA_RULES, one_of(ETA_RULES)),
    ("tail_ratio", lambda v: _real(v) and 0 <= v < 1, "must be in [0, 1)"),
    ("ignore_eos", lambda v: isinstance(v, bool), "must be a bool"),
    ("end_guard", lambda v: isinstance(v, bool), "must be a bool"),
    ("confidence_guard", lambda v: isinstance(v, bool), "must be a bool"),
    ("prefill_chunk_size", lambda v: _int(v) and v >= 1, "must be an integer >= 1"),
    ("truncation", lambda v: v in TRUNCATIONS, one_of(TRUNCATIONS)),
    (
        "retrieval_budget",
        _optional(lambda v: _int(v) and v >= 1),
        "must be an integer >= 1 or None",
    ),
    ("retrieval_chunk_tokens", lambda v: _int(v) and v >= 8, "must be an integer >= 8"),
    ("retrieval_threshold", lambda v: _real(v) and -1 <= v <= 1, "must be in [-1, 1]"),
    ("retrieval_top_k", _optional(lambda v: _int(v) and v >= 1), "must be an integer >= 1 or None"),
    ("retrieval_fallback", lambda v: v in RETRIEVAL_FALLBACKS, one_of(RETRIEVAL_FALLBACKS)),
    ("retrieval_timeout", _optional(lambda v: _real(v) and v > 0), "must be a number > 0 or None"),
    ("query_fn", _optional(callable), "must be a callable str -> str or None"),
    ("prefix_cache_bytes", lambda v: _int(v) and v >= 0, "must be an integer >= 0 (0 disables)"),
    (
        "retrieval_embedder",
        lambda v: (
            v is None or isinstance(v, (str, os.PathLike)) or callable(getattr(v, "embed", None))
        ),
        "must be a sentence-transformers name or path, an object with embed(texts), or None",
    ),
    ("logprobs", lambda v: isinstance(v, bool), "must be a bool"),
    (
        "top_logprobs",
        lambda v: _int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
        f"must be an integer in [0, {MAX_TOP_LOGPROBS}]",
    ),
    ("logprobs_p_hat", lambda v: isinstance(v, bool), "must be a bool"),
    ("reasoning", _optional(lambda v: isinstance(v, bool)), "must be a bool or None (auto)"),
    (
        "reasoning_markers",
        lambda v: (
            isinstance(v, tuple)
            and len(v) == 2
            and all(isinstance(m, str) and m.strip() for m in v)
            and v[0] != v[1]
        ),
        "must be two different non-empty strings (start, end)",
    ),
    (
        "max_reasoning_tokens",
        _optional(lambda v: _int(v) and v >= 1),
        "must be an integer >= 1 or None",
    ),
    ("deterministic", lambda v: isinstance(v, bool), "must be a bool"),
)

_DRAFTING_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("draft_confidence_threshold", lambda v: _real(v) and 0 <= v <= 1, "must be in [0, 1]"),
    (
        "adaptive_gamma",
        lambda v: isinstance(v, bool) or v == "measured",
        "must be a bool or 'measured'",
    ),
    ("gamma_max", lambda v: _int(v) and 1 <= v <= 64, "must be an integer in [1, 64]"),
    (
        "speculate_min_context",
        lambda v: v == "auto" or (_int(v) and v >= 0),
        "must be an integer >= 0 or 'auto'",
    ),
    (
        "lookup_ngram",
        lambda v: _int(v) and (v == 0 or 2 <= v <= 8),
        "must be 0 (off) or an integer in [2, 8]",
    ),
    ("lookup_tokens", lambda v: _int(v) and 1 <= v <= 64, "must be an integer in [1, 64]"),
)

# Checks of one field against another, run after every field passed its own check.
_COMBINED_CHECKS: tuple[tuple[str, Callable[[RapidConfig], bool], str], ...] = (
    ("top_logprobs", lambda c: c.logprobs or not c.top_logprobs, "needs logprobs=True"),
    ("logprobs_p_hat", lambda c: c.logprobs or not c.logprobs_p_hat, "needs logprobs=True"),
    (
        "max_reasoning_tokens",
        lambda c: c.reasoning is not False or c.max_reasoning_tokens is None,
        "needs reasoning on (True or None), not reasoning=False",
    ),
    # Both follow wall time: the payoff stop decides which tokens follow p, and a measured
    # gamma how a seeded call's draws fall (a greedy call's tokens do not depend on gamma).
    (
        "deterministic",
        lambda c: not (c.deterministic and c.speculate_min_context == "auto"),
        "cannot be combined with speculate_min_context='auto' (its stop follows wall time)",
    ),
    (
        "deterministic",
        lambda c: not (c.deterministic and c.adaptive_gamma == "measured" and not c.greedy),
        "cannot be combined with adaptive_gamma='measured' when sampling (the measured gamma "
        "follows wall time, and a seeded call's draws follow the gamma)",
    ),
)
