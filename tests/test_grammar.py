"""Grammar-constrained RAPID (docs/algorithm.md section 10) on tiny random models.

The reference is independent of the engine's masking: a fresh xgrammar matcher, its bitmask
unpacked bit by bit here, over no-cache forward passes.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from rapid_integrations import Grammar, GrammarError, RapidConfig, RapidEngine, RapidError
from rapid_integrations.sample.sampling import one_step_law, p_hat
from tests.seeded import position_counts
from tests.tiny import json_tokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "bc", "def"]},
    },
    "required": ["name", "age", "ok", "tag"],
}
GRAMMARS = {
    "schema": lambda: Grammar.json_schema(PERSON),
    "regex": lambda: Grammar.regex(r"[a-h]{1,4}( [0-9]{1,3}){1,3}\."),
    "ebnf": lambda: Grammar.ebnf('root ::= "[" item ("," item){0,4} "]"\nitem ::= [a-f] | [0-9]+'),
}
PROMPTS = [("name and age of bo", "bo"), ("ab 12", "12"), ("xyz cd ef", "cd"), ("k", "k")]


@pytest.fixture(scope="module")
def jtok():
    return json_tokenizer()


@pytest.fixture(scope="module")
def jtarget(jtok):
    return tiny_llama(len(jtok), seed=5)


@pytest.fixture(scope="module")
def jdraft(jtok):
    return tiny_llama(len(jtok), seed=6, layers=1)


@pytest.fixture(scope="module")
def engines(jtok, jtarget, jdraft):
    cfg = RapidConfig(eta=0.0, max_new_tokens=72)
    return {
        "self": RapidEngine(jtarget, tokenizer=jtok, config=cfg),
        "separate": RapidEngine(jtarget, jdraft, tokenizer=jtok, config=cfg),
    }


def reference_compiled(tok, grammar: Grammar) -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[0])
    return xgr.GrammarCompiler(info).compile_grammar(grammar.xgrammar)


def allowed(matcher: xgr.GrammarMatcher, vocab: int) -> torch.Tensor:
    """[vocab] bool: the tokens `matcher` allows next, from its bitmask bit by bit."""
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].tolist()
    return torch.tensor([bool((words[i // 32] >> (i % 32)) & 1) for i in range(vocab)])


@torch.inference_mode()
def masked_logits(model, ids: list[int], matcher, vocab: int) -> torch.Tensor:
    z = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1, :vocab].clone()
    return z.masked_fill(~allowed(matcher, vocab), float("-inf"))


def reference_constrained(model, tok, prompt: str, grammar: Grammar, n: int) -> list[int]:
    """Greedy decoding under `grammar` without a cache; ends with 0 when the grammar ends it."""
    vocab = len(tok)
    matcher = xgr.GrammarMatcher(reference_compiled(tok, grammar), override_stop_tokens=[0])
    ids, out = tok.encode(prompt), []
    while len(out) < n:
        token = int(masked_logits(model, ids + out, matcher, vocab).argmax())
        out.append(token)
        assert matcher.accept_token(token)
        if token == 0:
            break
    return out


@pytest.mark.parametrize("name", sorted(GRAMMARS))
@pytest.mark.parametrize(
    ("kind", "gamma"), [("self", 3), ("separate", 1), ("separate", 4), ("separate", 8)]
)
def test_eta0_greedy_equals_target_greedy_under_the_grammar(
    engines, jtarget, jtok, name, gamma, kind
):
    grammar = GRAMMARS[name]()
    ended = 0
    for i, (prompt, draft_prompt) in enumerate(PROMPTS):
        mode = "sd" if i % 2 else "rapid"
        out = engines[kind].generate(prompt, draft_prompt, mode=mode, gamma=gamma, grammar=grammar)
        want = reference_constrained(jtarget, jtok, prompt, grammar, 72)
        if want[-1:] == [0]:
            ended += 1
            assert (out.token_ids, out.finish_reason) == (want[:-1], "eos"), (prompt, mode)
        else:
            assert (out.token_ids, out.finish_reason) == (want, "length"), (prompt, mode)
        assert out.stats.grammar_seconds > 0
    assert ended >= 2  # most outputs complete their grammar


def test_self_draft_under_the_grammar_is_always_accepted(jtok, jtarget):
    """Self-speculation on the full prompt at eta = 0: the draft's masked greedy token is the
    target's, so every draft is accepted. A draft without the mask, or a draft matcher not
    rolled back after a verdict, proposes tokens the target's mask forbids."""
    engine = RapidEngine(jtarget, tokenizer=jtok, config=RapidConfig(eta=0.0, max_new_tokens=40))
    for name in sorted(GRAMMARS):
        for gamma in (2, 5):
            for prompt, _ in PROMPTS[:2]:
                s = engine.generate(prompt, mode="sd", gamma=gamma, grammar=GRAMMARS[name]()).stats
                assert s.accepted_tokens == s.drafted_tokens > 0, (name, gamma, prompt)


# ---- laws of single emitted tokens -----------------------------------------------------------

CHOICE = Grammar.regex("[a-h][a-z]{1,3}")
PROMPT, DRAFT_PROMPT = "kab", "ab"
N = 600


def sample_tokens(engine: RapidEngine, **overrides) -> np.ndarray:
    """Counts [2, V] of the first and the second emitted token over N seeds."""
    return position_counts(engine, (PROMPT, DRAFT_PROMPT), N, grammar=CHOICE, **overrides)


def assert_follows(counts: np.ndarray, law: np.ndarray) -> None:
    assert counts[law == 0].sum() == 0  # a forbidden token is never emitted
    keep = law * counts.sum() >= 5
    expected = law[keep] / law[keep].sum() * counts[keep].sum()
    result = chisquare(counts[keep], expected)
    assert result.pvalue > 1e-3, (result, counts, law * counts.sum())


def masked_p(model, tok, ids: list[int], prefix: list[int] = ()) -> torch.Tensor:
    matcher = xgr.GrammarMatcher(reference_compiled(tok, CHOICE), override_stop_tokens=[0])
    for t in prefix:
        assert matcher.accept_token(t)
    return torch.softmax(masked_logits(model, ids + list(prefix), matcher, len(tok)).double(), -1)


@pytest.fixture(scope="module")
def sampler(jtok, jtarget, jdraft):
    cfg = RapidConfig(temperature=1.0, confidence_guard=False)  # the paper's p_hat (section 2.3)
    return RapidEngine(jtarget, jdraft, tokenizer=jtok, config=cfg)


@pytest.mark.parametrize("gamma", [1, 3])
def test_eta0_first_two_tokens_follow_masked_p(sampler, jtarget, jtok, gamma):
    """Token 2 comes from a verified draft row (gamma 3) or the bonus row (gamma 1): its mask
    is the one after the first token."""
    ids = jtok.encode(PROMPT)
    p1 = masked_p(jtarget, jtok, ids)
    assert (p1 > 0).sum() == 8  # the grammar leaves a choice of a..h
    law = sum(p1[a] * masked_p(jtarget, jtok, ids, [a]) for a in range(len(jtok)) if p1[a] > 0)
    counts = sample_tokens(sampler, eta=0.0, gamma=gamma)
    assert_follows(counts[0], p1.numpy())
    assert_follows(counts[1], law.numpy())


@pytest.mark.parametrize("rule", ["paper", "exact"])
def test_eta_positive_first_token_follows_the_masked_law(sampler, jtarget, jdraft, jtok, rule):
    """docs/algorithm.md section 4 with masked p, q and p_hat. A draft left unmasked puts mass
    on forbidden tokens, which changes min(q, p_hat) and with it the law."""
    p = masked_p(jtarget, jtok, jtok.encode(PROMPT))
    q = masked_p(jdraft, jtok, jtok.encode(DRAFT_PROMPT))
    ph = p_hat(torch.log(p)[None], q[None], 3.0)[0]
    law = one_step_law(p, ph, q, rule).numpy()
    assert_follows(sample_tokens(sampler, eta=3.0, gamma=2, residual=rule)[0], law)


# ---- every completed output is valid ---------------------------------------------------------

LEAF = st.sampled_from(
    [
        {"type": "boolean"},
        {"type": "integer", "minimum": -5, "maximum": 300},
        {"type": "string", "maxLength": 4},
        {"enum": ["x", "yz", 3]},
        {"type": "null"},
    ]
)
SCHEMAS = st.recursive(
    LEAF,
    lambda inner: st.one_of(
        st.builds(
            lambda props, required: {
                "type": "object",
                "properties": props,
                "required": sorted(props)[: required % (len(props) + 1)],
            },
            st.dictionaries(
                st.sampled_from(["a", "b", "cd", "e_f"]), inner, min_size=1, max_size=3
            ),
            st.integers(0, 3),
        ),
        st.builds(lambda item: {"type": "array", "items": item, "maxItems": 3}, inner),
    ),
    max_leaves=5,
)


@settings(max_examples=15)
@given(schema=SCHEMAS, seed=st.integers(0, 2**16), sampled=st.booleans())
def test_every_completed_output_validates(engines, schema, seed, sampled):
    engine = engines["separate"]
    out = engine.generate(
        "data: ab 12",
        "ab",
        grammar=Grammar.json_schema(schema),
        seed=seed,
        temperature=1.0 if sampled else 0.0,
        eta=2.0,
        max_new_tokens=80,
    )
    if out.finish_reason == "eos":
        jsonschema.validate(json.loads(out.text), schema)
    else:
        assert out.finish_reason == "length"


def test_most_outputs_complete(engines):
    """The validity test above has something to validate."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    outs = [
        engines["separate"].generate("x", "x", grammar=Grammar.json_schema(schema), seed=s)
        for s in range(5)
    ]
    assert all(o.finish_reason == "eos" and json.loads(o.text)["a"] in (True, False) for o in outs)


# ---- errors, caching, streams ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Grammar.json_schema({"type": 5}), "invalid JSON schema"),
        (lambda: Grammar.json_schema("{not json"), "not JSON"),
        (lambda: Grammar.json_schema(["a"]), "expected an object"),
        (
            lambda: Grammar.json_schema({"type": "string", "pattern": "(?<=a)b"}),
            "cannot compile this JSON schema",
        ),
        (lambda: Grammar.regex("(ab"), "cannot compile this regex"),
        (lambda: Grammar.regex(""), "non-empty string"),
        (lambda: Grammar.ebnf("root ::= missing"), "cannot compile this EBNF"),
    ],
)
def test_bad_grammars_raise_grammar_error(build, match):
    with pytest.raises(GrammarError, match=match) as caught:
        build()
    assert isinstance(caught.value, RapidError) and isinstance(caught.value, ValueError)


def test_grammar_argument_is_checked_before_decoding(engines):
    with pytest.raises(GrammarError, match=r"must be a rapid_integrations\.Grammar"):
        engines["self"].stream("ab", grammar='{"type": "object"}')


def test_cut_off_structured_answer_ends_with_length(engines):
    out = engines["separate"].generate(
        "ab", "ab", grammar=Grammar.json_schema(PERSON), max_new_tokens=6
    )
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_each_grammar_compiles_once(jtok, jtarget):
    engine = RapidEngine(jtarget, tokenizer=jtok, config=RapidConfig(max_new_tokens=8))
    for _ in range(3):
        engine.generate("ab", grammar=Grammar.json_schema(PERSON))
        engine.generate("ab", grammar=Grammar.regex("[a-c]+"))
    assert len(engine._grammar_compiler._compiled) == 2


def test_stream_under_a_grammar_shows_the_same_text(engines):
    engine = engines["separate"]
    grammar = Grammar.json_object()
    stream = engine.stream("ab 12", "12", grammar=grammar, max_new_tokens=40)
    text = "".join(stream)
    assert (
        text
        == stream.output.text
        == engine.generate("ab 12", "12", grammar=grammar, max_new_tokens=40).text
    )


def test_grammar_ends_generation_even_under_ignore_eos(engines):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    out = engines["self"].generate("ab", grammar=Grammar.json_schema(schema), ignore_eos=True)
    assert out.finish_reason == "eos"
    json.loads(out.text)
