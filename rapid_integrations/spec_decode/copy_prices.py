"""Which of a lookup's copies a draft pass reads (docs/algorithm.md section 2.10): those whose
chance of being kept pays for the token each adds to the pass."""

from __future__ import annotations

from rapid_integrations.spec_decode.schedule import RunCurve


class CopyPrices:
    """How many of a lookup's copies a draft forward pass reads (docs/algorithm.md section
    2.10). A copy the draft keeps saves the forward pass that would have picked it; every copy
    read, kept or not, adds its share to the pass that reads it. So copy j is read while the
    chance that copies 0..j are all kept is at least the draft's token price `price` (what a
    token adds to a pass over a one-token pass's seconds, measured once per engine:
    `drafting.token_price`); the chances from a `RunCurve` over recent lookups (each a run cut
    at its first copy not kept). Every copy is read at a price below `FREE`, or unpriced
    (None: off the CPU, and for a seeded sampled call, `ModelProposer`).

    A lookup not read is still learned from: the draft's own pick at its first copy's
    position is that copy with the chance the draft would have kept it (greedy: iff it is the
    argmax; sampled: q(copy)), which the proposer reports as a run of one
    (`ModelProposer.commit`), so a lookup that starts paying is read again.
    """

    FREE = 0.05
    """A token price below which every copy is read: ten copies then cost under half a pass,
    and a price near some copy's chance could read that copy on one engine and not on another
    (the tiny test models' prices measured 0.016-0.027; SmolLM2-135M's int4 draft with native
    bf16 0.10-0.13, its bf16-weight draft on AVX2 0.34)."""

    def __init__(self, most: int, price: float | None) -> None:
        self._curve = RunCurve(most)
        self._price = price

    def learn(self, offered: int, kept: int) -> None:
        """A lookup's `offered` copies, of which the draft kept the first `kept`."""
        self._curve.learn(offered, kept)

    def worth(self, room: int) -> int:
        """How many of up to `room` copies to read."""
        if self._price is None or self._price < self.FREE:
            return room
        return sum(chance >= self._price for chance in self._curve.kept_chances(room))
