"""Which verify rows may lean toward the draft (`eta_rule="grounded"`, docs/algorithm.md
section 2.3): only where the draft's top token continues a run of C^S.

The lean eta (q - p) exists to bring in what the draft read in C^S and the target missed. A
row whose top draft token, after the `order - 1` tokens before it, occurs in the draft's
context is the draft copying what it read; any other row's q is the draft's own guess, and
leaning toward it carries the draft's errors (a quantized copy's included), not knowledge.
"""

from __future__ import annotations

import torch

ORDER = 3
"""Tokens in a run: the two before the row's position and the draft's top token there."""


class Grounding:
    """The runs of C^S and the committed sequence's last tokens, for one call.

    context: the draft's ids (C^S and its prompt); sequence: the target's ids so far (the
    prompt), whose last `order - 1` start the first row's run; `commit` extends it.
    """

    def __init__(self, context: list[int], sequence: list[int], order: int = ORDER) -> None:
        self._order = order
        self.read(context)
        self._tail = sequence[-(order - 1) :]

    def read(self, context: list[int]) -> None:
        """The draft reads `context` (its ids) from now on: its runs replace the last's."""
        order = self._order
        self._runs = {tuple(context[i : i + order]) for i in range(len(context) - order + 1)}

    def rows(self, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Which of q's rows lean: x [gamma] the drafts, q [gamma or gamma + 1, V] their
        distributions (row i predicts the token after the sequence and x[:i]). Returns a bool
        tensor [len(q)] on q's device: True where argmax q_i continues a run of C^S."""
        tops = q.argmax(-1).tolist()
        seq = self._tail + x.tolist()
        width = self._order - 1
        grounded = [(*seq[i : i + width], top) in self._runs for i, top in enumerate(tops)]
        return torch.tensor(grounded, dtype=torch.bool, device=q.device)

    def commit(self, tokens: list[int]) -> None:
        """Extend the sequence by one pass's committed `tokens`."""
        self._tail = (self._tail + tokens)[-(self._order - 1) :]
