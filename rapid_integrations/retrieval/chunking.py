"""Token-counted chunking at paragraph / sentence boundaries that never splits a character.

A document is cut into chunks of at most `max_tokens` target tokens. Cuts fall, in order of
preference, at paragraph breaks, line breaks, sentence ends (Latin and CJK punctuation), word
breaks and, only for runs with no break at all, between grapheme clusters (user-perceived
characters: an emoji with skin tone or ZWJ sequence, a flag, a letter with combining marks stay
whole). Chunks never start or end with whitespace; what lies between two neighbouring chunks is
the whitespace of the original text, so each chunk is the exact substring `doc[start:end]`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import regex

from .base import TokenizerLike, count_text_tokens, count_tokens

# Boundary strengths: a chunk prefers to end after the strongest boundary available.
GRAPHEME, WORD, SENTENCE, LINE, PARAGRAPH = range(5)

# Whitespace runs, plus the empty position after CJK sentence punctuation (and any closing
# quotes), since CJK text separates sentences without spaces.
_GAP = regex.compile(r"\s+|(?<=[。！？][」』”’）)]*)(?=[^\s」』”’）)])")
_SENTENCE_END = frozenset(".!?…。！？")
_CLOSERS = frozenset("\"')]”’」』）")
_GRAPHEME = regex.compile(r"\X")


@dataclass(frozen=True)
class Chunk:
    """A contiguous piece of a document.

    text: exactly `document[start:end]` (character offsets); n_tokens: its target-token count;
    doc: index of the document (or chat turn) it came from.
    """

    text: str
    start: int
    end: int
    n_tokens: int
    doc: int = 0


@dataclass(frozen=True)
class _Span:
    start: int
    end: int
    strength: int  # strength of the boundary right after the span
    n_tokens: int = 0


@dataclass(frozen=True)
class _Gaps:
    starts: list[int]
    ends: list[int]
    strengths: list[int]


def chunk_text(text: str, tokenizer: TokenizerLike, max_tokens: int, doc: int = 0) -> list[Chunk]:
    """Cut `text` into chunks of at most `max_tokens` tokens, in document order.

    A chunk exceeds `max_tokens` only when a single grapheme cluster does (a long emoji ZWJ
    sequence under a tiny limit), because characters are never broken.
    """
    gaps = _find_gaps(text)
    lo, hi = len(text) - len(text.lstrip()), len(text.rstrip())
    spans = _spans_between(gaps, lo, hi, SENTENCE, PARAGRAPH)
    spans = _fit(text, tokenizer, spans, max_tokens, gaps)
    return _pack(text, tokenizer, spans, max_tokens, doc)


def chunk_documents(
    documents: Sequence[str], tokenizer: TokenizerLike, max_tokens: int
) -> list[Chunk]:
    """Chunks of every document, in order; `Chunk.doc` is the document's index."""
    return [
        chunk
        for index, document in enumerate(documents)
        for chunk in chunk_text(document, tokenizer, max_tokens, doc=index)
    ]


def iter_gaps(text: str, pos: int = 0) -> Iterator[tuple[int, int, int]]:
    """(start, end, strength) of each break in `text` from `pos` on, in order.

    A break is a whitespace run (PARAGRAPH with two or more line breaks, LINE with one,
    SENTENCE after sentence-ending punctuation, else WORD) or the empty position after CJK
    sentence punctuation (SENTENCE).
    """
    for match in _GAP.finditer(text, pos):
        yield match.start(), match.end(), _gap_strength(text, match.start(), match.group())


def _find_gaps(text: str) -> _Gaps:
    gaps = _Gaps([], [], [])
    for start, end, strength in iter_gaps(text):
        gaps.starts.append(start)
        gaps.ends.append(end)
        gaps.strengths.append(strength)
    return gaps


def _gap_strength(text: str, start: int, gap: str) -> int:
    newlines = gap.count("\n")
    if newlines:
        return PARAGRAPH if newlines > 1 else LINE
    before = text[max(0, start - 2) : start]
    if (
        not gap
        or (before[-1:] in _SENTENCE_END)
        or (before[-1:] in _CLOSERS and before[:1] in _SENTENCE_END)
    ):
        return SENTENCE
    return WORD


def _spans_between(gaps: _Gaps, lo: int, hi: int, min_strength: int, last: int) -> list[_Span]:
    """Non-empty spans of [lo, hi) separated by gaps of at least `min_strength`.

    `last` is the strength recorded after the final span (the boundary that ends [lo, hi)).
    """
    spans: list[_Span] = []
    start = lo
    for k in range(bisect.bisect_left(gaps.starts, lo), len(gaps.starts)):
        if gaps.starts[k] >= hi:
            break
        if gaps.strengths[k] < min_strength:
            continue
        if gaps.starts[k] > start:
            spans.append(_Span(start, gaps.starts[k], gaps.strengths[k]))
        start = max(start, gaps.ends[k])
    if hi > start:
        spans.append(_Span(start, hi, last))
    return spans


def _grapheme_spans(text: str, span: _Span) -> list[_Span]:
    matches = list(_GRAPHEME.finditer(text, span.start, span.end))
    return [
        _Span(m.start(), m.end(), span.strength if i == len(matches) - 1 else GRAPHEME)
        for i, m in enumerate(matches)
    ]


def _fit(
    text: str, tokenizer: TokenizerLike, spans: list[_Span], max_tokens: int, gaps: _Gaps
) -> list[_Span]:
    """Count each span's tokens; split spans over `max_tokens` at words, then graphemes."""
    counts = count_tokens(tokenizer, [text[s.start : s.end] for s in spans])
    fitted: list[_Span] = []
    for span, n in zip(spans, counts, strict=True):
        if n <= max_tokens:
            fitted.append(_Span(span.start, span.end, span.strength, n))
            continue
        words = _spans_between(gaps, span.start, span.end, WORD, span.strength)
        finer = words if len(words) > 1 else _grapheme_spans(text, span)
        if len(finer) > 1:
            fitted.extend(_fit(text, tokenizer, finer, max_tokens, gaps))
        else:  # a single grapheme over the limit: kept whole rather than broken
            fitted.append(_Span(span.start, span.end, span.strength, n))
    return fitted


def _pack(
    text: str, tokenizer: TokenizerLike, spans: list[_Span], max_tokens: int, doc: int
) -> list[Chunk]:
    chunks: list[Chunk] = []
    i = 0
    while i < len(spans):
        j = _prefer_strong_end(spans, i, _greedy_end(spans, i, max_tokens), max_tokens)
        chunk, j = _exact_chunk(text, tokenizer, spans, i, j, max_tokens, doc)
        chunks.append(chunk)
        i = j
    return chunks


def _gap_tokens(span: _Span) -> int:
    """Estimated tokens of the gap after `span`: spaces usually merge into the next word's
    token (" word"); line breaks are tokens of their own."""
    return 1 if span.strength >= LINE else 0


def _greedy_end(spans: list[_Span], i: int, max_tokens: int) -> int:
    """Exclusive end of the longest run from `i` whose estimated size fits (at least one span).

    The estimate sums span counts and gaps; `_exact_chunk` then checks the true count.
    """
    total, k = spans[i].n_tokens, i + 1
    while k < len(spans):
        total += _gap_tokens(spans[k - 1]) + spans[k].n_tokens
        if total > max_tokens:
            break
        k += 1
    return k


def _prefer_strong_end(spans: list[_Span], i: int, j: int, max_tokens: int) -> int:
    """Move the end back to the strongest boundary that still leaves the chunk half full."""
    if j == len(spans):
        return j
    best, best_strength, total = j, -1, 0
    for k in range(i, j):
        total += spans[k].n_tokens + (_gap_tokens(spans[k - 1]) if k > i else 0)
        if total >= max_tokens // 2 and spans[k].strength >= best_strength:
            best, best_strength = k + 1, spans[k].strength
    return best


def _exact_chunk(
    text: str,
    tokenizer: TokenizerLike,
    spans: list[_Span],
    i: int,
    j: int,
    max_tokens: int,
    doc: int,
) -> tuple[Chunk, int]:
    """The chunk spans[i:j], shortened from the end until its true token count fits."""
    while True:
        start, end = spans[i].start, spans[j - 1].end
        n = count_text_tokens(tokenizer, text[start:end])
        if n <= max_tokens or j == i + 1:
            return Chunk(text[start:end], start, end, n, doc), j
        j -= 1
