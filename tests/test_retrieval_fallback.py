"""External retrievers and their failures: every fallback path, and the prompt forms.

Uses `HashingEmbedder` (bag of words, no model) so the plumbing is tested in milliseconds.
"""

from __future__ import annotations

import time

import pytest

from rapid_integrations.config import RapidConfig
from rapid_integrations.engine.prompts import DraftPrompt, build_draft_prompt, prepare_draft_prompt
from rapid_integrations.errors import RapidError, RapidInputError, RetrievalError
from rapid_integrations.retrieval import ContextRetriever, PromptSplit, split_prompt
from rapid_integrations.retrieval.base import count_text_tokens
from tests.retrieval_fixtures import HashingEmbedder, smol_tokenizer

FACT = "The harbour lighthouse was painted green in 1931."
FILLER = [
    f"Paragraph {i} is about the weather report number {i}, which predicts rain and wind."
    for i in range(80)
]
DOC = "\n\n".join([*FILLER[:40], FACT, *FILLER[40:]])
PROMPT = f"Answer from the notes.\n\n{DOC}\n\nQuestion: What colour was the harbour lighthouse?"
BUDGET = 64


def config(**overrides: object) -> RapidConfig:
    # Bag-of-words similarities are lower than MiniLM's, hence the lower threshold.
    base = {
        "retrieval_budget": BUDGET,
        "retrieval_embedder": HashingEmbedder(),
        "retrieval_threshold": 0.1,
    }
    return RapidConfig(**{**base, **overrides})


class Fixed:
    """A retriever returning a fixed value (or raising it, if it is an exception)."""

    def __init__(self, value: object, delay: float = 0.0) -> None:
        self.value, self.delay, self.queries = value, delay, []

    def retrieve(self, query: str) -> list[str]:
        self.queries.append(query)
        time.sleep(self.delay)
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value  # type: ignore[return-value]


FAILURES = [
    (Fixed(ValueError("boom")), "retriever raised ValueError: boom"),
    (Fixed(["late"], delay=20.0), "retriever timed out after 0.2 s"),
    (Fixed([]), "retriever returned no passages"),
    (Fixed(["  ", ""]), "retriever returned no passages"),
    (Fixed(None), "retriever returned NoneType, expected list[str]"),
    (Fixed("a string"), "retriever returned str, expected list[str]"),
    (Fixed([1, "x"]), "retriever returned list[int, str], expected list[str]"),
]


@pytest.mark.parametrize(("retriever", "reason"), FAILURES)
def test_failure_falls_back_to_builtin(retriever: Fixed, reason: str):
    tok, cfg = smol_tokenizer(), config(retrieval_timeout=0.2)
    start = time.perf_counter()
    result = prepare_draft_prompt(PROMPT, tok, retriever, config=cfg)
    assert time.perf_counter() - start < 5  # a hung retriever is not waited for
    assert result.fallback == reason and not result.target_only
    assert FACT in result.prompt  # the built-in retriever found it in the prompt itself
    assert result.prompt.startswith("Answer from the notes.\n\n")
    assert 0 < result.retrieved_tokens <= BUDGET


@pytest.mark.parametrize(("retriever", "reason"), FAILURES)
def test_failure_with_lc_fallback_decodes_target_only(retriever: Fixed, reason: str):
    cfg = config(retrieval_fallback="lc", retrieval_timeout=0.2)
    result = prepare_draft_prompt(PROMPT, smol_tokenizer(), retriever, config=cfg)
    assert (result.target_only, result.fallback, result.prompt) == (True, reason, PROMPT)
    assert build_draft_prompt(PROMPT, smol_tokenizer(), retriever, config=cfg) == PROMPT


@pytest.mark.parametrize(("retriever", "reason"), FAILURES)
def test_failure_with_raise_fallback_raises(retriever: Fixed, reason: str):
    cfg = config(retrieval_fallback="raise", retrieval_timeout=0.2)
    with pytest.raises(RetrievalError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        prepare_draft_prompt(PROMPT, smol_tokenizer(), retriever, config=cfg)
    assert issubclass(RetrievalError, RapidError)


class BrokenEmbedder:
    def embed(self, texts: object) -> object:
        raise OSError("embedding model missing")


def test_broken_builtin_retriever_decodes_target_only():
    cfg = config(retrieval_embedder=BrokenEmbedder())
    result = prepare_draft_prompt(PROMPT, smol_tokenizer(), config=cfg)
    assert result.target_only and result.prompt == PROMPT
    assert result.fallback == "built-in retriever raised OSError: embedding model missing"
    both = prepare_draft_prompt(PROMPT, smol_tokenizer(), Fixed([]), config=cfg)
    assert both.fallback == (
        "retriever returned no passages; built-in retriever raised OSError: embedding model missing"
    )
    with pytest.raises(RetrievalError, match="embedding model missing"):
        prepare_draft_prompt(
            PROMPT, smol_tokenizer(), config=cfg.replace(retrieval_fallback="raise")
        )


def test_external_passages_are_packed_in_order_within_budget():
    tok = smol_tokenizer()
    long = " ".join(f"Sentence {i} of a long retrieved passage." for i in range(40))
    retriever = Fixed(["First passage.", "First passage.", "  Second passage. ", long, "Last."])
    result = prepare_draft_prompt(PROMPT, tok, retriever, config=config())
    assert result.fallback is None and retriever.queries == [
        "What colour was the harbour lighthouse?"
    ]
    parts = split_prompt(PROMPT, tok)
    context = result.prompt[len(parts.head) : -len(parts.tail)]
    passages = context.split("\n\n")
    assert passages[:2] == ["First passage.", "Second passage."]  # deduplicated, stripped
    assert long.startswith(passages[2]) and passages[2].endswith(".")  # cut at a sentence end
    assert count_text_tokens(tok, context) == result.retrieved_tokens <= BUDGET


def test_short_prompt_passes_through_without_retrieval():
    retriever = Fixed(["never used"])
    short = "Notes: the lighthouse is green.\n\nQuestion: What colour is it?"
    result = prepare_draft_prompt(short, smol_tokenizer(), retriever, config=config())
    assert result.passthrough and result.prompt == short and retriever.queries == []


def test_query_sources():
    tok = smol_tokenizer()
    retriever = Fixed(["x"])
    prepare_draft_prompt(PROMPT, tok, retriever, query="explicit", config=config())
    seen: list[str] = []
    cfg = config(query_fn=lambda text: seen.append(text) or "from query_fn")
    prepare_draft_prompt(PROMPT, tok, retriever, config=cfg)
    prepare_draft_prompt(PROMPT, tok, retriever, query="wins", config=cfg)
    assert retriever.queries == ["explicit", "from query_fn", "wins"] and seen == [PROMPT]


def test_failing_query_fn_uses_the_default_query():
    def broken(text: str) -> str:
        raise KeyError("no question")

    retriever = Fixed(["x"])
    result = prepare_draft_prompt(
        PROMPT, smol_tokenizer(), retriever, config=config(query_fn=broken)
    )
    assert result.query == "What colour was the harbour lighthouse?"
    assert result.fallback == "query_fn raised KeyError: 'no question'"
    empty = prepare_draft_prompt(
        PROMPT, smol_tokenizer(), retriever, config=config(query_fn=lambda text: "  ")
    )
    assert empty.fallback is not None and "expected a non-empty str" in empty.fallback
    with pytest.raises(RetrievalError, match="query_fn raised KeyError"):
        cfg = config(query_fn=broken, retrieval_fallback="raise")
        prepare_draft_prompt(PROMPT, smol_tokenizer(), retriever, config=cfg)


def test_invalid_arguments_raise_input_errors():
    tok = smol_tokenizer()
    with pytest.raises(RapidInputError, match="retrieve"):
        prepare_draft_prompt(PROMPT, tok, retriever=object())  # type: ignore[arg-type]
    for bad in (None, 3.5, [], [{"role": "user"}], [{"role": "user", "content": 3}], ["a"]):
        with pytest.raises(RapidInputError):
            prepare_draft_prompt(bad, tok)  # type: ignore[arg-type]
    with pytest.raises(RapidInputError, match="query"):
        prepare_draft_prompt(PROMPT, tok, query=5)  # type: ignore[arg-type]


def test_protocol_is_runtime_checkable():
    assert isinstance(Fixed([]), ContextRetriever)
    assert not isinstance(object(), ContextRetriever)


def test_token_id_prompts_round_trip():
    tok = smol_tokenizer()
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    result = prepare_draft_prompt(ids, tok, config=config())
    assert isinstance(result.prompt, list) and len(result.prompt) < len(ids)
    assert FACT in tok.decode(result.prompt)
    short = ids[:20]
    assert build_draft_prompt(short, tok, config=config()) == short  # unchanged ids, exactly


CHAT = [
    {"role": "system", "content": "You are a harbour guide."},
    *(
        {"role": role, "content": text}
        for i, line in enumerate([*FILLER[:30], FACT, *FILLER[30:60]])
        for role, text in (("user", line), ("assistant", f"Noted, item {i}."))
    ),
    {"role": "user", "content": "What colour was the harbour lighthouse painted?"},
]


def test_chat_keeps_system_and_last_turn_and_retrieves_earlier_turns():
    tok = smol_tokenizer()
    result = prepare_draft_prompt(CHAT, tok, config=config())
    draft = result.prompt
    assert isinstance(draft, list) and draft[0] == CHAT[0] and draft[-1] == CHAT[-1]
    assert {"role": "user", "content": FACT} in draft  # the early fact, with its role
    assert len(draft) < len(CHAT) and all(m in CHAT for m in draft)
    assert sum(count_text_tokens(tok, m["content"]) for m in draft[1:-1]) <= BUDGET
    assert result.retrieved_tokens <= BUDGET and CHAT[1] == {"role": "user", "content": FILLER[0]}


def test_chat_with_external_retriever_adds_one_context_message():
    draft = build_draft_prompt(CHAT, smol_tokenizer(), Fixed(["From the store."]), config=config())
    assert draft == [CHAT[0], {"role": "user", "content": "From the store."}, CHAT[-1]]


def test_short_chat_passes_through():
    short = [CHAT[0], CHAT[1], CHAT[2], CHAT[-1]]
    result = prepare_draft_prompt(short, smol_tokenizer(), config=config())
    assert isinstance(result, DraftPrompt) and result.passthrough and result.prompt == short


def test_single_long_user_turn_is_split_like_a_string_prompt():
    tok = smol_tokenizer()
    chat = [CHAT[0], {"role": "user", "content": PROMPT}]
    result = prepare_draft_prompt(chat, tok, config=config())
    parts = split_prompt(PROMPT, tok)
    system, user = result.prompt
    assert system == CHAT[0] and user["role"] == "user"
    assert user["content"].startswith(parts.head) and user["content"].endswith(parts.tail)
    assert FACT in user["content"] and 0 < result.retrieved_tokens <= BUDGET
    external = build_draft_prompt(chat, tok, Fixed(["From the store."]), config=config())
    assert external[1]["content"] == parts.head + "From the store." + parts.tail


def test_a_long_system_message_is_split_like_the_context_it_carries():
    # LlamaIndex's chat engines and many LangChain prompts put the documents in the system
    # message and the bare question in the user turn.
    tok = smol_tokenizer()
    system = f"Answer from the notes below.\n\n{DOC}\n\nAnswer briefly."
    chat = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What colour was the harbour lighthouse?"},
    ]
    result = prepare_draft_prompt(chat, tok, config=config())
    parts = split_prompt(system, tok)
    draft = result.prompt
    assert isinstance(draft, list) and draft[-1] == chat[-1]
    assert draft[0]["role"] == "system" and draft[0]["content"].startswith(parts.head)
    assert draft[0]["content"].endswith(parts.tail) and FACT in draft[0]["content"]
    assert 0 < result.retrieved_tokens <= BUDGET and not result.passthrough
    assert result.query == "What colour was the harbour lighthouse?"
    retriever = Fixed(["From the store."])
    external = build_draft_prompt(chat, tok, retriever, config=config())
    assert retriever.queries == ["What colour was the harbour lighthouse?"]
    # As in a user turn: the retriever's passages replace the whole middle, earlier turns too.
    assert external == [
        {"role": "system", "content": parts.head + "From the store." + parts.tail},
        chat[-1],
    ]


def test_explicit_prompt_split_skips_the_heuristics():
    head, tail = "Notes follow.\n", "\nQuestion: What colour was the harbour lighthouse?"
    draft = build_draft_prompt(PromptSplit(head, DOC, tail), smol_tokenizer(), config=config())
    assert isinstance(draft, str) and draft.startswith(head) and draft.endswith(tail)
    assert FACT in draft and len(draft) < len(DOC) // 4
