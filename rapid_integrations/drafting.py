"""The proposer role: a draft model that proposes gamma tokens and learns what was kept.

Two methods, after transformers' candidate generators: `propose` and `commit`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .config import RapidConfig
from .constraints import Constraints
from .kv import KVState
from .sampling import check_finite, log_probs


class Proposer(Protocol):
    def propose(self, gamma: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft `gamma` tokens: ids [gamma] and their sampling distributions q [gamma, V]
        (None when the verdict does not need q: greedy with eta = 0)."""
        ...

    def commit(self, accepted: int, gamma: int, token: torch.Tensor) -> None:
        if self._constraints is not None:
            self._constraints.settle(accepted, token)
        """The target kept the first `accepted` of the `gamma` drafts, then emitted `token` [1]."""
        ...


class ModelProposer:
    """Drafts with a causal LM over its own (short) prompt and KV cache."""

    def __init__(
        self,
        state: KVState,
        config: RapidConfig,
        generator: torch.Generator,
        constraints: Constraints | None = None,
    ) -> None:
        self.state = state
        self._constraints = constraints
        self._cfg = config
        self._gen = generator
        self._need_q = not (config.greedy and config.eta == 0)
        self._last = state.pending[:0]  # [1] x_gamma of the last proposal, never fed to the draft

    def propose(self, gamma: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ids x [gamma] (int64) and q [gamma, V] (None unless needed): see `Proposer`."""
        logits = self.state.feed()[-1]  # [V]
        xs, qs, rows = [], [], []
        for i in range(gamma):
            x, q = self._pick(self._shaped(logits))
            if self._constraints is not None:
                self._constraints.advance(x)
            xs.append(x)
            qs.append(q)
            rows.append(logits)
            if i + 1 < gamma:
                logits = self.state.feed(x)[-1]
        self._last = xs[-1]
        if not self._need_q:
            # log_probs checks the logits whenever q is computed; once per proposal here, as a
            # check per step would wait on the device between draft steps.
            check_finite(torch.stack(rows), "the draft model")
        return torch.cat(xs), (torch.stack(qs) if self._need_q else None)

    def _shaped(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] through the call's constraints (docs/algorithm.md section 9); the
        constraints then follow the pick."""
        if self._constraints is None:
            return logits
        return self._constraints.apply(logits[None], logits.new_empty(0, dtype=torch.long))[0]

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token [1] from logits [V], with q [V] when needed."""
        if self._cfg.greedy:
            q = log_probs(logits[None], 0.0, 1.0)[0].exp() if self._need_q else None
            return logits.argmax(-1, keepdim=True), q
        cfg = self._cfg
        q = log_probs(logits[None], cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p)[0].exp()
        return torch.multinomial(q, 1, generator=self._gen), q

    def commit(self, accepted: int, gamma: int, token: torch.Tensor) -> None:
        """Roll the draft cache back to the kept drafts and queue `token` [1] (int64) after them."""
        if self._constraints is not None:
            self._constraints.settle(accepted, token)
        # The draft has read its pending tokens and x_1..x_{gamma-1}; x_gamma was never fed.
        if accepted < gamma:
            self.state.rollback(gamma - 1 - accepted)
            self.state.append(token)
        elif gamma == 0:
            self.state.append(token)
        else:
            self.state.append(torch.cat([self._last, token.to(self._last.device)]))
