"""Find the question inside a prompt that a LlamaIndex template has already filled in.

Query engines hand the LLM a finished prompt such as the default QA template's
``"Context information is below. ... {context_str} ... Query: {query_str}\\nAnswer: "``. The
draft prompt builder needs that ``query_str`` to retrieve for it, so `QueryExtractor` turns
templates back into patterns and reads the query out of the rendered text. The defaults are
LlamaIndex's own QA, tree-summarize and refine templates (text and chat variants, read from
llama-index-core so they follow its wording); custom templates are added with `templates=`.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable, Iterator, Sequence

from llama_index.core.prompts import BasePromptTemplate, ChatPromptTemplate, PromptTemplate
from llama_index.core.prompts.base import SelectorPromptTemplate
from llama_index.core.prompts.default_prompt_selectors import (
    DEFAULT_REFINE_PROMPT_SEL,
    DEFAULT_TEXT_QA_PROMPT_SEL,
    DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
)

from rapid_integrations import RapidInputError

QUERY_VAR = "query_str"
TemplateLike = str | BasePromptTemplate
QueryExtractorLike = Callable[[str], str | None] | TemplateLike | Sequence[TemplateLike]
DEFAULT_TEMPLATES: tuple[TemplateLike, ...] = (
    DEFAULT_TEXT_QA_PROMPT_SEL,
    DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
    DEFAULT_REFINE_PROMPT_SEL,
)


def template_pattern(template: str, query_var: str = QUERY_VAR) -> re.Pattern[str] | None:
    """A regex matching `template` once rendered, with group "query" around `query_var`.

    Literal text must match verbatim, except trailing whitespace, which chat templates and
    callers often strip; every other variable matches anything (as much as possible before
    the query, as little as possible after it). The pattern starts at the
    template's first literal, so text prepended to the prompt (a system prompt) is allowed;
    a template that starts with the query is anchored at the start instead, which keeps the
    search linear. Returns None when the template has no `query_var`.
    """
    parsed = list(string.Formatter().parse(template.rstrip()))
    if not any(name == query_var for _lit, name, _spec, _conv in parsed):
        return None
    pieces: list[str] = []
    seen_query = False
    for literal, name, _spec, _conv in parsed:
        if literal and (pieces or literal.strip()):
            pieces.append(re.escape(literal))
        if name == query_var:
            pieces.append("(?P<query>.*?)" if pieces else r"\A(?P<query>.*?)")
            seen_query = True
        elif name is not None and pieces:
            # Greedy before the query: a context that quotes the template's own labels
            # ("Query: ...") must not end early, so the last occurrence wins.
            pieces.append("(?:.*?)" if seen_query else "(?:.*)")
    return re.compile("".join(pieces) + r"\s*\Z", re.DOTALL)


def template_strings(template: TemplateLike) -> Iterator[str]:
    """The format strings inside a template object: each chat message, each selector choice."""
    if isinstance(template, str):
        yield template
    elif isinstance(template, SelectorPromptTemplate):
        yield from template_strings(template.default_template)
        for _condition, choice in template.conditionals or ():
            yield from template_strings(choice)
    elif isinstance(template, ChatPromptTemplate):
        for message in template.message_templates:
            yield message.content or ""
    elif isinstance(template, PromptTemplate):
        yield template.template
    else:
        raise RapidInputError(
            f"cannot read a query pattern from a {type(template).__name__}; pass its "
            "format string (with {query_str}) or a PromptTemplate / ChatPromptTemplate"
        )


class QueryExtractor:
    """Callable ``prompt -> query | None``: the `query_str` a known template put in `prompt`.

    `templates` (strings or LlamaIndex prompt templates using ``{query_str}``) are tried first,
    then LlamaIndex's defaults unless `include_defaults=False`. Returns None when no template
    matches, so the draft prompt builder falls back to its own choice (the prompt's tail).
    """

    def __init__(
        self,
        templates: Iterable[TemplateLike] = (),
        *,
        include_defaults: bool = True,
        query_var: str = QUERY_VAR,
    ) -> None:
        sources = [*templates, *(DEFAULT_TEMPLATES if include_defaults else ())]
        patterns = (
            template_pattern(text, query_var) for t in sources for text in template_strings(t)
        )
        # Dict keys: the same wording in a text and a chat variant is tried once.
        self.patterns: list[re.Pattern[str]] = list(dict.fromkeys(p for p in patterns if p))

    def __call__(self, prompt: str) -> str | None:
        for pattern in self.patterns:
            found = pattern.search(prompt)
            if found and found.group("query").strip():
                return found.group("query").strip()
        return None

    def __repr__(self) -> str:
        return f"QueryExtractor({len(self.patterns)} patterns)"


def as_query_extractor(value: QueryExtractorLike | None) -> Callable[[str], str | None]:
    """None -> the default `QueryExtractor`; a template or a list of templates -> one that
    knows them too; any other callable is used as given."""
    if value is None:
        return QueryExtractor()
    if isinstance(value, (str, BasePromptTemplate)):
        return QueryExtractor([value])
    if isinstance(value, (list, tuple)):
        return QueryExtractor(value)
    if callable(value):
        return value
    raise RapidInputError(
        f"query_extractor must be a callable, a template or a list of templates, got {value!r}"
    )
