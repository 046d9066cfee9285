"""C^S that follows the answer (`retrieval.following`, docs/algorithm.md section 2.13): the
answer's chunk shares against transformers' own eager attention, the margin rule and its state
after an update, the scoring's cadence, and through the engine: eta = 0 greedy output is the
target's own while C^S changes, and each rebuilt draft cache is a fresh read of the new short
context and the answer so far."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rapid_integrations import RapidEngine, generate_batch
from rapid_integrations.retrieval import attention as att
from rapid_integrations.retrieval.following import Following, chunk_shares
from rapid_integrations.runtime.kv import KVState
from tests.test_retrieval_attention import oracle_attention, prefilled, prompt
from tests.tiny import greedy_mismatches

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

HEAD, TAIL = "lead a dig. ", " face a bad jab"
HEADS = ((2, 1), (0, 3), (1, 0))


def body_of(text: str) -> str:
    return text[len(HEAD) : -len(TAIL)]


def following(model, tok, seed: int, answer: str = "", budget: int = 40):
    """A `Following` over `prompt(seed)` whose cache also holds `answer` (all but its last
    character, as the engine's cache holds all but the pending token), and the ids."""
    text = prompt(seed)
    ids = tok.encode(text + answer)
    prompt_ids = tok.encode(text)
    retriever = att.AttentionRetriever(
        body_of(text),
        tok,
        model=model,
        cache=prefilled(model, prompt_ids),
        ids=prompt_ids,
        budget=budget,
        heads=HEADS,
    )
    return Following(retriever, lambda: None), ids, len(prompt_ids)


@pytest.mark.parametrize("queries", [1, 4, 9])
def test_answer_shares_are_the_models_own_attention_on_each_chunk(eager, tok, queries):
    follow, ids, _ = following(eager, tok, 4, answer=" dig a bad cafe egg")
    got = chunk_shares(eager, prefilled(eager, ids), ids, follow.retriever, queries)
    want = oracle_attention(eager, ids)
    total = len(ids) - 1
    offset = tok.decode(ids).index(body_of(prompt(4)))
    mass = [
        sum(
            float(
                want[layer][
                    0, head, total - queries : total, offset + c.start : offset + c.end
                ].sum()
            )
            for layer, head in HEADS
        )
        for c in follow.retriever.chunks
    ]
    np.testing.assert_allclose(got, np.array(mass) / sum(mass), rtol=1e-5)
    assert got.sum() == pytest.approx(1.0)


def test_a_chunk_that_overtakes_the_weakest_by_the_margin_enters_cs(eager, tok):
    follow, _, _ = following(eager, tok, 5, budget=80)
    retriever, before = follow.retriever, follow.chosen
    chunks = retriever.chunks
    assert 1 < len(before) < len(chunks)
    inside, outside = sorted(before), sorted(set(range(len(chunks))) - before)
    # The weakest inside, and a chunk outside that fits in its place.
    weakest = max(inside, key=lambda i: chunks[i].n_tokens)
    entrant = next(i for i in outside if chunks[i].n_tokens <= chunks[weakest].n_tokens)
    scores = np.zeros(len(chunks))
    scores[inside] = 10.0
    scores[weakest] = 1.0
    # Just under the margin over the weakest: nothing changes, not even the retriever's scores.
    scores[entrant] = follow.margin * 0.999
    kept = retriever.attention_scores.copy()
    assert not follow.overtaken(scores)
    assert follow.chosen == before and follow.updates == 0
    np.testing.assert_array_equal(retriever.attention_scores, kept)
    # Just past it: the chunk enters in the weakest's place, and what the draft's prompt is
    # packed from says so.
    scores[entrant] = follow.margin * 1.01
    assert follow.overtaken(scores)
    assert follow.chosen == before - {weakest} | {entrant} and follow.updates == 1
    packed = {chunks.index(s.chunk) for s in retriever.search("unused")}
    assert packed == follow.chosen
    # The same scores again change nothing: C^S is what they already chose.
    assert not follow.overtaken(scores.copy())
    assert follow.updates == 1


def test_scoring_comes_every_few_tokens_and_reads_the_answers_last(eager, tok, monkeypatch):
    follow, ids, prompt_tokens = following(eager, tok, 6, answer=" abc dig fed hike jab kale")
    seen = []

    def recording(model, cache, ids_, retriever, queries):
        seen.append((queries, cache.get_seq_length()))
        return np.zeros(len(retriever.chunks))

    monkeypatch.setattr("rapid_integrations.retrieval.following.chunk_shares", recording)
    every = follow.every
    assert not follow.due(every - 1) and follow.due(every)
    cache = prefilled(eager, ids)
    answered = cache.get_seq_length() - prompt_tokens
    follow.rescore(eager, cache, ids, answered)
    assert seen == [(min(every, answered), len(ids) - 1)]
    assert not follow.due(answered + every) and follow.due(answered + 1 + every)


@pytest.mark.parametrize("kind", ["self", "separate"])
def test_eta0_greedy_is_the_targets_while_cs_follows_the_answer(
    retrieving, target, tok, kind, monkeypatch
):
    monkeypatch.setattr(Following, "margin", 0.0)  # any chunk outside that gains enters
    monkeypatch.setattr(Following, "every", 3)
    engine = retrieving[kind]
    starts, redrafts, checked, answered_at = [], [], [], []
    start, adopt = RapidEngine._start, KVState.adopt
    redraft, rescore = Following.__init__, Following.rescore

    def recording_start(self, model, ids, *args, **kwargs):
        if kwargs.get("draft"):
            starts.append(list(ids))
        return start(self, model, ids, *args, **kwargs)

    def recording_init(self, retriever, draft_ids):
        def recorded():
            ids = draft_ids()
            redrafts.append((ids, {retriever.chunks[i].text for i in self.chosen}))
            return ids

        redraft(self, retriever, recorded)

    def recording_rescore(self, model, cache, ids, answered):
        answered_at.append(answered)  # the answer's tokens in the target's cache
        return rescore(self, model, cache, ids, answered)

    def checked_adopt(self, other):
        ids = starts[-1]  # the rebuild's: the new short context, then the answer so far
        fresh = prefilled(self.model, ids)
        for layer, layer_fresh in zip(other.cache.layers, fresh.layers, strict=True):
            torch.testing.assert_close(att._layer_kv(layer)[0], layer_fresh.keys)
        assert other.pending.tolist() == ids[-1:]
        assert len(ids) - len(redrafts[-1][0]) == answered_at[-1] + 1  # all committed tokens
        checked.append(ids)
        adopt(self, other)
        assert self.cache is other.cache and self.pending is other.pending

    monkeypatch.setattr(RapidEngine, "_start", recording_start)
    monkeypatch.setattr(Following, "__init__", recording_init)
    monkeypatch.setattr(Following, "rescore", recording_rescore)
    monkeypatch.setattr(KVState, "adopt", checked_adopt)
    for seed in range(3):
        text = prompt(10 + seed)
        checked.clear()
        out = engine.generate(text, retriever="following", gamma=1 + seed * 2)
        assert out.stats.mode == "rapid"
        assert greedy_mismatches(target, tok.encode(text), out.token_ids, len(tok)) == []
        assert out.stats.follow_updates == len(checked) > 0
        assert out.stats.draft_context_tokens == len(redrafts[-1][0])  # the last C^S's
        for ids in checked:
            draft_ids, texts = next((d, t) for d, t in redrafts if ids[: len(d)] == d)
            answered = ids[len(draft_ids) :]
            assert answered == out.token_ids[: len(answered)]
            short_context = tok.decode(draft_ids)
            assert all(text.strip() in short_context for text in texts)


@pytest.mark.parametrize("kind", ["self", "separate"])
def test_in_a_batch_each_call_follows_its_own_answer_as_alone(retrieving, kind, monkeypatch):
    """Rebuilds of the draft run inside a batch's draft phase; each call's output and updates
    are what it gets alone."""
    monkeypatch.setattr(Following, "margin", 0.0)
    monkeypatch.setattr(Following, "every", 3)
    engine = retrieving[kind]
    texts = [prompt(20 + seed) for seed in range(3)]
    alone = [engine.generate(text, retriever="following", gamma=3) for text in texts]
    together = generate_batch(engine, texts, retriever="following", gamma=3)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.stats.follow_updates for o in together] == [o.stats.follow_updates for o in alone]
    assert all(o.stats.follow_updates > 0 for o in together)
