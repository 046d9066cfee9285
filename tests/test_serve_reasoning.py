"""Reasoning and streamed tool calls over `rapid serve` (docs/algorithm.md sections 11 and 13,
docs/serving.md "Reasoning models"), through the openai SDK against a live server, compared with
the in-process engine loaded from the same folder: `reasoning_content` in messages and deltas,
reasoning token counts, tool-call argument fragments that the SDK's stream helper merges into
the same call as the non-streamed answer, and the Responses API's reasoning item and argument
events.

The tiny model writes JSON and the call markup; its chat template opens a think section at the
end of the generation prompt (as DeepSeek-R1's does) and renders earlier turns' reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from rapid_integrations import RapidEngine, RapidOutput
from tests.serve_fixtures import DTYPE, MODEL, LiveServer, live_server, save_tiny_model
from tests.test_reasoning import OPEN_TEMPLATE, WEATHER
from tests.tiny import JSON_ALPHABET, char_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

CHAT = [{"role": "user", "content": "weather in paris"}]
THINK = {"max_reasoning_tokens": 12}
CALL = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = char_tokenizer(JSON_ALPHABET + "\n")
    tok.chat_template = OPEN_TEMPLATE
    return save_tiny_model(tmp_path_factory.mktemp("tiny-reasoning-model"), tok, window=2048)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> RapidEngine:
    return RapidEngine(str(model_dir), dtype=DTYPE, device="cpu")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[LiveServer]:
    with live_server(model_dir) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def expected(engine: RapidEngine, messages: list[dict[str, Any]], **options: Any) -> RapidOutput:
    return engine.generate(messages, **options)


def test_reasoning_content_and_usage(client: openai.OpenAI, engine: RapidEngine) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=60, extra_body=THINK
    )
    want = expected(engine, CHAT, max_new_tokens=60, **THINK)
    message = out.choices[0].message
    assert want.reasoning and message.reasoning_content == want.reasoning
    assert message.content == want.text
    assert out.usage.completion_tokens_details.reasoning_tokens == 12 + len("</think>")
    assert out.usage.completion_tokens == len(want.token_ids)


def test_streamed_reasoning_deltas_add_up(client: openai.OpenAI, engine: RapidEngine) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=60, extra_body=THINK, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    want = expected(engine, CHAT, max_new_tokens=60, **THINK)
    assert thought == want.reasoning
    assert "".join(d.content or "" for d in deltas) == want.text
    first = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first:])


def test_streamed_tool_call_fragments_merge_into_the_same_call(
    client: openai.OpenAI, engine: RapidEngine
) -> None:
    """The SDK's stream helper merges the argument fragments into the call the non-streamed
    answer has (the arguments' JSON text byte for byte), and the raw chunks have OpenAI's
    shape: index, id, type and name first, then argument pieces alone."""
    whole = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=160, extra_body=THINK, **CALL
    )
    with client.chat.completions.stream(
        model=MODEL, messages=CHAT, max_tokens=160, extra_body=THINK, **CALL
    ) as stream:
        pieces = [
            e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"
        ]
        final = stream.get_final_completion()
    want = expected(engine, CHAT, max_new_tokens=160, **THINK, **CALL)
    assert want.tool_calls and final.choices[0].finish_reason == "tool_calls"

    def calls(message: Any) -> list[tuple[str, str]]:
        return [(c.function.name, c.function.arguments) for c in message.tool_calls]

    engine_calls = [(c.name, c.arguments_json) for c in want.tool_calls]
    assert calls(final.choices[0].message) == calls(whole.choices[0].message) == engine_calls
    assert len(pieces) > len(want.tool_calls)  # arguments came in several pieces
    assert "".join(pieces) == "".join(c.arguments_json for c in want.tool_calls)
    assert final.choices[0].message.reasoning_content == whole.choices[0].message.reasoning_content

    raw = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=160, extra_body=THINK, stream=True, **CALL
        )
    )
    entries = [t for c in raw if c.choices for t in c.choices[0].delta.tool_calls or []]
    seen: set[int] = set()
    for entry in entries:
        if entry.index not in seen:
            seen.add(entry.index)
            assert entry.id and entry.type == "function" and entry.function.name
            assert entry.function.arguments == ""
        else:
            assert entry.id is None and entry.function.name is None
    assert seen == set(range(len(want.tool_calls)))


def test_earlier_reasoning_reaches_the_template(client: openai.OpenAI) -> None:
    turns = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "cd", "reasoning_content": "efg"},
        {"role": "user", "content": "hi"},
    ]
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in turns]
    counts = [
        client.chat.completions.create(model=MODEL, messages=m, max_tokens=1).usage.prompt_tokens
        for m in (turns, plain)
    ]
    assert counts[0] == counts[1] + len("<think>efg</think>")


def test_completions_return_the_raw_text(client: openai.OpenAI, engine: RapidEngine) -> None:
    out = client.completions.create(model=MODEL, prompt="ab <think>", max_tokens=20)
    raw = expected(engine, "ab <think>", max_new_tokens=20, reasoning=False)
    assert out.choices[0].text == raw.text != ""
    assert expected(engine, "ab <think>", max_new_tokens=20).text == ""  # all reasoning


# ---- the Responses API ---------------------------------------------------------------------


def test_responses_reasoning_item_and_argument_events(
    client: openai.OpenAI, engine: RapidEngine
) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "input": CHAT,
        "max_output_tokens": 160,
        "extra_body": THINK,
        "tools": [flat(WEATHER)],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    whole = client.responses.create(**request)
    want = expected(engine, CHAT, max_new_tokens=160, **THINK, **CALL)
    reasoning = [i for i in whole.output if i.type == "reasoning"]
    assert [c.text for c in reasoning[0].content] == [want.reasoning]
    assert whole.usage.output_tokens_details.reasoning_tokens == want.stats.reasoning_tokens
    calls = [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    assert calls == [(c.name, c.arguments_json) for c in want.tool_calls]

    events = list(client.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == want.reasoning
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert len(pieces) > len(done) == len(want.tool_calls)
    assert "".join(pieces) == "".join(done) == "".join(c.arguments_json for c in want.tool_calls)
    assert kinds.index("response.reasoning_text.delta") < kinds.index(
        "response.function_call_arguments.delta"
    )
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == calls


def test_responses_reasoning_input_items_reach_the_template(client: openai.OpenAI) -> None:
    reasoning = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "efg"}],
    }
    answer = {"type": "message", "role": "assistant", "content": "cd"}
    turns = [
        {"role": "user", "content": "ab"},
        reasoning,
        answer,
        {"role": "user", "content": "hi"},
    ]
    with_it, without = (
        client.responses.create(model=MODEL, input=t, max_output_tokens=1).usage.input_tokens
        for t in (turns, [turns[0], answer, turns[3]])
    )
    assert with_it == without + len("<think>efg</think>")


def flat(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"]}


# ---- docs ----------------------------------------------------------------------------------

DOC_SECTION = "Reasoning models"


def test_the_serving_docs_reasoning_example_runs(model_dir: Path, engine: RapidEngine) -> None:
    from tests.doc_examples import DOCS, python_sections

    code = dict(python_sections(DOCS / "serving.md"))[DOC_SECTION]
    with live_server(model_dir, served_model_name="rapid") as live:
        ns: dict[str, Any] = {}
        exec(compile(code.replace("http://127.0.0.1:8000", live.url), DOC_SECTION, "exec"), ns)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    want = expected(engine, msgs, max_new_tokens=100, max_reasoning_tokens=24)
    assert ns["message"].reasoning_content == want.reasoning
    assert ns["message"].content == want.text
    assert json.loads(ns["call"].function.arguments)["city"] is not None
