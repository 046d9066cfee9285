"""`RapidEngine`: plan, prefill, then passes until the call ends — retrieval-augmented
speculative decoding.

The engine loads the models and plans each call (`request.Plan`); a call's state while it
decodes is one `request.Request`, and each pass over it is `step.speculate` (draft, verify,
settle). Modes reuse the same loop:
  rapid  draft reads the retrieved prompt, p_hat leans toward it (eta)
  sd     draft reads the full prompt, eta = 0 (plain speculative decoding)
  lc     target alone (gamma = 0: every pass emits the target's own token)
  rag    draft model alone on the retrieved prompt
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Generator, Hashable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rapid_integrations.config import (
    Mode,
    RapidConfig,
)
from rapid_integrations.engine.args import LOADING_FIELDS, EngineArgs
from rapid_integrations.engine.call_options import CallOptions
from rapid_integrations.engine.planning import Planner, cache_retriever
from rapid_integrations.engine.request import Plan, Request
from rapid_integrations.engine.step import speculate
from rapid_integrations.errors import (
    DeviceOutOfMemoryError,
    GrammarError,
    RapidConfigError,
    RapidInputError,
    VocabularyMismatchError,
)
from rapid_integrations.models.loading import (
    LoadOptions,
    config_window,
    draft_precision_for,
    load_default,
    load_model,
    load_tokenizer,
    lower_precision_copy,
    target_precision_for,
)
from rapid_integrations.output.logprobs import LogprobScorer, token_bytes
from rapid_integrations.output.outputs import (
    Delta,
    Deltas,
    FinishReason,
    RapidOutput,
    RapidStats,
    RapidStream,
)
from rapid_integrations.runtime.attention import use_rapid_attention
from rapid_integrations.runtime.compiled import compile_decode
from rapid_integrations.runtime.kv import Forwards, KVState, check_cache_layout
from rapid_integrations.runtime.prefix_cache import PrefixCache
from rapid_integrations.runtime.threads import configure_torch_threads, follow_load
from rapid_integrations.sample.grounding import Grounding
from rapid_integrations.spec_decode.batch_caps import BatchSeat
from rapid_integrations.spec_decode.drafting import (
    LookupFirst,
    LookupProposer,
    ModelProposer,
    Proposer,
    token_price,
)
from rapid_integrations.spec_decode.schedule import GammaSchedule
from rapid_integrations.spec_decode.schedule_memory import ScheduleMemory, schedule_key
from rapid_integrations.structured_output.constraints import Constraints
from rapid_integrations.structured_output.sections import Sections
from rapid_integrations.structured_output.tools import Tools
from rapid_integrations.tokens import Prompt, encode_prompt, stop_token_ids

if TYPE_CHECKING:
    from rapid_integrations.structured_output.grammar import Grammar, GrammarCompiler

_Y = TypeVar("_Y")
_S = TypeVar("_S")
_R = TypeVar("_R")

# How the CPU allocator words running out (a plain RuntimeError, unlike CUDA's OutOfMemoryError).
_OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "not enough memory")


class RapidEngine:
    """Retrieval-augmented speculative decoding over Hugging Face causal LMs.

    target / draft: a transformers model, or a local folder / GGUF file / hub id to load.
    draft=None is self-speculation: the target object drafts too (loaded once, two caches).
    The draft may sit on another device; it must share the target's token ids.
    tokenizer / draft_tokenizer: a tokenizer object, or a folder / hub id loaded with
    `tokenizer_kwargs` (default: the tokenizer saved with the target).
    model_kwargs / draft_model_kwargs go to `from_pretrained` when target / draft are loaded
    here (device_map including "auto", quantization_config, attn_implementation,
    trust_remote_code, revision, dtype, ...); the draft does not inherit the target's. A
    device-mapped or quantized model is never moved: the verdict runs where its logits are.
    device / draft_device / dtype place and cast the models loaded here; a model object is
    used where and as it is, so one elsewhere than they ask is refused (`RapidConfigError`).
    draft_precision (one of `config.DRAFT_PRECISIONS`): "bfloat16", "float16", "int8-weight",
    "int4-weight" (CPU), "bf16-weight" (a float32 model) or "int8" drafts with a cheaper
    in-memory copy of the draft (of the target, under self-speculation); outputs stay exact,
    acceptance may drop (int8 loses most). "none" drafts with the draft as loaded. "auto" (the
    default; None means it too), for self-speculation on a CPU, is "int4-weight" for a bf16
    model and "bf16-weight" for a float32 one, where each was measured to pay
    (`models.draft_precision_for`), else "none"; `engine.draft_precision` says which was
    chosen.
    target_precision (one of `config.TARGET_PRECISIONS`): "int4-weight" (CPU, bf16) verifies
    with an int4 copy of the target, every Linear but the output head in 4-bit codes with a
    scale and offset per 32 input channels: a slightly different model, whose own output the
    engine then follows (on the embedded Q4_1 model the codes are the GGUF's;
    docs/performance.md, "An int4 target"). Under self-speculation the draft is that copy too
    (draft_precision "auto" or "none"). "none" and "auto" (the default) verify with the target
    as loaded; `engine.target_precision` says which was chosen.
    compile_draft: run the draft's decode passes through torch.compile (`compiled.py`): on a
    CPU a draft pass of a small model is mostly Python and small operations, which the
    compiled graph removes (docs/performance.md, "A compiled draft"). The graphs are built
    here: for SmolLM2-135M on two CPU cores the engine builds in 106 s the first time, 84 s
    from inductor's on-disk cache after that; `engine.draft_decode` is the compiled module.
    The draft must not be changed after the engine is built (its graphs do not check every
    pass that it was not: `compiled.py`).
    Models that use SDPA are switched to `attention.rapid_attention`, the same math without
    copying the grouped-query KV cache on verify passes.
    `engine.draft_token_price` is what a token adds to a draft forward pass, measured here
    (`drafting.token_price`), by which the draft reads only the lookup's copies that pay
    (docs/algorithm.md section 2.10); engines meant to run pass for pass alike (replicas
    compared call by call) may be given one price by assignment.
    Every argument is checked before any weights load: bad values raise `RapidConfigError`.
    """

    def __init__(
        self,
        target: Any,
        draft: Any = None,
        tokenizer: PreTrainedTokenizerBase | str | os.PathLike[str] | None = None,
        config: RapidConfig | Mapping[str, Any] | None = None,
        *,
        retriever: Any = None,
        device: str | torch.device | None = None,
        draft_device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        draft_tokenizer: PreTrainedTokenizerBase | str | os.PathLike[str] | None = None,
        draft_precision: str | None = "auto",
        target_precision: str | None = "auto",
        model_kwargs: dict[str, Any] | None = None,
        draft_model_kwargs: dict[str, Any] | None = None,
        tokenizer_kwargs: dict[str, Any] | None = None,
        compile_draft: bool = False,
    ) -> None:
        args = EngineArgs(
            target,
            draft,
            tokenizer,
            device,
            draft_device,
            dtype,
            draft_precision,
            target_precision,
            model_kwargs or {},
            draft_model_kwargs or {},
            tokenizer_kwargs or {},
            compile_draft,
        )
        self.config, options, draft_options = args.check(config)
        cache_retriever(retriever)  # an unknown retriever name, before any weights load
        configure_torch_threads()  # then followed as the load changes (threads.py)
        tokenizer, draft_tokenizer = _load_tokenizers(tokenizer, draft_tokenizer, tokenizer_kwargs)
        draft_tok = self._load_models(args, options, draft_options, tokenizer)
        self.vocab_size = _shared_vocab(
            self.tokenizer, self.target, self.draft, draft_tokenizer or draft_tok
        )
        # The draft's decode passes compiled (compiled.py), their graphs built now; None: eager.
        self.draft_decode = compile_decode(self.draft, self.vocab_size) if compile_draft else None
        # What a token adds to a draft pass (docs/algorithm.md section 2.10), measured once so
        # that every call on this engine reads the same copies for the same text.
        self.draft_token_price = token_price(self.draft, self.vocab_size, self.draft_decode)
        self.retriever = retriever
        self.planner = Planner(self.tokenizer, self.target, self.draft, self.vocab_size)
        self.prefix_cache = PrefixCache()
        self.schedules = ScheduleMemory()
        configs = {
            id(m): m.generation_config for m in (self.target, self.draft) if m.generation_config
        }
        self.eos_token_ids = stop_token_ids(self.tokenizer, configs.values())
        self._grammar_compiler: GrammarCompiler | None = None
        self._token_bytes: list[bytes] | None = None

    def _load_models(
        self,
        args: EngineArgs,
        options: LoadOptions,
        draft_options: LoadOptions,
        tokenizer: PreTrainedTokenizerBase | None,
    ) -> PreTrainedTokenizerBase | None:
        """Load the target and the draft with their checked options, make the lower-precision
        copies asked for, and switch both to the engine's attention; sets `target`, `draft`,
        `tokenizer` and the precisions chosen. Returns the tokenizer found beside the draft."""
        self.target, loaded_tok = load_model(args.model, options)
        self.target_precision = target_precision_for(args.target_precision or "auto")
        if self.target_precision != "none":
            self.target = lower_precision_copy(
                self.target, self.target_precision, "target_precision"
            )
        found = tokenizer or loaded_tok
        if found is None:
            raise RapidInputError("no tokenizer found for the target model; pass tokenizer=")
        self.tokenizer: PreTrainedTokenizerBase = found
        self_draft = args.self_draft
        if self_draft:
            self.draft, draft_tok = self.target, None
        else:
            self.draft, draft_tok = load_model(args.draft_model, draft_options)
        # The copy the draft runs as ("none": as loaded), what "auto" chose included; a
        # self-draft of a lower-precision target shares that copy ("auto" is "none" there).
        self.draft_precision = draft_precision_for(
            self.draft,
            args.draft_precision or "auto",
            self_draft and self.target_precision == "none",
        )
        if self.draft_precision != "none":
            self.draft = lower_precision_copy(self.draft, self.draft_precision)
        check_cache_layout(self.target, "target")
        check_cache_layout(self.draft, "draft")
        for model in {id(m): m for m in (self.target, self.draft)}.values():
            use_rapid_attention(model)
        return draft_tok

    @classmethod
    def from_default(
        cls,
        draft: Any = None,
        *,
        retriever: Any = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        model_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> RapidEngine:
        """An engine on the embedded SmolLM2-135M-Instruct (self-speculation unless `draft`).

        `options` are `RapidConfig` fields, plus the constructor's loading options
        (`args.LOADING_FIELDS`) but the models and tokenizers; all are checked before the
        model loads."""
        loading = {k: options.pop(k) for k in LOADING_FIELDS if k in options}
        for own in set(loading) & {"model", "draft_model", "tokenizer", "tokenizer_kwargs"}:
            raise RapidConfigError(
                own,
                "from_default loads the embedded model and its tokenizer; pass draft= "
                "for a separate draft, or build RapidEngine(model, ...) for another model",
            )
        args = EngineArgs(
            draft_model=draft,
            device=device,
            dtype=dtype,
            model_kwargs=model_kwargs or {},
            **loading,
        )
        config, _, _ = args.check(options)
        model, tokenizer = load_default(device, dtype, model_kwargs)
        # The target is loaded (model_kwargs applied): the engine gets the rest.
        given = {k: v for k, v in args.options().items() if k != "model_kwargs"}
        return cls(model, draft, tokenizer, config, retriever=retriever, **given)

    @property
    def model_name(self) -> str:
        return str(getattr(self.target.config, "_name_or_path", "") or type(self.target).__name__)

    @property
    def context_window(self) -> int:
        """The target's window in tokens (prompt and generated tokens together)."""
        return config_window(self.target.config)

    def count_tokens(self, prompt: Prompt) -> int:
        """Tokens the target would read for `prompt`."""
        return len(encode_prompt(prompt, self.tokenizer, self.vocab_size))

    def generate(
        self,
        prompt: Prompt,
        draft_prompt: Prompt | None = None,
        mode: Mode | None = None,
        *,
        options: CallOptions | None = None,
        **overrides: Any,
    ) -> RapidOutput:
        """Generate a completion. The call's options are `options` (a `CallOptions`), or the
        keyword form that builds one (`CallOptions.of`): `draft_prompt`, `mode` (None:
        "rapid"), and `overrides`: `RapidConfig` fields for this call, plus `retriever=` and
        `query=` for building the draft prompt when `draft_prompt` is None, and `grammar=` (a
        `Grammar`) that the output must match (docs/algorithm.md section 10), or `tools=`,
        `tool_choice=` and `parallel_tool_calls=` (section 11). Unknown names raise
        `RapidConfigError` naming them.
        """
        run = self._begin(prompt, CallOptions.for_call(options, draft_prompt, mode, overrides))
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(
        self,
        prompt: Prompt,
        draft_prompt: Prompt | None = None,
        mode: Mode | None = None,
        *,
        options: CallOptions | None = None,
        **overrides: Any,
    ) -> RapidStream:
        """Like `generate`, but iterate text deltas as tokens are committed; `.output` at the end."""
        return RapidStream(
            self._begin(prompt, CallOptions.for_call(options, draft_prompt, mode, overrides))
        )

    def _begin(self, prompt: Prompt, options: CallOptions) -> Generator[Delta, None, RapidOutput]:
        """Plan the call now, so that bad input raises here and not at a stream's first token;
        the generator returned decodes it."""
        start = time.perf_counter()
        plan, stats = self._plan(prompt, options)
        return self._free_on_out_of_memory(self._run(plan, stats, start), plan)

    def _free_on_out_of_memory(
        self, run: Generator[_Y, _S, _R], plan: Plan
    ) -> Generator[_Y, _S, _R]:
        """`run` (a call alone, or its loop in a batch), with running out of memory raised as
        `DeviceOutOfMemoryError`.

        The failed call's frames are cleared, or the error would keep its half-filled KV caches
        and the model's activations alive for as long as the caller holds it; the prefix cache
        is emptied, as the memory the engine itself can give back.
        """
        try:
            return (yield from run)
        except Exception as exc:
            if not _is_out_of_memory(exc):
                raise
            traceback.clear_frames(exc.__traceback__)
            self.prefix_cache.clear()
            raise DeviceOutOfMemoryError(_out_of_memory_advice(exc, plan)) from exc

    @torch.inference_mode()
    def _run(
        self, plan: Plan, stats: RapidStats, start: float
    ) -> Generator[Delta, None, RapidOutput]:
        """The call alone, the batch of one: each forward pass its loop asks for runs by
        itself (`KVState.feed`), and what a pass commits is yielded before the next runs."""
        deltas = Deltas()
        steps = self._decode(plan, stats, start, deltas.append)
        try:
            feed = next(steps)
            while True:
                yield from deltas.take()
                follow_load()  # threads.py: fewer threads while other processes are busy
                feed = steps.send(feed.run())
        except StopIteration as done:
            yield from deltas.take()
            return cast(RapidOutput, done.value)

    def decoding(
        self,
        prompt: Prompt,
        options: CallOptions,
        emit: Callable[[Delta], None],
        seat: BatchSeat,
    ) -> Forwards[RapidOutput]:
        """A call's loop for a batch (`batching.runner.BatchRunner`): planned now, so that bad input
        raises here; `emit` gets each delta as its pass commits it; `seat` is its place in the
        batch (docs/algorithm.md section 14.2). A packed pass's error is thrown into the loop,
        so that running out of memory raises as it does alone."""
        start = time.perf_counter()
        plan, stats = self._plan(prompt, options)
        return self._free_on_out_of_memory(self._decode(plan, stats, start, emit, seat), plan)

    @torch.inference_mode()
    def _decode(
        self,
        plan: Plan,
        stats: RapidStats,
        start: float,
        emit: Callable[[Delta], None],
        seat: BatchSeat | None = None,
    ) -> Forwards[RapidOutput]:
        """One call's loop: prefill, then passes (`speculate`) until it finishes; every
        forward pass after the prefill is yielded as a `Feed` to whoever drives it (`_run`
        alone, `batch.BatchRunner` packed, which passes the call's `seat`), and each committed
        step goes to `emit`."""
        cfg = plan.cfg
        assert stats.seed is not None  # `_plan` always draws one
        # Sampling and the verdict run where the deciding model's logits come out.
        gen = torch.Generator(logits_device(plan.main)).manual_seed(stats.seed)
        limit = min(cfg.max_new_tokens, plan.window - len(plan.ids))
        target = yield from self._start(plan.main, plan.ids, limit, cfg)
        if plan.after_prefill is not None:  # C^S from the target's cache (`Planner._from_cache`)
            plan = plan.after_prefill(target)
            cfg = plan.cfg
        stats.cached_prefix_tokens = target.reused_tokens
        shaping = self._constraints(plan, plan.main, "the model")
        # A grammar ends on its stop tokens even under ignore_eos: nothing may follow it.
        eos = frozenset() if cfg.ignore_eos and not plan.grammar else self.eos_token_ids
        proposer, draft_shaping, draft = yield from self._proposer(plan, stats, gen, limit, eos)
        decode_start = time.perf_counter()
        stats.prefill_seconds = decode_start - start

        guarded = cfg.end_guard and eos and cfg.eta > 0
        key, schedule, fresh = self._schedule(plan, stats)
        request = Request(
            plan,
            stats,
            start,
            emit,
            limit,
            eos,
            target,
            gen,
            schedule,
            Sections(self.tokenizer, cfg.stop, plan.gate, plan.tools is not None),
            proposer,
            torch.tensor(sorted(eos), device=gen.device) if guarded else None,
            shaping,
            draft_shaping,
            LogprobScorer(cfg, self._vocabulary_bytes()) if cfg.logprobs else None,
            seat or BatchSeat(),
            _grounding(plan),
            draft,
        )
        finish: FinishReason | None = None
        while finish is None:
            finish = request.commit((yield from speculate(request)))
            if finish is None and plan.following is not None:
                yield from self._follow(request)
        stats.decode_seconds = time.perf_counter() - decode_start
        self.schedules.keep(key, schedule, fresh)
        return request.output(finish)

    def _proposer(
        self,
        plan: Plan,
        stats: RapidStats,
        gen: torch.Generator,
        limit: int,
        eos: frozenset[int],
    ) -> Forwards[tuple[Proposer | None, Constraints | None, KVState | None]]:
        """The call's drafting strategy (None: the target alone), the draft's constraints and
        its sequence; the draft's prefill passes are yielded (`_start`)."""
        if plan.draft_ids is None:
            return None, None, None
        cfg = plan.cfg
        assert stats.seed is not None  # `_plan` always draws one
        draft_at = logits_device(self.draft)
        draft_gen = (
            gen if draft_at == gen.device else torch.Generator(draft_at).manual_seed(stats.seed + 1)
        )
        draft = yield from self._start(self.draft, plan.draft_ids, limit, cfg, draft=True)
        stats.draft_cached_prefix_tokens = draft.reused_tokens
        shaping = self._constraints(plan, self.draft, "the draft model")
        model = ModelProposer(draft, cfg, draft_gen, shaping, eos, self.draft_token_price)
        # The lookup's copies bypass the draft's constraints (its matcher and history
        # would fall behind), so it drafts only for calls with nothing to shape.
        if cfg.lookup_ngram and shaping is None:
            lookup = LookupProposer(plan.draft_ids, plan.ids, cfg.lookup_ngram)
            return LookupFirst(lookup, model), shaping, draft
        return model, shaping, draft

    def _follow(self, request: Request) -> Forwards[None]:
        """C^S after the answer's last tokens (`retrieval.following`, docs/algorithm.md
        section 2.13), when due: if it changes, the draft's short context is rebuilt with it
        and the draft reads it afresh, the answer so far included (its prefill passes
        yielded); the target's cache is only read."""
        following, draft, committed = request.plan.following, request.draft, request.sections.ids
        if following is None or draft is None or not following.due(len(committed)):
            return
        target, ids = request.target, request.plan.ids
        answered = target.cache.get_seq_length() - len(ids)
        if not following.rescore(request.plan.main, target.cache, ids + committed, answered):
            return
        start = time.perf_counter()
        draft_ids = following.redraft()
        if draft_ids is not None:
            left = request.limit - len(committed)
            fresh = yield from self._start(
                self.draft, draft_ids + committed, left, request.cfg, draft=True
            )
            draft.adopt(fresh)
            request.stats.draft_context_tokens = len(draft_ids)
            if request.grounding:
                request.grounding.read(draft_ids)
        following.seconds += time.perf_counter() - start

    def _schedule(self, plan: Plan, stats: RapidStats) -> tuple[Hashable, GammaSchedule, bool]:
        """The call's gamma schedule, its key and whether it is fresh: where the last call at
        its length left off, while that still holds (docs/algorithm.md section 2.11)."""
        key = schedule_key(stats.mode, len(plan.ids), plan.cfg, plan.grammar is not None)
        schedule, fresh = self.schedules.start(key, plan.cfg)
        stats.schedule_from_earlier_call = not fresh
        return key, schedule, fresh

    def _constraints(self, plan: Plan, model: PreTrainedModel, source: str) -> Constraints | None:
        """The call's logit shaping for `model`, or None when nothing shapes them. Both
        models count the decoding model's prompt as history and follow the same grammar past
        the same reasoning section, so q is shaped exactly as p (docs/algorithm.md sections
        9, 10 and 13)."""
        if plan.cfg.repetition_penalty == 1.0 and plan.grammar is None:
            return None
        matcher = None if plan.grammar is None else self._grammars().matcher(plan.grammar)
        return Constraints(
            plan.ids, self.vocab_size, plan.cfg, logits_device(model), source, matcher, plan.gate
        )

    def _grammar(self, grammar: object, tools: Tools | None) -> Grammar | None:
        """Check a call's `grammar=` and compile it now, so errors raise before decoding.
        With tools, the tools' grammar, `grammar=` then being what an answer that is no call
        must match (`Tools.grammar`, docs/algorithm.md section 11)."""
        if grammar is not None:
            from rapid_integrations.structured_output.grammar import Grammar

            if not isinstance(grammar, Grammar):
                raise GrammarError(
                    "grammar must be a rapid_integrations.Grammar (Grammar.json_schema, .regex, "
                    f".ebnf or .json_object), got {type(grammar).__name__}"
                )
        if tools is not None:
            grammar = tools.grammar(self.tokenizer, grammar)
        if grammar is None:
            return None
        self._grammars().matcher(grammar)
        return grammar

    def _vocabulary_bytes(self) -> list[bytes]:
        """Each token id's bytes, for log probabilities; made on first use."""
        if self._token_bytes is None:
            self._token_bytes = token_bytes(self.tokenizer, self.vocab_size)
        return self._token_bytes

    def _grammars(self) -> GrammarCompiler:
        """The engine's grammar compiler, made on first use (xgrammar loads only then)."""
        if self._grammar_compiler is None:
            from rapid_integrations.structured_output.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(
                self.tokenizer, self.vocab_size, self.eos_token_ids
            )
        return self._grammar_compiler

    def _start(
        self,
        model: PreTrainedModel,
        ids: list[int],
        limit: int,
        cfg: RapidConfig,
        draft: bool = False,
    ) -> Forwards[KVState]:
        """The sequence's cache, its prefill chunks yielded (`KVState.starting`; `draft`: the
        draft's, run in a batch's draft phase)."""
        # A sequence never holds more than its prompt plus `limit` tokens: drafting stops
        # short of the budget, so drafts in flight fit too.
        return (
            yield from KVState.starting(
                model,
                ids,
                self.vocab_size,
                cfg.prefill_chunk_size,
                len(ids) + limit,
                self.prefix_cache,
                cfg.prefix_cache_bytes,
                draft,
                self.draft_decode if draft else None,
                deterministic=cfg.deterministic,
            )
        )

    def _plan(self, prompt: Prompt, options: CallOptions) -> tuple[Plan, RapidStats]:
        """The call planned on this engine's models, config and retriever (`planning.Planner`),
        its tools parsed and its grammar compiled here, where the grammar compiler lives."""
        tools = Tools.parse(options.tools, options.tool_choice, options.parallel_tool_calls)
        grammar = self._grammar(options.grammar, tools)
        return self.planner.plan(prompt, options, self.config, self.retriever, tools, grammar)


def _load_tokenizers(
    tokenizer: Any, draft_tokenizer: Any, tokenizer_kwargs: dict[str, Any] | None
) -> tuple[PreTrainedTokenizerBase | None, PreTrainedTokenizerBase | None]:
    """The target's and the draft's tokenizers, loaded where given as a folder or hub id
    (None: found with the model); `tokenizer_kwargs` apply only to those loaded here."""
    if tokenizer_kwargs and not (
        tokenizer is None
        or any(isinstance(t, (str, os.PathLike)) for t in (tokenizer, draft_tokenizer))
    ):
        raise RapidConfigError(
            "tokenizer_kwargs", "apply when a tokenizer is loaded, not to tokenizer objects"
        )
    return (
        load_tokenizer(tokenizer, tokenizer_kwargs),
        load_tokenizer(draft_tokenizer, tokenizer_kwargs, "draft_tokenizer"),
    )


def _grounding(plan: Plan) -> Grounding | None:
    """The rows a call's verdict leans on, for `eta_rule="grounded"` with a draft and a lean
    (docs/algorithm.md section 2.3); None: every row."""
    cfg = plan.cfg
    if cfg.eta_rule != "grounded" or cfg.eta == 0 or plan.draft_ids is None:
        return None
    return Grounding(plan.draft_ids, plan.ids)


def _is_out_of_memory(exc: Exception) -> bool:
    """Whether `exc` is a device (or host) running out of memory, however the backend says it."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OUT_OF_MEMORY)


def _out_of_memory_advice(exc: Exception, plan: Plan) -> str:
    """The message of `DeviceOutOfMemoryError`: the call's size, the cause, what to lower."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return (
        f"out of memory on a call with a {len(plan.ids)}-token prompt ({reason}). The call's "
        "caches were freed and the prefix cache emptied; the engine can be called again. To "
        f"fit: a smaller prefill_chunk_size (now {plan.cfg.prefill_chunk_size}) or "
        "prefix_cache_bytes, a shorter prompt (or truncation='head_tail'), fewer "
        "max_new_tokens, or the model in a lower-precision dtype"
    )


def logits_device(model: PreTrainedModel) -> torch.device:
    """Where `model`'s logits come out: under a multi-device map (accelerate hooks) the output
    head's execution device, which need not be `model.device` (the first weight's); else the
    head's weight device."""
    head = model.get_output_embeddings()
    hooked = getattr(getattr(head, "_hf_hook", None), "execution_device", None)
    if hooked is not None:
        return torch.device(hooked)
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    return model.device


def _width(model: PreTrainedModel) -> int:
    weight = getattr(model.get_output_embeddings(), "weight", None)
    weight = weight() if callable(weight) else weight  # quantized Linear exposes weight()
    return (
        int(weight.shape[0]) if isinstance(weight, torch.Tensor) else int(model.config.vocab_size)
    )


def _shared_vocab(
    tokenizer: PreTrainedTokenizerBase,
    target: PreTrainedModel,
    draft: PreTrainedModel,
    draft_tokenizer: PreTrainedTokenizerBase | None,
) -> int:
    """The vocabulary width both models use: logit widths may differ only by padding."""
    n, wt, wd = len(tokenizer), _width(target), _width(draft)
    if wt != wd and min(wt, wd) < n:
        raise VocabularyMismatchError(
            f"target has {wt} output logits and draft {wd}, but the tokenizer has {n} tokens: "
            "draft and target must share a vocabulary"
        )
    if draft_tokenizer is not None and draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise VocabularyMismatchError("draft and target tokenizers map tokens to different ids")
    return min(n, wt, wd)
