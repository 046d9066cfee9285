"""`rapid bench`: the QA suite, the speed-only suites, and the files they write.

Suites (field `suite` of each record):
  qa             the embedded model (or --model/--draft): every method on every task, greedy,
                 answers scored; a second question on the same document at the longest length
                 (`turn` 2) for time-to-first-token on a repeated document
  broad          `--suite broad` alone: the broad QA suite (`bench/suite.py`), one split (dev
                 or test), every method on every task, answers scored, prompt KV shared by
                 the methods of a task
  short          the short-prompt set (`bench/short.py`: chat and agent turns, nothing to
                 retrieve) beside the QA suite, or alone with `--suite short`: every method
                 on every prompt, greedy, answers scored and compared with lc's
  speed          the same model, lc against rapid at a fixed number of decoded tokens; lengths
                 past the model's window use a RoPE-scaled copy (linear scaling)
  tiny-downward  random 8-layer target, 2-layer draft, on the single-needle prompts
  tiny-upward    the same pair with the roles swapped (the draft is the larger model)
Speed-only suites ignore end-of-sequence, so every method decodes the same number of tokens.
Every measured call starts from an empty prefix cache except the `turn` 2 question.
Every record's `end_to_end_seconds` is what a user waits for the whole answer (`_record`).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from rapid_integrations.config import DRAFT_PRECISIONS, TARGET_PRECISIONS, RapidConfig, check_choice
from rapid_integrations.engine.prompts import prepare_draft_prompt
from rapid_integrations.engine.rapid_engine import RapidEngine
from rapid_integrations.errors import RapidConfigError
from rapid_integrations.models.loading import (
    LoadOptions,
    ensure_default_model,
    load_model,
    resolve_dtype,
)
from rapid_integrations.retrieval.base import ContextRetriever
from rapid_integrations.runtime.compiled import CompiledDecode
from rapid_integrations.runtime.kv import pass_seconds
from rapid_integrations.tokens import encode_prompt

from . import llamacpp
from .bounds import Device, attach_bounds, read_bytes_per_second, weights_read_bytes, widest_pass
from .dataset import CONTEXT_LENGTHS, TASK_KINDS, Task, build_tasks
from .magicdec import streaming_ids
from .methods import (
    DEFAULT_METHODS,
    ENGINE_METHODS,
    LLAMA_METHODS,
    METHODS,
    Measurement,
    Method,
    measure_engine,
    measure_llamacpp,
    measure_transformers,
    model_name,
    warm_up,
)
from .model_draft import VERIFY_TOKENS, StepCosts, best_model_draft
from .models import choose_dtype, load_rope_scaled, tiny_pair
from .off_topic import OffTopicRetriever
from .prefill import chunk_sizes_to_try, matmul_flops_per_second, prefill_rows
from .probe import ForwardProbe
from .report import write_report
from .scoring import score, token_f1
from .short import attach_agreement, short_tasks
from .speed_tasks import SPEED_KINDS, build_speed_tasks
from .suite import QUESTION_KINDS, SPLITS, build_suite
from .summary import QA_SUITES
from .texts import TEXT_KINDS

DEFAULT_ETA = RapidConfig().eta
QA_STOP = ("\n\n",)
"""Answers end at a blank line, as in `make demo`; the models otherwise ramble on."""
SPEED_METHODS = (Method("lc"), Method("rapid", DEFAULT_ETA))
TINY_METHODS = (Method("lc"), Method("sd"), Method("rapid", DEFAULT_ETA))


ADAPTIVE = (("adaptive_gamma", "measured"), ("speculate_min_context", "auto"))
"""The adaptive variant: gamma is the argmax of expected tokens per second from the call's
own timed costs and recent acceptance, and the call stops drafting where its passes measure
slower than a plain target step (docs/algorithm.md section 2.9). No confidence stop: with
eta > 0 the target leans toward the draft, so doubtful drafts are still kept (measured in
docs/performance.md, "Why these defaults")."""
FALLBACK = (("speculate_min_context", "auto"),)
"""The measured fallback alone (a candidate default): gamma stays fixed, and the call
stops drafting where its passes measure slower than a plain target step (section 2.11)."""
NO_LOOKUP = (("lookup_ngram", 0),)
DRAFT_CONFIDENCE = (("eta_rule", "draft-confidence"),)
OFF_TOPIC = (("retriever", OffTopicRetriever()),)
VARIANTS: dict[str, tuple[tuple[str, Any], ...]] = {
    "adaptive": ADAPTIVE,
    "adaptive-again": ADAPTIVE,
    "fallback": FALLBACK,
    "no-lookup": NO_LOOKUP,
    "adaptive+no-lookup": ADAPTIVE + NO_LOOKUP,
    "paper": (("confidence_guard", False),),
    "draft-confidence": DRAFT_CONFIDENCE,
    "off-topic": OFF_TOPIC,
    "draft-confidence+off-topic": DRAFT_CONFIDENCE + OFF_TOPIC,
    "deterministic": (("deterministic", True),),
    "attention": (("retriever", "attention"),),
    "hybrid": (("retriever", "hybrid"),),
    "following": (("retriever", "following"),),
    "grounded": (("eta_rule", "grounded"),),
}
"""Named rapid variants (their `RapidConfig` overrides): `--long` runs the first four, and
`--variants` adds any of them to the QA suite. `adaptive-again` is `adaptive` run right after
it: the engine's next call at that length, which starts from the schedule the first left
(docs/algorithm.md section 2.11). The lookup proposer is on by default, so `no-lookup`
measures what it adds (section 2.10). `draft-confidence` scales eta per row by the draft's top
probability (section 2.3). `off-topic` retrieves fixed unrelated paragraphs instead of the
document's (bench/off_topic.py): RAPID's accuracy with a useless C^S against lc's.
`deterministic` prices batch-invariant decoding (docs/algorithm.md section 8) beside the
default path; `attention`, `hybrid` and `following` build C^S from the target's cache
(docs/retrieval.md, "The target's attention as the retriever"; `following` chooses it again
as the answer unfolds) instead of the built-in embedder. `grounded` leans
only on rows whose draft token continues a run of C^S (docs/algorithm.md section 2.3)."""


@dataclass(frozen=True)
class BenchSettings:
    """What `rapid bench` runs. Lengths are nominal context sizes in tokens.

    per_cell: tasks per (kind, length); etas: the rapid eta values; max_new_tokens: answer
    cap of QA runs; speed_tokens: tokens decoded by speed-only runs; rounds: how many times
    the speed-only suites run all their methods on a task, one method after another each round
    (the machine's drift over minutes touches every method alike; rates pool over the rounds,
    and the figures give the spread of their per-round ratios); speed_lengths: lengths of
    the speed suite within the model's window, rope_lengths: beyond it (RoPE-scaled); either
    may be empty; speed_kinds: the prompts of the speed-only suites and of `long`, one task
    of each kind a length (`bench/speed_tasks.py`); tiny_speed: run the upward/downward
    suites (at `lengths`); tiny_models: run the QA and speed suites on the tiny random pair
    instead of real models (smoke tests).
    Presets that replace the suites: long (the `long` suite at `lengths`, with rapid also at
    each of `gammas`), eta_sweep (QA only, prompt KV shared by the methods of a task), prefill
    (prefill time at `lengths` by `chunk_sizes`, against transformers and the compute bound).
    suite: "standard" (the suites above, the short-prompt set after the QA suite except in
    eta_sweep), "broad" (the broad QA suite alone, its `split` half, `texts` by `kinds` of
    question, `per_cell` tasks per pair, cycling `lengths`) or "short" (the short-prompt
    set alone).
    """

    out: Path = Path("bench-out")
    lengths: tuple[int, ...] = CONTEXT_LENGTHS
    kinds: tuple[str, ...] = TASK_KINDS
    per_cell: int = 5
    methods: tuple[str, ...] = DEFAULT_METHODS
    etas: tuple[float, ...] = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0)
    variants: tuple[str, ...] = ()
    variant_etas: tuple[float, ...] = (DEFAULT_ETA,)
    max_new_tokens: int = 48
    speed_tokens: int = 128
    rounds: int = 1
    speed_lengths: tuple[int, ...] = CONTEXT_LENGTHS
    speed_kinds: tuple[str, ...] = ("single",)
    rope_lengths: tuple[int, ...] = (16384, 32768)
    tiny_speed: bool = True
    tiny_models: bool = False
    model: str | None = None
    draft: str | None = None
    draft_precision: str | None = None
    target_precision: str | None = None
    compile_draft: bool = False
    dtype: str = "auto"
    device: str | None = None
    seed: int = 0
    progress: bool = True
    quick: bool = False
    long: bool = False
    gammas: tuple[int, ...] = ()
    eta_sweep: bool = False
    prefill: bool = False
    chunk_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    suite: str = "standard"
    split: str = "dev"
    texts: tuple[str, ...] = TEXT_KINDS

    def __post_init__(self) -> None:
        _require(
            "methods", self.methods and set(self.methods) <= set(METHODS), f"names from {METHODS}"
        )
        check_choice("suite", self.suite, SUITES)
        check_choice("split", self.split, SPLITS)
        known = QUESTION_KINDS if self.suite == "broad" else TASK_KINDS
        _require("kinds", self.kinds and set(self.kinds) <= set(known), f"names from {known}")
        _require(
            "texts", self.texts and set(self.texts) <= set(TEXT_KINDS), f"names from {TEXT_KINDS}"
        )
        kinds_ok = self.speed_kinds and set(self.speed_kinds) <= set(SPEED_KINDS)
        _require("speed_kinds", kinds_ok, f"names from {SPEED_KINDS}")
        for name in ("lengths", "speed_lengths", "rope_lengths"):
            _require(name, all(n >= 256 for n in getattr(self, name)), "lengths >= 256")
        _require("lengths", bool(self.lengths), "at least one length")
        for name in ("etas", "variant_etas"):
            _require(name, getattr(self, name) and min(getattr(self, name)) >= 0, "values >= 0")
        _require("variants", set(self.variants) <= set(VARIANTS), f"names from {list(VARIANTS)}")
        for name in ("per_cell", "max_new_tokens", "speed_tokens", "rounds"):
            _require(name, getattr(self, name) >= 1, "an integer >= 1")
        _require("gammas", all(1 <= g <= 64 for g in self.gammas), "integers in [1, 64]")
        gguf_ok = not self.uses_llamacpp or (
            not self.tiny_models and llamacpp.gguf_file(self.model) is not None
        )
        _require("methods", gguf_ok, "without llama.cpp ones unless the model is a GGUF")
        _require("chunk_sizes", self.chunk_sizes and min(self.chunk_sizes) >= 1, "sizes >= 1")
        if self.draft_precision is not None:
            check_choice("draft_precision", self.draft_precision, DRAFT_PRECISIONS)
        if self.target_precision is not None:
            check_choice("target_precision", self.target_precision, TARGET_PRECISIONS)
        presets = [n for n in ("quick", "long", "eta_sweep", "prefill") if getattr(self, n)]
        _require("preset", len(presets) <= 1, f"one preset at most, got {presets}")
        alone_ok = self.suite == "standard" or not (self.long or self.eta_sweep or self.prefill)
        _require("preset", alone_ok, f"--quick or none with the {self.suite} suite")
        suites = self.speed_lengths or self.rope_lengths or self.tiny_speed
        speed = self.long or (suites and not self.prefill)
        _require("rounds", self.rounds == 1 or speed, "1 where no speed-only suite runs")

    @classmethod
    def preset(cls, name: str | bool = "full", **overrides: Any) -> BenchSettings:
        """A preset of `PRESETS` ("full"; True means "quick", False "full") with overrides
        (None values are ignored); with suite "broad", "full" and "quick" are the broad
        suite's presets."""
        name = ("quick" if name else "full") if isinstance(name, bool) else name
        if overrides.get("suite") == "broad":
            name = {"full": "broad", "quick": "broad-quick"}.get(name, name)
            _require("preset", name.startswith("broad"), "--quick or none with the broad suite")
        _require("preset", name in PRESETS, f"one of {sorted(PRESETS)}")
        base = cls(**PRESETS[name])
        return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def uses_llamacpp(self) -> bool:
        """Whether the methods name a llama.cpp one."""
        return bool(set(self.methods) & set(LLAMA_METHODS))

    def gguf(self) -> Path | None:
        """The GGUF the llama.cpp methods run (`bench/llamacpp.py`); None when none runs."""
        return llamacpp.gguf_file(self.model) if self.uses_llamacpp else None

    def method_list(self) -> list[Method]:
        """The methods to run, rapid expanded over `etas` and its `variants` over
        `variant_etas`; the llama.cpp ones only where llama-cpp-python is installed."""
        return runnable(
            method
            for name in METHODS
            if name in self.methods
            for method in (self._rapid_methods() if name == "rapid" else [Method.of(name)])
        )

    def _rapid_methods(self) -> list[Method]:
        plain = [Method("rapid", eta) for eta in self.etas]
        named = [
            Method("rapid", eta, name, VARIANTS[name])
            for name in self.variants
            for eta in self.variant_etas
        ]
        return plain + named


def _require(name: str, ok: object, expected: str) -> None:
    if not ok:
        raise RapidConfigError(name, f"must be {expected}")


def runnable(methods: Iterable[Method]) -> list[Method]:
    """`methods` without the llama.cpp ones where llama-cpp-python is missing (logged once:
    the run goes on with the others)."""
    return [m for m in methods if m.name not in LLAMA_METHODS or llamacpp.available()]


QUICK: dict[str, Any] = {
    "quick": True,
    "per_cell": 1,
    "etas": (0.0, DEFAULT_ETA, 10.0),
    "speed_tokens": 64,
    "speed_lengths": (8192,),
    "rope_lengths": (),
}
"""The `--quick` preset: one task per (kind, length), three eta values, the speed suite at 8K
only; `--rope-lengths 16384` adds a 16K RoPE-scaled run (its cost: docs/benchmarks.md,
"Presets and options")."""
LONG: dict[str, Any] = {
    "long": True,
    "methods": tuple(m for m in METHODS if m not in LLAMA_METHODS),
    "lengths": (16384, 32768),
    "gammas": (4, 16),
    "etas": (DEFAULT_ETA,),
}
"""The `--long` preset: the `long` suite at 16K and 32K (YaRN-scaled past the window); 64K is
opt-in (`--lengths 16384,32768,65536`), and so are the llama.cpp methods (`--methods`).
`--etas 0` compares the schedules text for text: at eta 0 every schedule writes the target's
own greedy text, up to bf16 rounding."""
ETA_SWEEP: dict[str, Any] = {
    "eta_sweep": True,
    "methods": ("lc", "rag", "rapid"),
    "etas": (0.0, 2.0, 5.0, 10.0, 20.0),
    "variants": ("paper",),
    "variant_etas": (5.0, 10.0, 20.0),
    "speed_lengths": (),
    "rope_lengths": (),
    "tiny_speed": False,
}
"""The `--eta-sweep` preset: QA accuracy of lc, rag and rapid over eta at 2K, 4K and 8K, five
tasks per cell (the default p_hat, confidence-guarded), and the paper's p_hat (no confidence
guard, docs/algorithm.md section 2.4) at eta 5, 10, 20; the methods of a task share its prompt
KV (only answers are compared)."""
BROAD: dict[str, Any] = {
    **ETA_SWEEP,
    "eta_sweep": False,
    "suite": "broad",
    "kinds": QUESTION_KINDS,
    "per_cell": 10,
}
"""`--suite broad`: the QA candidates on one split (`--split dev`, the default, to
choose; `--split test` once per chosen candidate): lc, rag, rapid at eta 0, 2, 5, 10, 20 with
the confidence guard and at eta 5, 10, 20 without it (`paper`), 10 tasks per (text kind,
question kind) at 2K, 4K, 8K in turn."""
BROAD_QUICK: dict[str, Any] = {
    **BROAD,
    "quick": True,
    "per_cell": 1,
    "lengths": (2048,),
    "etas": (0.0, DEFAULT_ETA),
    "variants": (),
}
"""`--suite broad --quick`: one 2K task per (text kind, question kind), rapid at eta 0 and 5."""
PRESETS: dict[str, dict[str, Any]] = {
    "full": {},
    "quick": QUICK,
    "long": LONG,
    "eta-sweep": ETA_SWEEP,
    "prefill": {"prefill": True, "lengths": (8192, 32768)},
    "broad": BROAD,
    "broad-quick": BROAD_QUICK,
}
SUITES = ("standard", "broad", "short")
LONG_VARIANTS = ("adaptive", "adaptive-again", "fallback", "no-lookup")
LONG_CACHE_BYTES = 1 << 33
"""Prefix cache bound of the long suite: a 64K prompt's KV must stay stored for the methods
after `lc` (SmolLM2 bf16: 1.5 GB)."""


def long_methods(settings: BenchSettings) -> list[Method]:
    """Those of lc, sd, rapid at each of `etas` (fixed gamma; at each of `gammas`; adaptive;
    without the lookup proposer), magicdec, transformers prompt lookup and llama.cpp that
    `settings.methods` names (a 64K run may skip the slow ones). The first prefills, the
    engine's others reuse it: lc first (transformers and llama.cpp prefill their own)."""
    rapid = [
        method
        for eta in settings.etas
        for method in (
            Method("rapid", eta),
            *(Method("rapid", eta, f"gamma={g}", (("gamma", g),)) for g in settings.gammas),
            *(Method("rapid", eta, name, VARIANTS[name]) for name in LONG_VARIANTS),
        )
    ]
    others = [Method.of(name) for name in ("magicdec", "hf-pld", *LLAMA_METHODS)]
    every = [Method("lc"), Method("sd"), *rapid, *others]
    return runnable(method for method in every if method.name in settings.methods)


@dataclass(frozen=True)
class _Suite:
    """What every call of one suite shares: its name, engine, forward probe and the
    `RapidConfig` overrides of each call."""

    name: str
    engine: RapidEngine
    probe: ForwardProbe
    overrides: dict[str, Any]
    share_prefill: bool = False  # methods after a task's first reuse its prompt KV


@dataclass(frozen=True)
class _Call:
    """One measured generation: `method` on `task` within `suite`, with the draft prompt
    built for the task; turn 2 is a second question on the same document (warm cache)."""

    suite: _Suite
    method: Method
    task: Task
    retrieved: _Retrieved
    turn: int = 1
    cold: bool = True  # start from an empty prefix cache
    round: int = 1  # of a speed-only suite's rounds (`BenchSettings.rounds`)
    stored: tuple[float, int] | None = None
    """The prefill seconds and prompt tokens of the task's first call, whose prompt KV the
    call may read where the suite shares it (a cold call finds none)."""


@dataclass
class _Session:
    """One run: its settings, where records go, and the progress bar."""

    settings: BenchSettings
    device: torch.device
    dtype: torch.dtype
    meta: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    bar: Any = None

    def run(self, call: _Call) -> dict[str, Any]:
        """Measure one call and keep its record (returned too); speed-only suites are not
        scored."""
        record = _record(call, _measure(call, self.settings.gguf()))
        if call.suite.name not in QA_SUITES:
            record.update(accuracy=None, f1=None)
        record["dtype"] = str(self.dtype).removeprefix("torch.")
        self.records.append(record)
        self.bar.set_postfix_str(
            f"{call.suite.name} {call.task.task_id} {call.method.label}", refresh=False
        )
        self.bar.update()
        return record

    def save(self, plots: bool = False) -> None:
        write_report(self.settings.out, self.meta, self.records, plots=plots)


def run_bench(settings: BenchSettings) -> Path:
    """Run every suite `settings` asks for; write results.json, results.md and plots under
    `settings.out`; return that folder."""
    start = time.perf_counter()
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    engine, dtype, probe_seconds = _qa_engine(settings, device)
    meta = {
        "settings": _jsonable(dataclasses.asdict(settings)),
        "machine": machine_info(device),
        "dtype": str(dtype).removeprefix("torch."),
        "dtype_probe_seconds": probe_seconds,
        "draft_precision": engine.draft_precision,
        "target_precision": engine.target_precision,
        "memory_model": memory_model(engine.target, dtype),
        "default_eta": DEFAULT_ETA,
    }
    session = _Session(settings, device, dtype, meta)
    if settings.suite == "broad":
        return _run_broad(session, engine, start)
    if settings.suite == "short":
        return _run_short(session, engine, start)
    tok, seed = engine.tokenizer, settings.seed
    tasks = build_tasks(tok, settings.kinds, settings.lengths, settings.per_cell, seed)
    kinds = settings.speed_kinds
    speed = build_speed_tasks(tok, kinds, settings.speed_lengths, seed)
    rope = (
        [] if settings.tiny_models else build_speed_tasks(tok, kinds, settings.rope_lengths, seed)
    )
    tiny = build_speed_tasks(tok, kinds, settings.lengths, seed) if settings.tiny_speed else []
    short = [] if settings.eta_sweep else short_tasks()
    runs = (len(tasks) + len(short)) * len(settings.method_list())
    runs += sum(map(bool, _followups(settings, tasks)))
    speed_runs = (len(speed) + len(rope)) * len(SPEED_METHODS) + 2 * len(tiny) * len(TINY_METHODS)
    runs += settings.rounds * speed_runs
    if settings.long or settings.prefill:
        long_kinds = kinds if settings.long else ("single",)  # prefill: one prompt a length
        long_tasks = build_speed_tasks(tok, long_kinds, settings.lengths, seed)
        runs = len(long_tasks) * (
            settings.rounds * len(long_methods(settings)) if settings.long else 1
        )
    with tqdm(total=runs, unit="run", disable=not settings.progress) as session.bar:
        if settings.long:
            _long_suite(session, engine, long_tasks)
        elif settings.prefill:
            _prefill_suite(session, engine, long_tasks)
        else:
            _qa_suite(session, engine, tasks)
            _short_suite(session, engine, short)
            _speed_suite(session, "speed", engine, speed, SPEED_METHODS)
            if rope:
                rope_engine = _rope_engine(session, engine, rope)
                _speed_suite(session, "speed", rope_engine, rope, SPEED_METHODS)
            if tiny:
                _tiny_suites(session, tok, tiny)
    return _finish(session, start)


def _run_broad(session: _Session, engine: RapidEngine, start: float) -> Path:
    """The broad QA suite's `split` half, every method on every task (no speed suites)."""
    s = session.settings
    tasks = build_suite(engine.tokenizer, s.split, s.texts, s.kinds, s.lengths, s.per_cell)
    runs = len(tasks) * len(s.method_list())
    with tqdm(total=runs, unit="run", disable=not s.progress) as session.bar:
        _qa_suite(session, engine, tasks, "broad")
    return _finish(session, start)


def _run_short(session: _Session, engine: RapidEngine, start: float) -> Path:
    """The short-prompt set alone, every method on every prompt (no speed suites)."""
    tasks = short_tasks()
    runs = len(tasks) * len(session.settings.method_list())
    with tqdm(total=runs, unit="run", disable=not session.settings.progress) as session.bar:
        _short_suite(session, engine, tasks)
    return _finish(session, start)


def _finish(session: _Session, start: float) -> Path:
    session.meta["wall_seconds"] = time.perf_counter() - start
    session.meta["machine"]["load_average_end"] = _load_average()
    # The plots draw the standard suites by length; the others have their tables.
    session.save(plots=session.settings.suite == "standard")
    return session.settings.out


# ---- engines --------------------------------------------------------------------------------


def _qa_engine(
    settings: BenchSettings, device: torch.device
) -> tuple[RapidEngine, torch.dtype, dict[str, float]]:
    """The QA suite's engine, in the dtype asked for or, for "auto", the faster one here."""
    fixed = settings.dtype not in ("auto", "")
    dtype = resolve_dtype(settings.dtype if fixed else "float32", device)
    if settings.tiny_models:
        tokenizer = load_model(ensure_default_model(), LoadOptions(device, dtype))[1]
        assert tokenizer is not None  # saved beside the default model by its conversion
        small, large = tiny_pair(len(tokenizer), 2 * max(settings.lengths + settings.speed_lengths))
        target, draft = large.to(device), small.to(device)  # type: ignore[arg-type]  # python/typeshed#10653
    else:
        spec = settings.model or ensure_default_model()
        target, tokenizer = load_model(spec, LoadOptions(device, dtype))
        draft = (
            load_model(settings.draft, LoadOptions(device, dtype))[0] if settings.draft else None
        )
    probe_seconds: dict[str, float] = {}
    if not fixed and settings.target_precision == "int4-weight":
        # bfloat16 activations, where torch's int4 CPU kernel is fast (models._warn_slow_int4);
        # the probe would time the dequantized model instead.
        dtype = torch.bfloat16
        target.to(dtype)
    elif not fixed:
        dtype, probe_seconds = choose_dtype(target, device)
    if draft is not None and not fixed:
        draft.to(dtype)
    engine = RapidEngine(
        target,
        draft,
        tokenizer,
        draft_precision=settings.draft_precision,
        target_precision=settings.target_precision,
        compile_draft=settings.compile_draft,
    )
    return engine, dtype, probe_seconds


def forward_modules(engine: RapidEngine) -> list[torch.nn.Module]:
    """What the probe hooks: the target, the draft, and the draft's compiled decode module,
    whose passes bypass the draft's own hooks (compiled.py)."""
    return [m for m in (engine.target, engine.draft, engine.draft_decode) if m is not None]


def _rope_engine(
    session: _Session, engine: RapidEngine, tasks: list[Task], rope_type: str = "linear"
) -> RapidEngine:
    """A copy of the QA target stretched by RoPE scaling to the longest task."""
    folder = session.settings.model or ensure_default_model()
    window = max(t.context_label for t in tasks)
    model, factor = load_rope_scaled(folder, window, session.device, session.dtype, rope_type)
    session.meta.setdefault("rope_scaling", {})[str(window)] = {
        "rope_type": rope_type,
        "factor": factor,
    }
    settings = session.settings
    return RapidEngine(
        model,
        tokenizer=engine.tokenizer,
        draft_precision=settings.draft_precision,
        target_precision=settings.target_precision,
        compile_draft=settings.compile_draft,
    )


def _engine_for(session: _Session, engine: RapidEngine, task: Task) -> RapidEngine:
    """`engine` when `task` fits its target's window, else a YaRN-scaled copy that fits it."""
    if task.context_label <= engine.context_window or session.settings.tiny_models:
        return engine
    return _rope_engine(session, engine, [task], "yarn")


def memory_model(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of the weights and of one token of KV cache (keys and values, every layer)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return {
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "kv_bytes_per_token": 2 * cfg.num_hidden_layers * kv_heads * head_dim * itemsize,
    }


# ---- suites ---------------------------------------------------------------------------------


def _qa_suite(session: _Session, engine: RapidEngine, tasks: list[Task], name: str = "qa") -> None:
    """Every method on every task, then the follow-up questions (prefix cache kept warm).
    The eta sweep and the broad suite share a task's prompt KV among its methods."""
    settings = session.settings
    methods = settings.method_list()
    overrides = {
        "max_new_tokens": settings.max_new_tokens,
        "stop": QA_STOP,
        "temperature": 0.0,
        "seed": settings.seed,
    }
    with ForwardProbe(forward_modules(engine)) as probe:
        share = settings.eta_sweep or name == "broad"
        suite = _Suite(name, engine, probe, overrides, share_prefill=share)
        warm_up(engine, methods, probe, settings.gguf())
        for task, followup in zip(tasks, _followups(settings, tasks), strict=True):
            drafts = _Retrieved.for_methods(engine, task, methods)
            stored: tuple[float, int] | None = None
            for i, method in enumerate(methods):
                cold = i == 0 or not suite.share_prefill
                retrieved = drafts[_own_retriever(method)]
                call = _Call(suite, method, task, retrieved, cold=cold, stored=stored)
                record = session.run(call)
                stored = stored or _stored(record)
            if followup:
                # The engine still holds this document's KV from the methods above.
                retrieved = _Retrieved.build(engine, followup, True)
                method = Method("rapid", DEFAULT_ETA)
                session.run(_Call(suite, method, followup, retrieved, turn=2))
            session.save()


def _short_suite(session: _Session, engine: RapidEngine, tasks: list[Task]) -> None:
    """The short prompts as the QA suite runs its tasks (each call cold), then each record's
    agreement with lc's answer to the same prompt (`bench/short.py`)."""
    if not tasks:
        return
    _qa_suite(session, engine, tasks, "short")
    tokenizer = engine.tokenizer
    for task in tasks:
        mine = [
            r for r in session.records if r["suite"] == "short" and r["task_id"] == task.task_id
        ]
        attach_agreement(mine, lambda text: tokenizer.encode(text, add_special_tokens=False))
    session.save()


def _followups(settings: BenchSettings, tasks: list[Task]) -> list[Task | None]:
    """For each task, its second question when one is asked: at the longest length only."""
    wanted = "rapid" in settings.methods and not settings.eta_sweep
    longest = max(settings.lengths)
    return [t.followup if wanted and t.context_label == longest else None for t in tasks]


def _tiny_suites(session: _Session, tokenizer: Any, tasks: list[Task]) -> None:
    """Downward then upward speculation with the tiny random pair, speed only."""
    small, large = tiny_pair(len(tokenizer), 2 * max(t.context_label for t in tasks))
    small, large = small.to(session.device, session.dtype), large.to(session.device, session.dtype)  # type: ignore[arg-type]  # python/typeshed#10653
    for suite, target, draft in (("tiny-downward", large, small), ("tiny-upward", small, large)):
        _speed_suite(session, suite, RapidEngine(target, draft, tokenizer), tasks, TINY_METHODS)


def _long_suite(session: _Session, engine: RapidEngine, tasks: list[Task]) -> None:
    """`long_methods` at each length, YaRN-scaled past the window; after `lc` the methods
    reuse the prompt's KV (speed only: prefill is measured once, by `lc` and transformers)."""
    methods = long_methods(session.settings)
    for task in tasks:
        at = _engine_for(session, engine, task)
        _speed_suite(session, "long", at, [task], methods, share_prefill=True)


def _prefill_suite(session: _Session, engine: RapidEngine, tasks: list[Task]) -> None:
    """Prefill time at each task's length by chunk size, against transformers' own prefill
    and the compute bound (`bench/prefill.py`); rows go to results.json's `prefill`."""
    rate = matmul_flops_per_second(session.dtype, session.device)
    session.meta["matmul_flops_per_second"] = rate
    rows: list[dict[str, Any]] = session.meta.setdefault("prefill", [])
    for task in tasks:
        at = _engine_for(session, engine, task)
        ids = encode_prompt(task.messages, at.tokenizer, at.vocab_size)
        chunks = chunk_sizes_to_try(
            rows, session.settings.chunk_sizes, at.config.prefill_chunk_size
        )
        rows += prefill_rows(at, ids, task.context_label, chunks, rate)
        session.bar.update()
        session.save()


def _speed_suite(
    session: _Session,
    suite: str,
    engine: RapidEngine,
    tasks: list[Task],
    methods: Sequence[Method],
    share_prefill: bool = False,
) -> None:
    """`methods` on `tasks`, each decoding exactly `speed_tokens` tokens, `rounds` times in
    turn; then the step costs at each task's length and each record's model-draft speedup
    (`bench/model_draft.py`) and bounds (`bench/bounds.py`). Each round starts with no kept
    schedules, as a fresh engine would (docs/algorithm.md section 2.11): its first adaptive
    call measures afresh."""
    if not tasks:
        return
    overrides = {
        "max_new_tokens": session.settings.speed_tokens,
        "ignore_eos": True,
        "stop": (),
        "temperature": 0.0,
        "seed": session.settings.seed,
    }
    if share_prefill:
        overrides["prefix_cache_bytes"] = LONG_CACHE_BYTES
    device = _bounds_device(session, engine, methods)
    with ForwardProbe(forward_modules(engine)) as probe:
        settings = _Suite(suite, engine, probe, overrides, share_prefill)
        warm_up(engine, list(methods), probe, session.settings.gguf())
        for task in tasks:
            retrieved = _Retrieved.build(engine, task, True)
            for round_ in range(1, session.settings.rounds + 1):
                engine.schedules.clear()
                stored: tuple[float, int] | None = None
                for i, method in enumerate(methods):
                    cold = i == 0 or not share_prefill
                    call = _Call(
                        settings, method, task, retrieved, cold=cold, round=round_, stored=stored
                    )
                    record = session.run(call)
                    stored = stored or _stored(record)
            attach_step_costs(session.records, settings, task, retrieved, device)
            session.save()


def _bounds_device(session: _Session, engine: RapidEngine, methods: Sequence[Method]) -> Device:
    """What the bounds of a suite on `engine` read (`bench/bounds.py`); the read rate is
    measured once per run, at the first speed suite."""
    if "read_bytes_per_second" not in session.meta:
        session.meta["read_bytes_per_second"] = read_bytes_per_second(session.device)
    kv = memory_model(engine.target, session.dtype)["kv_bytes_per_token"]
    rate = session.meta["read_bytes_per_second"]
    widest = widest_pass(engine.config, methods)
    return Device(weights_read_bytes(engine.target), kv, rate, widest)


def attach_step_costs(
    records: list[dict[str, Any]],
    suite: _Suite,
    task: Task,
    retrieved: _Retrieved,
    device: Device,
) -> None:
    """Time target, verify and draft passes at `task`'s length (reusing the prompt KV the runs
    left in the prefix cache) and give each of the task's records of `suite` its
    `step_costs`, `achieved_speedup` (decode rate x target step), the bounds of
    `bench/bounds.py` and, where it drafted, `model_draft_speedup` and `model_draft_gamma` at
    its measured acceptance (not a bound: docs/algorithm.md section 2.12)."""
    engine = suite.engine
    ids = encode_prompt(task.messages, engine.tokenizer, engine.vocab_size)
    stored = suite.overrides.get("prefix_cache_bytes", engine.config.prefix_cache_bytes)
    cache = {"prefixes": engine.prefix_cache, "max_prefix_bytes": stored}
    chunk = engine.config.prefill_chunk_size
    target = pass_seconds(
        engine.target, ids, engine.vocab_size, (1, *VERIFY_TOKENS), chunk=chunk, **cache
    )
    drafts: dict[str, float] = {}
    verify = tuple((k, target[k]) for k in VERIFY_TOKENS)
    mine = [r for r in records if r["suite"] == suite.name and r["task_id"] == task.task_id]
    for record in mine:
        rate = record["decode_tokens_per_second"]
        record["achieved_speedup"] = rate * target[1] if rate else None
        record["model_draft_speedup"] = record["model_draft_gamma"] = None
        which = record["method"]
        if which not in DRAFT_READS or record["acceptance_rate"] is None:
            record["step_costs"] = None
            continue
        if which not in drafts:
            draft, draft_ids, decode = _draft_reads(engine, which, ids, retrieved)
            drafts[which] = pass_seconds(
                draft, draft_ids, engine.vocab_size, (1,), chunk=chunk, decode=decode, **cache
            )[1]
        costs = StepCosts(target[1], drafts[which], verify)
        record["step_costs"] = dataclasses.asdict(costs)
        best, gamma = best_model_draft(costs, record["acceptance_rate"], max(VERIFY_TOKENS) - 1)
        record["model_draft_speedup"], record["model_draft_gamma"] = best, gamma
    # The bounds are this engine's target's; llama.cpp runs other code on other weights.
    ours = [r for r in mine if r["method"] not in LLAMA_METHODS]
    attach_bounds(ours, StepCosts(target[1], 0.0, verify), device)


DRAFT_READS = ("sd", "rapid", "magicdec")
"""The drafting methods whose draft step is timed: the draft on the prompt, the draft on C^S,
the target on its streaming selection (`bench/magicdec.py`)."""


def _draft_reads(
    engine: RapidEngine, method: str, ids: list[int], retrieved: _Retrieved
) -> tuple[PreTrainedModel, list[int], CompiledDecode | None]:
    """The model a method of `DRAFT_READS` drafts with, the ids it drafts on, and the
    compiled forward its decode passes run (None: the model's own; magicdec's own engine
    never compiles)."""
    if method == "magicdec":
        return engine.target, streaming_ids(ids), None
    if method == "rapid" and retrieved.prompt is not None:
        prompt = encode_prompt(retrieved.prompt, engine.tokenizer, engine.vocab_size)
        return engine.draft, prompt, engine.draft_decode
    return engine.draft, ids, engine.draft_decode


def _draft_model(engine: RapidEngine, method: str) -> str | None:
    """The name of the model that drafts for `method` (None: nothing drafts)."""
    if method == "magicdec":
        return model_name(engine.target)
    return model_name(engine.draft) if method in ("rag", "sd", "rapid") else None


# ---- one measurement ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Retrieved:
    """The draft prompt built once per task (every retrieving method reads the same C^S),
    how long building it took, and how many planted facts it kept."""

    prompt: Any
    seconds: float
    needle_recall: float | None

    @classmethod
    def build(
        cls,
        engine: RapidEngine,
        task: Task,
        needed: bool,
        retriever: ContextRetriever | None = None,
    ) -> _Retrieved:
        if not needed:
            return cls(None, 0.0, None)
        start = time.perf_counter()
        tok, config = engine.tokenizer, engine.config
        built = prepare_draft_prompt(task.messages, tok, retriever=retriever, config=config)
        seconds = time.perf_counter() - start
        if built.target_only:  # retrieval failed: the engine falls back to the target alone
            return cls(None, seconds, 0.0)
        messages = cast(list[dict[str, Any]], built.prompt)  # chat in, chat out
        text = "\n".join(m["content"] for m in messages)
        found = sum(f in text for f in task.facts)
        return cls(built.prompt, seconds, found / len(task.facts) if task.facts else None)

    @classmethod
    def for_methods(
        cls, engine: RapidEngine, task: Task, methods: Sequence[Method]
    ) -> dict[ContextRetriever | str | None, _Retrieved]:
        """The task's draft prompts, built once each, by the retriever that builds them: None
        for the task's own (the engine's default), and each retriever a method names (the
        `off-topic` variant). The draft prompt is passed explicitly, which the engine prefers
        to a `retriever` option, so a method must get the C^S of its own retriever here. A
        retriever named by a string reads the target's cache ("attention", ...): the
        engine builds its C^S inside the call, after the target's prefill, so its time is the
        call's and its recall is not measured."""
        drafts: dict[ContextRetriever | str | None, _Retrieved] = {
            None: cls.build(engine, task, any(m.retrieves for m in methods))
        }
        for retriever in {_own_retriever(m) for m in methods} - {None}:
            if isinstance(retriever, str):
                drafts[retriever] = cls(None, 0.0, None)
            else:
                drafts[retriever] = cls.build(engine, task, True, retriever)
        return drafts


def _own_retriever(method: Method) -> ContextRetriever | str | None:
    """The retriever a method's options name (an object, or the name of one that reads the
    target's cache), None where it reads the task's own C^S."""
    return cast("ContextRetriever | str | None", dict(method.options).get("retriever"))


def _measure(call: _Call, gguf: Path | None) -> Measurement:
    engine, method, task, overrides = (
        call.suite.engine,
        call.method,
        call.task,
        call.suite.overrides,
    )
    if method.name in ENGINE_METHODS:
        draft_prompt = call.retrieved.prompt if method.retrieves else None
        return measure_engine(
            engine,
            method,
            task.messages,
            draft_prompt,
            call.suite.probe,
            cold=call.cold and call.turn == 1,
            draft_cold=call.turn == 1,
            **overrides,
        )
    ids = encode_prompt(task.messages, engine.tokenizer, engine.vocab_size)
    ending = {
        "max_new_tokens": overrides["max_new_tokens"],
        "stop": overrides["stop"],
        "ignore_eos": overrides.get("ignore_eos", False),
    }
    if method.name in LLAMA_METHODS:
        assert gguf is not None  # BenchSettings refuses these methods without a GGUF
        return measure_llamacpp(engine, method, ids, gguf, **ending)
    return measure_transformers(engine, method, ids, call.suite.probe, **ending)


def _record(call: _Call, measured: Measurement) -> dict[str, Any]:
    """One results record: what ran, on what, how well, at what cost (docs/benchmarks.md)."""
    engine, method, task, retrieved = call.suite.engine, call.method, call.task, call.retrieved
    retrieves = method.retrieves
    record = {
        "suite": call.suite.name,
        "method": method.name,
        "label": method.label,
        "eta": method.eta
        if method.name in ("rapid", "magicdec")
        else (0.0 if method.name == "sd" else None),
        "task": task.kind,
        "task_id": task.task_id,
        "text_kind": task.text_kind,
        "split": task.split,
        "task_seed": task.seed,
        "context_label": task.context_label,
        "turn": call.turn,
        "round": call.round,
        "target_model": model_name(engine.target),
        "draft_model": _draft_model(engine, method.name),
        "accuracy": score(measured.answer, task.references, task.rule, task.wrong),
        "f1": token_f1(measured.answer, task.references),
        "references": list(task.references),
        "rule": task.rule,
        "wrong": list(task.wrong),
        "needle_recall": retrieved.needle_recall if retrieves else None,
        "retrieval_seconds": retrieved.seconds if retrieves else None,
        **dataclasses.asdict(measured),
    }
    # What the user waits for beyond the call itself: C^S was built before it, and a call
    # that read the prompt KV an earlier method stored is charged the prefill that one paid.
    reused = _reused_prefill(call, measured)
    waited = (retrieved.seconds if retrieves else 0.0) + reused
    record["reused_prefill_seconds"] = reused
    record["time_to_first_token"] += waited
    record["end_to_end_seconds"] = measured.call_seconds + waited
    return record


def _stored(record: dict[str, Any]) -> tuple[float, int]:
    """`_Call.stored` of the calls after the one that wrote `record`."""
    return record["prefill_seconds"], record["context_tokens"]


def _reused_prefill(call: _Call, measured: Measurement) -> float:
    """The prefill `call` skipped by reading the prompt KV its task's first method stored:
    that call's prefill seconds, pro rata of the prompt tokens this one found cached (all but
    a few where it read the same prompt; a draft reading C^S may share only the template's
    opening); 0 for a call that paid its own prefill."""
    if call.stored is None or not measured.cached_prefix_tokens:
        return 0.0
    seconds, tokens = call.stored
    return seconds * min(1.0, measured.cached_prefix_tokens / tokens)


# ---- machine description --------------------------------------------------------------------


def machine_info(device: torch.device) -> dict[str, Any]:
    """The machine and software the figures come from, and how busy it was at the start."""
    info: dict[str, Any] = {
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "load_average_start": _load_average(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value
