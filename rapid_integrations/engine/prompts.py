"""The draft prompt: the target's prompt with its long context C replaced by retrieved C^S.

`build_draft_prompt` is the public entry; the engine calls `prepare_draft_prompt`, which also
reports how C^S was obtained. Rules (docs/algorithm.md section 1; docs/retrieval.md):

* string prompts keep the instruction head and the question tail verbatim and replace the
  middle by retrieved passages (`retrieval.splitting` finds the cuts); chat prompts keep
  everything from the last user turn on and retrieve from earlier turns, and a system message
  or last user turn longer than the budget is cut like a string prompt; token-id prompts are decoded, handled as strings and encoded again;
* the budget is `config.retrieval_budget`, else `default_budget(prompt tokens)`:
  `clamp(ceil(tokens / 24), 512, 4096)` (the paper's 1/24 and 4096 cap, with a floor for
  4K-8K windows). A middle that fits the budget passes through unchanged;
* the draft prompt never exceeds head + budget + tail tokens and contains only prompt or
  retriever text (passages are joined by a blank line);
* an external retriever that raises, times out (`retrieval_timeout`), returns nothing or the
  wrong type falls back per `retrieval_fallback`: "builtin" (FAISS over the prompt's own
  middle), "lc" (`target_only`: decode with the target alone) or "raise" (`RetrievalError`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

from rapid_integrations.config import RapidConfig
from rapid_integrations.errors import RapidInputError, RetrievalError
from rapid_integrations.retrieval.base import (
    ContextRetriever,
    TokenizerLike,
    count_text_tokens,
    count_tokens,
    default_budget,
)
from rapid_integrations.retrieval.faiss_retriever import FaissContextRetriever
from rapid_integrations.retrieval.guard import call_retriever
from rapid_integrations.retrieval.packing import Passage, join_passages, pack_passages
from rapid_integrations.retrieval.splitting import PromptSplit, default_query, split_prompt

Messages = list[dict[str, Any]]
PromptLike = str | Sequence[Mapping[str, Any]] | Sequence[int] | PromptSplit
Builtin = Callable[[list[str], TokenizerLike, RapidConfig, int], FaissContextRetriever]
"""Makes the built-in retriever over a prompt's documents: (documents, tokenizer, config,
budget) -> a retriever whose `select(query)` gives C^S (`FaissContextRetriever.from_config`,
or the target's attention: `retrieval.attention.cache_retriever_factory`)."""


@dataclass(frozen=True)
class DraftPrompt:
    """The draft's prompt and how it was built.

    prompt: same form as the input (str, chat messages or token ids; a `PromptSplit` gives
    str); retrieved_tokens: tokens of C^S (of the whole middle when passed through);
    fallback: None when retrieval went as configured, else the reason a fallback was taken
    (e.g. "retriever raised TimeoutError: ..."); target_only: the fallback is "lc", so decode
    with the target alone (prompt is then the unchanged input); query: the retrieval query;
    budget: the C^S budget in tokens; passthrough: the prompt fit and is unchanged.
    """

    prompt: str | Messages | list[int]
    retrieved_tokens: int
    fallback: str | None = None
    target_only: bool = False
    query: str = ""
    budget: int = 0
    passthrough: bool = False


@dataclass(frozen=True)
class _Layout:
    """A prompt seen as fixed parts around `documents`, the middle C^S is retrieved from.

    total_tokens: tokens of the whole prompt (sets the automatic budget); query_source: what
    `config.query_fn` receives; assemble(passages, budget) -> (draft prompt, C^S tokens).
    """

    original: str | Messages
    documents: list[str]
    total_tokens: int
    query_source: str
    default_query: str
    assemble: Callable[[list[Passage], int], tuple[str | Messages, int]]


@dataclass(frozen=True)
class _Retrieved:
    passages: list[Passage]
    fallback: str | None = None
    target_only: bool = False


def build_draft_prompt(
    prompt: PromptLike,
    tokenizer: TokenizerLike,
    retriever: ContextRetriever | None = None,
    query: str | None = None,
    config: RapidConfig | None = None,
) -> str | Messages | list[int]:
    """The draft prompt for `prompt`, in the same form (str -> str, messages -> messages).

    tokenizer: the target's tokenizer (budgets count its tokens); retriever: an external
    source of C^S, or None to retrieve from the prompt's own middle with `FaissContextRetriever`;
    query: the retrieval query (default: `config.query_fn`, else the question in the tail);
    config: retrieval settings (`retrieval_budget`, `retrieval_threshold`, ...). When the
    fallback is "lc", the unchanged prompt is returned. See `prepare_draft_prompt`.
    """
    return prepare_draft_prompt(prompt, tokenizer, retriever, query, config).prompt


def prepare_draft_prompt(
    prompt: PromptLike,
    tokenizer: TokenizerLike,
    retriever: ContextRetriever | None = None,
    query: str | None = None,
    config: RapidConfig | None = None,
    builtin: Builtin | None = None,
) -> DraftPrompt:
    """`build_draft_prompt` plus what happened: tokens retrieved, fallback, target-only.
    `builtin`: what retrieves from the prompt's own middle (None: the embedder and FAISS)."""
    config = config or RapidConfig()
    if retriever is not None and not isinstance(retriever, ContextRetriever):
        raise RapidInputError(
            f"retriever must have a retrieve(query) -> list[str] method, got {type(retriever)!r}"
        )
    if query is not None and not isinstance(query, str):
        raise RapidInputError(f"query must be a string, got {type(query).__name__}")
    make = builtin or FaissContextRetriever.from_config
    if isinstance(prompt, str | PromptSplit):
        return _prepare(_text_layout(prompt, tokenizer), tokenizer, retriever, query, config, make)
    if _is_token_ids(prompt):
        return _prepare_ids(list(prompt), tokenizer, retriever, query, config, make)
    layout = _chat_layout(_messages(prompt), tokenizer, config)
    return _prepare(layout, tokenizer, retriever, query, config, make)


def _prepare(
    layout: _Layout,
    tokenizer: TokenizerLike,
    retriever: ContextRetriever | None,
    query: str | None,
    config: RapidConfig,
    builtin: Builtin,
) -> DraftPrompt:
    budget = _budget(config, layout.total_tokens)
    middle_tokens = sum(count_tokens(tokenizer, layout.documents))
    if middle_tokens <= budget:
        return DraftPrompt(layout.original, middle_tokens, budget=budget, passthrough=True)
    question, query_failure = _resolve_query(query, config, layout)
    found = _retrieve(layout.documents, question, tokenizer, retriever, config, budget, builtin)
    fallback = _join_reasons(query_failure, found.fallback)
    if found.target_only:
        return DraftPrompt(layout.original, 0, fallback, True, question, budget)
    draft, retrieved_tokens = layout.assemble(found.passages, budget)
    return DraftPrompt(draft, retrieved_tokens, fallback, False, question, budget)


def _prepare_ids(
    ids: list[int],
    tokenizer: TokenizerLike,
    retriever: ContextRetriever | None,
    query: str | None,
    config: RapidConfig,
    builtin: Builtin,
) -> DraftPrompt:
    """Token ids go through their text; unchanged prompts keep their exact ids."""
    text = cast(str, tokenizer.decode(ids))  # one flat id list: one string
    layout = _text_layout(text, tokenizer)
    result = _prepare(layout, tokenizer, retriever, query, config, builtin)
    if result.passthrough or result.target_only:
        return dataclasses.replace(result, prompt=ids)
    encoded = tokenizer(result.prompt, add_special_tokens=False)["input_ids"]
    return dataclasses.replace(result, prompt=list(encoded))


# ---- string prompts -------------------------------------------------------------------------


def _text_layout(prompt: str | PromptSplit, tokenizer: TokenizerLike) -> _Layout:
    specials = _special_tokens(tokenizer)
    split = prompt
    if isinstance(split, str):
        split = split_prompt(split, tokenizer, special_tokens=specials)
    return _Layout(
        original=split.text,
        documents=[split.body],
        total_tokens=split.n_tokens or count_text_tokens(tokenizer, split.text),
        query_source=split.text,
        default_query=default_query(split.tail, specials),
        assemble=lambda passages, budget: _assemble_text(split, passages, tokenizer, budget),
    )


def _assemble_text(
    split: PromptSplit, passages: list[Passage], tokenizer: TokenizerLike, budget: int
) -> tuple[str, int]:
    """head + C^S + tail, dropping trailing passages until it has at most head + budget + tail
    tokens (C^S alone already fits; this guards against merges at the two seams)."""
    limit = sum(count_tokens(tokenizer, [split.head, split.tail])) + budget
    while True:
        context = join_passages(passages)
        draft = split.head + context + split.tail
        if not passages or count_text_tokens(tokenizer, draft) <= limit:
            return draft, count_text_tokens(tokenizer, context)
        passages = passages[:-1]


# ---- chat prompts ---------------------------------------------------------------------------


def _messages(prompt: object) -> Messages:
    """Validated copies of chat messages: each a mapping with str `role` and `content`."""
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes) or not prompt:
        raise RapidInputError(
            "prompt must be a string, a list of token ids or a non-empty list of chat messages "
            f"({{'role': ..., 'content': str}}), got {type(prompt).__name__}"
        )
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or not all(
            isinstance(message.get(key), str) for key in ("role", "content")
        ):
            raise RapidInputError(
                f"chat message {i} must be a mapping with string 'role' and 'content', "
                f"got {message!r:.200}"
            )
        messages.append(dict(message))
    return messages


def _chat_layout(messages: Messages, tokenizer: TokenizerLike, config: RapidConfig) -> _Layout:
    """Everything from the last user turn on stays; earlier user and assistant turns are the
    documents (one per turn). A system message or last user turn longer than the budget
    carries its own context: RAG templates put the documents there (LlamaIndex's chat engines
    in the system message, its query engines' "Context information is below. ... Query: ..."
    in the user turn). It is split like a string prompt, its middle is one more document, and
    it keeps its head and tail around its retrieved passages; shorter system messages stay."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    last_user = users[-1] if users else len(messages) - 1
    earlier = [i for i in range(last_user) if messages[i]["role"] != "system"]
    question = messages[last_user]["content"]
    counts = count_tokens(tokenizer, [m["content"] for m in messages])
    budget = _budget(config, sum(counts))
    carriers = sorted({i for i, m in enumerate(messages) if m["role"] == "system"} | {last_user})
    splits = {
        i: split
        for i in carriers
        if (split := _turn_split(messages[i]["content"], counts[i], budget, tokenizer))
    }
    tail = splits[last_user].tail if last_user in splits else question
    return _Layout(
        original=messages,
        documents=[messages[i]["content"] for i in earlier] + [s.body for s in splits.values()],
        total_tokens=sum(counts),
        query_source=question,
        default_query=default_query(tail, _special_tokens(tokenizer)),
        assemble=lambda passages, budget: _assemble_chat(
            messages, _ChatCuts(earlier, last_user, splits), passages, tokenizer, budget
        ),
    )


@dataclass(frozen=True)
class _ChatCuts:
    """Where a chat prompt's documents come from.

    earlier: indices of the earlier turns, one document each, then one document per entry of
    `splits` (message index -> its head / context / tail), in that order; last_user: the
    index of the question's turn.
    """

    earlier: list[int]
    last_user: int
    splits: dict[int, PromptSplit]

    def source(self, doc: int | None) -> int:
        """The message a passage of document `doc` belongs to. An external retriever's (doc
        None) replaces the longest context a message carries, else it goes into a user
        message of its own right before the question (index -1)."""
        if doc is None:
            carried = [(len(s.body), i) for i, s in self.splits.items()]
            return max(carried)[1] if carried else -1
        return (self.earlier + list(self.splits))[doc]


def _turn_split(
    text: str, n_tokens: int, budget: int, tokenizer: TokenizerLike
) -> PromptSplit | None:
    """`text` as head + context + question if it is longer than `budget`, else None."""
    if n_tokens <= budget:
        return None
    split = split_prompt(text, tokenizer, special_tokens=_special_tokens(tokenizer))
    return split if split.body else None


def _assemble_chat(
    messages: Messages,
    cuts: _ChatCuts,
    passages: list[Passage],
    tokenizer: TokenizerLike,
    budget: int,
) -> tuple[Messages, int]:
    """Messages with earlier turns, and the contexts messages carry, cut to their retrieved
    passages within `budget` content tokens; dropping trailing passages if exact counts
    exceed it."""
    while True:
        kept = _retrieved_messages(messages, cuts, passages)
        tokens = sum(count_tokens(tokenizer, [m["content"] for m in kept.values()]))
        if tokens <= budget or not passages:
            break
        passages = passages[:-1]
    draft = []
    for i, message in enumerate(messages):
        if i == cuts.last_user and -1 in kept:  # external passages go right before the question
            draft.append(kept[-1])
        split = cuts.splits.get(i)
        if split:  # the carrier keeps its head and tail around its retrieved context
            context = kept[i]["content"] if i in kept else ""
            draft.append({**message, "content": split.head + context + split.tail})
        elif i in kept or i >= cuts.last_user or message["role"] == "system":
            draft.append(kept.get(i, message))
    return draft, tokens


def _retrieved_messages(
    messages: Messages, cuts: _ChatCuts, passages: list[Passage]
) -> dict[int, dict[str, Any]]:
    """Message index -> that message (role kept) with the content of its retrieved passages
    (`_ChatCuts.source`; -1: a new user message)."""
    by_message: dict[int, list[Passage]] = {}
    for passage in passages:
        by_message.setdefault(cuts.source(passage.doc), []).append(passage)
    return {
        i: {**(messages[i] if i >= 0 else {"role": "user"}), "content": join_passages(group)}
        for i, group in by_message.items()
    }


# ---- query and retrieval --------------------------------------------------------------------


def _resolve_query(
    query: str | None, config: RapidConfig, layout: _Layout
) -> tuple[str, str | None]:
    """The retrieval query and, if `config.query_fn` failed, why (its default is used then)."""
    if query is not None and query.strip():
        return query, None
    if config.query_fn is None:
        return layout.default_query, None
    try:
        value = config.query_fn(layout.query_source)
    except Exception as exc:  # a user function: its failure is a recorded fallback
        reason = f"query_fn raised {type(exc).__name__}: {exc}"
        if config.retrieval_fallback == "raise":
            raise RetrievalError(reason) from exc
        return layout.default_query, reason
    if isinstance(value, str) and value.strip():
        return value, None
    reason = f"query_fn returned {type(value).__name__} {value!r:.50}, expected a non-empty str"
    if config.retrieval_fallback == "raise":
        raise RetrievalError(reason)
    return layout.default_query, reason


def _retrieve(
    documents: list[str],
    query: str,
    tokenizer: TokenizerLike,
    retriever: ContextRetriever | None,
    config: RapidConfig,
    budget: int,
    builtin: Builtin,
) -> _Retrieved:
    """C^S from `retriever`, or from the built-in one over `documents`, per the fallback rule."""
    failure = None
    if retriever is not None:
        texts, failure = call_retriever(retriever, query, config.retrieval_timeout)
        if failure is None:
            return _Retrieved(pack_passages(texts, tokenizer, budget))
        if config.retrieval_fallback != "builtin":
            return _give_up(failure, config)
    try:
        chosen = builtin(documents, tokenizer, config, budget).select(query)
        return _Retrieved(chosen, failure)
    except Exception as exc:  # a broken index must not stop generation: decode target-only
        reason = f"built-in retriever raised {type(exc).__name__}: {exc}"
        return _give_up(_join_reasons(failure, reason) or reason, config, exc)


def _give_up(reason: str, config: RapidConfig, cause: Exception | None = None) -> _Retrieved:
    if config.retrieval_fallback == "raise":
        raise RetrievalError(reason) from cause
    return _Retrieved([], reason, target_only=True)


def _join_reasons(*reasons: str | None) -> str | None:
    return "; ".join(r for r in reasons if r) or None


# ---- helpers ---------------------------------------------------------------------------------


def _budget(config: RapidConfig, total_tokens: int) -> int:
    return config.retrieval_budget or default_budget(total_tokens)


def _special_tokens(tokenizer: TokenizerLike) -> tuple[str, ...]:
    return tuple(getattr(tokenizer, "all_special_tokens", None) or ())


def _is_token_ids(prompt: object) -> TypeGuard[Sequence[int]]:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )
