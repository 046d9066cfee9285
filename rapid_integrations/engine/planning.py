"""`Planner`: a call checked, both prompts encoded, C^S built, and who decodes what chosen.

The engine hands each call's prompt and `CallOptions` here before anything runs, so that bad
input raises before a forward pass. The plan (`request.Plan`) says which model reads which ids
under which config. Where C^S comes from the target's own attention (a retriever named in
`retrieval.attention.CACHE_RETRIEVERS`), the draft's ids wait for the target's prefill: the plan
carries `after_prefill`, which completes it from the target's cache (docs/retrieval.md, "The
target's attention as the retriever").
"""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING, Any, cast

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rapid_integrations.config import DRAWN_SEEDS, Mode, RapidConfig
from rapid_integrations.engine.call_options import ENGINE_RETRIEVER, CallOptions
from rapid_integrations.engine.request import Plan
from rapid_integrations.errors import (
    ContextWindowExceededError,
    RapidConfigError,
    RapidInputError,
)
from rapid_integrations.models.loading import config_window
from rapid_integrations.output.outputs import RapidStats
from rapid_integrations.runtime.kv import KVState
from rapid_integrations.structured_output.sections import Gate
from rapid_integrations.structured_output.tools import Tools, prepare_messages
from rapid_integrations.tokens import Prompt, encode_prompt, is_chat

if TYPE_CHECKING:
    from rapid_integrations.engine.prompts import Builtin
    from rapid_integrations.retrieval.faiss_retriever import FaissContextRetriever
    from rapid_integrations.structured_output.grammar import Grammar


class Planner:
    """Plans the calls of one engine: its tokenizer, its target and draft models (the draft is
    the target itself under self-speculation) and their shared vocabulary size."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        vocab_size: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.target = target
        self.draft = draft
        self.vocab_size = vocab_size

    def plan(
        self,
        prompt: Prompt,
        options: CallOptions,
        config: RapidConfig,
        engine_retriever: Any,
        tools: Tools | None,
        grammar: Grammar | None,
    ) -> tuple[Plan, RapidStats]:
        """Validate the call, encode both prompts, and choose who decodes what. `config` and
        `engine_retriever` are the engine's, which the call's options override; `tools` and
        `grammar` are the call's, parsed and compiled by the engine."""
        mode, draft_prompt = options.mode, options.draft_prompt
        retriever = options.retriever
        if retriever is ENGINE_RETRIEVER:
            retriever = engine_retriever
        # A retriever named in `CACHE_RETRIEVERS` ("attention", ...) reads the target's cache,
        # so the draft's prompt waits for the target's prefill (`_from_cache`); "rag" never
        # runs the target and retrieves with the embedder.
        from_cache = cache_retriever(retriever)
        if from_cache is not None:
            retriever = None
        cfg = config.replace(**options.config)
        if mode == "sd":
            cfg = cfg.replace(eta=0.0)
        seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(DRAWN_SEEDS)
        stats = RapidStats(mode=mode, eta=cfg.eta, gamma=cfg.gamma, seed=seed)
        plain, _ = self.with_tools(prompt, None)  # calls and results rendered, no specs
        prompt, template = self.with_tools(prompt, tools)
        ids = self.fit(self.encode(prompt, template), self.target, cfg)
        short = isinstance(cfg.speculate_min_context, int) and len(ids) < cfg.speculate_min_context
        if mode in ("rapid", "sd") and short:
            mode = "lc"  # too short for speculation to pay off (docs/algorithm.md section 2.9)
        deferred = from_cache is not None and mode == "rapid" and draft_prompt is None
        if mode in ("rapid", "rag") and draft_prompt is None and not deferred:
            # Retrieved before the tool specs join the system message: they are instructions
            # the draft reads whole, never context to cut (docs/algorithm.md section 11).
            draft_prompt, mode = self._retrieve(
                plain, ids, retriever, options.query, cfg, stats, mode
            )
        if draft_prompt is not None:
            draft_prompt, _ = self.with_tools(draft_prompt, tools)
        draft_ids = None
        if mode in ("rapid", "rag") and not deferred:
            # The draft reads the same tool specs (docs/algorithm.md section 11): they join
            # its retrieved prompt above, and the template gets the same arguments.
            assert draft_prompt is not None  # given, or retrieved above
            draft_ids = self.fit(self.encode(draft_prompt, template), self.draft, cfg)
        elif mode == "sd":
            draft_ids = self.fit(ids, self.draft, cfg)
        if mode == "rapid":
            cfg = lean_only_with_retrieval(cfg, draft_ids, ids, stats)
        stats.mode = mode
        stats.target_context_tokens = len(ids)
        stats.draft_context_tokens = len(draft_ids or ())
        if mode == "rag":
            assert draft_ids is not None  # encoded above for "rag"
            main, main_ids, draft_ids = self.draft, draft_ids, None
        else:
            main, main_ids = self.target, ids
        gate = Gate.for_call(self.tokenizer, cfg, main_ids)
        window = config_window(main.config)
        plan = Plan(main, main_ids, window, draft_ids, cfg, grammar, tools, gate)
        if deferred:
            assert from_cache is not None  # deferred only for a named cache retriever
            name, query = from_cache, options.query

            def after_prefill(target: KVState) -> Plan:
                return self._from_cache(name, plain, tools, template, query, stats, plan, target)

            plan = dataclasses.replace(plan, after_prefill=after_prefill)
        return plan, stats

    def with_tools(self, prompt: Prompt, tools: Tools | None) -> tuple[Prompt, dict[str, Any]]:
        """Chat messages with tools, calls and results rendered for the chat template, and the
        template's extra arguments (`tools.prepare_messages`); other prompts pass through."""
        if is_chat(prompt):
            return prepare_messages(prompt, tools, self.tokenizer)
        if tools is not None:
            raise RapidInputError("tools= needs a chat prompt (a list of role/content messages)")
        return prompt, {}

    def encode(self, prompt: Prompt, template: dict[str, Any]) -> list[int]:
        """The token ids the models read for `prompt` (`template`: the chat template's extra
        arguments, from `with_tools`)."""
        return encode_prompt(prompt, self.tokenizer, self.vocab_size, template)

    def fit(self, ids: list[int], model: PreTrainedModel, cfg: RapidConfig) -> list[int]:
        """Enforce the model's window: raise, or keep head and tail under truncation='head_tail'."""
        window = config_window(model.config)
        if len(ids) < window:
            return ids
        if cfg.truncation == "error":
            which = "target" if model is self.target else "draft"
            raise ContextWindowExceededError(len(ids), window, which)
        keep = window - min(cfg.max_new_tokens, window // 4)
        head = keep // 4
        return ids[:head] + ids[len(ids) - (keep - head) :]

    def _retrieve(
        self,
        prompt: Prompt,
        ids: list[int],
        retriever: Any,
        query: str | None,
        cfg: RapidConfig,
        stats: RapidStats,
        mode: Mode,
        builtin: Builtin | None = None,
    ) -> tuple[Prompt, Mode]:
        """Build the draft prompt by retrieval; returns it and the mode to run (lc on fallback).
        `builtin`: what retrieves from the prompt's own middle (None: the embedder)."""
        from rapid_integrations.engine.prompts import prepare_draft_prompt

        source = (
            prompt
            if isinstance(prompt, str) or is_chat(prompt)
            else cast(str, self.tokenizer.decode(ids))  # one flat id list: one string
        )
        built = prepare_draft_prompt(
            source, self.tokenizer, retriever=retriever, query=query, config=cfg, builtin=builtin
        )
        stats.retrieved_tokens = built.retrieved_tokens
        stats.retrieval_fallback = built.fallback
        return built.prompt, ("lc" if built.target_only else mode)

    def _from_cache(
        self,
        name: str,
        prompt: Prompt,
        tools: Tools | None,
        template: dict[str, Any],
        query: str | None,
        stats: RapidStats,
        plan: Plan,
        target: KVState,
    ) -> Plan:
        """`plan` with the draft's ids, once `target` holds the prompt: C^S scored by the
        target's attention (`retrieval.attention`, retriever `name`), budgeted and packed as
        the embedder's is, then encoded and checked as `plan` does for the embedder's. Under
        "following" the plan keeps the retriever, to choose C^S again as the answer unfolds."""
        from rapid_integrations.retrieval.attention import (
            AttentionRetriever,
            cache_retriever_factory,
        )
        from rapid_integrations.retrieval.following import Following

        make = cache_retriever_factory(name, plan.main, target.cache, plan.ids)
        made: list[FaissContextRetriever] = []

        def builtin(*args: Any) -> FaissContextRetriever:
            # Made once; a rebuild re-packs the same retriever under its new scores.
            if not made:
                made.append(make(*args))
            return made[0]

        def redraft() -> list[int] | None:
            draft_prompt, mode = self._retrieve(
                prompt, plan.ids, None, query, plan.cfg, stats, "rapid", builtin
            )
            if mode != "rapid":
                return None
            draft_prompt, _ = self.with_tools(draft_prompt, tools)
            return self.fit(self.encode(draft_prompt, template), self.draft, plan.cfg)

        draft_ids, cfg, following = redraft(), plan.cfg, None
        if draft_ids is not None:
            cfg = lean_only_with_retrieval(cfg, draft_ids, plan.ids, stats)
            if name == "following" and made and isinstance(made[0], AttentionRetriever):
                following = Following(made[0], redraft)
        stats.mode = "rapid" if draft_ids is not None else "lc"
        stats.draft_context_tokens = len(draft_ids or ())
        return dataclasses.replace(
            plan, draft_ids=draft_ids, cfg=cfg, after_prefill=None, following=following
        )


def lean_only_with_retrieval(
    cfg: RapidConfig, draft_ids: list[int] | None, ids: list[int], stats: RapidStats
) -> RapidConfig:
    """A rapid call's config: eta 0 when the draft reads the target's own prompt, token for
    token. q then knows nothing p does not, so a lean toward it would carry only the draft
    copy's rounding (docs/algorithm.md section 1.1); `stats` say so."""
    if draft_ids != ids or cfg.eta == 0.0:
        return cfg
    stats.eta, stats.lean_skipped = 0.0, True
    return cfg.replace(eta=0.0)


def cache_retriever(retriever: Any) -> str | None:
    """The name of a retriever that reads the target's cache, None for any other retriever;
    an unknown name raises `RapidConfigError`."""
    if not isinstance(retriever, str):
        return None
    from rapid_integrations.retrieval.attention import CACHE_RETRIEVERS

    if retriever not in CACHE_RETRIEVERS:
        raise RapidConfigError(
            "retriever",
            f"unknown retriever {retriever!r}: name one of {', '.join(CACHE_RETRIEVERS)}, "
            "or pass an object with retrieve(query) -> list[str], or None for the embedder",
        )
    return retriever
