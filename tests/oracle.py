"""An independent oracle for one verify step, in plain numpy, from docs/algorithm.md alone.

It shares no code with `rapid_integrations` (nothing is imported from it): every formula below
is written again from sections 2.3-2.7 (sampling) and 3 (greedy), so a bug in the package's
math cannot hide in the expected values. All arrays are float64 numpy:
  z [gamma + 1, V] target logits, q [gamma, V] draft distributions (or [gamma + 1, V], with a
  row for the bonus position), x [gamma] draft ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rules:
    """The settings one step depends on (docs/algorithm.md section 2)."""

    eta: float
    temperature: float = 1.0
    top_p: float = 1.0
    residual: str = "paper"  # "paper" | "exact"
    tail_guard: str = "paper"  # "paper" | "draft" | "none"
    tail_ratio: float = 0.1
    end_ids: tuple[int, ...] = ()  # end guard (section 2.4) on when non-empty
    confidence_guard: bool = False  # section 2.4: rows with max p >= max q keep p
    eta_rule: str = "fixed"  # "fixed" | "draft-confidence" (eta_i = eta max_v q_i(v))
    lean: tuple[bool, ...] | None = None  # rows that lean ("grounded"); None: every row


def softmax(a: np.ndarray) -> np.ndarray:
    """Row-wise softmax of [k, V]; -inf entries get probability 0."""
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p per row of [k, V]: keep the most likely tokens, in order, until their mass reaches
    top_p (a token is kept when the mass of the tokens strictly more likely than it, ties by
    index, is still below top_p); renormalize."""
    if top_p >= 1.0:
        return p
    out = np.zeros_like(p)
    for row, probs in enumerate(p):
        order = sorted(range(len(probs)), key=lambda v: (-probs[v], v))
        mass = 0.0
        for v in order:
            if mass >= top_p:
                break
            out[row, v] = probs[v]
            mass += probs[v]
    return out / out.sum(axis=-1, keepdims=True)


def target_p(z: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """p = softmax(z / T) after top-p, [k, V]; greedy (T = 0) uses T = 1 (section 3)."""
    return nucleus(softmax(z / (temperature or 1.0)), top_p)


def augmented(p: np.ndarray, q: np.ndarray, rules: Rules) -> np.ndarray:
    """p_hat [k, V] (section 2.3) with the tail guard, then the end and confidence guards
    (section 2.4)."""
    with np.errstate(divide="ignore"):
        logp = np.log(p)
    eta = rules.eta * (q.max(axis=-1, keepdims=True) if rules.eta_rule != "fixed" else 1.0)
    shift = eta * (q - p)
    if rules.tail_guard == "draft":
        shift = np.where(q >= rules.tail_ratio * q.max(axis=-1, keepdims=True), shift, 0.0)
    out = softmax(logp + shift)
    if rules.tail_guard == "paper":
        out = np.where(out < rules.tail_ratio * out.max(axis=-1, keepdims=True), p, out)
        out = out / out.sum(axis=-1, keepdims=True)
    keep_p = np.isin(p.argmax(axis=-1), list(rules.end_ids))
    if rules.confidence_guard:
        keep_p |= p.max(axis=-1) >= q.max(axis=-1)
    if rules.lean is not None:
        keep_p |= ~np.array(rules.lean[: len(p)])
    return np.where(keep_p[:, None], p, out)


def residual(p: np.ndarray, p_hat: np.ndarray, q: np.ndarray, rule: str) -> np.ndarray:
    """The distribution [V] drawn from after a rejection (section 2.6)."""
    if rule == "paper":
        mass = np.maximum(np.maximum(p - p_hat, p - q), 0.0)
    else:
        mass = np.maximum(p_hat - q, 0.0)
    return mass / mass.sum() if mass.sum() > 0 else p


def acceptance(x: np.ndarray, q: np.ndarray, p_hat: np.ndarray) -> np.ndarray:
    """a_i = min(1, p_hat_i(x_i) / q_i(x_i)) per draft row, [gamma] (section 2.5)."""
    rows = np.arange(len(x))
    return np.minimum(1.0, p_hat[rows, x] / q[rows, x])


def step_law(z: np.ndarray, x: np.ndarray, q: np.ndarray, rules: Rules) -> np.ndarray:
    """The exact law of one sampled verify step: L[n, t] = P(n drafts accepted, then token t),
    shape [gamma + 1, V]. Row n < gamma: a_1..a_n accepted, x_{n+1} rejected, t drawn from the
    residual at row n (section 2.6); row gamma: every draft accepted, t the bonus token
    (section 2.7), from p_hat at row gamma where q has a row there ([gamma + 1, V]), else p."""
    gamma = len(x)
    p = target_p(z, rules.temperature, rules.top_p)
    p_hat = augmented(p[: len(q)], q, rules)
    a = acceptance(x, q[:gamma], p_hat[:gamma])
    law = np.zeros((gamma + 1, z.shape[-1]))
    reach = 1.0  # probability that rows 0..n-1 were all accepted
    for n in range(gamma):
        law[n] = reach * (1 - a[n]) * residual(p[n], p_hat[n], q[n], rules.residual)
        reach *= a[n]
    law[gamma] = reach * (p_hat[gamma] if len(q) > gamma else p[gamma])
    return law


def greedy_step(
    z: np.ndarray, x: np.ndarray, q: np.ndarray | None, rules: Rules
) -> tuple[int, int]:
    """Greedy verify (section 3): x_i is accepted iff it equals argmax p_hat_i (T = 1
    softmaxes, no top-p); on the first rejection, at row n, argmax p_hat_n is emitted; when all
    are accepted, the bonus argmax p_gamma (argmax p_hat_gamma where q has a row there, as
    for copies, section 2.10). Returns (n, token)."""
    gamma = len(x)
    p = softmax(z)
    best = p.argmax(axis=-1)
    if q is not None and rules.eta > 0:
        best[: len(q)] = augmented(p[: len(q)], q, rules).argmax(axis=-1)
    for n in range(gamma):
        if x[n] != best[n]:
            return n, int(best[n])
    return gamma, int(best[gamma])


def total_variation(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row total variation distance of [k, V] distributions."""
    return 0.5 * np.abs(a - b).sum(axis=-1)


def one_token_law(p: np.ndarray, q: np.ndarray, rules: Rules) -> np.ndarray:
    """Law [V] of the token emitted at a drafted position (docs/algorithm.md section 4):
    P(x) = min(q(x), p_hat(x)) + (1 - sum_y min(q(y), p_hat(y))) r(x), for p, q of shape [V]."""
    p_hat = augmented(p[None], q[None], rules)[0]
    overlap = np.minimum(q, p_hat)
    return overlap + (1 - overlap.sum()) * residual(p, p_hat, q, rules.residual)
