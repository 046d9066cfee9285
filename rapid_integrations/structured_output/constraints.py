"""What one model's raw logits go through before p or q is formed: the repetition penalty
(docs/algorithm.md section 9) and the grammar mask (section 10).

The target and the draft each hold a `Constraints` for the call, built from the same history
and grammar, so that p and q (and therefore p_hat) are shaped identically. A block's rows are
positions in order: row i follows the committed sequence, the tokens already advanced over in
this block (the tail), then `drafts[:i]`. The grammar matcher is advanced over the same
tokens, so row i gets the mask of its own position; `settle` rolls it back to what the
verdict kept and advances it by the emitted token.

With a reasoning section (docs/algorithm.md section 13) the grammar reads no token of it: rows
inside it are unmasked, and the matcher starts from its start state at the first row after
the end marker. Before anything is decided the first row also allows the start marker's first
token, and rows inside the start marker allow only its next token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from rapid_integrations.config import RapidConfig
from rapid_integrations.errors import GrammarError, RapidError
from rapid_integrations.sample.sampling import check_finite, penalize
from rapid_integrations.structured_output.sections import ANSWER, Gate, Place

if TYPE_CHECKING:
    import xgrammar as xgr


class Constraints:
    """The per-call logit shaping of one model.

    history: the token ids the repetition penalty counts as seen (the target's prompt: the
    draft shares it, so that q is shaped exactly as p); vocab: the shared vocabulary width;
    matcher: a fresh xgrammar matcher of the call's grammar, or None; gate: the call's
    reasoning section (None: none), which the matcher does not read. `seconds` is the time
    spent on the grammar (masks, matcher moves).
    """

    def __init__(
        self,
        history: Sequence[int],
        vocab: int,
        cfg: RapidConfig,
        device: torch.device,
        source: str = "the model",
        matcher: xgr.GrammarMatcher | None = None,
        gate: Gate | None = None,
    ) -> None:
        self._penalty = cfg.repetition_penalty
        self._source = source
        self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self._seen[torch.tensor(list(history), dtype=torch.long, device=device)] = True
        self._tail: list[int] = []  # tokens advanced over in this block, not yet settled
        self._matcher = matcher
        self._gate = gate
        self._place = gate.first if gate else ANSWER  # after the tail
        self._places: list[Place] = []  # the place before each tail token
        self._moves: list[bool] = []  # whether the matcher accepted each tail token
        self._live = matcher is not None  # False once the matcher refused or terminated
        self.seconds = 0.0
        if matcher is not None:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(cfg.gamma + 1, vocab)

    def apply(self, z: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Shaped logits of a block: z [k, V] raw, drafts [k - 1] ids; returns a new [k, V].

        Row i follows the tail and drafts[:i]; afterwards the drafts are part of the tail.
        """
        check_finite(z, self._source)
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        ids = drafts.tolist()
        if self._penalty != 1.0:
            z = penalize(z, self._seen_rows(ids, z.shape[0]), self._penalty)
        if self._matcher is not None:
            z = self._mask(z, ids)
        else:
            self._tail += ids
        return z

    def advance(self, tokens: torch.Tensor) -> None:
        """The draft picked `tokens` [k]: later rows follow them too."""
        start = time.perf_counter()
        for token in tokens.tolist():
            self._accept(token)
        self.seconds += time.perf_counter() - start

    def settle(self, kept: int, token: torch.Tensor) -> None:
        """The first `kept` tail tokens were kept, then `token` [1] was emitted."""
        start = time.perf_counter()
        committed = [*self._tail[:kept], *token.tolist()]
        self._seen[torch.tensor(committed, dtype=torch.long, device=self._seen.device)] = True
        self._tail = []
        if self._matcher is not None:
            self._matcher.rollback(sum(self._moves[kept:]))
            if kept < len(self._places):
                self._place = self._places[kept]
            self._places, self._moves = [], []
            self._live = not self._matcher.is_terminated()
            for t in token.tolist():
                self._accept(t)
            if not (self._live or self._matcher.is_terminated()):
                raise RapidError(
                    f"internal: the grammar refused the emitted token {token.tolist()}"
                )
            self._tail, self._places, self._moves = [], [], []
        self.seconds += time.perf_counter() - start

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was emitted."""
        return self._matcher is not None and self._matcher.is_terminated()

    def _accept(self, token: int) -> None:
        """Advance the matcher over one tail token, unless the token belongs to the reasoning
        section; after a refusal it stays where it was."""
        self._tail.append(token)
        place = self._place
        self._places.append(place)
        moved = False
        if self._gate is not None and place.phase != "after":
            self._place = self._gate.step(place, token)
            if place.phase == "inside" or self._gate.opens(place, token):
                self._moves.append(moved)
                return
        if self._live and self._matcher is not None and self._matcher.accept_token(token):
            moved = True
            self._live = not self._matcher.is_terminated()
        else:
            self._live = False
        self._moves.append(moved)

    def _mask(self, z: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """Mask row i of z [k, V] to the tokens the grammar allows after the tail and
        drafts[:i], advancing the matcher over the drafts. Rows after a refused or final token
        repeat the last mask: the verdict can never keep a draft past such a token."""
        import xgrammar as xgr

        start = time.perf_counter()
        k = z.shape[0]
        for i in range(k):
            if self._place.phase == "inside":
                self._bitmask[i] = -1  # every bit set: the grammar does not read the section
            elif self._live and self._matcher is not None:  # live: there is a matcher
                self._matcher.fill_next_token_bitmask(self._bitmask, i)
                self._check_writable(i)
                if self._place.phase == "before":
                    self._opening(i)
            elif i:
                self._bitmask[i] = self._bitmask[i - 1]
            if i < len(drafts):
                self._accept(drafts[i])
        # xgrammar's CPU kernel takes float32 only; elsewhere (CUDA without triton, float64)
        # its plain-torch path.
        kernel = z.device.type == "cpu" and z.dtype == torch.float32
        xgr.apply_token_bitmask_inplace(
            z,
            self._bitmask[:k].to(z.device),
            vocab_size=z.shape[-1],
            backend="cpu" if kernel else "torch_native",
        )
        # The lowest finite logit instead of -inf: softmax still gives it probability 0
        # exactly, and the finiteness checks downstream keep meaning "the model went wrong".
        z.clamp_(min=torch.finfo(z.dtype).min)
        self.seconds += time.perf_counter() - start
        return z

    def _opening(self, row: int) -> None:
        """Row `row` comes before anything was decided: the first row allows the start
        marker's first token besides the grammar's, a row inside the start marker only the
        marker's next token."""
        assert self._gate is not None
        token = self._gate.start[self._place.matched]
        if self._place.matched:
            self._bitmask[row] = 0
        word, bit = divmod(token, 32)
        self._bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32 words

    def _check_writable(self, row: int) -> None:
        """A live matcher that allows no token means the tokenizer cannot spell what the
        grammar requires next (a character missing from its vocabulary): say so instead of
        sampling from an all-zero p."""
        if not bool(self._bitmask[row].any()):
            raise GrammarError(
                "the grammar allows no token of this tokenizer at this point: its vocabulary "
                "cannot write what the grammar requires next (a missing character, such as "
                "the newline of the tool-call markup)"
            )

    def _seen_rows(self, drafts: list[int], k: int) -> torch.Tensor:
        """[k, V] bool: row i marks the history, the tail and drafts[:i]."""
        seen = self._seen.clone()
        seen[torch.tensor(self._tail, dtype=torch.long, device=seen.device)] = True
        rows = seen.expand(k, -1).clone()
        for i, token in enumerate(drafts):
            rows[i + 1 :, token] = True
        return rows
