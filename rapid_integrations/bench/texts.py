"""The kinds of text of the broad QA suite (`bench/suite.py`), generated offline from a seeded RNG.

* ``docs``: Python standard-library docstrings (`haystack.stdlib_paragraphs`), a run of
  consecutive ones from a seeded start, as in the standard QA set (`bench/dataset.py`);
* ``story``: narrative prose, paragraphs of sentences from templates about a small cast of
  characters walking, talking and working in a village;
* ``logs``: record-like text, blocks of syslog-style lines and short incident reports.

The generated kinds use word lists disjoint from those of the planted facts (`bench/suite.py`):
no subject, person or city of a fact, and no number of 1000 or more, occurs in their filler,
so every fact is the only sentence that answers its question.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from rapid_integrations.retrieval.base import TokenizerLike, count_text_tokens

from .dataset import haystack_pool, pick_paragraphs

TEXT_KINDS = ("docs", "story", "logs")

_CAST = ("Ada", "Bruno", "Celia", "Dmitri", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas")
_PLACES = (
    "the bakery", "the mill", "the river bank", "the old bridge", "the market square",
    "the chapel", "the school yard", "the bell tower", "the orchard road", "the ferry landing",
)  # fmt: skip
_THINGS = (
    "a basket of apples", "a lantern", "a bundle of letters", "a wooden flute", "a map",
    "a loaf of rye bread", "a jar of honey", "a fishing net", "a broken clock", "a red scarf",
)  # fmt: skip
_WEATHER = ("a cold wind", "a light rain", "thick fog", "bright sunshine", "a warm breeze")
_TIMES = ("At dawn", "Before noon", "In the afternoon", "At dusk", "Late that evening")
_MOODS = ("cheerful", "tired", "worried", "curious", "restless", "calm")
_STORY = (
    "{time}, {a} walked to {place} carrying {thing}.",
    "{a} met {b} near {place}, and they talked about the harvest for a while.",
    "The village was covered in {weather}, and {a} felt {mood}.",
    "{b} had not slept well, so {b} sat by the window and watched {place}.",
    "{a} asked {b} whether the ferry would run in {weather}.",
    "Nobody at {place} remembered who had left {thing} on the bench.",
    "{a} laughed at an old story that {b} told about {place}.",
    "{time}, the bells rang twice, and {a} hurried past {place}.",
    "{b} mended {thing} while {a} swept the floor of {place}.",
    "It was a {mood} day; even the dogs near {place} were quiet.",
    "{a} wrote a short note to {b} and left it under {thing}.",
    "{b} said that {place} had looked different when they were children.",
)  # fmt: skip

_HOSTS = ("node-3", "node-7", "edge-2", "db-1", "cache-5", "web-4")
_SERVICES = ("scheduler", "ingest", "billing", "search", "backup", "mailer")
_EVENTS = (
    "job {n} finished in {x}.{y} s (queue {queue}, retries {r})",
    "connection from 10.0.{r}.{n} accepted",
    "cache miss ratio {x}.{y} percent over the last {r} minutes",
    "worker {r} restarted after a timeout",
    "disk usage at {x} percent on volume {r}",
    "request {n} served in {x} ms with status 200",
    "config reloaded, {r} keys changed",
    "retrying upload of batch {n} (attempt {r})",
)  # fmt: skip
_LEVELS = ("INFO", "INFO", "INFO", "WARN", "DEBUG", "ERROR")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun")
_QUEUES = ("ingest", "reports", "email", "thumbnails")
_CAUSES = ("disk pressure", "a stuck lock", "a slow upstream", "an expired certificate")
_FIXES = ("rotating the logs", "restarting the worker", "raising the timeout", "a manual retry")


@dataclass(frozen=True)
class TextKind:
    """One kind of text: how it is named in a chat turn and how one paragraph is generated
    (None: the docstring haystack, paragraphs drawn from a fixed pool)."""

    name: str
    described_as: str
    paragraph: Callable[[random.Random], str] | None


def _story_paragraph(rng: random.Random) -> str:
    a, b = rng.sample(_CAST, 2)
    sentences = [
        template.format(
            a=a,
            b=b,
            place=rng.choice(_PLACES),
            thing=rng.choice(_THINGS),
            weather=rng.choice(_WEATHER),
            time=rng.choice(_TIMES),
            mood=rng.choice(_MOODS),
        )
        for template in rng.sample(_STORY, rng.randint(4, 7))
    ]
    return " ".join(sentences)


def _log_line(rng: random.Random) -> str:
    event = rng.choice(_EVENTS).format(
        n=rng.randrange(1, 1000),
        x=rng.randrange(1, 100),
        y=rng.randrange(10),
        r=rng.randrange(0, 10),
        queue=rng.choice(_QUEUES),
    )
    stamp = f"{rng.choice(_MONTHS)} {rng.randint(1, 28):2d} {rng.randrange(24):02d}:"
    stamp += f"{rng.randrange(60):02d}:{rng.randrange(60):02d}"
    service = f"{rng.choice(_SERVICES)}[{rng.randrange(100, 1000)}]"
    return f"{stamp} {rng.choice(_HOSTS)} {service}: {rng.choice(_LEVELS)} {event}"


def _logs_paragraph(rng: random.Random) -> str:
    if rng.random() < 0.25:
        return (
            f"Incident report {rng.randrange(1, 1000)}: {rng.choice(_CAUSES)} on "
            f"{rng.choice(_HOSTS)} slowed the {rng.choice(_SERVICES)} service for "
            f"{rng.randint(2, 90)} minutes; resolved by {rng.choice(_FIXES)}."
        )
    return "\n".join(_log_line(rng) for _ in range(rng.randint(4, 8)))


TEXTS = {
    kind.name: kind
    for kind in (
        TextKind("docs", "some documentation", None),
        TextKind("story", "a passage of a story", _story_paragraph),
        TextKind("logs", "some log output", _logs_paragraph),
    )
}


def paragraphs(
    kind: str, tokenizer: TokenizerLike, budget: int, rng: random.Random, per_item: int = 1
) -> list[str]:
    """Paragraphs of text `kind` totalling at most `budget` tokens, each costing its tokens
    plus `per_item` (the separator, or a chat turn's template), within a paragraph's worth of
    the budget."""
    make = TEXTS[kind].paragraph
    if make is None:
        pool = haystack_pool(tokenizer)
        return [pool.paragraphs[i] for i in pick_paragraphs(pool, budget, rng, per_item)]
    chosen: list[str] = []
    total = 0
    while True:
        paragraph = make(rng)
        cost = count_text_tokens(tokenizer, paragraph) + per_item
        if total + cost > budget:
            return chosen
        chosen.append(paragraph)
        total += cost
