"""Continuous batching (rapid_integrations/batching/runner.py, docs/algorithm.md section 14) on tiny
float32 models: every call's output is its own unbatched `generate` output, whatever else is in
the batch and whenever it joined; a cancelled or failed call leaves the others unchanged. The
sampling laws are tested on batches of seeded calls (tests/seeded.py, used by
tests/test_engine_distribution.py and tests/test_grammar.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from rapid_integrations import (
    BatchRunner,
    Grammar,
    RapidConfig,
    RapidConfigError,
    RapidEngine,
    generate_batch,
)
from tests.tiny import char_tokenizer, json_tokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

# (prompt, draft prompt, per-call options): lengths 1 to 40, gammas 1 to 9, every mode,
# lookup on and off, eta 0 and the default eta (greedy: argmax p_hat, section 2.7), forced
# tokens.
CALLS = [
    ("abc def gh", "def", {"gamma": 1}),
    ("hello. ab cd ab cd ab", "ab cd", {"gamma": 4, "lookup_ngram": 0}),
    ("k", "k", {"gamma": 9}),
    ("jkl jkl jkl jkl abc abc abc a", "abc", {"gamma": 3, "mode": "sd", "prefill_chunk_size": 3}),
    ("ab " * 13 + "l", "ab", {"gamma": 6, "lookup_tokens": 4, "prefill_chunk_size": 5}),
    ("fed cba", "cba", {"mode": "lc"}),
    ("ghi. jkl", "ghi", {"mode": "rag"}),
    ("a.b.c.d.e.f", "d.e", {"gamma": 2, "eta": 5.0}),
    ("lkj ihg fed", "fed", {"gamma": 5, "eta": 5.0, "lookup_ngram": 0}),
    # A spent thinking budget: the end marker is committed by no model (section 13).
    ("abc <think>", "abc", {"gamma": 4, "reasoning": True, "max_reasoning_tokens": 3}),
]


@pytest.fixture(scope="module")
def pair():
    tok = char_tokenizer()
    target = tiny_llama(len(tok), seed=11, dtype=torch.float32, scale=0.5)
    draft = tiny_llama(len(tok), seed=12, layers=1, dtype=torch.float32, scale=0.5)
    return tok, target, draft


@pytest.fixture(scope="module")
def engines(pair):
    tok, target, draft = pair
    cfg = RapidConfig(eta=0.0, max_new_tokens=14, ignore_eos=True)
    return {
        "separate": RapidEngine(target, draft, tokenizer=tok, config=cfg),
        "self": RapidEngine(target, tokenizer=tok, config=cfg),
    }


def alone(engine: RapidEngine, call: tuple) -> list[int]:
    prompt, draft_prompt, options = call
    return engine.generate(prompt, draft_prompt, **options).token_ids


def submit(runner: BatchRunner, call: tuple) -> int:
    prompt, draft_prompt, options = call
    return runner.submit(prompt, draft_prompt, **options)


def run_mix(engine: RapidEngine, calls: list[tuple], joins: list[int]) -> list[list[int]]:
    """Decode `calls` together, call i joining after `joins[i]` steps of the batch."""
    runner = BatchRunner(engine)
    ids: dict[int, int] = {}
    step = 0
    while len(ids) < len(calls) or runner.running:
        for i, call in enumerate(calls):
            if i not in ids and joins[i] <= step:
                ids[i] = submit(runner, call)
        if runner.running:
            runner.step()
        step += 1
    assert not runner.errors
    return [runner.outputs[ids[i]].token_ids for i in range(len(calls))]


@pytest.mark.parametrize("kind", ["separate", "self"])
@pytest.mark.parametrize("mix", range(3))
def test_each_call_decodes_as_it_would_alone(engines, kind, mix):
    engine = engines[kind]
    calls = CALLS[mix::3] + CALLS[(mix + 1) % 3 :: 3][:2]
    joins = [0, 0, 3, 1, 7, 2][: len(calls)]
    want = [alone(engine, call) for call in calls]
    assert run_mix(engine, calls, joins) == want


def test_one_call_is_the_batch_of_one(engines):
    for call in CALLS[:4]:
        assert run_mix(engines["separate"], [call], [0]) == [alone(engines["separate"], call)]


def test_one_verify_pass_reads_every_call(engines):
    """Draft passes run together, then one target pass reads every call's pending token and
    drafts: the first verify pass of three calls at gammas 1, 4 and 9 reads 2 + 5 + 10 rows."""
    engine = engines["separate"]
    runner = BatchRunner(engine)
    for gamma in (1, 4, 9):
        runner.submit("abc def", "ef", gamma=gamma, lookup_ngram=0, max_new_tokens=12)
    widths: list[int] = []  # of every target pass after the prefills
    hook = engine.target.register_forward_hook(
        lambda _m, _a, kw, _o: widths.append(kw["input_ids"].shape[-1]), with_kwargs=True
    )
    try:
        runner.run()
    finally:
        hook.remove()
    assert widths[0] == 2 + 5 + 10
    passes = sum(o.stats.target_forward_passes for o in runner.outputs.values())
    assert len(widths) < passes  # the calls shared target passes


def test_a_newcomers_prefill_runs_one_chunk_a_step(engines):
    """A call that joins a running batch is prefilled one chunk per verify pass, beside the
    running call's rows: no pass reads more than a chunk of its prompt, and the running call
    commits tokens while the newcomer is still prefilling."""
    engine = engines["separate"]
    runner = BatchRunner(engine)
    running = runner.submit("abc def", "def", gamma=2, lookup_ngram=0, max_new_tokens=40)
    runner.step()
    widths: list[int] = []
    hook = engine.target.register_forward_hook(
        lambda _m, _a, kw, _o: widths.append(kw["input_ids"].shape[-1]), with_kwargs=True
    )
    try:
        newcomer = runner.submit("jkl abc " * 5, "abc", prefill_chunk_size=6, max_new_tokens=6)
        assert widths == []  # submitting runs no pass: the prefill joins the steps
        committed = 0
        for _ in range(6 * 3):  # 7 chunks of the target's prompt, each a draft phase apart
            runner.step()
            committed += len(runner.take_deltas(running))
    finally:
        hook.remove()
    assert max(widths) <= 6 + 1 + 2  # a chunk beside the running call's verify rows
    assert committed > 0
    runner.run()
    want = engine.generate("jkl abc " * 5, "abc", prefill_chunk_size=6, max_new_tokens=6)
    assert runner.outputs[newcomer].token_ids == want.token_ids


def test_streamed_deltas_and_log_probabilities_are_each_calls_own(engines):
    """A call's deltas, taken as the batch runs, join to its output, and its log
    probabilities (section 12) are those it gets alone (to float rounding: its rows come from
    a packed pass)."""
    engine = engines["separate"]
    calls = [
        ("abc def gh", "def", {"gamma": 3, "logprobs": True, "top_logprobs": 2}),
        ("hello. ab", "ab", {"gamma": 5, "eta": 5.0, "logprobs": True, "logprobs_p_hat": True}),
    ]
    runner = BatchRunner(engine)
    ids = [submit(runner, call) for call in calls]
    texts = {i: "" for i in ids}
    while runner.running:
        runner.step()
        for i in ids:
            texts[i] += "".join(d.text for d in runner.take_deltas(i))
    for i, call in zip(ids, calls, strict=True):
        out, want = runner.outputs[i], engine.generate(call[0], call[1], **call[2])
        assert out.token_ids == want.token_ids and texts[i] == out.text == want.text
        for got, ref in zip(out.logprobs, want.logprobs, strict=True):
            assert got.token_id == ref.token_id
            assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)
            assert [t.token_id for t in got.top_logprobs] == [t.token_id for t in ref.top_logprobs]
            if ref.p_hat_logprob is not None:
                assert got.p_hat_logprob == pytest.approx(ref.p_hat_logprob, abs=1e-4)


def test_grammars_and_penalties_in_some_calls():
    """Calls under a grammar (section 10) or a repetition penalty (section 9) beside plain
    ones: each equals its own unbatched output."""
    tok = json_tokenizer()
    target = tiny_llama(len(tok), seed=5, dtype=torch.float32, scale=0.5)
    draft = tiny_llama(len(tok), seed=6, layers=1, dtype=torch.float32, scale=0.5)
    engine = RapidEngine(target, draft, tokenizer=tok, config=RapidConfig(max_new_tokens=20))
    regex = Grammar.regex(r"[a-h]{1,4}( [0-9]{1,3}){1,3}\.")
    calls = [
        ("ab 12", "12", {"grammar": regex, "gamma": 3, "eta": 0.0}),
        ("xyz cd ef", "cd", {"gamma": 5}),
        ("name and age", "age", {"grammar": regex, "gamma": 2}),
        ("k 1 2 3", "k", {"repetition_penalty": 1.3, "gamma": 4, "eta": 0.0}),
    ]
    want = [alone(engine, call) for call in calls]
    assert run_mix(engine, calls, [0, 0, 1, 2]) == want


class _FailsAfter:
    """A call's loop that raises after `passes` more passes (a call failing mid-decode)."""

    def __init__(self, steps, passes: int) -> None:
        self.steps, self.passes = steps, passes

    def send(self, logits):
        self.passes -= 1
        if self.passes < 0:
            raise RuntimeError("planted failure")
        return self.steps.send(logits)

    def close(self) -> None:
        self.steps.close()


@pytest.mark.parametrize("how", ["cancel", "fail"])
def test_a_cancelled_or_failed_call_frees_its_slot_and_changes_no_other(engines, how):
    engine = engines["separate"]
    calls = CALLS[:3]
    runner = BatchRunner(engine)
    ids = [submit(runner, call) for call in calls]
    loop = weakref.ref(runner._calls[ids[1]].steps)
    for _ in range(3):
        runner.step()
    if how == "cancel":
        runner.cancel(ids[1])
    else:
        runner._calls[ids[1]].steps = _FailsAfter(runner._calls[ids[1]].steps, 2)
    runner.run()
    gc.collect()
    assert loop() is None  # its loop, and with it both of its KV caches, is gone
    assert ids[1] not in runner.outputs
    assert (ids[1] in runner.errors) == (how == "fail")
    for i in (0, 2):
        assert runner.outputs[ids[i]].token_ids == alone(engine, calls[i])


def test_generate_batch_returns_each_calls_output(engines):
    engine = engines["self"]
    prompts = ["abc def", "k", "hello. ab"]
    outs = generate_batch(engine, prompts, gamma=3)
    assert [o.token_ids for o in outs] == [engine.generate(p, gamma=3).token_ids for p in prompts]


def test_a_model_on_another_attention_is_refused(pair):
    tok, _, _ = pair
    model = tiny_llama(len(tok), seed=3, dtype=torch.float32)
    model.set_attn_implementation("eager")
    engine = RapidEngine(model, tokenizer=tok)
    with pytest.raises(RapidConfigError, match="attention"):
        BatchRunner(engine)
