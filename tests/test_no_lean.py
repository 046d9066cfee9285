"""docs/algorithm.md section 1.1: a `rapid` call whose draft read the target's own prompt runs
as eta 0, so its greedy output is the target's, token for token, whatever the draft is."""

from __future__ import annotations

import pytest

from rapid_integrations import RapidConfig, RapidEngine
from tests.tiny import reference_greedy

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

PROMPTS = ["abc def.", "la la la ghi", "k.j.i hhh ab", "a"]

# Short chat prompts with nothing to retrieve: agent and chat traffic. With the lean on, the
# default int4 self-draft changed the bf16 target's answer on half of these.
SHORT_CHATS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
]


@pytest.fixture(scope="module")
def leaning(tok, target, draft):
    """A separate, different draft and a strong lean: any lean changes the greedy output."""
    cfg = RapidConfig(eta=20.0, max_new_tokens=24, ignore_eos=True)
    return RapidEngine(target, draft, tokenizer=tok, config=cfg)


def test_a_draft_prompt_equal_to_the_prompt_gives_the_target_greedy(leaning, target, tok):
    for prompt in PROMPTS:
        out = leaning.generate(prompt, prompt)
        assert out.token_ids == reference_greedy(target, tok.encode(prompt), 24, len(tok))
        assert out.stats.lean_skipped and out.stats.eta == 0.0
        assert out.stats.mode == "rapid" and out.stats.drafted_tokens > 0


def test_a_prompt_under_the_retrieval_budget_gives_the_target_greedy(leaning, target, tok):
    # No draft prompt: the built-in retrieval keeps a prompt this short whole (C^S is C).
    for prompt in PROMPTS:
        out = leaning.generate(prompt)
        assert out.stats.draft_context_tokens == out.stats.target_context_tokens
        assert out.token_ids == reference_greedy(target, tok.encode(prompt), 24, len(tok))
        assert out.stats.lean_skipped


def test_a_shorter_draft_prompt_still_leans(leaning, target, tok):
    """The rule is for equal prompts only: a draft that read other text keeps eta, and with
    eta 20 toward a different model the output leaves the target's on some prompt."""
    differs = 0
    for prompt in PROMPTS[:3]:
        out = leaning.generate(prompt, prompt[2:])
        assert not out.stats.lean_skipped and out.stats.eta == 20.0
        differs += out.token_ids != reference_greedy(target, tok.encode(prompt), 24, len(tok))
    assert differs > 0


@pytest.mark.slow
def test_short_chats_on_the_default_bf16_engine_answer_as_the_target_alone():
    engine = RapidEngine.from_default(dtype="bfloat16", max_new_tokens=24)
    assert engine.draft_precision != "none"  # a lower-precision copy: its q differs from p
    for question in SHORT_CHATS:
        messages = [{"role": "user", "content": f"Answer briefly. {question}"}]
        alone = engine.generate(messages, mode="lc")
        out = engine.generate(messages)
        assert out.stats.lean_skipped, question
        assert out.stats.draft_context_tokens == out.stats.target_context_tokens, question
        assert out.token_ids == alone.token_ids, question
