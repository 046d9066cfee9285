"""The RAPID acceptance math, pure and in the paper's notation.

Chen et al., "Long-Context Inference with Retrieval-Augmented Speculative Decoding" (RAPID),
ICML 2025, arXiv:2502.20330. Per draft position i (all tensors fp32 or wider, shape [k, V]):

    z_i     target logits           p_i = softmax(z_i / T)   (after top-p filtering)
    q_i     the draft's sampling distribution (same temperature and top-p)
    p_hat_i = softmax(z_i / T + eta * (q_i - p_i))          retrieval-augmented target
    gamma   number of draft tokens verified per target pass

A draft token x ~ q_i is accepted with probability min(1, p_hat_i(x) / q_i(x)); on the first
rejection a token is drawn from the residual. One emitted token then follows
    P(x) = min(q(x), p_hat(x)) + (1 - sum_y min(q(y), p_hat(y))) * r(x)
which equals p_hat exactly under residual="exact" and equals p when eta = 0 (the paper claims
the output follows p for any eta; with eta > 0 it does not).
"""

from __future__ import annotations

import math

import torch

from rapid_integrations.errors import NumericalError


def check_finite(logits: torch.Tensor, source: str = "the model") -> None:
    """Raise `NumericalError` unless every logit is finite: nothing is sampled from NaN."""
    if not torch.isfinite(logits).all():
        raise NumericalError(
            f"{source} produced NaN or infinite logits; refusing to sample (the usual cause is "
            "float16 overflowing: use bfloat16 or float32, or another draft_precision)"
        )


def log_probs(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0
) -> torch.Tensor:
    """[k, V] logits -> [k, V] log-probabilities at temperature T, then top-k, top-p, min-p.

    The order and rules are transformers' warpers (TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper, MinPLogitsWarper); 0, 1 and 0 turn them off. Temperature 0 (greedy) uses
    T = 1, as docs/algorithm.md section 3 prescribes for p_hat. Filtered tokens get -inf.
    Computed in at least fp32 whatever the model's dtype.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    check_finite(z)
    # Shifted to <= 0 and T kept above underflow: a tiny T or a huge logit then overflows only
    # to -inf (probability 0), never to +inf, whose softmax is NaN.
    z = z - z.amax(dim=-1, keepdim=True)
    z = z / max(temperature or 1.0, torch.finfo(z.dtype).tiny)
    if 0 < top_k < z.shape[-1]:
        # Ties with the k-th logit stay, as in TopKLogitsWarper.
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    logp = torch.log_softmax(z, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass
        # strictly before it already reaches top_p (the top token is always kept).
        sorted_p = sorted_logp.exp()
        drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    if min_p > 0.0:
        # MinPLogitsWarper: drop p(v) < min_p * max p; the top token always stays.
        floor = logp.amax(dim=-1, keepdim=True) + math.log(min_p)
        logp = torch.log_softmax(logp.masked_fill(logp < floor, float("-inf")), dim=-1)
    return logp


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: [k, V] logits, [k, V] bool `seen` (each row's history).

    A token already in the row's history has its logit divided by `penalty` when positive and
    multiplied by it when negative (RepetitionPenaltyLogitsProcessor), before temperature.
    """
    if penalty == 1.0:
        return logits
    hit = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, hit, logits)


def p_hat(
    logp: torch.Tensor,
    q: torch.Tensor,
    eta: float,
    tail_guard: str = "paper",
    tail_ratio: float = 0.1,
    eta_rule: str = "fixed",
) -> torch.Tensor:
    """Retrieval-augmented target p_hat = softmax(log p + eta_i * (q - p)), shape [k, V].

    logp, q: [k, V]. `logp` are the target's log-probabilities (softmax(z/T) differs from z/T
    by a constant per row, so this is softmax(z/T + eta_i (q - p))). eta_i is `eta` on every
    row ("fixed") or eta * max_v q_i(v) ("draft-confidence"): a function of the row's q alone,
    so each row's p_hat is still one fixed law. Tail guards (docs/algorithm.md section 2.3):
      "paper": where p_hat(v) < tail_ratio * max p_hat, use p(v) instead; renormalize.
      "draft": apply the shift only where q(v) >= tail_ratio * max q (the authors' code).
      "none":  no guard.
    """
    p = logp.exp()
    if eta == 0:
        return p
    # eta beyond the dtype's range would turn eta * 0 into NaN; the capped shift still
    # dominates every log-probability, which is the limit eta -> inf.
    strength = min(eta, torch.finfo(logp.dtype).max)
    if eta_rule == "draft-confidence":
        shift = strength * q.amax(dim=-1, keepdim=True) * (q - p)
    else:
        shift = strength * (q - p)
    if tail_guard == "draft":
        shift = shift * (q >= tail_ratio * q.amax(dim=-1, keepdim=True))
    out = torch.softmax(logp + shift, dim=-1)
    if tail_guard == "paper":
        out = torch.where(out < tail_ratio * out.amax(dim=-1, keepdim=True), p, out)
        out = out / out.sum(dim=-1, keepdim=True)
    return out


def end_guard(p_hat_rows: torch.Tensor, p: torch.Tensor, end_ids: torch.Tensor) -> torch.Tensor:
    """Rows where the target's most likely token ends the sequence get p_hat = p, [k, V].

    Not in the paper: a draft reading a short context often does not see that the answer is
    complete and, with eta > 0, would talk the target out of stopping (measured: answers that
    repeat until max_new_tokens). The law of docs/algorithm.md section 4 holds with this p_hat.
    """
    ends = torch.isin(p.argmax(dim=-1), end_ids)
    return torch.where(ends[:, None], p, p_hat_rows)


def confidence_guard(p_hat_rows: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Rows where the target is at least as sure as the draft (max p >= max q) get p_hat = p,
    [k, V] (docs/algorithm.md section 2.4).

    Not in the paper: the shift eta (q - p) moves the target wherever the two disagree, also
    where the target reads the answer plainly in its long context and the draft, on a few
    retrieved passages, guesses; the guard lets the more confident of the two decide.
    """
    target_sure = p.amax(dim=-1) >= q.amax(dim=-1)
    return torch.where(target_sure[:, None], p, p_hat_rows)


def accepted_count(
    x: torch.Tensor, p_hat_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor
) -> int:
    """Number of draft tokens accepted left to right (stops at the first rejection).

    x: [gamma] draft tokens; p_hat_x, q_x: [gamma] their probabilities under p_hat and q;
    u: [gamma] uniforms in [0, 1). Token i is accepted iff u_i < min(1, p_hat_i(x_i) / q_i(x_i)),
    written u * q < p_hat so that no division by a tiny q happens.
    """
    rejected = ~(u * q_x < p_hat_x)
    return int(rejected.int().argmax()) if bool(rejected.any()) else int(x.numel())


def residual(
    p: torch.Tensor, p_hat_n: torch.Tensor, q: torch.Tensor, rule: str = "paper"
) -> torch.Tensor:
    """Distribution to sample from after a rejection at position n, shape [V].

    "paper": norm(max(p - p_hat, p - q, 0)); "exact": norm(max(p_hat - q, 0)).
    A residual with no mass (p_hat == q, say) falls back to p.
    """
    if rule == "paper":
        mass = torch.clamp(torch.maximum(p - p_hat_n, p - q), min=0)
    else:
        mass = torch.clamp(p_hat_n - q, min=0)
    total = mass.sum()
    return mass / total if total > 0 else p


def one_step_law(
    p: torch.Tensor, p_hat_n: torch.Tensor, q: torch.Tensor, rule: str = "paper"
) -> torch.Tensor:
    """The analytic law of one emitted token (docs/algorithm.md section 4), shape [V].

    P(x) = min(q(x), p_hat(x)) + (1 - sum_y min(q(y), p_hat(y))) * r(x).
    """
    overlap = torch.minimum(q, p_hat_n)
    return overlap + (1 - overlap.sum()) * residual(p, p_hat_n, q, rule)
