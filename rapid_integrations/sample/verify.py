"""The scorer/sampler role: turn the target's logits over the drafts into emitted tokens.

Terms (after vLLM's rejection sampler; docs/algorithm.md sections 2.3-2.7 and 3):
  p        the target's distribution per position, softmax(z / T) after top-p, [gamma + 1, V];
  q        the draft's sampling distribution at each drafted position (same T, top-p), [gamma, V];
  p_hat    the retrieval-augmented target softmax(z / T + eta (q - p)), tail-, confidence- and
           end-guarded, [gamma, V]; it is p when eta = 0 and on rows that do not lean;
  lean     which of q's rows p_hat leans on, [rows] bool (`grounding.Grounding`; None: all);
  accepted tokens   the drafts x_1..x_n kept, each with probability min(1, p_hat_i(x_i) / q_i(x_i))
           (greedy: iff x_i == argmax p_hat_i), left to right until the first rejection;
  rejected token    the first draft x_{n+1} not kept; every draft after it is discarded too;
  recovered (residual) token   the one token drawn after a rejection at row n, from the
           residual of p_n, p_hat_n and q_n (greedy: argmax p_hat_n);
  bonus token       the token drawn at row gamma (the row past the last draft) when all
           gamma drafts are accepted: from p_hat_gamma where q has a row there ([gamma + 1, V],
           with eta > 0), else from p (the paper's rule).
Copies of the lookup (section 2.10) arrive vetted by the draft, distributed as q: drafts here.
Each target pass emits accepted tokens + one recovered or bonus token.
"""

from __future__ import annotations

import torch

from rapid_integrations.config import RapidConfig
from rapid_integrations.sample.sampling import (
    accepted_count,
    check_finite,
    confidence_guard,
    end_guard,
    log_probs,
    p_hat,
    residual,
)


def verdict(
    z: torch.Tensor,
    x: torch.Tensor,
    q: torch.Tensor | None,
    cfg: RapidConfig,
    gen: torch.Generator,
    end_ids: torch.Tensor | None = None,
    lean: torch.Tensor | None = None,
) -> tuple[int, torch.Tensor]:
    """Accept a prefix of the drafts and pick the next token.

    z: [gamma + 1, V] target logits at the drafts' positions and one past them;
    x: [gamma] draft ids; q: [gamma, V] or [gamma + 1, V] (a row for the bonus position)
    draft distributions (None when greedy with eta = 0);
    end_ids: end-of-sequence ids for `sampling.end_guard` (None: no guard);
    lean: [len(q)] bool, the rows p_hat leans on (None: every row of q).
    Returns (n accepted, the token [1] emitted after them).
    """
    x = x.to(z.device)
    q = None if q is None else q.to(z.device)
    lean = None if lean is None else lean.to(z.device)
    if cfg.greedy:
        return _greedy(z, x, q, cfg, end_ids, lean)
    return _sampled(z, x, q, cfg, gen, end_ids, lean)


def _augmented(
    logp: torch.Tensor,
    q: torch.Tensor,
    cfg: RapidConfig,
    end_ids: torch.Tensor | None,
    lean: torch.Tensor | None,
) -> torch.Tensor:
    """p_hat for the draft rows, confidence and end guards applied, p on the rows that do not
    lean: logp, q [gamma, V], lean [gamma] bool or None -> [gamma, V]."""
    ph = p_hat(logp, q, cfg.eta, cfg.tail_guard, cfg.tail_ratio, cfg.eta_rule)
    p = logp.exp()
    ph = confidence_guard(ph, p, q) if cfg.confidence_guard else ph
    ph = ph if lean is None else torch.where(lean[:, None], ph, p)
    return ph if end_ids is None else end_guard(ph, p, end_ids)


def p_hat_rows(
    z: torch.Tensor,
    q: torch.Tensor | None,
    cfg: RapidConfig,
    end_ids: torch.Tensor | None,
    lean: torch.Tensor | None = None,
) -> torch.Tensor:
    """The law `verdict` decides with at each row of z [k, V]: p_hat where q has a row
    (guards applied; p where `lean` [len(q)] is False), p past q's rows; temperature, top-k,
    top-p and min-p applied when sampling, softmax at T = 1 when greedy (section 3). Returns
    probabilities [k, V]."""
    if cfg.greedy:
        logp = log_probs(z, 0.0, 1.0)
    else:
        logp = log_probs(z, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p)
    rows = len(z)
    q = None if q is None else q[:rows]
    lean = None if lean is None else lean[:rows].to(z.device)
    return _with_p_hat(logp, logp.exp(), q, cfg, end_ids, lean)


def _with_p_hat(
    logp: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    cfg: RapidConfig,
    end_ids: torch.Tensor | None,
    lean: torch.Tensor | None,
) -> torch.Tensor:
    """p_hat on q's rows and p on the rows past them: logp and p = exp(logp) [k, V] (the
    caller's, which needs p too), q [<= k, V], lean [len(q)] bool or None -> [k, V]."""
    rows = 0 if q is None else len(q)
    return (
        torch.cat([_augmented(logp[:rows], q, cfg, end_ids, lean), p[rows:]])
        if q is not None and rows
        else p
    )


def _greedy(
    z: torch.Tensor,
    x: torch.Tensor,
    q: torch.Tensor | None,
    cfg: RapidConfig,
    end_ids: torch.Tensor | None,
    lean: torch.Tensor | None,
) -> tuple[int, torch.Tensor]:
    """`verdict` at temperature 0; shapes as there (q may be None only when eta = 0)."""
    # docs/algorithm.md section 3: accept iff x_i == argmax p_hat_i (T = 1 softmaxes); emit argmax p_hat on
    # rejection; at the bonus position p_hat = p unless q has a row there (eta > 0).
    # argmax p is argmax z; taken on z, logits closer than log_softmax's rounding stay apart,
    # so eta = 0 picks exactly the target's own greedy token.
    check_finite(z)
    y = z.argmax(-1)
    gamma = x.numel()
    if q is not None and len(q):
        # The full-vocabulary softmax is needed only when p_hat differs from p.
        rows = len(q)
        top = _augmented(log_probs(z[:rows], 0.0, 1.0), q, cfg, end_ids, lean).argmax(-1)
        # A row that does not lean keeps argmax z, for the reason above.
        y[:rows] = top if lean is None else torch.where(lean, top, y[:rows])
    mismatch = (y[:gamma] != x).int()
    n = int(mismatch.argmax()) if bool(mismatch.any()) else gamma
    return n, y[n : n + 1]


def _sampled(
    z: torch.Tensor,
    x: torch.Tensor,
    q: torch.Tensor | None,
    cfg: RapidConfig,
    gen: torch.Generator,
    end_ids: torch.Tensor | None,
    lean: torch.Tensor | None,
) -> tuple[int, torch.Tensor]:
    """`verdict` when sampling; shapes as there (q has at least gamma rows whenever gamma > 0)."""
    logp = log_probs(z, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p)
    gamma = x.numel()
    p = logp.exp()  # [gamma + 1, V]
    ph = _with_p_hat(logp, p, q, cfg, end_ids, lean)
    if not gamma:
        return 0, torch.multinomial(ph[0], 1, generator=gen)
    assert q is not None
    idx = x[:, None]
    u = torch.rand(gamma, generator=gen, device=z.device)
    n = accepted_count(x, ph[:gamma].gather(1, idx)[:, 0], q[:gamma].gather(1, idx)[:, 0], u)
    dist = residual(p[n], ph[n], q[n], cfg.residual) if n < gamma else ph[gamma]
    return n, torch.multinomial(dist, 1, generator=gen)
