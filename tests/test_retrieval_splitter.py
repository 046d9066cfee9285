"""Head / middle / tail splitting of flat prompts, the default query, and the draft-prompt bound."""

from __future__ import annotations

import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapid_integrations.config import RapidConfig
from rapid_integrations.engine.prompts import prepare_draft_prompt
from rapid_integrations.retrieval import PromptSplit, default_query, split_prompt
from rapid_integrations.retrieval.base import count_text_tokens
from tests.retrieval_fixtures import HashingEmbedder, smol_tokenizer

DOC = "\n\n".join(
    f"Section {i}. The module handles case {i} by reading the configuration file. "
    f"Option {i} controls how often the cache is flushed to disk."
    for i in range(60)
)
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def split(text: str) -> PromptSplit:
    return split_prompt(text, smol_tokenizer(), special_tokens=SPECIALS)


def test_langchain_stuff_template():
    head = (
        "Use the following pieces of context to answer the question at the end. If you don't "
        "know the answer, just say that you don't know.\n\n"
    )
    tail = "\n\nQuestion: How often is the cache flushed?\nHelpful Answer:"
    parts = split(head + DOC + tail)
    assert (parts.head, parts.body, parts.tail) == (head, DOC, tail)
    assert default_query(parts.tail) == "How often is the cache flushed?"


def test_llamaindex_text_qa_template():
    head = "Context information is below.\n---------------------\n"
    tail = (
        "\n---------------------\nGiven the context information and not prior knowledge, "
        "answer the query.\nQuery: How often is the cache flushed?\nAnswer: "
    )
    parts = split(head + DOC + tail)
    assert (parts.head, parts.body, parts.tail) == (head, DOC, tail)
    assert default_query(parts.tail) == "How often is the cache flushed?"


def test_document_then_bare_question():
    parts = split(DOC + "\n\nHow often is the cache flushed?")
    assert parts.tail == "\n\nHow often is the cache flushed?"
    assert parts.head.startswith("Section 0.") and parts.body.endswith("flushed to disk.")


def test_rendered_chat_keeps_its_markup_out_of_the_middle():
    head = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "Read this:\n\n"
    )
    tail = "\n\nQuestion: How often is the cache flushed?<|im_end|>\n<|im_start|>assistant\n"
    parts = split(head + DOC + tail)
    assert (parts.head, parts.tail) == (head, tail)
    assert default_query(parts.tail, SPECIALS) == "How often is the cache flushed?"


def test_prompt_without_line_breaks_still_splits_at_a_sentence():
    text = DOC.replace("\n\n", " ") + " So, how often is the cache flushed?"
    parts = split(text)
    assert parts.tail == " So, how often is the cache flushed?"
    assert parts.head == "Section 0. "


def test_default_query_drops_answer_cues_and_delimiters():
    assert default_query("\n-----\nQ: Who wrote it?\nA:") == "Who wrote it?"
    chat_tail = "<|im_start|>user\nWho wrote it?<|im_end|>\n<|im_start|>assistant\n"
    assert default_query(chat_tail, SPECIALS) == "Who wrote it?"
    assert default_query("Please summarise the text above.") == "Please summarise the text above."


# ---- property tests --------------------------------------------------------------------------

LINES = st.sampled_from(
    [
        "Context:", "Question: what is the flush interval?", "Query: 東京はどこ？", "Answer:",
        "-----", "=====", "Some documentation sentence. Another one!", "def f(x): return x",
        "家族👨‍👩‍👧‍👦で旅行しました。", "🇯🇵👍🏽 e\u0301", "<|im_start|>user", "<|im_end|>",
        "x" * 50, "A long line of words " * 8,
    ]
)  # fmt: skip
BREAKS = st.sampled_from(["\n", "\n\n", " ", "", "\n \n"])


@st.composite
def prompts(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.tuples(LINES, BREAKS), min_size=1, max_size=80))
    return "".join(line + brk for line, brk in parts)


def graphemes(text: str) -> set[int]:
    return {m.start() for m in regex.finditer(r"\X", text)} | {len(text)}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=prompts())
def test_split_properties(text: str):
    tok = smol_tokenizer()
    parts = split(text)
    assert parts.head + parts.body + parts.tail == text
    assert parts.body == parts.body.strip()
    assert {len(parts.head), len(text) - len(parts.tail)} <= graphemes(text)
    n = parts.n_tokens
    assert count_text_tokens(tok, parts.head.rstrip()) <= min(256, n // 4) + 2
    assert count_text_tokens(tok, parts.tail.lstrip()) <= min(512, n // 4) + 2 or not parts.body


class SubstringRetriever:
    """Returns fixed slices of the text it was given: never text of its own."""

    def __init__(self, text: str) -> None:
        self.passages = [text[i : i + 300] for i in range(0, len(text), 700)]

    def retrieve(self, query: str) -> list[str]:
        return self.passages


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=prompts(), budget=st.integers(1, 200), external=st.booleans())
def test_draft_prompt_bound_and_provenance(text: str, budget: int, external: bool):
    tok = smol_tokenizer()
    config = RapidConfig(
        retrieval_budget=budget, retrieval_threshold=-1.0, retrieval_embedder=HashingEmbedder()
    )
    retriever = SubstringRetriever(text) if external else None
    result = prepare_draft_prompt(text, tok, retriever=retriever, config=config)
    parts = split(text)
    assert result.fallback is None and not result.target_only
    if result.passthrough:
        assert result.prompt == text
        assert count_text_tokens(tok, parts.body) <= budget
        return
    limit = count_text_tokens(tok, parts.head) + budget + count_text_tokens(tok, parts.tail)
    assert count_text_tokens(tok, result.prompt) <= limit
    assert result.retrieved_tokens <= budget
    assert result.prompt.startswith(parts.head) and result.prompt.endswith(parts.tail)
    context = result.prompt[len(parts.head) : len(result.prompt) - len(parts.tail)]
    for passage in filter(None, context.split("\n\n")):
        assert passage in text  # nothing invented
