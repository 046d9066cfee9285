"""The retrievers that read the target's cache, through the engine: eta = 0 greedy output is
the target's own under every retriever, and retriever names are checked."""

from __future__ import annotations

import pytest

from rapid_integrations import RapidEngine
from rapid_integrations.errors import RapidConfigError
from rapid_integrations.retrieval import attention as att
from tests.test_retrieval_attention import prompt
from tests.tiny import char_tokenizer, greedy_mismatches

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


@pytest.mark.parametrize("retriever", [None, "attention", "hybrid", "following"])
@pytest.mark.parametrize("kind", ["self", "separate"])
def test_eta0_greedy_is_the_targets_under_every_retriever(
    retrieving, target, tok, retriever, kind, monkeypatch
):
    if retriever is not None:  # the attention is read, never the embedder's fallback for it

        def refused(*args, **kwargs):
            raise AssertionError("fell back to the embedder")

        monkeypatch.setattr(att.FaissContextRetriever, "from_config", refused)
    for seed in range(3):
        text = prompt(10 + seed)
        out = retrieving[kind].generate(
            text, retriever=retriever, gamma=1 + seed * 2, prefill_chunk_size=7 + seed * 20
        )
        assert out.stats.mode == "rapid"
        assert 0 < out.stats.draft_context_tokens < out.stats.target_context_tokens
        assert out.stats.retrieval_fallback is None
        assert len(out.token_ids) == 24
        assert greedy_mismatches(target, tok.encode(text), out.token_ids, len(tok)) == []


def test_rag_mode_under_a_cache_retriever_uses_the_embedder(retrieving, tok):
    engine = retrieving["separate"]
    text = prompt(20)
    named = engine.generate(text, retriever="attention", mode="rag")
    embedded = engine.generate(text, retriever=None, mode="rag")
    assert named.token_ids == embedded.token_ids


def test_an_unknown_retriever_name_is_a_config_error(retrieving, target, tok):
    with pytest.raises(RapidConfigError, match="retriever"):
        retrieving["self"].generate(prompt(1), retriever="atention")
    with pytest.raises(RapidConfigError, match="retriever"):
        RapidEngine(target, tokenizer=char_tokenizer(), retriever="bm25")
