"""C^S chosen by the target's attention (`retrieval.attention`): scores against transformers'
own eager attention probabilities, chunk spans against character offsets, the probe's heads
against an exhaustive search, and the eta = 0 identity under every retriever."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from rapid_integrations import RapidConfig
from rapid_integrations.retrieval import attention as att
from rapid_integrations.retrieval.chunking import chunk_documents
from tests.retrieval_fixtures import HashingEmbedder

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

WORDS = ["abc", "bad", "cafe", "dig", "egg", "fed", "hike", "jab", "kale", "lid", "gel", "ice"]


def document(seed: int, sentences: int = 14) -> str:
    rng = random.Random(seed)
    return " ".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7))) + "."
        for _ in range(sentences)
    )


def prompt(seed: int) -> str:
    """Head sentence, a body of sentences (the context C), question sentence."""
    return "lead a dig. " + document(seed) + " face a bad jab"


def prefilled(model, ids: list[int]) -> DynamicCache:
    """The model's cache of all but the last prompt token, as the engine's prefill leaves it."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.tensor([ids[:-1]]), **{att.cache_keyword(model): cache})
    return cache


def oracle_attention(model, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' probabilities per layer [1, heads, P, P] over the cached tokens."""
    with torch.inference_mode():
        return model(torch.tensor([ids[:-1]]), output_attentions=True).attentions


@pytest.mark.parametrize("queries", [1, 5, 32])
def test_question_attention_is_the_models_own(eager, tok, queries):
    ids = tok.encode(prompt(1))
    got = att.question_attention(eager, prefilled(eager, ids), ids, [0, 1, 2], queries)
    want = oracle_attention(eager, ids)
    total = len(ids) - 1
    for layer in range(3):
        expected = want[layer][0, :, total - queries : total, :]
        # transformers' eager softmax runs in float32, this one in the model's float64.
        torch.testing.assert_close(got[layer], expected, rtol=1e-5, atol=1e-7)


def test_only_the_asked_layers_come_back(eager, tok):
    ids = tok.encode(prompt(2))
    got = att.question_attention(eager, prefilled(eager, ids), ids, [1], 4)
    assert list(got) == [1]
    assert got[1].shape == (4, 4, len(ids) - 1)


def test_chunk_spans_are_the_chunks_characters(tok):
    # One character a token: a chunk's span is its characters' offset in the prompt.
    text = prompt(3)
    body = text[len("lead a dig. ") : -len(" face a bad jab")]
    ids = tok.encode(text)
    chunks = chunk_documents([body], tok, 20)
    assert len(chunks) > 3
    spans = att.token_spans([body], chunks, ids, tok)
    offset = text.index(body)
    assert spans == [(offset + c.start, offset + c.end) for c in chunks]


def test_span_mass_sums_each_span():
    mass = torch.rand(50, dtype=torch.float64)
    spans = [(0, 3), (3, 10), (12, 50), (7, 8)]
    want = [float(mass[a:b].sum()) for a, b in spans]
    np.testing.assert_allclose(att.span_mass(mass, spans), want, rtol=1e-12)


def test_a_document_missing_from_the_ids_is_refused(tok):
    chunks = chunk_documents(["abc dig fed"], tok, 4)
    with pytest.raises(att.AttentionUnavailable):
        att.token_spans(["abc dig fed"], chunks, tok.encode("kale lid gel ice egg"), tok)


def test_probe_picks_the_heads_most_on_the_needle(eager, tok):
    att._heads_by_model.pop(eager, None)
    chosen = att.probe_heads(eager, tok, top=5)
    total = torch.zeros(3, 4, dtype=torch.float64)
    for probe in att.probe_prompts(tok):
        a, b = probe.needle
        last = len(probe.ids) - 1
        for layer, probs in enumerate(oracle_attention(eager, probe.ids)):
            rows = probs[0, :, last - att.QUERY_TOKENS : last, a:b]
            total[layer] += rows.sum(-1).mean(-1)
    flat = sorted(range(12), key=lambda i: -float(total.flatten()[i]))[:5]
    assert chosen == tuple((i // 4, i % 4) for i in flat)
    assert att.probe_heads(eager, tok, top=5) is chosen  # measured once per model


def test_chunk_scores_are_the_attention_mass_on_each_chunk(eager, tok):
    text = prompt(4)
    body = text[len("lead a dig. ") : -len(" face a bad jab")]
    ids = tok.encode(text)
    heads = ((2, 1), (0, 3), (1, 0))
    retriever = att.AttentionRetriever(
        body, tok, model=eager, cache=prefilled(eager, ids), ids=ids, budget=40, heads=heads
    )
    want = oracle_attention(eager, ids)
    total = len(ids) - 1
    offset = text.index(body)
    queries = min(att.QUERY_TOKENS, total - (offset + len(body)))
    expected = []
    for chunk in retriever.chunks:
        a, b = offset + chunk.start, offset + chunk.end
        mass = sum(float(want[i][0, h, total - queries : total, a:b].sum()) for i, h in heads)
        expected.append(mass)
    np.testing.assert_allclose(retriever.attention_scores, expected, rtol=1e-5)
    chosen = retriever.search("unused")
    best = max(range(len(expected)), key=lambda i: expected[i])
    assert retriever.chunks[best] in [s.chunk for s in chosen]


def test_each_prompt_is_scored_from_its_own_cache(eager, tok):
    heads = ((1, 2), (2, 0))
    for seed in (6, 7):
        text = prompt(seed)
        body = text[len("lead a dig. ") : -len(" face a bad jab")]
        ids = tok.encode(text)
        make = att.cache_retriever_factory("attention", eager, prefilled(eager, ids), ids)
        att._heads_by_model[eager] = heads
        retriever = make([body], tok, RapidConfig(retrieval_budget=40), 40)
        assert isinstance(retriever, att.AttentionRetriever)
        fresh = att.AttentionRetriever(
            body, tok, model=eager, cache=prefilled(eager, ids), ids=ids, budget=40, heads=heads
        )
        np.testing.assert_array_equal(retriever.attention_scores, fresh.attention_scores)
    att._heads_by_model.pop(eager, None)


def test_hybrid_fuses_the_two_rankings(eager, tok):
    text = prompt(8)
    body = text[len("lead a dig. ") : -len(" face a bad jab")]
    ids = tok.encode(text)
    att._heads_by_model[eager] = ((0, 0), (2, 3))
    config = RapidConfig(retrieval_budget=40, retrieval_embedder=HashingEmbedder())
    hybrid = att.cache_retriever_factory("hybrid", eager, prefilled(eager, ids), ids)(
        [body], tok, config, 40
    )
    att._heads_by_model.pop(eager, None)
    assert isinstance(hybrid, att.HybridRetriever)
    query = "face a bad jab"
    cosine = att.FaissContextRetriever.scores(hybrid, query)
    attention = hybrid.attention.attention_scores

    def ranks(scores):
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return {i: r + 1 for r, i in enumerate(order)}

    rc, ra = ranks(cosine), ranks(attention)
    want = [1 / (att.RRF_K + rc[i]) + 1 / (att.RRF_K + ra[i]) for i in range(len(cosine))]
    np.testing.assert_allclose(hybrid.scores(query), want, rtol=1e-6)


# ---- the embedded model ------------------------------------------------------------------------

NEEDLE = "The night porter at the Grand Hotel keeps a parrot named Captain Ochre."


@pytest.mark.slow
def test_smol_attention_puts_the_needle_into_cs(smol_bf16):
    """A fact planted at five depths of a 2K-token document of Python's own docstrings (text
    unlike the probe's): the attention retriever's C^S holds it each time, on the model in the
    engine's default dtype."""
    from rapid_integrations.bench.haystack import stdlib_paragraphs
    from rapid_integrations.engine.prompts import prepare_draft_prompt

    model, tokenizer = smol_bf16
    paragraphs: list[str] = []
    for paragraph in stdlib_paragraphs():
        paragraphs.append(paragraph)
        if len(tokenizer("\n\n".join(paragraphs))["input_ids"]) > 2000:
            break
    found = []
    for depth in (0.1, 0.3, 0.5, 0.7, 0.9):
        cut = int(len(paragraphs) * depth)
        doc = "\n\n".join([*paragraphs[:cut], NEEDLE, *paragraphs[cut:]])
        text = (
            f"Answer from the document.\n\n{doc}\n\n"
            "Question: What is the name of the night porter's parrot?\nAnswer:"
        )
        ids = tokenizer(text)["input_ids"]
        cache = prefilled(model, ids)
        make = att.cache_retriever_factory("attention", model, cache, ids)
        built = prepare_draft_prompt(text, tokenizer, config=RapidConfig(), builtin=make)
        assert built.fallback is None and not built.passthrough
        assert built.retrieved_tokens <= built.budget
        found.append("Captain Ochre" in built.prompt)
    assert found == [True] * 5
