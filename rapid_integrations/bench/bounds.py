"""Bounds no drafter can pass at one context length on this device (docs/algorithm.md 2.12).

Both are speedups over one measured target decode step (`StepCosts.target_step`, what `lc`
pays per token up to its work outside forward passes), the unit of a record's
`achieved_speedup` (decode tokens/s x target step), so achieved / bound compares like with
like; a bound over the target step is a rate bound of bound / target_step tokens/s.

* speculation bound: drafts that cost nothing and are all accepted, so a verify pass of k
  tokens emits k: the best over k in [1, K] of k x target_step / verify(k), from the verify
  passes `bench/model_draft.py` already timed (`StepCosts`), K the widest pass the suite's
  methods can verify (`widest_pass`);
* bandwidth bound: every target pass reads the weights once and the KV of the context once,
  and emits at most K tokens, so a token costs at least (weights + KV) / K bytes of reads:
  target_step x K x read rate / (weights + KV), the read rate measured once per run
  (`read_bytes_per_second`).

A record whose achieved speedup exceeds either bound by more than `TIMING_SLACK` is flagged
(`bound_exceeded`) and logged as a warning: the bound or the measurement is wrong.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from rapid_integrations.config import RapidConfig

from .methods import LLAMA_METHODS, PROMPT_LOOKUP_TOKENS
from .model_draft import StepCosts, best_model_draft

log = logging.getLogger(__name__)

READ_BYTES = 1 << 28
"""Bytes of the tensor the read rate is measured on: far above any cache (CPU L3, GPU L2)."""
READ_REPEATS = 5
"""Reads timed; the fastest is kept: the bound is the best the memory system gave."""
TIMING_SLACK = 1.05
"""How far an achieved speedup may pass a bound before it is flagged: the bound rests on
medians of 3 timed passes, which drift by a few percent between the runs and the timing on a
busy machine (an `lc` record sits near 1 of the speculation bound by construction)."""
BOUND_NAMES = ("speculation_bound", "bandwidth_bound")
"""The record fields of the bounds; each has `achieved_over_<name>` beside it."""


@dataclass(frozen=True)
class Bounds:
    """Both bounds of one record, as speedups over one target decode step (module docstring).

    speculation_tokens: the k whose verify pass gives the speculation bound; widest: K."""

    speculation_bound: float
    speculation_tokens: int
    bandwidth_bound: float
    widest: int


def speculation_bound(costs: StepCosts, widest: int) -> tuple[float, int]:
    """(max over k in [1, widest] of k x target_step / verify(k), that k): the speedup of
    free drafts all accepted, which is the model-draft speedup at acceptance 1 and a draft
    step of 0 seconds (`best_model_draft`; gamma = k - 1)."""
    free = StepCosts(costs.target_step, 0.0, costs.verify)
    best, gamma = best_model_draft(free, 1.0, widest - 1)
    return best, gamma + 1


def read_bytes_per_token(
    weights_bytes: int, kv_bytes_per_token: int, context_tokens: int, widest: int
) -> float:
    """The fewest bytes a decoded token can cost: one target pass's reads (the weights and the
    KV of `context_tokens`) over the most tokens a pass emits (`widest`)."""
    return (weights_bytes + kv_bytes_per_token * context_tokens) / widest


def bandwidth_bound(target_step: float, read_rate: float, bytes_per_token: float) -> float:
    """The most tokens/s the memory reads allow (`read_rate` bytes/s over `bytes_per_token`),
    as a speedup over one target decode step of `target_step` seconds."""
    return target_step * read_rate / bytes_per_token


def widest_pass(config: RapidConfig, methods: Iterable[Any]) -> int:
    """K: the most tokens one verify pass of any of `methods` (bench `Method`s) can emit,
    on an engine configured by `config`: the most model drafts (a fixed gamma, or gamma_max
    under an adaptive one), the most copies of the lookup proposer, and the target's own
    token; transformers' prompt lookup drafts `PROMPT_LOOKUP_TOKENS`; the target alone 1.
    llama.cpp's passes are not this target's (its records get no bounds): they do not count."""
    widths = [1]
    for method in methods:
        if method.name in LLAMA_METHODS:
            continue
        if method.name == "hf-pld":
            widths.append(PROMPT_LOOKUP_TOKENS + 1)
        elif method.name not in ("lc", "hf", "rag"):
            cfg = config.replace(**dict(method.options))
            copies = cfg.lookup_tokens if cfg.lookup_ngram else 0
            drafts = cfg.gamma_max if cfg.adaptive_gamma else cfg.gamma
            widths.append(drafts + copies + 1)
    return max(widths)


def weights_read_bytes(model: PreTrainedModel) -> int:
    """Bytes of the weights a decode step reads: every parameter and buffer (int4 and int8
    copies keep their codes in buffers) except an input embedding not tied to the output
    head, of which a step reads one row."""
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    embed = cast(torch.Tensor, model.get_input_embeddings().weight)
    head = model.get_output_embeddings()
    tied = head is not None and cast(torch.Tensor, head.weight).data_ptr() == embed.data_ptr()
    return total if tied else total - embed.numel() * embed.element_size()


@torch.inference_mode()
def read_bytes_per_second(
    device: torch.device, nbytes: int = READ_BYTES, repeats: int = READ_REPEATS
) -> float:
    """The device's read rate (bytes/s): the fastest of `repeats` sums of an `nbytes`
    float32 tensor, after one untimed sum (first touch, kernel choice)."""
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    data.sum()
    fastest = math.inf
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        data.sum()
        _synchronize(device)
        fastest = min(fastest, time.perf_counter() - start)
    return data.numel() * data.element_size() / fastest


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exceeds(ratio: float | None) -> bool:
    """Whether an achieved / bound ratio passes the bound beyond `TIMING_SLACK`."""
    return ratio is not None and ratio > TIMING_SLACK


@dataclass(frozen=True)
class Device:
    """What the bounds of one suite's records read: the target's weight bytes, its KV bytes per
    token of context, the run's read rate (bytes/s) and K (`widest_pass`)."""

    weights_bytes: int
    kv_bytes_per_token: int
    read_rate: float
    widest: int

    def bounds(self, costs: StepCosts, context_tokens: int) -> Bounds:
        """Both bounds at `context_tokens` of context from the timed passes `costs`."""
        spec, tokens = speculation_bound(costs, self.widest)
        per_token = read_bytes_per_token(
            self.weights_bytes, self.kv_bytes_per_token, context_tokens, self.widest
        )
        band = bandwidth_bound(costs.target_step, self.read_rate, per_token)
        return Bounds(spec, tokens, band, self.widest)


def attach_bounds(records: Sequence[dict[str, Any]], costs: StepCosts, device: Device) -> None:
    """Give each record (of one task, whose passes `costs` timed) both bounds at its context,
    its achieved speedup over each, and `bound_exceeded`; log each record that exceeds one."""
    for record in records:
        found = device.bounds(costs, record["context_tokens"])
        record.update(
            speculation_bound=found.speculation_bound,
            speculation_bound_tokens=found.speculation_tokens,
            bandwidth_bound=found.bandwidth_bound,
            widest_pass=found.widest,
        )
        achieved = record.get("achieved_speedup")
        over = []
        for name in BOUND_NAMES:
            ratio = achieved / record[name] if achieved else None
            record[f"achieved_over_{name}"] = ratio
            if exceeds(ratio):
                over.append(f"{name} x{ratio:.2f}")
        record["bound_exceeded"] = bool(over)
        if over:
            log.warning(
                "%s %s at %s tokens beats %s: the bound or the timing is wrong "
                "(docs/algorithm.md section 2.12)",
                record["suite"],
                record["label"],
                record["context_tokens"],
                ", ".join(over),
            )
