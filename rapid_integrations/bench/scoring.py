"""Answer checking: exact match (every reference inside the answer) and SQuAD-style token F1.

Answers of chat models are sentences ("The access code is 4721."), so exact match is the
containment form used by needle benchmarks (RULER's string match, all references required):
each reference's normalized words must appear as a contiguous run in the normalized answer.
Token F1 is SQuAD's: word overlap between the answer and the references joined, which also
rewards partial answers of two-fact questions and penalizes padding.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Sequence

_ARTICLES = frozenset({"a", "an", "the"})


def normalize_words(text: str) -> list[str]:
    """Lowercase words of `text` without punctuation or articles (SQuAD normalization)."""
    folded = unicodedata.normalize("NFKC", text).lower()
    return [word for word in re.findall(r"\w+", folded) if word not in _ARTICLES]


def _contains(words: list[str], run: list[str]) -> bool:
    """True when `run` occurs as a contiguous slice of `words` (an empty run never does)."""
    n = len(run)
    return n > 0 and any(words[i : i + n] == run for i in range(len(words) - n + 1))


def exact_match(prediction: str, references: Sequence[str]) -> float:
    """1.0 when every reference appears in the prediction (normalized words), else 0.0."""
    words = normalize_words(prediction)
    found = all(_contains(words, normalize_words(ref)) for ref in references)
    return 1.0 if references and found else 0.0


def token_f1(prediction: str, references: Sequence[str]) -> float:
    """SQuAD token F1 between the prediction and all references joined, in [0, 1]."""
    predicted = normalize_words(prediction)
    gold = normalize_words(" ".join(references))
    overlap = sum((Counter(predicted) & Counter(gold)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(gold)
    return 2 * precision * recall / (precision + recall)
