"""The scorer/sampler role: turn the target's logits over the drafts into emitted tokens."""

from __future__ import annotations

import torch

from .config import RapidConfig
from .sampling import accepted_count, log_probs, p_hat, residual


def verdict(
    z: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None, cfg: RapidConfig, gen: torch.Generator
) -> tuple[int, torch.Tensor]:
    """Accept a prefix of the drafts and pick the next token.

    z: [gamma + 1, V] target logits at the drafts' positions and one past them;
    x: [gamma] draft ids; q: [gamma, V] draft distributions (None when greedy with eta = 0).
    Returns (n accepted, the token [1] emitted after them).
    """
    x, q = x.to(z.device), (None if q is None else q.to(z.device))
    if cfg.greedy:
        return _greedy(z, x, q, cfg)
    return _sampled(z, x, q, cfg, gen)


def _greedy(
    z: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None, cfg: RapidConfig
) -> tuple[int, torch.Tensor]:
    # DESIGN.md 2.5: accept iff x_i == argmax p_hat_i (T = 1 softmaxes); emit argmax p_hat on
    # rejection; the bonus position has no q, so p_hat = p there.
    logp = log_probs(z, 0.0, 1.0)
    y = logp.argmax(-1)
    gamma = x.numel()
    if q is not None and gamma:
        y[:gamma] = p_hat(logp[:gamma], q, cfg.eta, cfg.tail_guard, cfg.tail_ratio).argmax(-1)
    mismatch = (y[:gamma] != x).int()
    n = int(mismatch.argmax()) if bool(mismatch.any()) else gamma
    return n, y[n : n + 1]


def _sampled(
    z: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None, cfg: RapidConfig, gen: torch.Generator
) -> tuple[int, torch.Tensor]:
    logp = log_probs(z, cfg.temperature, cfg.top_p)
    gamma = x.numel()
    n, dist = 0, logp[0].exp()
    if gamma:
        assert q is not None
        ph = p_hat(logp[:gamma], q, cfg.eta, cfg.tail_guard, cfg.tail_ratio)
        idx = x[:, None]
        u = torch.rand(gamma, generator=gen, device=z.device)
        n = accepted_count(x, ph.gather(1, idx)[:, 0], q.gather(1, idx)[:, 0], u)
        p_n = logp[n].exp()
        dist = residual(p_n, ph[n], q[n], cfg.residual) if n < gamma else p_n
    return n, torch.multinomial(dist, 1, generator=gen)
