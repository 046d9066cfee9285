"""Reasoning sections (docs/algorithm.md section 13) and streamed tool-call fragments
(section 11) on tiny float32 models with a chat template that carries think markers.

The references are independent of the engine: no-cache forward passes, the end marker
appended by hand when the budget is spent, and a fresh xgrammar matcher (its bitmask unpacked
bit by bit in tests/test_grammar.py's `allowed`) only after the end marker.
"""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr
from hypothesis import given
from hypothesis import strategies as st

from rapid_integrations import Grammar, RapidConfig, RapidConfigError, RapidEngine
from rapid_integrations.structured_output.sections import CallSplitter, Gate, Sections
from tests.test_grammar import allowed, reference_compiled
from tests.tiny import JSON_ALPHABET, char_tokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

# Earlier turns' reasoning is rendered, as Qwen3's template does for the turns it keeps; the
# generation prompt opens the section (DeepSeek-R1's templates, Qwen3 with thinking on).
OPEN_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{% if m.reasoning_content %}<think>"
    "{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant><think>{% endif %}"
)
# The template knows the markers (so reasoning is on) but leaves the choice to the model.
CHOICE_TEMPLATE = OPEN_TEMPLATE.replace("<assistant><think>", "<assistant>")
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    },
}
QUESTIONS = ["name and age of bo", "ab 12", "xyz cd ef", "k"]
LIMIT = 60


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def rtok():
    tok = char_tokenizer(JSON_ALPHABET + "\n")
    tok.chat_template = OPEN_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def rtarget(rtok):
    return tiny_llama(len(rtok), seed=11, window=1024, dtype=torch.float32)


@pytest.fixture(scope="module")
def rdraft(rtok):
    return tiny_llama(len(rtok), seed=12, layers=1, window=1024, dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(rtok, rtarget, rdraft):
    cfg = RapidConfig(eta=0.0, max_new_tokens=LIMIT)
    return RapidEngine(rtarget, rdraft, tokenizer=rtok, config=cfg)


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def prompt_ids(tok, question: str) -> list[int]:
    rendered = tok.apply_chat_template(chat(question), tokenize=False, add_generation_prompt=True)
    return ids_of(tok, rendered)


@torch.inference_mode()
def reference(model, tok, prompt, budget, grammar=None, n=LIMIT, opened=True, start=None):
    """Greedy decoding under section 13's law, by hand: inside the section the raw argmax,
    the end marker appended once `budget` tokens are inside; after it, the argmax under a
    fresh matcher of `grammar`. `start`: the start marker's ids when the output begins with it
    (then it is counted as section tokens, and `budget` counts from after it)."""
    end = ids_of(tok, "</think>")
    vocab = len(tok)
    matcher = None
    if grammar is not None:
        matcher = xgr.GrammarMatcher(reference_compiled(tok, grammar), override_stop_tokens=[0])
    out, inside, count = list(start or []), opened or start is not None, 0
    while len(out) < n:
        if inside and count == budget:
            out += end[: n - len(out)]
            inside = False
            continue
        z = model(input_ids=torch.tensor([prompt + out]), use_cache=False).logits[0, -1, :vocab]
        if not inside and matcher is not None:
            z = z.masked_fill(~allowed(matcher, vocab), float("-inf"))
        token = int(z.argmax())
        out.append(token)
        if token == 0:
            break
        if inside:
            count += 1
            inside = out[-len(end) :] != end
        elif matcher is not None:
            assert matcher.accept_token(token)
    return out


def text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def split(tok, out: list[int], start: int = 0) -> tuple[str, str]:
    """(reasoning, answer) of reference ids whose section begins at `start`."""
    end = ids_of(tok, "</think>")
    for i in range(start, len(out) - len(end) + 1):
        if out[i : i + len(end)] == end:
            return text(tok, out[start:i]), text(tok, out[i + len(end) :])
    return text(tok, out[start:]), ""


def without_eos(out: list[int]) -> tuple[list[int], str]:
    return (out[:-1], "eos") if out[-1:] == [0] else (out, "length")


@pytest.mark.parametrize("budget", [1, 5, 17])
@pytest.mark.parametrize(("mode", "gamma"), [("rapid", 4), ("sd", 8), ("lc", 1)])
def test_eta0_greedy_with_a_budget_equals_the_targets_own(
    engine, rtarget, rtok, budget, mode, gamma
):
    """Section 13: forced end-marker tokens enter both caches, so eta = 0 greedy is still the
    target's own greedy, with the end marker after exactly `budget` tokens."""
    end = ids_of(rtok, "</think>")
    for question in QUESTIONS:
        want = reference(rtarget, rtok, prompt_ids(rtok, question), budget)
        out = engine.generate(
            chat(question), chat(question[:3]), mode=mode, gamma=gamma, max_reasoning_tokens=budget
        )
        assert (out.token_ids, out.finish_reason) == without_eos(want), question
        assert out.token_ids[budget : budget + len(end)] == end  # exactly N tokens inside
        assert out.stats.reasoning_tokens == budget + len(end)
        assert (out.reasoning, out.text) == split(rtok, want[: len(out.token_ids)])


def test_self_draft_keeps_every_draft_across_the_forced_marker(rtok, rtarget):
    """The forced tokens enter the draft's cache and constraints as the target's: drafting
    with the target itself (not the bf16-weight copy a float32 self-draft gets by default),
    every draft is kept, before and after the end marker."""
    engine = RapidEngine(
        rtarget, tokenizer=rtok, config=RapidConfig(lookup_ngram=0), draft_precision="none"
    )
    # eta > 0 without a grammar: the draft reads ahead past its drafts (section 2.7).
    for grammar, eta in ((None, 0.0), (None, 2.0), (Grammar.json_schema(PERSON), 0.0)):
        out = engine.generate(
            chat("ab"),
            chat("ab"),
            eta=eta,
            max_reasoning_tokens=6,
            grammar=grammar,
            max_new_tokens=50,
        )
        assert out.stats.reasoning_tokens == 14
        assert out.stats.accepted_tokens == out.stats.drafted_tokens > 20


@pytest.mark.parametrize(("mode", "gamma"), [("rapid", 3), ("sd", 6)])
def test_grammar_starts_after_the_end_marker(engine, rtarget, rtok, mode, gamma):
    """The grammar reads no reasoning token and starts from its start state after the end
    marker: eta = 0 greedy equals the target's own constrained greedy after the section."""
    grammar = Grammar.json_schema(PERSON)
    ended = 0
    for question in QUESTIONS:
        want = reference(rtarget, rtok, prompt_ids(rtok, question), 9, grammar, n=80)
        out = engine.generate(
            chat(question),
            chat(question[-4:]),
            mode=mode,
            gamma=gamma,
            grammar=grammar,
            max_reasoning_tokens=9,
            max_new_tokens=80,
        )
        assert (out.token_ids, out.finish_reason) == without_eos(want), question
        assert out.reasoning == split(rtok, want)[0]
        if out.finish_reason == "eos":
            ended += 1
            assert set(json.loads(out.text)) == {"name", "age"}
    assert ended >= 2


def test_the_model_may_open_the_section_itself(rtok, rtarget, rdraft):
    """A template that does not open the section: under a grammar the first row allows the
    start marker's first token besides the grammar's, and once taken, the rest of the marker
    (section 13). A question whose greedy first token is "<" under that mask thinks."""
    tok = char_tokenizer(JSON_ALPHABET + "\n")
    tok.chat_template = CHOICE_TEMPLATE
    engine = RapidEngine(rtarget, rdraft, tokenizer=tok, config=RapidConfig(eta=0.0))
    grammar = Grammar.json_schema(PERSON)
    start = ids_of(tok, "<think>")
    seen = set()
    for question in [*QUESTIONS, "a", "bb", "c d", "ee f", "l.k", "hij", "g", "fa"]:
        prompt = prompt_ids(tok, question)
        z = rtarget(input_ids=torch.tensor([prompt])).logits[0, -1, : len(tok)]
        matcher = xgr.GrammarMatcher(reference_compiled(tok, grammar), override_stop_tokens=[0])
        first = allowed(matcher, len(tok))
        first[start[0]] = True
        thinks = int(z.masked_fill(~first, float("-inf")).argmax()) == start[0]
        want = reference(
            rtarget, tok, prompt, 6, grammar, n=80, opened=False, start=start if thinks else None
        )
        out = engine.generate(
            chat(question), mode="sd", grammar=grammar, max_reasoning_tokens=6, max_new_tokens=80
        )
        assert out.token_ids == without_eos(want)[0], question
        assert (out.reasoning is not None) == thinks
        assert out.stats.reasoning_tokens == (len(start) + 6 + 8 if thinks else 0)
        seen.add(thinks)
    assert seen == {True, False}  # both branches were taken


def test_stream_deltas_add_up_to_the_output(engine):
    for question in QUESTIONS:
        with engine.stream(
            chat(question), chat(question[:2]), max_reasoning_tokens=7, seed=3
        ) as stream:
            deltas = list(stream.deltas())
        out = stream.output
        assert "".join(d.reasoning for d in deltas) == out.reasoning
        assert "".join(d.text for d in deltas) == out.text
        assert "</think>" not in out.reasoning + out.text
        plain = engine.stream(chat(question), chat(question[:2]), max_reasoning_tokens=7, seed=3)
        assert "".join(plain) == out.text  # plain iteration: answer text only


def test_sampled_calls_split_consistently(engine, rtok):
    """Sampling, with drafts crossing the end marker: the parts still add up."""
    for seed in range(4):
        out = engine.generate(
            chat("ab"), chat("a"), temperature=1.0, eta=2.0, seed=seed, max_reasoning_tokens=12
        )
        whole = rtok.decode(out.token_ids, skip_special_tokens=True)
        assert whole == out.reasoning + "</think>" * (out.text != "") + out.text
        assert out.stats.reasoning_tokens <= 12 + len(ids_of(rtok, "</think>"))


def test_forced_tokens_report_the_targets_log_probabilities(engine, rtarget, rtok):
    out = engine.generate(chat("ab 12"), max_reasoning_tokens=4, logprobs=True, mode="sd")
    assert len(out.logprobs) == len(out.token_ids)
    prompt = prompt_ids(rtok, "ab 12")
    with torch.inference_mode():
        z = rtarget(input_ids=torch.tensor([prompt + out.token_ids])).logits[0, :, : len(rtok)]
    logp = torch.log_softmax(z.double(), dim=-1)
    for i in range(4, 4 + 8):  # the forced "</think>"
        want = float(logp[len(prompt) + i - 1, out.token_ids[i]])
        assert out.logprobs[i].logprob == pytest.approx(want, abs=1e-4)


def test_without_a_budget_the_section_runs_to_the_limit(engine, rtok):
    out = engine.generate(chat("k"), mode="sd", max_new_tokens=20)
    assert out.text == "" and out.stats.reasoning_tokens == len(out.token_ids)
    assert out.reasoning == rtok.decode(out.token_ids, skip_special_tokens=True)


def test_reasoning_off_leaves_all_to_the_answer(engine, rtok):
    out = engine.generate(chat("k"), mode="sd", max_new_tokens=20, reasoning=False)
    assert out.reasoning is None and out.stats.reasoning_tokens == 0
    assert out.text == rtok.decode(out.token_ids, skip_special_tokens=True)


def test_earlier_reasoning_goes_to_the_template(engine):
    turns = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "cd", "reasoning_content": "efg"},
        {"role": "user", "content": "hi"},
    ]
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in turns]
    assert engine.count_tokens(turns) == engine.count_tokens(plain) + len("<think>efg</think>")


# ---- tool calls -----------------------------------------------------------------------------


def merged(fragments) -> dict[int, dict[str, str]]:
    """Fragments merged per index as an OpenAI client does."""
    calls: dict[int, dict[str, str]] = {}
    for f in fragments:
        if f.index not in calls:
            assert f.id and f.name  # the first fragment names the call
            calls[f.index] = {"id": f.id, "name": f.name, "arguments": ""}
        else:
            assert f.id is None and f.name is None
        calls[f.index]["arguments"] += f.arguments
    return calls


@pytest.mark.parametrize(("choice", "least"), [("required", 3), ("auto", 0)])
def test_call_fragments_merge_into_the_final_calls(engine, choice, least):
    made = 0
    for question in QUESTIONS:
        stream = engine.stream(
            chat(question),
            mode="sd",
            tools=[WEATHER],
            tool_choice=choice,
            max_reasoning_tokens=5,
            max_new_tokens=120,
        )
        deltas = list(stream.deltas())
        out = stream.output
        calls = merged(f for d in deltas for f in d.tool_calls)
        assert len(calls) == len(out.tool_calls)
        for i, call in enumerate(out.tool_calls):
            made += 1
            assert calls[i] == {"id": call.id, "name": call.name, "arguments": call.arguments_json}
            assert call.to_openai()["function"]["arguments"] == call.arguments_json
            assert json.loads(call.arguments_json) == call.arguments
        assert "".join(d.text for d in deltas) == out.text
        assert out.reasoning is not None and "<tool_call>" not in out.reasoning
    assert made >= least


CALLS = [
    '<tool_call>\n{"name": "f", "arguments": {"a": {"b": "}"}}}\n</tool_call>',
    'ok <tool_call>\n{"name": "g", "arguments": {"x": 1} }\n</tool_call>\n<tool_call>\n'
    '{"name": "f", "arguments": {}}\n</tool_call>',
    '<tool_call>{"arguments": {"k": [1, 2]}, "name": "h"}</tool_call> tail',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1',
]


@given(cuts=st.lists(st.integers(0, 120), max_size=10), text=st.sampled_from(CALLS))
def test_call_splitter_fragments_are_split_independent(cuts, text):
    splitter, start, fragments, shown = CallSplitter(), 0, [], []
    for cut in [*sorted({c for c in cuts if c < len(text)}), len(text)]:
        piece, new = splitter.push(text[start:cut])
        shown.append(piece)
        fragments += new
        start = cut
    piece, new = splitter.finish()
    shown.append(piece)
    calls = merged([*fragments, *new])
    kept = {i: c for i, c in calls.items() if i < len(splitter.calls)}
    assert kept == {
        i: {"id": c.id, "name": c.name, "arguments": c.arguments_json}
        for i, c in enumerate(splitter.calls)
    }
    whole = [
        json.loads(b.split("</tool_call>")[0]) for b in text.split("<tool_call>")[1:] if "</" in b
    ]
    assert [c.arguments for c in splitter.calls] == [w["arguments"] for w in whole]
    assert "".join(shown) == splitter.text and "tool_call" not in splitter.text


# ---- the gate and bad values ----------------------------------------------------------------


def test_sections_hold_a_partial_marker_until_it_is_known(rtok):
    gate = Gate.for_call(rtok, RapidConfig(reasoning=True), [5, 6])
    assert gate.first.phase == "before"
    sections = Sections(rtok, (), gate, tools=False)
    text = "<think>ab</thx</think>cd<th"
    deltas = [sections.push(t) for t in ids_of(rtok, text)] + [sections.finish()]
    assert "".join(d.reasoning for d in deltas) == sections.reasoning == "ab</thx"
    assert "".join(d.text for d in deltas) == sections.text == "cd<th"
    assert sections.reasoning_tokens == len("<think>ab</thx</think>")
    other = Sections(rtok, (), gate, tools=False)
    shown = [other.push(t).text for t in ids_of(rtok, "<tha")]
    assert shown == ["", "", "", "<tha"] and other.reasoning is None


@pytest.mark.parametrize(
    "bad",
    [
        {"reasoning": "yes"},
        {"reasoning_markers": ("<think>",)},
        {"reasoning_markers": ("<t>", "<t>")},
        {"reasoning_markers": ("", "</t>")},
        {"max_reasoning_tokens": 0},
        {"max_reasoning_tokens": 2.5},
        {"reasoning": False, "max_reasoning_tokens": 4},
    ],
)
def test_bad_reasoning_values_raise(engine, bad):
    with pytest.raises(RapidConfigError, match=next(iter(bad)) if len(bad) == 1 else "max_reas"):
        RapidConfig(**bad)
    with pytest.raises(RapidConfigError):
        engine.generate("ab", **bad)
