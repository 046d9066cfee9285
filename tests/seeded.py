"""Many seeded calls of one engine, for the sampling-law tests (docs/algorithm.md section 4).

The calls are decoded together by a `BatchRunner` (section 14), a few dozen per forward pass,
which on the tiny models is several times faster than one `generate` after another. A batched
call's output is its own `generate`'s (tests/test_batch.py); the first `CHECKED` seeds are
compared with `generate` here too, token for token, so a law the batch follows is the law of
the single-call path as well, and a bug on either path alone fails the comparison.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rapid_integrations import RapidEngine
from rapid_integrations.batching.runner import BatchRunner

BATCH = 48  # calls per runner: the fastest of 8 / 48 / 240 on the tiny models
CHECKED = 6


def seeded_token_ids(
    engine: RapidEngine, prompts: tuple[str, str], n: int, **overrides: Any
) -> list[list[int]]:
    """The token ids emitted with seeds 0 .. n-1, one list per seed."""
    emitted: list[list[int]] = []
    for start in range(0, n, BATCH):
        runner = BatchRunner(engine)
        seeds = range(start, min(n, start + BATCH))
        ids = [runner.submit(*prompts, seed=seed, **overrides) for seed in seeds]
        runner.run()
        for i in ids:
            if i in runner.errors:
                raise runner.errors[i]
            emitted.append(runner.outputs[i].token_ids)
    for seed in range(min(n, CHECKED)):
        alone = engine.generate(*prompts, seed=seed, **overrides).token_ids
        assert emitted[seed] == alone, (seed, emitted[seed], alone)
    return emitted


def position_counts(
    engine: RapidEngine, prompts: tuple[str, str], n: int, positions: int = 2, **overrides: Any
) -> np.ndarray:
    """Counts [positions, V] of the token emitted at each of the first `positions` places over
    seeds 0 .. n-1."""
    return counted(
        seeded_token_ids(engine, prompts, n, **overrides), len(engine.tokenizer), positions
    )


def counted(emitted: list[list[int]], vocab: int, positions: int = 2) -> np.ndarray:
    """Counts [positions, vocab] of the token each output of `emitted` has at each of its
    first `positions` places."""
    counts = np.zeros((positions, vocab))
    for token_ids in emitted:
        for position in range(positions):
            counts[position, token_ids[position]] += 1
    return counts
