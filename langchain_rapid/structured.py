"""Tool binding and structured output for `ChatRapid`, on langchain-core's own utilities.

Tools are converted with `convert_to_openai_tool` and reach the engine per call as
`tools=` / `tool_choice=` (the engine constrains decoding to valid calls, docs/algorithm.md
section 11); structured output is a grammar per call (`Grammar.json_schema` /
`Grammar.json_object`, section 10) or a forced tool call, then LangChain's own parsers. An
answer cut off by `max_tokens` raises `OutputParserException` naming the cause instead of
parsing half a JSON document.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal, get_args

from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from rapid_integrations import RapidConfigError

if TYPE_CHECKING:
    from rapid_integrations.structured_output.grammar import Grammar

StructuredMethod = Literal["json_schema", "function_calling", "json_mode"]
ToolLike = dict[str, Any] | type | Callable[..., Any] | BaseTool


def openai_tools(tools: Sequence[ToolLike]) -> list[dict[str, Any]]:
    """LangChain tools (functions, pydantic classes, `BaseTool`s, dicts) in the OpenAI shape."""
    return [convert_to_openai_tool(tool) for tool in tools]


def tool_choice_of(choice: object) -> object:
    """LangChain's tool_choice in the engine's words: True forces a call ("required", as
    ChatOpenAI reads it), False and None leave it to the model; the rest ("auto", "none",
    "any", a tool's name, OpenAI's dict) the engine reads as it is."""
    if choice is True:
        return "required"
    if choice is False:
        return None
    return choice


def response_format_grammar(response_format: dict[str, Any] | type) -> Grammar | None:
    """OpenAI's `response_format` (what create_agent's provider strategy binds, as ChatOpenAI
    takes it) as the engine's grammar: `{"type": "json_schema", "json_schema": {"schema":
    ...}}`, `{"type": "json_object"}`, or a pydantic class, TypedDict or JSON schema; None for
    `{"type": "text"}`. Next to tools it is what an answer that is no call must match."""
    from rapid_integrations.structured_output.grammar import Grammar

    if not isinstance(response_format, dict) or "type" not in response_format:
        try:
            return Grammar.json_schema(convert_to_json_schema(response_format))
        except (ValueError, TypeError) as exc:
            raise RapidConfigError(
                "response_format", f"not an OpenAI response format nor a schema: {exc}"
            ) from exc
    kind, spec = response_format["type"], response_format.get("json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind != "json_schema":
        raise RapidConfigError(
            "response_format", f"type must be 'json_schema', 'json_object' or 'text', got {kind!r}"
        )
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RapidConfigError(
            "response_format", "json_schema needs a 'schema' object: {'name', 'schema'}"
        )
    return Grammar.json_schema(spec["schema"])


def structured_runnable(
    model: Runnable[Any, AIMessage],
    bind_tools: Callable[..., Runnable[Any, AIMessage]],
    schema: dict[str, Any] | type | None,
    method: StructuredMethod,
    include_raw: bool,
) -> Runnable[Any, Any]:
    """`with_structured_output`'s runnable: the constrained model, then the parser."""
    if method not in get_args(StructuredMethod):
        raise RapidConfigError(
            "method", f"must be one of {list(get_args(StructuredMethod))}, got {method!r}"
        )
    if schema is None and method != "json_mode":
        raise RapidConfigError("schema", f"method={method!r} needs a schema")
    # What LangSmith and the standard tests read from the call's options (popped by
    # BaseChatModel before the call reaches the engine); an empty one (no schema) is skipped.
    traced = {} if schema is None else {"kwargs": {"method": method}, "schema": schema}
    if method == "function_calling":
        bound, parser = _forced_call(bind_tools, schema, traced)
    else:
        bound, parser = _grammar_answer(model, schema, method, traced)
    checked = RunnableLambda(_complete) | parser
    if not include_raw:
        return bound | checked
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | checked, parsing_error=_none)
    failed = RunnablePassthrough.assign(parsed=_none)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([failed], exception_key="parsing_error")


def _forced_call(
    bind_tools: Callable[..., Runnable[Any, AIMessage]], schema: Any, traced: dict[str, Any]
) -> tuple[Runnable[Any, AIMessage], Runnable[Any, Any]]:
    """The schema as the one tool, its call forced; parsed by LangChain's tool parsers."""
    name = convert_to_openai_tool(schema)["function"]["name"]
    bound = bind_tools([schema], tool_choice=name, ls_structured_output_format=traced)
    if _is_pydantic(schema):
        return bound, PydanticToolsParser(tools=[schema], first_tool_only=True)
    return bound, JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)


def _grammar_answer(
    model: Runnable[Any, AIMessage], schema: Any, method: str, traced: dict[str, Any]
) -> tuple[Runnable[Any, AIMessage], Runnable[Any, Any]]:
    """The answer's text constrained to the schema ("json_schema") or to any JSON object
    ("json_mode", where the prompt must ask for the keys, as with OpenAI's JSON mode)."""
    from rapid_integrations.structured_output.grammar import Grammar

    grammar = (
        Grammar.json_schema(convert_to_json_schema(schema))
        if method == "json_schema"
        else Grammar.json_object()
    )
    bound = model.bind(grammar=grammar, ls_structured_output_format=traced)
    if _is_pydantic(schema):
        return bound, PydanticOutputParser(pydantic_object=schema)
    return bound, JsonOutputParser()


def _is_pydantic(schema: object) -> bool:
    return isinstance(schema, type) and is_basemodel_subclass(schema)


def _complete(message: AIMessage) -> AIMessage:
    """The message, unless generation was cut off before the structure was complete."""
    if message.response_metadata.get("finish_reason") == "length":
        raise OutputParserException(
            "the structured answer was cut off by the token limit (finish_reason='length') "
            "before it was complete; raise max_tokens",
            llm_output=str(message.content),
        )
    return message


def _none(_: object) -> None:
    return None
