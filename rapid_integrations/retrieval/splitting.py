"""Split a flat prompt into instruction head, long middle (the context C) and question tail.

RAPID's draft keeps the head and tail verbatim and reads retrieved chunks of the middle
instead of the whole of it. Prompts carry no markup for where C starts and ends, so cuts are
found where templates put them, in this order of preference:

1. a delimiter line (`-----`, `=====`, `*****`...), as in LlamaIndex's
   "Context information is below.\\n-----\\n{context}\\n-----\\nGiven the context... Query: ...";
2. a label line: `Context:` / `Document:` ends the head, `Question:` / `Query:` starts the tail
   (LangChain's "...\\n\\n{context}\\n\\nQuestion: {question}\\nHelpful Answer:");
3. a blank line, 4. a line break, 5. a sentence end, 6. a word break (the chunker's breaks,
   `chunking.iter_gaps`).

The head is searched in the first `HEAD_TOKENS` tokens (earliest strongest cut wins), the tail
in the last `TAIL_TOKENS` (latest strongest cut wins); neither takes more than a quarter of the
prompt. Special tokens of a rendered chat template (`<|im_start|>user`...) are kept out of the
middle so the draft prompt stays well formed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import regex

from .base import TokenizerLike
from .chunking import PARAGRAPH, iter_gaps

HEAD_TOKENS = 256
"""Longest instruction head searched for, in target tokens."""
TAIL_TOKENS = 512
"""Longest question tail searched for, in target tokens (room for multiple-choice options)."""

_DELIMITER = regex.compile(r"^[^\S\n]*([-=*_~#])\1{2,}[^\S\n]*$", regex.M)
_LABEL_PREFIX = r"^[^\S\n]*(?:[#*>]+[^\S\n]*)?"
_CONTEXT_LABEL = regex.compile(
    _LABEL_PREFIX + r"(?:context|document|passage|text|article|transcript|background|source|"
    r"information|reference)s?[^\S\n]*[:：][^\S\n]*\n?",
    regex.M | regex.I,
)
_QUESTION_LABEL = regex.compile(
    _LABEL_PREFIX + r"(?:question|query|q|user question|user query|instruction|task|problem|"
    r"问题|質問|问)s?[^\S\n]*[:：]",
    regex.M | regex.I,
)
# Lines of a tail that are not part of the question: empty, a bare label ("Answer:"), a
# delimiter, or a chat role name left over from a rendered template.
_NOT_QUESTION = regex.compile(
    r"^\s*(?:[\w ]{0,30}[:：])?\s*$|^\s*([-=*_~#])\1{2,}\s*$"
    r"|^\s*(?:system|user|assistant|human|ai|model|bot)\s*$",
    regex.I,
)

# Template markers outrank every break found by the chunker (PARAGRAPH ... WORD).
_DELIMITER_RANK, _LABEL_RANK = PARAGRAPH + 2, PARAGRAPH + 1


@dataclass(frozen=True)
class PromptSplit:
    """A prompt as `head + body + tail` (exact concatenation).

    head: the instruction head verbatim, with the whitespace that preceded the body;
    body: the long middle, without leading or trailing whitespace (may be empty);
    tail: the question tail verbatim, with the whitespace that followed the body;
    n_tokens: token count of the whole prompt (0 when built by hand, e.g. from a template).
    """

    head: str
    body: str
    tail: str
    n_tokens: int = 0

    @property
    def text(self) -> str:
        return self.head + self.body + self.tail


def split_prompt(
    text: str,
    tokenizer: TokenizerLike,
    head_tokens: int = HEAD_TOKENS,
    tail_tokens: int = TAIL_TOKENS,
    special_tokens: tuple[str, ...] = (),
) -> PromptSplit:
    """Cut `text` into head, body and tail (see the module docstring for the rules).

    `special_tokens` (e.g. `tokenizer.all_special_tokens`) never end up inside the body.
    """
    starts = _token_starts(text, tokenizer)
    n = len(starts)
    # Token offsets can fall inside a character (byte-level BPE): shrink both windows to
    # whole grapheme clusters.
    head_end = _grapheme_bounds(text, _char_at(starts, min(head_tokens, n // 4), len(text)))[0]
    tail_start = _grapheme_bounds(text, _char_at(starts, n - min(tail_tokens, n // 4), len(text)))[
        1
    ]
    head = _head_cut(text, head_end, special_tokens)
    tail = _tail_cut(text, max(head, tail_start), special_tokens)
    body_start = head + _leading_space(text[head:tail])
    body_end = max(body_start, tail - _trailing_space(text[head:tail]))
    return PromptSplit(text[:body_start], text[body_start:body_end], text[body_end:], n)


def default_query(tail: str, special_tokens: tuple[str, ...] = ()) -> str:
    """The question in a tail, as one line.

    Of the tail's pieces between special tokens (a rendered chat template), the last one with a
    `Question:`/`Query:` label is used, else the longest; then the text after that label,
    without answer cues (`Answer:`), delimiter lines or bare role names (`assistant`).
    """
    pieces = (
        regex.split("|".join(map(regex.escape, special_tokens)), tail) if special_tokens else [tail]
    )
    labelled = [p for p in pieces if _QUESTION_LABEL.search(p)]
    text = labelled[-1] if labelled else max(pieces, key=len)
    labels = list(_QUESTION_LABEL.finditer(text))
    if labels:
        text = text[labels[-1].end() :]
    lines = [line for line in text.splitlines() if not _NOT_QUESTION.match(line)]
    return " ".join(" ".join(lines).split())


def _token_starts(text: str, tokenizer: TokenizerLike) -> list[int]:
    """Character offset where each token of `text` starts.

    Fast tokenizers report offsets; for others the offsets are spread evenly over the text,
    which is enough to size the head and tail search windows.
    """
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True, verbose=False
        )
        return [start for start, _ in encoded["offset_mapping"]]
    n = len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    return [i * len(text) // n for i in range(n)]


def _char_at(starts: list[int], token: int, length: int) -> int:
    return starts[token] if token < len(starts) else length


def _head_cut(text: str, window_end: int, special_tokens: tuple[str, ...]) -> int:
    """End of the head: earliest of the strongest cuts in text[:window_end]; if none, 0 (or
    the end of the last special-token line)."""
    floor = _after_last_special_line(text, window_end, special_tokens)
    cuts = [(rank, -end) for rank, _, end in _cuts(text, floor, window_end, _CONTEXT_LABEL)]
    return -max(cuts)[1] if cuts else floor


def _tail_cut(text: str, window_start: int, special_tokens: tuple[str, ...]) -> int:
    """Start of the tail: latest of the strongest cuts in text[window_start:]; if none, the
    window start."""
    ceiling = _before_first_special_line(text, window_start, special_tokens)
    cuts = [
        (rank, start)
        for rank, start, _ in _cuts(text, window_start, len(text), _QUESTION_LABEL)
        if start <= ceiling
    ]
    return max(cuts)[1] if cuts else min(ceiling, window_start)


def _cuts(text: str, lo: int, hi: int, label: regex.Pattern[str]) -> Iterator[tuple[int, int, int]]:
    """(rank, start, end) of every delimiter line, `label` line and break inside text[lo:hi].

    Matching runs on the whole text from `lo` (not on a slice), so `$` and look-arounds see
    the real neighbours of the window's edges. A head cut falls after a match, a tail cut
    before it.
    """
    for pattern, rank in ((_DELIMITER, _DELIMITER_RANK), (label, _LABEL_RANK)):
        for match in pattern.finditer(text, lo):
            if match.end() > hi:
                break
            yield rank, match.start(), match.end()
    for start, end, strength in iter_gaps(text, lo):
        if end > hi:
            break
        yield strength, start, end


def _after_last_special_line(text: str, window_end: int, special_tokens: tuple[str, ...]) -> int:
    found = [text.rfind(token, 0, window_end) for token in special_tokens if token]
    last = max(found, default=-1)
    if last < 0:
        return 0
    newline = text.find("\n", last, window_end)
    return window_end if newline < 0 else newline + 1


def _before_first_special_line(
    text: str, window_start: int, special_tokens: tuple[str, ...]
) -> int:
    found = [i for token in special_tokens if token and (i := text.find(token, window_start)) >= 0]
    if not found:
        return len(text)
    return max(window_start, text.rfind("\n", window_start, min(found)) + 1)


def _grapheme_bounds(text: str, position: int) -> tuple[int, int]:
    """The grapheme-cluster starts just at/before and at/after `position`."""
    before = text.rfind("\n", 0, position) + 1  # a line break always ends a cluster
    for match in regex.finditer(r"\X", text, pos=before):
        if match.start() == position:
            return position, position
        if match.start() > position:
            return before, match.start()
        before = match.start()
    return before, len(text)


def _leading_space(text: str) -> int:
    return len(text) - len(text.lstrip())


def _trailing_space(text: str) -> int:
    return len(text) - len(text.rstrip())
