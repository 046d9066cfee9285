"""Answer checking: exact match (every reference inside the answer) and SQuAD-style token F1.

Answers of chat models are sentences ("The access code is 4721."), so exact match is the
containment form used by needle benchmarks (RULER's string match, all references required):
each reference's normalized words must appear as a contiguous run in the normalized answer.
Token F1 is SQuAD's: word overlap between the answer and the references joined, which also
rewards partial answers of two-fact questions and penalizes padding.

`score` applies a task's rule (`RULES`): "contains" is exact match; "count" wants the right
number (digits or a word) as the first number of the answer; "absent" wants an abstention
(a negation such as "not in the document", "no information", "unknown"). Under every rule an
answer that names one of the task's `wrong` strings (another subject's code) scores 0.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Sequence

_ARTICLES = frozenset({"a", "an", "the"})
RULES = ("contains", "count", "absent")
NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
)  # fmt: skip
"""Number words read as counts, at their value's index."""
ABSTAIN_WORDS = frozenset({"not", "no", "cannot", "unknown", "none", "neither", "nowhere"})
"""Words of an answer that declines: "not in the document", "no information", "I cannot
find it" ("n't" is read as "not")."""


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


def first_number(prediction: str) -> int | None:
    """The first number of `prediction`, in digits or as a word of `NUMBER_WORDS`, or None."""
    for word in normalize_words(prediction):
        if word.isdecimal():
            return int(word)
        if word in NUMBER_WORDS:
            return NUMBER_WORDS.index(word)
    return None


def abstains(prediction: str) -> bool:
    """Whether `prediction` declines to answer (holds a word of `ABSTAIN_WORDS`)."""
    spelled = re.sub(r"n[’']t\b", " not", prediction, flags=re.IGNORECASE)
    return not ABSTAIN_WORDS.isdisjoint(normalize_words(spelled))


def score(
    prediction: str, references: Sequence[str], rule: str = "contains", wrong: Sequence[str] = ()
) -> float:
    """1.0 when `prediction` is right under `rule` (module docstring) and names none of
    `wrong`, else 0.0."""
    words = normalize_words(prediction)
    if any(_contains(words, normalize_words(w)) for w in wrong):
        return 0.0
    if rule == "count":
        return 1.0 if first_number(prediction) == int(references[0]) else 0.0
    if rule == "absent":
        return 1.0 if abstains(prediction) else 0.0
    return exact_match(prediction, references)
