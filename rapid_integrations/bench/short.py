"""The short-prompt set: chat and agent-like turns with nothing to retrieve.

Most chat and agent traffic is short: a question, a few turns, a tool call and its result.
Every prompt here is far under the retrieval budget (at least 512 tokens), so C^S is the
whole prompt and the draft reads what the target reads: whatever RAPID's text adds to the
target's own is not knowledge from retrieval. Three kinds:

* ``question``: one user turn, "Answer briefly." and a question with a one-word answer;
* ``chat``: a few turns; the last asks about what the user said earlier;
* ``agent``: a system turn that lists tools and the JSON shape of a call; the user asks for
  something a tool gives (the answer is the call), or the conversation holds the call and
  its result and the answer reads the result.

Each record of the suite carries `same_text_as_lc` and `first_difference_from_lc`
(`attach_agreement`): whether its answer is `lc`'s text, and where the two first part, in
tokens of the target's tokenizer. Fixed prompts, no randomness, no model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .dataset import Task

SHORT_KINDS = ("question", "chat", "agent")
SHORT_CONTEXT = 256
"""The nominal length the set's records carry (`context_label`): every prompt is shorter
(tested), so it is under any retrieval budget."""
BRIEFLY = "Answer briefly."

TOOLS_SYSTEM = (
    "You are an assistant that can call tools. To call one, reply with only a JSON object "
    '{"tool": NAME, "arguments": {...}}. Tools: get_weather(city) gives the current weather '
    "of a city; search(query) searches the web. When you have a tool's result, answer the "
    "user in one sentence."
)
WEATHER_CALL = json.dumps({"tool": "get_weather", "arguments": {"city": "Paris"}})
WEATHER_RESULT = json.dumps({"city": "Paris", "temperature_c": 18, "sky": "sunny"})


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def _system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


PROMPTS: tuple[tuple[str, list[dict[str, str]], tuple[str, ...], str], ...] = (
    ("question", [_user(f"{BRIEFLY} What is the capital of France?")], ("Paris",), "contains"),
    ("question", [_user(f"{BRIEFLY} How many days are there in a week?")], ("7",), "count"),
    (
        "question",
        [_user(f"{BRIEFLY} Which planet is called the Red Planet?")],
        ("Mars",),
        "contains",
    ),
    ("question", [_user(f"{BRIEFLY} Who wrote Romeo and Juliet?")], ("Shakespeare",), "contains"),
    (
        "chat",
        [
            _user("Hi! My name is Sam and I live in Lisbon."),
            _assistant("Nice to meet you, Sam! How can I help you today?"),
            _user(f"{BRIEFLY} In which city do I live?"),
        ],
        ("Lisbon",),
        "contains",
    ),
    (
        "chat",
        [
            _user("I have 3 apples. I buy 2 more apples."),
            _assistant("Then you have 5 apples."),
            _user(f"I eat one of them. {BRIEFLY} How many apples do I have now?"),
        ],
        ("4",),
        "count",
    ),
    (
        "agent",
        [_system(TOOLS_SYSTEM), _user("What is the weather in Paris right now?")],
        ("get_weather", "Paris"),
        "contains",
    ),
    (
        "agent",
        [
            _system(TOOLS_SYSTEM),
            _user("What is the weather in Paris right now?"),
            _assistant(WEATHER_CALL),
            _user(f"Tool result: {WEATHER_RESULT}"),
        ],
        ("18",),
        "contains",
    ),
)
"""(kind, messages, references, scoring rule) of each prompt (`bench/scoring.py`)."""


def short_tasks() -> list[Task]:
    """The set's prompts as tasks (`short-KIND-I`, I counting within the kind), in order."""
    return [
        Task(f"short-{kind}-{index}", kind, SHORT_CONTEXT, messages, references, (), rule=rule)
        for i, (kind, messages, references, rule) in enumerate(PROMPTS)
        for index in [sum(p[0] == kind for p in PROMPTS[:i])]
    ]


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The position of the first token where two answers differ (where one ends while the
    other goes on, the shorter one's length); None when they are the same."""
    if list(ours) == list(theirs):
        return None
    same = (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
    return next(same, min(len(ours), len(theirs)))


def attach_agreement(records: list[dict[str, Any]], encode: Callable[[str], list[int]]) -> None:
    """Give each of one task's records `same_text_as_lc` (its answer is the `lc` record's)
    and `first_difference_from_lc` (`first_difference` of the two answers as `encode` splits
    them: the target's tokenizer, the same for every method); both None where lc did not
    run."""
    lc = next((r for r in records if r["method"] == "lc"), None)
    theirs = encode(lc["answer"]) if lc else None
    for record in records:
        same = None if lc is None else record["answer"] == lc["answer"]
        record["same_text_as_lc"] = same
        record["first_difference_from_lc"] = (
            None if theirs is None or same else first_difference(encode(record["answer"]), theirs)
        )
