"""Tool calling, framework-free (docs/algorithm.md section 11).

Tools come in the OpenAI shape `{"type": "function", "function": {"name", "description",
"parameters"}}`. A call is written in the Hermes / Qwen markup

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and decoding is constrained to it by a grammar per `tool_choice`: "auto" (text, or calls of
the given tools), "required" (one or more calls), a tool's name (one call of it), "none" (text
without call markup). `parallel_tool_calls=False` (OpenAI's option) allows at most one call
under "auto" and exactly one under "required": decoding ends after it. Tools reach the model
through the tokenizer's chat template when it renders tools, else through `SYSTEM_PROMPT` in
the system message, and tool results as `RESULT_TURN` user turns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapid_integrations.errors import RapidInputError

if TYPE_CHECKING:
    from rapid_integrations.structured_output.grammar import Grammar

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN = "<tool_response>"  # how Qwen's template shows a tool result; never answer text
CHOICES = ("auto", "none", "required")
SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
# A tool result for a template without tool support, as a user turn in prose: a model that was
# not trained on the markup copies a `<tool_response>` turn into its answer (section 11).
RESULT_TURN = "Here is the result of {name}: {content}"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tools:
    """A call's validated tools and tool choice ("auto", "none", "required" or a name)."""

    specs: tuple[dict[str, Any], ...]
    choice: str
    parallel: bool = True

    @classmethod
    def parse(
        cls, tools: object, tool_choice: object = None, parallel_tool_calls: object = True
    ) -> Tools | None:
        """Validate `tools`, `tool_choice` and `parallel_tool_calls`; None without tools."""
        if not isinstance(parallel_tool_calls, bool):
            raise RapidInputError(
                f"parallel_tool_calls must be a bool, got {type(parallel_tool_calls).__name__}"
            )
        if tools is None or (isinstance(tools, Sequence) and not tools):
            if tool_choice not in (None, "none", "auto"):
                raise RapidInputError(f"tool_choice {tool_choice!r} given without tools")
            return None
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
            raise RapidInputError(f"tools must be a list of tool specs, got {type(tools).__name__}")
        specs = tuple(_spec(i, tool) for i, tool in enumerate(tools))
        names = [s["function"]["name"] for s in specs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RapidInputError(f"tool names must be unique; given more than once: {twice}")
        return cls(specs, _choice(tool_choice, names), parallel_tool_calls)

    @property
    def names(self) -> list[str]:
        return [s["function"]["name"] for s in self.specs]

    def grammar(self, tokenizer: Any, answer: Grammar | None = None) -> Grammar:
        """What decoding must match under the tool choice (an xgrammar structural tag), for
        the model behind `tokenizer`: text outside calls never holds the call or result markup,
        and several calls are separated by `call_separator(tokenizer)`.

        `answer`: what an answer that is not a call must match (a response format, as OpenAI,
        vLLM and Ollama take it next to tools): under "auto" the output is then either calls
        or one such answer, under "none" that answer; "required" and a named tool still call.
        """
        from rapid_integrations.structured_output.grammar import Grammar

        if self.choice == "none":
            if answer is not None:
                return answer
            text = {"type": "any_text", "excludes": [CALL_OPEN, RESPONSE_OPEN]}
            return Grammar.structural_tag({"type": "structural_tag", "format": text})
        if self.choice == "auto" and answer is not None:
            return Grammar.union(self._calls(tokenizer, several=True), answer)
        if self.choice == "auto":
            form = {
                "type": "triggered_tags",
                "triggers": [CALL_OPEN],
                "tags": self._tags(),
                "stop_after_first": not self.parallel,
                "excludes": [RESPONSE_OPEN],
            }
            return Grammar.structural_tag({"type": "structural_tag", "format": form})
        return self._calls(tokenizer, several=self.choice == "required")

    def _calls(self, tokenizer: Any, several: bool) -> Grammar:
        """One call and nothing else, or several when `several` ("required", or "auto" beside
        an answer) and parallel calls are allowed."""
        from rapid_integrations.structured_output.grammar import Grammar

        form = {
            "type": "tags_with_separator",
            "tags": self._tags(),
            "separator": call_separator(tokenizer),
            "at_least_one": True,
            "stop_after_first": not (self.parallel and several),
        }
        return Grammar.structural_tag({"type": "structural_tag", "format": form})

    def _tags(self) -> list[dict[str, Any]]:
        """The call tags of the tools the choice allows (all, or the named one)."""
        return [
            _call_tag(s["function"])
            for s in self.specs
            if self.choice in CHOICES or s["function"]["name"] == self.choice
        ]


def _spec(i: int, tool: object) -> dict[str, Any]:
    """One tool in the OpenAI shape, checked; `parameters` defaults to an empty object."""
    from rapid_integrations.structured_output.grammar import Grammar

    function = tool.get("function") if isinstance(tool, Mapping) else None
    if (
        not isinstance(tool, Mapping)
        or tool.get("type", "function") != "function"
        or not isinstance(function, Mapping)
    ):
        raise RapidInputError(
            f'tool {i} must be {{"type": "function", "function": {{"name", "description", '
            f'"parameters"}}}}, got {tool!r:.200}'
        )
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise RapidInputError(
            f"tool {i}: name must be 1-64 letters, digits, _ . or -, got {name!r}"
        )
    parameters = function.get("parameters") or _EMPTY_PARAMETERS
    schema = Grammar.json_schema(parameters).schema  # GrammarError when invalid
    assert schema is not None  # a json_schema grammar keeps its schema
    if schema.get("type", "object") != "object":
        raise RapidInputError(f"tool {name!r}: parameters must be a JSON schema of an object")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise RapidInputError(f"tool {name!r}: description must be a string")
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }


def _choice(tool_choice: object, names: list[str]) -> str:
    """tool_choice in the OpenAI forms -> "auto", "none", "required" or a tool's name."""
    if tool_choice is None:
        return "auto"
    if tool_choice == "any":  # LangChain's word for "required"
        return "required"
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        tool_choice = function.get("name") if isinstance(function, Mapping) else None
    if tool_choice in CHOICES or tool_choice in names:
        return str(tool_choice)
    raise RapidInputError(
        f"tool_choice {tool_choice!r} names no given tool; expected one of "
        f"{[*CHOICES, *names]} or {{'type': 'function', 'function': {{'name': ...}}}}"
    )


def _call_tag(function: Mapping[str, Any]) -> dict[str, Any]:
    """The structural tag of one tool's call: the markup around its arguments' schema."""
    return {
        "type": "tag",
        "begin": f'{CALL_OPEN}\n{{"name": {json.dumps(function["name"])}, "arguments": ',
        # At most one whitespace character in a row: a model free to pad JSON can do so forever.
        "content": {
            "type": "json_schema",
            "json_schema": function["parameters"],
            "max_whitespace_cnt": 1,
        },
        "end": f"}}\n{CALL_CLOSE}",
    }


# ---- rendering ----------------------------------------------------------------------------


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` list itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def call_separator(tokenizer: Any) -> str:
    """What stands between two calls: the newline of Qwen's template for a model whose
    template renders tools, else nothing. A model not trained on the markup reads a newline
    after `</tool_call>` as the start of more text, so under "required" that newline would
    commit it to a call it does not want (docs/algorithm.md section 11); back to back, its
    choice right after a call is between the end and `<` of another call."""
    return "\n" if renders_tools(tokenizer) else ""


def prepare_messages(
    messages: Sequence[Mapping[str, Any]], tools: Tools | None, tokenizer: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Chat messages ready for the chat template, and the template's extra arguments.

    A template that renders tools gets the OpenAI messages and `tools=`. Otherwise the tools
    go into the system message (`SYSTEM_PROMPT`; not under "none", where the grammar forbids
    the calls it asks for), an assistant's calls become their markup in its content, and a
    tool result becomes a user turn `RESULT_TURN` naming the tool, so every template reads
    them.
    """
    if renders_tools(tokenizer):
        plain = [_with_text_content(m) for m in messages]
        return plain, ({"tools": list(tools.specs)} if tools else {})
    names = {
        c.get("id"): c["function"].get("name")
        for m in messages
        if isinstance(m, Mapping)
        for c in _calls(m.get("tool_calls") or [])
    }
    out = [_rendered(m, names) for m in messages]
    if tools and tools.choice != "none":
        text = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(s) for s in tools.specs))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}


def _with_text_content(message: Mapping[str, Any]) -> dict[str, Any]:
    """A copy whose content is a string (OpenAI allows null next to tool calls), with
    call arguments as dicts, which chat templates expect."""
    out = dict(message)
    if out.get("content") is None and out.get("tool_calls"):
        out["content"] = ""
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": call_arguments(c["function"])}}
            for c in _calls(out["tool_calls"])
        ]
    return out


def _rendered(message: Mapping[str, Any], names: Mapping[Any, Any]) -> dict[str, Any]:
    """One message as plain {role, content}, tool calls and results written out; `names`
    maps call ids to tool names, for results that do not name their tool (OpenAI's)."""
    message = _with_text_content(message)
    if message.get("role") == "tool":
        name = message.get("name") or names.get(message.get("tool_call_id")) or "a tool"
        return {
            "role": "user",
            "content": RESULT_TURN.format(name=name, content=message.get("content")),
        }
    calls = message.get("tool_calls")
    if not calls:
        return message
    markup = "".join(  # written as the grammar writes them (`call_separator`)
        f"{CALL_OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}\n{CALL_CLOSE}"
        for c in calls
    )
    content = f"{message['content']}\n{markup}" if message["content"] else markup
    return {"role": message["role"], "content": content}


def _calls(calls: object) -> list[Mapping[str, Any]]:
    if not isinstance(calls, Sequence) or not all(
        isinstance(c, Mapping) and isinstance(c.get("function"), Mapping) for c in calls
    ):
        raise RapidInputError(
            "an assistant message's tool_calls must be a list of "
            '{"id", "type": "function", "function": {"name", "arguments"}}'
        )
    return list(calls)


def call_arguments(function: Mapping[str, Any]) -> dict[str, Any]:
    """A history call's `function.arguments` as a dict (OpenAI sends a JSON string)."""
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise RapidInputError(f"tool call arguments are not JSON: {arguments!r:.200}") from exc
    if not isinstance(arguments, Mapping):
        raise RapidInputError(f"tool call arguments must be a JSON object, got {arguments!r:.200}")
    return dict(arguments)
