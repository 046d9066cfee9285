"""The broad QA suite (`rapid bench --suite broad`): every kind of text by every kind of question.

Texts (`bench/texts.py`): ``docs`` (stdlib docstrings), ``story`` (generated narrative prose),
``logs`` (generated log lines and incident reports). Questions (`QUESTION_KINDS`):

* ``single``: one planted fact ("The access code of the copper heron depot is 4721.");
* ``two``: two facts about one subject in different halves (its city, its access code);
* ``hop``: a two-step fact: "The key to S is kept by P." in one half names the person whose
  badge number, in the other half, is the answer; two other people's badge numbers are planted
  too, and naming one is wrong;
* ``absent``: the code of a subject the text never names, while a near namesake's code is
  planted (same noun and site, another adjective); the right answer says it is not there;
* ``chat``: the text as a long chat of turns quoting its paragraphs; the user stated the fact
  early on and asks for it in the last turn;
* ``count``: 2 to 5 people signed one subject's guest book, spread over the whole text (and
  one person another's); the answer is how many.

Every prompt's system turn asks to answer "not in the document" when the text does not say,
for every kind alike, so the instruction does not tell which question has no answer.

A task is drawn from `random.Random` of (text kind, question kind, length, seed) alone, so it
never changes when other tasks or settings change. Seeds split the tasks: even seeds are the
**dev** half, odd seeds the **test** half (`task_seed`, `split_of`); rules are chosen on dev.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rapid_integrations.config import check_choice
from rapid_integrations.demo_data import demo_messages
from rapid_integrations.errors import RapidConfigError
from rapid_integrations.retrieval.base import TokenizerLike, count_tokens

from .dataset import (
    ADJECTIVES,
    CHAT_TURN_TOKENS,
    CITIES,
    CONTEXT_LENGTHS,
    NOUNS,
    SITES,
    Task,
    Turn,
    chat_messages,
    code_fact,
    code_question,
    content_budget,
    documentation_turn,
    fact_turn,
    insert_facts,
    place_and_code_question,
    place_fact,
)
from .texts import TEXT_KINDS, TEXTS, paragraphs

QUESTION_KINDS = ("single", "two", "hop", "absent", "chat", "count")
SPLITS = ("dev", "test")
ABSENT_ANSWER = "not in the document"
DOCUMENT_SYSTEM = (
    "You answer questions about documents. If the document does not give the answer, "
    f"say that it is {ABSENT_ANSWER}."
)
CHAT_SUITE_SYSTEM = (
    "You are a helpful assistant. Answer from the conversation. If the conversation does not "
    "give the answer, say that it is not in the conversation."
)
_FIRST = ("Marta", "Tomasz", "Yuki", "Olu", "Priya", "Sven", "Leila", "Mateo", "Anouk", "Kofi")
_LAST = ("Okafor", "Lindqvist", "Haddad", "Moreau", "Tanaka", "Novak", "Ferreira", "Castillo")
"""Names of the people in facts; none is a name of the story's cast (`bench/texts.py`)."""


def task_seed(split: str, index: int) -> int:
    """The seed of the `index`-th task of a cell in `split`: dev even, test odd."""
    check_choice("split", split, SPLITS)
    return 2 * index + SPLITS.index(split)


def split_of(seed: int) -> str:
    """The half a task seed belongs to."""
    return SPLITS[seed % 2]


def build_suite(
    tokenizer: TokenizerLike,
    split: str,
    texts: Sequence[str] = TEXT_KINDS,
    kinds: Sequence[str] = QUESTION_KINDS,
    lengths: Sequence[int] = CONTEXT_LENGTHS,
    per_cell: int = 10,
) -> list[Task]:
    """`per_cell` tasks of `split` for every (text kind, question kind), index-major (a run cut
    short has covered every cell alike); the i-th task of a cell is `lengths[i % len]` long."""
    for name, given, known in (("texts", texts, TEXT_KINDS), ("kinds", kinds, QUESTION_KINDS)):
        unknown = set(given) - set(known)
        if unknown:
            raise RapidConfigError(name, f"unknown {name} {sorted(unknown)}; known: {known}")
    return [
        make_task(tokenizer, text, kind, lengths[i % len(lengths)], task_seed(split, i))
        for i in range(per_cell)
        for text in texts
        for kind in kinds
    ]


@dataclass(frozen=True)
class _Plan:
    """What a question plants and asks: sentences at depths (0..1), and how it is scored."""

    question: str
    references: tuple[str, ...]
    facts: tuple[tuple[str, float], ...]
    distractors: tuple[tuple[str, float], ...] = ()
    rule: str = "contains"
    wrong: tuple[str, ...] = ()
    absent: str | None = None


_RUN = 4
"""The longest value drawn, in words ("the copper heron depot")."""


class _Draw:
    """The task's RNG and the names and numbers it has drawn: a draw is new, and not a word
    (or run of words) of the filler text, so no two facts share a name and the filler never
    answers a question."""

    def __init__(self, rng: random.Random, filler: str) -> None:
        self.rng, self.filler = rng, filler
        self.used: set[str] = set()

    @functools.cached_property
    def spans(self) -> dict[tuple[str, ...], list[tuple[int, int]]]:
        """Where each run of up to _RUN words of the filler starts and ends (character
        offsets), by its words. Built on the first draw the filler holds as a substring: a
        regex scan of the whole filler per draw took seconds where it names most candidates."""
        spans: dict[tuple[str, ...], list[tuple[int, int]]] = {}
        found = list(re.finditer(r"\w+", self.filler))
        words = [m.group() for m in found]
        for n in range(1, _RUN + 1):
            for i in range(len(found) - n + 1):
                span = (found[i].start(), found[i + n - 1].end())
                spans.setdefault(tuple(words[i : i + n]), []).append(span)
        return spans

    def _named(self, value: str) -> bool:
        """True when `value` occurs in the filler as a word or run of words: for a value that
        starts and ends on a word character, exactly where its own words run over a span whose
        text is the value."""
        if value not in self.filler:
            return False
        words = tuple(re.findall(r"\w+", value))
        if len(words) > _RUN or not re.fullmatch(r"\w(.*\w)?", value, re.DOTALL):
            return re.search(rf"(?<!\w){re.escape(value)}(?!\w)", self.filler) is not None
        return any(self.filler[a:b] == value for a, b in self.spans.get(words, ()))

    def _fresh(self, make: Callable[[], str]) -> str:
        while True:
            value = make()
            if value not in self.used and not self._named(value):
                self.used.add(value)
                return value

    def number(self) -> str:
        return self._fresh(lambda: str(self.rng.randrange(1000, 10000)))

    def city(self) -> str:
        return self._fresh(lambda: self.rng.choice(CITIES))

    def person(self) -> str:
        return self._fresh(lambda: f"{self.rng.choice(_FIRST)} {self.rng.choice(_LAST)}")

    def subject(self, noun: str | None = None, site: str | None = None) -> str:
        """A new subject, "the copper heron depot"; with `noun` and `site`, a namesake."""
        rng = self.rng
        return self._fresh(
            lambda: (
                f"the {rng.choice(ADJECTIVES)} {noun or rng.choice(NOUNS)} "
                f"{site or rng.choice(SITES)}"
            )
        )

    def depth(self, low: float = 0.05, high: float = 0.95) -> float:
        return self.rng.uniform(low, high)


def _single(draw: _Draw) -> _Plan:
    subject, code = draw.subject(), draw.number()
    fact = (code_fact(subject, code), draw.depth())
    return _Plan(code_question(subject), (code,), (fact,))


def _two(draw: _Draw) -> _Plan:
    subject, code, city = draw.subject(), draw.number(), draw.city()
    # One fact in each half of the text, so the two are never in the same passage.
    place = (place_fact(subject, city), draw.depth(0.05, 0.45))
    facts = (place, (code_fact(subject, code), draw.depth(0.55, 0.95)))
    return _Plan(place_and_code_question(subject), (city, code), facts)


def _hop(draw: _Draw) -> _Plan:
    subject, keeper = draw.subject(), draw.person()
    badges = {person: draw.number() for person in (keeper, draw.person(), draw.person())}
    first, second = [draw.depth(0.05, 0.45), draw.depth(0.55, 0.95)]  # in different halves
    if draw.rng.random() < 0.5:  # the link comes first or second
        first, second = second, first
    link = (f"The key to {subject} is kept by {keeper}.", first)
    answer = (f"The badge number of {keeper} is {badges[keeper]}.", second)
    others = tuple(
        (f"The badge number of {person} is {badge}.", draw.depth())
        for person, badge in badges.items()
        if person != keeper
    )
    question = f"What is the badge number of the person who keeps the key to {subject}?"
    wrong = tuple(badge for person, badge in badges.items() if person != keeper)
    return _Plan(question, (badges[keeper],), (link, answer), others, wrong=wrong)


def _absent(draw: _Draw) -> _Plan:
    planted = draw.subject()
    _, _, noun, site = planted.split()
    asked, code = draw.subject(noun, site), draw.number()
    distractor = (code_fact(planted, code), draw.depth())
    return _Plan(
        code_question(asked),
        (ABSENT_ANSWER,),
        (),
        (distractor,),
        rule="absent",
        wrong=(code,),
        absent=asked,
    )


def _chat(draw: _Draw) -> _Plan:
    subject, code = draw.subject(), draw.number()
    fact = (code_fact(subject, code), draw.depth(0.05, 0.5))  # stated many turns before the end
    question = f"Earlier I told you an access code. {code_question(subject)}"
    return _Plan(question, (code,), (fact,))


def _count(draw: _Draw) -> _Plan:
    subject, other = draw.subject(), draw.subject()
    count = draw.rng.randint(2, 5)
    facts = tuple(
        (f"{draw.person()} signed the guest book of {subject}.", (i + draw.depth(0.1, 0.9)) / count)
        for i in range(count)
    )
    distractor = (f"{draw.person()} signed the guest book of {other}.", draw.depth())
    question = f"How many people signed the guest book of {subject}?"
    return _Plan(question, (str(count),), facts, (distractor,), rule="count")


_PLANS = {
    "single": _single,
    "two": _two,
    "hop": _hop,
    "absent": _absent,
    "chat": _chat,
    "count": _count,
}


MESSAGE_TEMPLATE_TOKENS = 6
"""Tokens a chat template adds around one message (SmolLM2's: 5)."""


def _fit(tokenizer: TokenizerLike, turns: list[Turn], budget: int) -> list[Turn]:
    """`turns` without the last ones that take them past `budget` tokens, template included:
    a reply quotes up to 30 words, which in log lines cost more than `CHAT_TURN_TOKENS` allows."""
    costs = count_tokens(tokenizer, [user["content"] + reply["content"] for user, reply in turns])
    while turns and sum(costs) + 2 * MESSAGE_TEMPLATE_TOKENS * len(costs) > budget:
        turns, costs = turns[:-1], costs[:-1]
    return turns


def make_task(tokenizer: TokenizerLike, text: str, kind: str, length: int, seed: int) -> Task:
    """The task of (text kind, question kind, nominal length, seed): its text first, then what
    the question plants in it (numbers and names the text does not hold)."""
    rng = random.Random(f"broad:{text}:{kind}:{length}:{seed}")
    per_item = CHAT_TURN_TOKENS if kind == "chat" else 1
    budget = content_budget(length)
    filler = paragraphs(text, tokenizer, budget, rng, per_item)
    plan = _PLANS[kind](_Draw(rng, "\n".join(filler)))
    planted = [*plan.facts, *plan.distractors]
    if kind == "chat":
        turns = [documentation_turn(p, TEXTS[text].described_as) for p in filler]
        turns = _fit(tokenizer, turns, budget)
        for fact, depth in planted:
            turns.insert(round(depth * len(turns)), fact_turn(fact))
        messages = chat_messages(CHAT_SUITE_SYSTEM, turns, plan.question)
    else:
        document = insert_facts(filler, planted)
        messages = demo_messages(document, plan.question, DOCUMENT_SYSTEM)
    return Task(
        f"{text}-{kind}-{length}-s{seed}",
        kind,
        length,
        messages,
        plan.references,
        tuple(fact for fact, _ in plan.facts),
        rule=plan.rule,
        wrong=plan.wrong,
        distractors=tuple(sentence for sentence, _ in plan.distractors),
        absent=plan.absent,
        text_kind=text,
        split=split_of(seed),
        seed=seed,
    )
