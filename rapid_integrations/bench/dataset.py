"""Long-context QA tasks generated offline and deterministically from stdlib docstrings.

Three task kinds, each at a nominal context length (2K, 4K, 8K tokens of the target's
tokenizer, question and answer room included):

* ``single``: one planted fact ("The access code of the copper heron depot is 4721.") and a
  question about it;
* ``two``: two facts about the same subject planted far apart (where it is, and its access
  code); the answer must combine them. Its ``followup`` asks a second question about the same
  document, for time-to-first-token on a repeated document;
* ``chat``: a long chat history of documentation turns; the user stated the fact many turns
  earlier and asks for it in the last turn (the paper's long chat-history setting).

The haystack is `haystack.stdlib_paragraphs()` (Python standard-library docstrings, the same for
a given Python version). Every task draws its own `random.Random` from (seed, kind, length,
index), so a task does not change when other tasks are added.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..demo_data import demo_messages
from ..errors import RapidConfigError
from ..retrieval.base import TokenizerLike, count_tokens
from .haystack import stdlib_paragraphs

TASK_KINDS = ("single", "two", "chat")
CONTEXT_LENGTHS = (2048, 4096, 8192)
RESERVE_TOKENS = 192
"""Tokens of a nominal length kept free for the system prompt, question, template and answer,
so an 8K task fits the embedded model's 8192-token window."""
RESERVE_FRACTION = 1 / 32
"""Further room, as a share of the length: paragraphs joined into one text take about 1.4%
more tokens than counted one by one (merges at the seams)."""
CHAT_TURN_TOKENS = 52
"""Template and wrapper tokens one documentation turn pair adds beyond its paragraph
(a conservative estimate; the exact prompt length is measured when the task runs)."""
CHAT_SYSTEM = "You are a helpful assistant. Answer from the conversation."

_ADJECTIVES = ("copper", "granite", "hollow", "marble", "northern", "quiet", "silver", "velvet")
_NOUNS = ("compass", "harbor", "heron", "lantern", "meadow", "orchard", "raven", "willow")
_SITES = ("archive", "depot", "gallery", "library", "station", "tower", "vault", "workshop")
_CITIES = ("Lisbon", "Oslo", "Nairobi", "Quito", "Hanoi", "Perth", "Tunis", "Kyoto", "Lima")


@dataclass(frozen=True)
class Task:
    """One question over a long context.

    messages: the target's chat prompt; references: strings that must all appear in a correct
    answer; facts: the planted sentences (to check whether retrieval put them in C^S);
    context_label: the nominal length in tokens; followup: a second question on the same
    document, or None.
    """

    task_id: str
    kind: str
    context_label: int
    messages: list[dict[str, str]]
    references: tuple[str, ...]
    facts: tuple[str, ...]
    followup: Task | None = None


@dataclass(frozen=True)
class _Pool:
    """The haystack paragraphs and their token counts."""

    paragraphs: tuple[str, ...]
    tokens: tuple[int, ...]


@functools.lru_cache(maxsize=4)
def _pool(tokenizer: TokenizerLike) -> _Pool:
    paragraphs = tuple(stdlib_paragraphs())
    return _Pool(paragraphs, tuple(count_tokens(tokenizer, list(paragraphs))))


def build_tasks(
    tokenizer: TokenizerLike,
    kinds: Sequence[str] = TASK_KINDS,
    lengths: Sequence[int] = CONTEXT_LENGTHS,
    per_cell: int = 1,
    seed: int = 0,
) -> list[Task]:
    """`per_cell` tasks for every (kind, nominal length), in length-major order."""
    unknown = set(kinds) - set(TASK_KINDS)
    if unknown:
        raise RapidConfigError(
            "kinds", f"unknown task kinds {sorted(unknown)}; known: {TASK_KINDS}"
        )
    pool = _pool(tokenizer)
    return [
        _make(kind, length, i, seed, pool)
        for length in lengths
        for kind in kinds
        for i in range(per_cell)
    ]


def _make(kind: str, length: int, index: int, seed: int, pool: _Pool) -> Task:
    rng = random.Random(f"{seed}:{kind}:{length}:{index}")
    task_id = f"{kind}-{length}-{index}"
    budget = length - min(RESERVE_TOKENS + int(length * RESERVE_FRACTION), length // 4)
    if kind == "single":
        return _single(task_id, length, rng, pool, budget)
    if kind == "two":
        return _two(task_id, length, rng, pool, budget)
    return _chat(task_id, length, rng, pool, budget)


def _subject(rng: random.Random) -> str:
    return f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_SITES)}"


def _code_fact(subject: str, code: int) -> str:
    return f"The access code of {subject} is {code}."


def _code_question(subject: str) -> str:
    return f"What is the access code of {subject}?"


def _single(task_id: str, length: int, rng: random.Random, pool: _Pool, budget: int) -> Task:
    subject, code = _subject(rng), rng.randrange(1000, 10000)
    fact = _code_fact(subject, code)
    document = _document(pool, budget, rng, [(fact, rng.uniform(0.05, 0.95))])
    messages = demo_messages(document, _code_question(subject))
    return Task(task_id, "single", length, messages, (str(code),), (fact,))


def _two(task_id: str, length: int, rng: random.Random, pool: _Pool, budget: int) -> Task:
    subject, code, city = _subject(rng), rng.randrange(1000, 10000), rng.choice(_CITIES)
    place = f"{subject[0].upper()}{subject[1:]} is located in {city}."
    fact = _code_fact(subject, code)
    # One fact in each half of the document, so the two are never in the same passage.
    depths = [(place, rng.uniform(0.05, 0.45)), (fact, rng.uniform(0.55, 0.95))]
    document = _document(pool, budget, rng, depths)
    question = f"In which city is {subject} located, and what is its access code?"
    followup = Task(
        f"{task_id}-followup",
        "two",
        length,
        demo_messages(document, _code_question(subject)),
        (str(code),),
        (fact,),
    )
    return Task(
        task_id,
        "two",
        length,
        demo_messages(document, question),
        (city, str(code)),
        (place, fact),
        followup,
    )


def _chat(task_id: str, length: int, rng: random.Random, pool: _Pool, budget: int) -> Task:
    subject, code = _subject(rng), rng.randrange(1000, 10000)
    fact = _code_fact(subject, code)
    indices = _pick(pool, budget, rng, per_item=CHAT_TURN_TOKENS)
    turns = [_documentation_turn(pool.paragraphs[i]) for i in indices]
    at = round(rng.uniform(0.05, 0.5) * len(turns))  # stated early: many turns before the end
    turns.insert(at, _fact_turn(fact))
    question = f"Earlier I told you an access code. {_code_question(subject)}"
    messages = [
        {"role": "system", "content": CHAT_SYSTEM},
        *(m for pair in turns for m in pair),
        {"role": "user", "content": question},
    ]
    return Task(task_id, "chat", length, messages, (str(code),), (fact,))


def _documentation_turn(paragraph: str) -> tuple[dict[str, str], dict[str, str]]:
    """A user turn quoting a docstring and an assistant reply with its first sentence."""
    first = re.split(r"(?<=[.!?])\s", paragraph.strip(), maxsplit=1)[0]
    reply = " ".join(first.split()[:30])
    return (
        {
            "role": "user",
            "content": f"Here is some documentation:\n\n{paragraph}\n\nWhat is it about?",
        },
        {"role": "assistant", "content": f"It is about this: {reply}"},
    )


def _fact_turn(fact: str) -> tuple[dict[str, str], dict[str, str]]:
    return (
        {"role": "user", "content": f"Please remember this for later: {fact}"},
        {"role": "assistant", "content": "Noted, I will remember it."},
    )


def _pick(pool: _Pool, budget: int, rng: random.Random, per_item: int = 1) -> list[int]:
    """Indices of consecutive paragraphs (from a seeded start, wrapping) totalling at most
    `budget` tokens, each costing its tokens plus `per_item`; paragraphs that would overflow
    are skipped, so the total lands within a paragraph's worth of the budget."""
    n = len(pool.paragraphs)
    start, total, chosen = rng.randrange(n), 0, []
    for k in range(n):
        i = (start + k) % n
        cost = pool.tokens[i] + per_item
        if total + cost <= budget:
            chosen.append(i)
            total += cost
    if total < budget // 2:
        raise RapidConfigError(
            "lengths", f"the stdlib haystack is too small for a {budget}-token context"
        )
    return chosen


def _document(pool: _Pool, budget: int, rng: random.Random, facts: list[tuple[str, float]]) -> str:
    """Haystack paragraphs joined by blank lines, each fact inserted at its depth (0..1)."""
    paragraphs = [pool.paragraphs[i] for i in _pick(pool, budget, rng)]
    for fact, depth in sorted(facts, key=lambda item: -item[1]):  # deepest first keeps offsets
        paragraphs.insert(round(depth * len(paragraphs)), fact)
    return "\n\n".join(paragraphs)
