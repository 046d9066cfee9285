"""Tool calls (docs/algorithm.md section 11): validation, rendering, the call grammars under
every tool_choice, parsing, streams without markup; tiny models, one SmolLM2 run."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rapid_integrations import (
    Grammar,
    GrammarError,
    RapidConfig,
    RapidEngine,
    RapidError,
    RapidInputError,
    build_draft_prompt,
)
from rapid_integrations.structured_output.sections import CallSplitter
from rapid_integrations.structured_output.tools import (
    CALL_OPEN,
    Tools,
    call_separator,
    prepare_messages,
)
from tests.test_grammar import reference_constrained
from tests.tiny import JSON_ALPHABET, char_tokenizer, tiny_llama

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["paris", "rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a"],
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "weather in paris"}]


@pytest.fixture(scope="module")
def ttok():
    return char_tokenizer(JSON_ALPHABET + "\n")


@pytest.fixture(scope="module")
def ttarget(ttok):
    return tiny_llama(len(ttok), seed=5, window=2048)


@pytest.fixture(scope="module")
def engine(ttok, ttarget):
    draft = tiny_llama(len(ttok), seed=6, layers=1, window=2048)
    return RapidEngine(ttarget, draft, tokenizer=ttok, config=RapidConfig(max_new_tokens=120))


def assert_valid_calls(calls, names=tuple(SCHEMAS)):
    assert calls
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.name in names
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "choice", "error", "match"),
    [
        ([WEATHER, WEATHER], "auto", RapidInputError, "unique.*get_weather"),
        (TOOLS, "search", RapidInputError, "names no given tool"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, RapidInputError, "nope"),
        ([{"name": "x"}], "auto", RapidInputError, "tool 0 must be"),
        ([{"type": "function", "function": {"name": "a b"}}], "auto", RapidInputError, "name"),
        (WEATHER, "auto", RapidInputError, "list of tool specs"),
        (None, "required", RapidInputError, "without tools"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
            "auto",
            GrammarError,
            "invalid JSON schema",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "auto",
            RapidInputError,
            "object",
        ),
    ],
)
def test_bad_tools_raise_before_decoding(engine, tools, choice, error, match):
    with pytest.raises(error, match=match) as caught:
        engine.stream(MESSAGES, tools=tools, tool_choice=choice)
    assert isinstance(caught.value, RapidError) and isinstance(caught.value, ValueError)


def test_tools_need_chat_messages_and_a_real_grammar(engine):
    with pytest.raises(RapidInputError, match="chat prompt"):
        engine.generate("weather", tools=TOOLS)
    with pytest.raises(GrammarError, match=r"must be a rapid_integrations\.Grammar"):
        engine.generate(MESSAGES, tools=TOOLS, grammar={"type": "object"})


def test_a_tokenizer_that_cannot_write_the_markup_gets_a_grammar_error(engine):
    """Without a newline token the call markup cannot be written: a clear GrammarError, not
    an all-zero p sampled into a token the matcher refuses; the engine serves on."""
    tok = char_tokenizer(JSON_ALPHABET)
    weak = RapidEngine(tiny_llama(len(tok), seed=5, window=2048), tokenizer=tok)
    with pytest.raises(GrammarError, match="cannot write"):
        weak.generate(MESSAGES, tools=TOOLS, tool_choice="required", max_new_tokens=40)
    assert weak.generate(MESSAGES, max_new_tokens=4).finish_reason == "length"


# ---- the call grammars -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["rapid", "sd", "lc"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_gives_valid_calls_and_no_text(engine, mode, temperature):
    finished = 0
    for seed in range(3):
        out = engine.generate(
            MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            mode=mode,
            seed=seed,
            temperature=temperature,
        )
        assert out.text == ""
        if out.finish_reason == "length":  # a random model may chain calls past the limit
            assert temperature > 0
            continue
        finished += 1
        assert out.finish_reason == "tool_calls"
        assert_valid_calls(out.tool_calls)
    assert finished >= (1 if temperature else 3)  # sampled, a random model may chain calls


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_no_parallel_calls_ends_after_one_call(engine, choice):
    """parallel_tool_calls=False: the grammar takes one call and then only the end (with the
    option on, a second call may follow); decoded, at most one call."""
    call = CALL_OPEN + '\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'
    between = call_separator(engine.tokenizer) if choice == "required" else "\n"
    for parallel in (True, False):
        tools = Tools.parse(TOOLS, choice, parallel)
        matcher = engine._grammars().matcher(tools.grammar(engine.tokenizer))
        assert matcher.accept_string(call)
        assert matcher.accept_string(between + call) is parallel
    for seed in range(3):
        out = engine.generate(
            MESSAGES,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            seed=seed,
            temperature=1.0,
        )
        assert len(out.tool_calls) <= 1
        if out.tool_calls:
            assert out.finish_reason == "tool_calls"
            assert_valid_calls(out.tool_calls)


REPORT = {
    "type": "object",
    "properties": {"city": {"enum": ["paris", "rome"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
CALL = CALL_OPEN + '\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'


@pytest.mark.parametrize(
    ("choice", "calls", "answer"),
    [("auto", True, True), ("none", False, True), ("required", True, False)],
)
def test_a_response_format_beside_tools_is_what_answers_must_match(engine, choice, calls, answer):
    """Tools with a response format (OpenAI's, vLLM's and Ollama's `response_format` next to
    `tools`): under "auto" the output is calls or one answer of the format, under "none" that
    answer, under "required" calls; free text never."""
    grammar = Tools.parse(TOOLS, choice).grammar(engine.tokenizer, Grammar.json_schema(REPORT))
    for text, allowed in (
        (CALL + call_separator(engine.tokenizer) + CALL, calls),
        ('{"city": "rome", "sunny": true}', answer),
        ('{"city": "oslo", "sunny": true}', False),
        ("it is sunny", False),
        (CALL + '{"city": "rome", "sunny": true}', False),
    ):
        matcher = engine._grammars().matcher(grammar)
        assert (matcher.accept_string(text) and matcher.is_completed()) is allowed, text


def test_tools_with_a_response_format_decode_to_calls_or_an_answer(engine):
    seen = set()
    for seed in range(12):  # hot: this random model starts a call 2 times in 12, at 1.0 never
        out = engine.generate(
            MESSAGES, tools=TOOLS, grammar=Grammar.json_schema(REPORT), temperature=3.0, seed=seed
        )
        if out.finish_reason == "length":  # a random model may chain calls past the limit
            continue
        if out.tool_calls:
            assert (out.text, out.finish_reason) == ("", "tool_calls")
            assert_valid_calls(out.tool_calls)
            seen.add("calls")
        else:
            jsonschema.validate(json.loads(out.text), REPORT)
            seen.add("answer")
    assert seen == {"calls", "answer"}


def test_eta0_greedy_under_tools_and_a_response_format_is_the_targets_own(engine, ttarget, ttok):
    """docs/algorithm.md section 10 with the union of the calls and the answer's grammar."""
    tools = Tools.parse(TOOLS, "auto")
    answer = Grammar.json_schema(REPORT)
    messages, _ = prepare_messages(MESSAGES, tools, ttok)
    prompt = ttok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = reference_constrained(ttarget, ttok, prompt, tools.grammar(ttok, answer), 120)
    out = engine.generate(MESSAGES, tools=TOOLS, grammar=answer, eta=0.0, gamma=4)
    assert out.token_ids == [t for t in want if t != 0]


TOOL_TEMPLATE = (
    "{% if tools %}<system>{% for t in tools %}{{ t.function.name }} {% endfor %}</s>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments.city }}{% endfor %}"
    "</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tool_template_tokenizer():
    """The JSON character tokenizer with a chat template that renders tools itself."""
    tok = char_tokenizer(JSON_ALPHABET + "\n")
    tok.chat_template = TOOL_TEMPLATE
    return tok


@pytest.mark.parametrize("native", [False, True], ids=["plain template", "tool template"])
def test_required_calls_follow_each_other_as_the_template_writes_them(engine, native):
    """Under "required", a template without tool support gets its calls back to back, so
    that right after `</tool_call>` the model chooses between the end and `<` of another
    call, never a newline it would read as more text; a template that renders tools keeps
    Qwen's newline between calls. After each complete call the end is allowed."""
    tok = tool_template_tokenizer() if native else engine.tokenizer
    call = CALL_OPEN + '\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'
    matcher = engine._grammars().matcher(Tools.parse(TOOLS, "required").grammar(tok))
    assert matcher.accept_string(call)
    assert matcher.is_completed()  # the end may come here
    assert matcher.accept_string("\n") is native
    assert matcher.accept_string(call) and matcher.is_completed()


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_text_next_to_tools_never_holds_a_tool_response(engine, choice):
    """The answer side: text outside calls cannot write the tool-result markup (a model that
    saw it copies it into its answer); other text, even the tag's start, can."""
    matcher = engine._grammars().matcher(Tools.parse(TOOLS, choice).grammar(engine.tokenizer))
    assert matcher.accept_string("the answer: <tool_resp")
    assert not matcher.accept_string("onse>")


def test_parallel_tool_calls_must_be_a_bool(engine):
    with pytest.raises(RapidInputError, match="parallel_tool_calls must be a bool"):
        engine.generate(MESSAGES, tools=TOOLS, parallel_tool_calls="no")


@pytest.mark.parametrize(
    "choice", ["get_weather", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_named_tool_gives_exactly_one_call_of_it(engine, choice):
    out = engine.generate(MESSAGES, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=3)
    assert len(out.tool_calls) == 1
    assert_valid_calls(out.tool_calls, ["get_weather"])


def test_none_and_auto_never_show_markup(engine):
    for choice in ("none", "auto"):
        for seed in range(3):
            out = engine.generate(
                MESSAGES, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed
            )
            assert CALL_OPEN not in out.text
            if choice == "none":
                assert out.tool_calls == [] and "<tool_call" not in engine.tokenizer.decode(
                    out.token_ids
                )


@pytest.mark.parametrize("gamma", [1, 4])
def test_eta0_greedy_under_the_call_grammar_is_the_targets_own(engine, ttarget, ttok, gamma):
    """docs/algorithm.md section 10 with the tools' grammar: the target's masked greedy."""
    tools = Tools.parse(TOOLS, "required")
    messages, _ = prepare_messages(MESSAGES, tools, ttok)
    prompt = ttok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = reference_constrained(ttarget, ttok, prompt, tools.grammar(ttok), 120)
    out = engine.generate(MESSAGES, tools=TOOLS, tool_choice="required", eta=0.0, gamma=gamma)
    assert out.token_ids == [t for t in want if t != 0]


def test_stream_shows_content_only_and_ends_with_the_calls(engine):
    stream = engine.stream(MESSAGES, tools=TOOLS, tool_choice="required", seed=1)
    deltas = list(stream)
    assert "".join(deltas) == stream.output.text == ""
    assert_valid_calls(stream.output.tool_calls)


# ---- rendering -------------------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "weather in rome"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "rome", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
]


def test_history_with_calls_and_results_is_rendered_without_tool_support(engine, ttok):
    messages, extra = prepare_messages(HISTORY, Tools.parse(TOOLS), ttok)
    assert extra == {}
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert (
        messages[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}\n</tool_call>'
    )
    assert messages[3] == {"role": "user", "content": "Here is the result of get_weather: sunny"}
    out = engine.generate(HISTORY, tools=TOOLS, tool_choice="none", max_new_tokens=8)
    assert out.prompt_tokens > 0


def test_a_result_without_a_name_is_named_after_its_call_and_calls_sit_back_to_back(ttok):
    """OpenAI's tool messages carry only the call id; several calls are written as the
    grammar writes them, with the assistant's text first."""
    second = {**HISTORY[1]["tool_calls"][0], "id": "call_2"}
    second["function"] = {"name": "add", "arguments": {"a": 1}}
    history = [
        HISTORY[0],
        {"role": "assistant", "content": "both", "tool_calls": [*HISTORY[1]["tool_calls"], second]},
        {"role": "tool", "content": "3", "tool_call_id": "call_2"},
        {"role": "tool", "content": "?", "tool_call_id": "call_9"},
    ]
    messages, _ = prepare_messages(history, Tools.parse(TOOLS), ttok)
    assert messages[2]["content"] == (
        'both\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}\n'
        '</tool_call><tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert [m["content"] for m in messages[3:]] == [
        "Here is the result of add: 3",
        "Here is the result of a tool: ?",
    ]


def test_under_none_a_plain_template_gets_no_tool_instructions(ttok):
    """tool_choice "none" forbids calls, so the system prompt that asks for them is left out
    for a template without tool support; a template that renders tools still gets them."""
    system = {"role": "system", "content": "be brief"}
    for choice, asked in (("none", False), ("auto", True)):
        messages, extra = prepare_messages([system, *HISTORY], Tools.parse(TOOLS, choice), ttok)
        assert ("<tools>" in messages[0]["content"]) is asked and extra == {}
        assert messages[0]["content"].startswith("be brief")
    _, extra = prepare_messages(HISTORY, Tools.parse(TOOLS, "none"), tool_template_tokenizer())
    assert [t["function"]["name"] for t in extra["tools"]] == ["get_weather", "add"]


def test_a_template_that_renders_tools_gets_them(ttok, ttarget):
    tok = tool_template_tokenizer()
    messages, extra = prepare_messages(HISTORY, Tools.parse(TOOLS), tok)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "rome", "days": 2}
    engine = RapidEngine(ttarget, tokenizer=tok, config=RapidConfig(max_new_tokens=4))
    rendered = tok.decode(
        engine.planner.encode(*engine.planner.with_tools(HISTORY, Tools.parse(TOOLS)))
    )
    assert rendered.startswith("<system>get_weather add </s>") and "get_weatherrome" in rendered


def test_the_draft_prompt_keeps_the_tool_system_message(engine, ttok):
    """The draft reads the retrieved context plus the same tool specs, whole: specs longer
    than the retrieval budget are instructions, not context to retrieve from."""
    document = " ".join(f"fact {i} is {i * 7}." for i in range(50))
    chat = [{"role": "user", "content": f"{document}\n\nquestion: what is fact 3"}]
    config = RapidConfig(retrieval_budget=64)
    draft, _ = prepare_messages(
        build_draft_prompt(chat, ttok, config=config), Tools.parse(TOOLS), ttok
    )
    messages, _ = prepare_messages(chat, Tools.parse(TOOLS), ttok)
    assert draft[0] == messages[0] and len(ttok.encode(draft[0]["content"])) > 64
    assert len(draft[-1]["content"]) < len(chat[0]["content"]) / 4
    out = engine.generate(chat, tools=TOOLS, retrieval_budget=64, max_new_tokens=2)
    assert out.stats.draft_context_tokens == len(engine.planner.encode(draft, {}))


# ---- the content filter ----------------------------------------------------------------------

TEXTS = [
    ("hello <tool_call>\n{}\n</tool_call>", "hello"),
    ("<tool_call>x</tool_call>\n<tool_call>y</tool_call>", ""),
    ("a <tool_c b", "a <tool_c b"),
    ("say <tool_call>{cut off", "say"),
    ("x\n<tool_call>{}</tool_call>\nthen y  ", "xthen y"),
]


@given(cuts=st.lists(st.integers(0, 60), max_size=8), case=st.sampled_from(TEXTS))
def test_content_filter_is_split_independent(cuts, case):
    text, want = case
    shown, start = CallSplitter(), 0
    deltas = []
    for cut in sorted(set(c for c in cuts if c < len(text))):
        deltas.append(shown.push(text[start:cut])[0])
        start = cut
    deltas += [shown.push(text[start:])[0], shown.finish()[0]]
    assert "".join(deltas) == shown.text == want
    assert not any("<tool_call" in d for d in deltas)


@pytest.mark.slow
def test_smol_required_tool_call_parses(smol_engine):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"],
                },
            },
        }
    ]
    out = smol_engine.generate(
        [{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice="required",
        max_new_tokens=60,
    )
    # "required" allows parallel calls; the 135M model makes one here (calls back to back:
    # test_smol_required_ends_after_its_call), and every listed call is complete and valid.
    assert out.finish_reason == "tool_calls", out
    assert out.tool_calls and {c.name for c in out.tool_calls} == {"get_weather"}
    for call in out.tool_calls:
        jsonschema.validate(call.arguments, tools[0]["function"]["parameters"])
    assert out.text == ""
    assert out.stats.grammar_seconds > 0


MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is 23 times 37?"}]


@pytest.mark.slow
def test_smol_required_ends_after_its_call(smol_engine):
    """With a newline between calls, SmolLM2 wrote the call twice (the
    newline it prefers after `</tool_call>` forced a second call), so 64 tokens cut the
    repeat off with finish_reason "length". Back to back, it ends after the call."""
    out = smol_engine.generate(
        QUESTION, tools=[MULTIPLY], tool_choice="required", max_new_tokens=64
    )
    assert out.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("multiply", {"a": 23, "b": 37})]
    assert smol_engine.tokenizer.decode(out.token_ids).endswith("</tool_call>")


@pytest.mark.slow
@pytest.mark.parametrize("question", ["What is 23 times 37?", "What is 23 * 37?"])
def test_smol_answer_after_a_tool_result_has_no_markup(smol_engine, question):
    """Shown its result as `<tool_response>...</tool_response>`, SmolLM2
    answered with that markup; in prose, without the call instructions under "none", it
    answers in text."""
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "multiply", "arguments": '{"a": 23, "b": 37}'}
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "851"},
    ]
    out = smol_engine.generate(messages, tools=[MULTIPLY], tool_choice="none", max_new_tokens=48)
    assert out.finish_reason == "eos" and out.text.strip()
    assert "<" not in smol_engine.tokenizer.decode(out.token_ids)
