"""Chunker: exact token limits, positions, boundary preference, whole characters; budgets."""

from __future__ import annotations

import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapid_integrations.retrieval import (
    chunk_documents,
    chunk_text,
    chunk_tokens_for,
    default_budget,
)
from rapid_integrations.retrieval.base import count_text_tokens
from tests.retrieval_fixtures import smol_tokenizer

CJK_EMOJI = (
    "家族で旅行に行きました。👨‍👩‍👧‍👦 とても楽しかった！東京タワー🗼を見ました。"
    "国旗🇯🇵🇫🇷、肌色👍🏽👋🏿、合字🏳️‍🌈。한국어 문장도 있습니다. Ελληνικά κείμενα. "
    "Café naïve e\u0301 déjà vu 🙂🙃\n\n"
    "第二段落です。句読点のない長い文章が続くかもしれませんそしてこれはとても長い文章です"
)


def graphemes_boundaries(text: str) -> set[int]:
    return {m.start() for m in regex.finditer(r"\X", text)} | {len(text)}


def assert_valid_chunks(text: str, chunks, max_tokens: int, tok) -> None:
    """Exact substrings at their positions, in order, whitespace between, whole graphemes."""
    boundaries = graphemes_boundaries(text)
    position = 0
    for chunk in chunks:
        assert text[chunk.start : chunk.end] == chunk.text
        assert chunk.text and chunk.text == chunk.text.strip()
        assert not text[position : chunk.start].strip()  # only whitespace was skipped
        assert chunk.start in boundaries and chunk.end in boundaries
        assert chunk.n_tokens == count_text_tokens(tok, chunk.text)
        single_grapheme = len(regex.findall(r"\X", chunk.text)) == 1
        assert chunk.n_tokens <= max_tokens or single_grapheme
        position = chunk.end
    assert not text[position:].strip()


def test_chunks_fit_and_cover_a_long_document():
    tokenizer = smol_tokenizer()
    text = "\n\n".join(
        f"Paragraph {i}. " + " ".join(f"Sentence {i}.{j} has some words in it." for j in range(9))
        for i in range(40)
    )
    for max_tokens in (16, 64, 200, 512):
        assert_valid_chunks(text, chunk_text(text, tokenizer, max_tokens), max_tokens, tokenizer)


def test_chunks_prefer_paragraph_then_sentence_ends():
    tokenizer = smol_tokenizer()
    paragraph = " ".join(f"This is sentence number {j} of the paragraph." for j in range(6))
    text = "\n\n".join([paragraph] * 6)
    per_paragraph = count_text_tokens(tokenizer, paragraph)
    chunks = chunk_text(text, tokenizer, per_paragraph * 2 + 10)
    assert all(c.text.endswith("paragraph.") for c in chunks)
    assert {c.text.count("\n\n") for c in chunks} == {1}  # two whole paragraphs each
    small = chunk_text(paragraph, tokenizer, per_paragraph // 2)
    assert all(c.text.endswith(".") for c in small)  # cut at sentence ends, not mid-sentence


def test_cjk_and_emoji_never_break_a_character():
    tokenizer = smol_tokenizer()
    for max_tokens in (8, 12, 32, 128):
        chunks = chunk_text(CJK_EMOJI, tokenizer, max_tokens)
        assert_valid_chunks(CJK_EMOJI, chunks, max_tokens, tokenizer)
        for chunk in chunks:  # every chunk is whole text that survives a tokenizer round trip
            ids = tokenizer(chunk.text, add_special_tokens=False)["input_ids"]
            assert tokenizer.decode(ids) == chunk.text
    assert len(chunk_text(CJK_EMOJI, tokenizer, 32)) > 3


def test_cjk_sentences_split_without_spaces():
    tokenizer = smol_tokenizer()
    text = "今日は晴れです。" * 30
    chunks = chunk_text(text, tokenizer, 20)
    assert all(c.text.endswith("。") for c in chunks)


def test_documents_keep_their_index():
    tokenizer = smol_tokenizer()
    chunks = chunk_documents(["First document.", "", "Third one here."], tokenizer, 64)
    assert [(c.doc, c.text) for c in chunks] == [(0, "First document."), (2, "Third one here.")]


def test_default_budget_rule():
    assert default_budget(1_000) == 512  # floor for short inputs
    assert default_budget(8_192) == 512  # 1/16 of an 8K window
    assert default_budget(32_768) == 1366  # the paper's 1/24
    assert default_budget(200_000) == 4096  # the paper's cap


def test_chunk_size_follows_the_budget():
    assert chunk_tokens_for(4096) == 512  # the paper's chunks under its cap
    assert chunk_tokens_for(2048) == 256
    assert chunk_tokens_for(512) == 64
    assert chunk_tokens_for(40) == 40  # never larger than the budget
    assert chunk_tokens_for(4096, max_chunk_tokens=300) == 300


PIECES = st.sampled_from(
    [
        "word", "Hello", "the", "3.14", "e.g.", "end.", "Why?", "Yes!", "(note)", '"quoted."',
        "東京", "です。", "「本当？」", "한국어", "👨‍👩‍👧‍👦", "🇯🇵", "👍🏽", "e\u0301", "🏳️‍🌈",
        "x" * 40, "長" * 30,
    ]
)  # fmt: skip
SEPARATORS = st.sampled_from(["", " ", "  ", "\n", "\n\n", " \n \n ", "\t"])


@st.composite
def texts(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.tuples(PIECES, SEPARATORS), max_size=60))
    return "".join(piece + sep for piece, sep in parts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), max_tokens=st.integers(8, 80))
def test_chunker_properties_on_random_text(text: str, max_tokens: int):
    tok = smol_tokenizer()
    assert_valid_chunks(text, chunk_text(text, tok, max_tokens), max_tokens, tok)
