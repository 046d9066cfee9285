"""The prompts of the speed-only suites (`--speed-kinds`), by kind.

* ``single``: the single-needle QA prompt of `bench/dataset.py` (answers repeat a sentence
  of the document: the best case of copying drafts, the lookup proposer and prompt lookup);
* ``rewrite``: free-form writing over the same haystack: the document at the nominal length
  and the instruction to rewrite one of its paragraphs in other words, so a good answer
  copies no run of the prompt (the case where copies cannot help and drafting rests on the
  model draft alone, where the default must still not lose to lc).

Tasks are drawn from `random.Random` of (seed, kind, length) alone, so a task does not change
when other kinds or lengths are added. Imports nothing heavy (no torch, no model).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rapid_integrations.config import check_choice
from rapid_integrations.demo_data import demo_messages
from rapid_integrations.retrieval.base import TokenizerLike

from .dataset import Pool, Task, build_tasks, content_budget, haystack_pool, pick_paragraphs

SPEED_KINDS = ("single", "rewrite")
REWRITE_SYSTEM = "You rewrite passages of documents in your own words."
REWRITE_QUOTED_WORDS = 8
"""Words of the paragraph's opening the instruction quotes to name it."""
REWRITE_MIN_CHARS = 400
"""A paragraph to rewrite is at least this long: enough text for a free-form answer."""


def build_speed_tasks(
    tokenizer: TokenizerLike, kinds: Sequence[str], lengths: Sequence[int], seed: int = 0
) -> list[Task]:
    """One task of each kind at each nominal length, in length-major order."""
    for kind in kinds:
        check_choice("speed_kinds", kind, SPEED_KINDS)
    pool = haystack_pool(tokenizer)
    return [
        build_tasks(tokenizer, ("single",), (length,), 1, seed)[0]
        if kind == "single"
        else rewrite_task(pool, length, seed)
        for length in lengths
        for kind in kinds
    ]


def rewrite_task(pool: Pool, length: int, seed: int = 0) -> Task:
    """The haystack at `length` tokens and the instruction to rewrite one of its paragraphs
    (drawn among those of at least `REWRITE_MIN_CHARS`, in the middle half of the document)
    in other words. `facts` holds that paragraph (whether retrieval kept it in C^S)."""
    rng = random.Random(f"{seed}:rewrite:{length}")
    paragraphs = [pool.paragraphs[i] for i in pick_paragraphs(pool, content_budget(length), rng)]
    middle = range(len(paragraphs) // 4, max(len(paragraphs) // 4 + 1, 3 * len(paragraphs) // 4))
    long_enough = [i for i in middle if len(paragraphs[i]) >= REWRITE_MIN_CHARS]
    chosen = paragraphs[rng.choice(long_enough or list(middle))]
    opening = " ".join(chosen.split()[:REWRITE_QUOTED_WORDS])
    instruction = (
        f'Rewrite the paragraph that begins "{opening}" in your own words, for a reader new '
        "to Python. Keep its meaning, but do not copy its sentences or phrases: use other "
        "words and another order."
    )
    messages = demo_messages("\n\n".join(paragraphs), instruction, REWRITE_SYSTEM)
    return Task(f"rewrite-{length}-0", "rewrite", length, messages, (chosen,), (chosen,))
