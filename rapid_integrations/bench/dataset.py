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

from rapid_integrations.demo_data import demo_messages
from rapid_integrations.errors import RapidConfigError
from rapid_integrations.retrieval.base import TokenizerLike, count_tokens

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

ADJECTIVES = ("copper", "granite", "hollow", "marble", "northern", "quiet", "silver", "velvet")
NOUNS = ("compass", "harbor", "heron", "lantern", "meadow", "orchard", "raven", "willow")
SITES = ("archive", "depot", "gallery", "library", "station", "tower", "vault", "workshop")
CITIES = ("Lisbon", "Oslo", "Nairobi", "Quito", "Hanoi", "Perth", "Tunis", "Kyoto", "Lima")


@dataclass(frozen=True)
class Task:
    """One question over a long context.

    messages: the target's chat prompt; references: strings that must all appear in a correct
    answer (rule "contains"), the count (rule "count") or the abstention answer (rule
    "absent"; `bench/scoring.py`); facts: the planted sentences that answer the question (to
    check whether retrieval put them in C^S); context_label: the nominal length in tokens;
    followup: a second question on the same document, or None. Tasks of the broad suite
    (`bench/suite.py`) also give their text kind, split and seed; wrong: strings (another
    subject's code) an answer must not name; distractors: planted sentences that do not
    answer; absent: what an "absent" question asks about, which the text never names.
    """

    task_id: str
    kind: str
    context_label: int
    messages: list[dict[str, str]]
    references: tuple[str, ...]
    facts: tuple[str, ...]
    followup: Task | None = None
    rule: str = "contains"
    wrong: tuple[str, ...] = ()
    distractors: tuple[str, ...] = ()
    absent: str | None = None
    text_kind: str | None = None
    split: str | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Pool:
    """The haystack paragraphs and their token counts."""

    paragraphs: tuple[str, ...]
    tokens: tuple[int, ...]


@functools.lru_cache(maxsize=4)
def haystack_pool(tokenizer: TokenizerLike) -> Pool:
    paragraphs = tuple(stdlib_paragraphs())
    return Pool(paragraphs, tuple(count_tokens(tokenizer, list(paragraphs))))


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
    pool = haystack_pool(tokenizer)
    return [
        _make(kind, length, i, seed, pool)
        for length in lengths
        for kind in kinds
        for i in range(per_cell)
    ]


def content_budget(length: int) -> int:
    """Tokens of a `length`-token task left for its text, after `RESERVE_TOKENS` and
    `RESERVE_FRACTION` (at most a quarter of it)."""
    return length - min(RESERVE_TOKENS + int(length * RESERVE_FRACTION), length // 4)


def _make(kind: str, length: int, index: int, seed: int, pool: Pool) -> Task:
    rng = random.Random(f"{seed}:{kind}:{length}:{index}")
    task_id = f"{kind}-{length}-{index}"
    budget = content_budget(length)
    if kind == "single":
        return _single(task_id, length, rng, pool, budget)
    if kind == "two":
        return _two(task_id, length, rng, pool, budget)
    return _chat(task_id, length, rng, pool, budget)


def _subject(rng: random.Random) -> str:
    return f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(SITES)}"


def code_fact(subject: str, code: int | str) -> str:
    return f"The access code of {subject} is {code}."


def code_question(subject: str) -> str:
    return f"What is the access code of {subject}?"


def place_fact(subject: str, city: str) -> str:
    return f"{subject[0].upper()}{subject[1:]} is located in {city}."


def place_and_code_question(subject: str) -> str:
    return f"In which city is {subject} located, and what is its access code?"


def _single(task_id: str, length: int, rng: random.Random, pool: Pool, budget: int) -> Task:
    subject, code = _subject(rng), rng.randrange(1000, 10000)
    fact = code_fact(subject, code)
    document = _document(pool, budget, rng, [(fact, rng.uniform(0.05, 0.95))])
    messages = demo_messages(document, code_question(subject))
    return Task(task_id, "single", length, messages, (str(code),), (fact,))


def _two(task_id: str, length: int, rng: random.Random, pool: Pool, budget: int) -> Task:
    subject, code, city = _subject(rng), rng.randrange(1000, 10000), rng.choice(CITIES)
    place = place_fact(subject, city)
    fact = code_fact(subject, code)
    # One fact in each half of the document, so the two are never in the same passage.
    depths = [(place, rng.uniform(0.05, 0.45)), (fact, rng.uniform(0.55, 0.95))]
    document = _document(pool, budget, rng, depths)
    question = place_and_code_question(subject)
    followup = Task(
        f"{task_id}-followup",
        "two",
        length,
        demo_messages(document, code_question(subject)),
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


def _chat(task_id: str, length: int, rng: random.Random, pool: Pool, budget: int) -> Task:
    subject, code = _subject(rng), rng.randrange(1000, 10000)
    fact = code_fact(subject, code)
    indices = pick_paragraphs(pool, budget, rng, per_item=CHAT_TURN_TOKENS)
    turns = [documentation_turn(pool.paragraphs[i]) for i in indices]
    at = round(rng.uniform(0.05, 0.5) * len(turns))  # stated early: many turns before the end
    turns.insert(at, fact_turn(fact))
    question = f"Earlier I told you an access code. {code_question(subject)}"
    messages = chat_messages(CHAT_SYSTEM, turns, question)
    return Task(task_id, "chat", length, messages, (str(code),), (fact,))


Turn = tuple[dict[str, str], dict[str, str]]
"""A user message and the assistant's reply."""


def chat_messages(system: str, turns: Sequence[Turn], question: str) -> list[dict[str, str]]:
    """The chat prompt: `system`, the turn pairs in order, then `question` as the last user turn."""
    return [
        {"role": "system", "content": system},
        *(m for pair in turns for m in pair),
        {"role": "user", "content": question},
    ]


def documentation_turn(paragraph: str, described_as: str = "some documentation") -> Turn:
    """A user turn quoting a paragraph and an assistant reply with its first sentence."""
    first = re.split(r"(?<=[.!?])\s", paragraph.strip(), maxsplit=1)[0]
    reply = " ".join(first.split()[:30])
    return (
        {
            "role": "user",
            "content": f"Here is {described_as}:\n\n{paragraph}\n\nWhat is it about?",
        },
        {"role": "assistant", "content": f"It is about this: {reply}"},
    )


def fact_turn(fact: str) -> Turn:
    return (
        {"role": "user", "content": f"Please remember this for later: {fact}"},
        {"role": "assistant", "content": "Noted, I will remember it."},
    )


def pick_paragraphs(pool: Pool, budget: int, rng: random.Random, per_item: int = 1) -> list[int]:
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


def _document(pool: Pool, budget: int, rng: random.Random, facts: list[tuple[str, float]]) -> str:
    """Haystack paragraphs joined by blank lines, each fact inserted at its depth (0..1)."""
    return insert_facts([pool.paragraphs[i] for i in pick_paragraphs(pool, budget, rng)], facts)


def insert_facts(paragraphs: Sequence[str], facts: Sequence[tuple[str, float]]) -> str:
    """`paragraphs` joined by blank lines, each fact inserted as a paragraph at its depth (0..1)."""
    planted = list(paragraphs)
    for fact, depth in sorted(facts, key=lambda item: -item[1]):  # deepest first keeps offsets
        planted.insert(round(depth * len(planted)), fact)
    return "\n\n".join(planted)
