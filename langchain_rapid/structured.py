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
from typing import Any, Literal

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

StructuredMethod = Literal["json_schema", "function_calling", "json_mode"]
ToolLike = dict[str, Any] | type | Callable[..., Any] | BaseTool


def openai_tools(tools: Sequence[ToolLike]) -> list[dict[str, Any]]:
    """LangChain tools (functions, pydantic classes, `BaseTool`s, dicts) in the OpenAI shape."""
    return [convert_to_openai_tool(tool) for tool in tools]


def tool_choice_of(choice: object, tools: list[dict[str, Any]]) -> object:
    """LangChain's tool_choice values in the engine's vocabulary: "any" and True are
    "required" (True with one tool names it), a tool's name stays a name."""
    if choice is True:
        return tools[0]["function"]["name"] if len(tools) == 1 else "required"
    if choice == "any":
        return "required"
    if choice is False or choice is None:
        return "none" if choice is False else None
    return choice


def structured_runnable(
    model: Runnable[Any, AIMessage],
    bind_tools: Callable[..., Runnable[Any, AIMessage]],
    schema: dict[str, Any] | type | None,
    method: StructuredMethod,
    include_raw: bool,
) -> Runnable[Any, Any]:
    """`with_structured_output`'s runnable: the constrained model, then the parser."""
    from rapid_integrations.grammar import Grammar

    pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    if method == "function_calling":
        if schema is None:
            raise RapidConfigError("schema", "function_calling needs a schema")
        name = convert_to_openai_tool(schema)["function"]["name"]
        bound = bind_tools([schema], tool_choice=name)
        parser: Runnable[Any, Any] = (
            PydanticToolsParser(tools=[schema], first_tool_only=True)
            if pydantic
            else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
        )
    elif method in ("json_schema", "json_mode"):
        if method == "json_schema" and schema is None:
            raise RapidConfigError("schema", "json_schema needs a schema")
        grammar = (
            Grammar.json_schema(convert_to_json_schema(schema))
            if method == "json_schema"
            else Grammar.json_object()
        )
        bound = model.bind(grammar=grammar)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
    else:
        raise RapidConfigError(
            "method", f"must be json_schema, function_calling or json_mode, got {method!r}"
        )
    checked = RunnableLambda(_complete) | parser
    if not include_raw:
        return bound | checked
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | checked, parsing_error=_none)
    failed = RunnablePassthrough.assign(parsed=_none)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([failed], exception_key="parsing_error")


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
