"""QueryExtractor: the question read back out of prompts LlamaIndex templates filled in."""

from __future__ import annotations

import pytest
from llama_index.core.prompts import ChatPromptTemplate, PromptTemplate, RichPromptTemplate
from llama_index.core.prompts.chat_prompts import (
    CHAT_REFINE_PROMPT,
    CHAT_TEXT_QA_PROMPT,
    CHAT_TREE_SUMMARIZE_PROMPT,
)
from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL
from llama_index.core.prompts.default_prompts import (
    DEFAULT_REFINE_PROMPT,
    DEFAULT_TEXT_QA_PROMPT,
    DEFAULT_TREE_SUMMARIZE_PROMPT,
)

from llamaindex_rapid import QueryExtractor
from llamaindex_rapid.templates import as_query_extractor, template_pattern
from rapid_integrations import RapidInputError

QUERY = "Who maintains the\nnorth warehouse?"
# A context that itself looks like a template tail must not fool the extractor.
CONTEXT = "Query: not this one\nAnswer: nor this\n---------------------\n" * 50
ARGS = {"context_str": CONTEXT, "context_msg": CONTEXT, "existing_answer": "Bob."}


def _last_message(template: ChatPromptTemplate) -> str:
    return template.format_messages(query_str=QUERY, **ARGS)[-1].content or ""


@pytest.mark.parametrize(
    "prompt",
    [
        DEFAULT_TEXT_QA_PROMPT.format(query_str=QUERY, **ARGS),
        DEFAULT_TREE_SUMMARIZE_PROMPT.format(query_str=QUERY, **ARGS),
        DEFAULT_REFINE_PROMPT.format(query_str=QUERY, **ARGS),
        _last_message(CHAT_TEXT_QA_PROMPT),
        _last_message(CHAT_TREE_SUMMARIZE_PROMPT),
        _last_message(CHAT_REFINE_PROMPT),
    ],
    ids=["qa", "tree_summarize", "refine", "chat_qa", "chat_tree_summarize", "chat_refine"],
)
def test_default_templates_give_back_the_query(prompt: str) -> None:
    assert QueryExtractor()(prompt) == QUERY


def test_system_prompt_before_and_stripped_whitespace_after_still_match() -> None:
    prompt = "You are terse.\n\n" + DEFAULT_TEXT_QA_PROMPT.format(query_str=QUERY, **ARGS)
    assert QueryExtractor()(prompt.rstrip()) == QUERY


def test_unknown_prompts_give_none_so_the_builder_picks_the_tail() -> None:
    assert QueryExtractor()("Tell me a story about a warehouse.") is None
    assert (
        QueryExtractor(include_defaults=False)(
            DEFAULT_TEXT_QA_PROMPT.format(query_str=QUERY, **ARGS)
        )
        is None
    )


@pytest.mark.parametrize(
    "template",
    [
        "Documents:\n{context_str}\nQuestion ({lang}): {query_str}\nShort answer:",
        PromptTemplate("Documents:\n{context_str}\nQuestion ({lang}): {query_str}\nShort answer:"),
    ],
    ids=["string", "PromptTemplate"],
)
def test_custom_templates_are_tried_first(template: str | PromptTemplate) -> None:
    prompt = f"Documents:\n{CONTEXT}\nQuestion (en): {QUERY}\nShort answer: "
    assert QueryExtractor([template])(prompt) == QUERY
    assert as_query_extractor(template)(prompt) == QUERY


def test_selector_and_chat_templates_contribute_every_variant() -> None:
    patterns = QueryExtractor([DEFAULT_TEXT_QA_PROMPT_SEL], include_defaults=False).patterns
    assert len(patterns) == 1  # text and chat variants share their wording: one pattern


def test_template_starting_with_the_query_is_anchored() -> None:
    pattern = template_pattern("{query_str}\nContext: {context_str}")
    assert pattern is not None and pattern.pattern.startswith(r"\A")
    assert pattern.search(f"{QUERY}\nContext: abc").group("query") == QUERY


def test_templates_without_a_query_and_unreadable_types() -> None:
    assert template_pattern("Summarize:\n{context_str}") is None
    with pytest.raises(RapidInputError, match="RichPromptTemplate"):
        QueryExtractor([RichPromptTemplate("{{ query_str }}")])
    with pytest.raises(RapidInputError, match="query_extractor"):
        as_query_extractor(42)


def test_a_callable_is_used_as_given() -> None:
    def upper(prompt: str) -> str:
        return prompt.upper()

    assert as_query_extractor(upper) is upper
