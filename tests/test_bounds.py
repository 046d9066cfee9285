"""The bounds of `rapid bench` (bench/bounds.py, docs/algorithm.md section 2.12) on synthetic
costs: the argmax over the verify width, monotone cases, the bandwidth arithmetic by hand,
K per method, and the flag on a record that beats a bound."""

from __future__ import annotations

import logging

import pytest
import torch

from rapid_integrations import RapidConfig
from rapid_integrations.bench.bounds import (
    Device,
    attach_bounds,
    bandwidth_bound,
    exceeds,
    read_bytes_per_second,
    read_bytes_per_token,
    speculation_bound,
    weights_read_bytes,
    widest_pass,
)
from rapid_integrations.bench.methods import Method
from rapid_integrations.bench.model_draft import StepCosts
from rapid_integrations.bench.models import tiny_pair
from rapid_integrations.bench.runner import VARIANTS

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

# Target step 1 s; verify passes of 2, 5, 9, 17, 33 tokens. k / verify(k): 1 at k = 1, 1.33
# at 2, 2.5 at 5, 9 / 4 = 2.25 at 9, 17 / 9 = 1.89 at 17; between the timed sizes the cost is
# linear, so k / verify(k) is monotone on each piece and the best k is a timed one: here 5.
HUMP = StepCosts(1.0, 0.3, ((2, 1.5), (5, 2.0), (9, 4.0), (17, 9.0), (33, 20.0)))


def test_the_speculation_bound_is_the_best_width_by_hand():
    assert speculation_bound(HUMP, 33) == (pytest.approx(2.5), 5)
    # Capped below the best width: the widest allowed wins (k / verify(k) rises up to 5).
    assert speculation_bound(HUMP, 4) == (pytest.approx(4 / (1.5 + 2 / 6)), 4)
    # The draft step does not enter: drafts are free.
    assert speculation_bound(StepCosts(1.0, 99.0, HUMP.verify), 33)[0] == pytest.approx(2.5)


def test_a_verify_cost_flat_in_its_width_bounds_at_the_widest_pass():
    flat = StepCosts(0.5, 0.1, ((2, 1.0), (33, 1.0)))  # every wider pass costs 1 s
    assert speculation_bound(flat, 33) == (pytest.approx(33 * 0.5 / 1.0), 33)
    assert speculation_bound(flat, 9) == (pytest.approx(4.5), 9)


def test_a_verify_cost_proportional_to_its_width_bounds_at_the_target_alone():
    # k tokens cost k target steps: no width pays, and the bound is 1 (k = 1, the target alone).
    linear = StepCosts(1.0, 0.1, ((2, 2.0), (5, 5.0), (33, 33.0)))
    assert speculation_bound(linear, 33) == (pytest.approx(1.0), 1)
    assert speculation_bound(StepCosts(1.0, 0.1, ((2, 2.5),)), 33)[0] == pytest.approx(1.0)


def test_the_bandwidth_bound_by_hand():
    # 300 MB of weights + 20 kB of KV a token x 10,000 tokens = 500 MB a pass; 10 tokens a pass
    # at best: 50 MB a token; at 20 GB/s, 400 tokens/s; over a 50 ms target step, 20x.
    per_token = read_bytes_per_token(300_000_000, 20_000, 10_000, 10)
    assert per_token == pytest.approx(50_000_000)
    assert bandwidth_bound(0.05, 20e9, per_token) == pytest.approx(20.0)
    # A longer context reads more KV: the bound falls; a wider pass shares the reads: it rises.
    assert read_bytes_per_token(300_000_000, 20_000, 20_000, 10) > per_token
    assert read_bytes_per_token(300_000_000, 20_000, 10_000, 20) == pytest.approx(per_token / 2)


def test_the_widest_pass_of_each_method():
    config = RapidConfig()  # gamma 8, gamma_max 32, lookup_tokens 10
    assert widest_pass(config, [Method("lc"), Method("rag"), Method("hf")]) == 1
    assert widest_pass(config, [Method("lc"), Method("hf-pld")]) == 11
    assert widest_pass(config, [Method("sd")]) == 8 + 10 + 1
    assert widest_pass(config, [Method("rapid", 5.0, "gamma=16", (("gamma", 16),))]) == 27
    assert widest_pass(config, [Method("rapid", 5.0, "no-lookup", VARIANTS["no-lookup"])]) == 9
    adaptive = Method("rapid", 5.0, "adaptive", VARIANTS["adaptive"])
    assert widest_pass(config, [Method("lc"), adaptive, Method("sd")]) == 32 + 10 + 1


def _records(*achieved: float | None) -> list[dict]:
    return [
        {"suite": "long", "label": f"m{i}", "context_tokens": 1000, "achieved_speedup": a}
        for i, a in enumerate(achieved)
    ]


def test_a_record_that_beats_a_bound_is_flagged_and_logged(caplog):
    # Speculation bound 2.5 (HUMP, k = 5); bandwidth: (4 GB + 1 MB x 1000 tokens) / 5 tokens
    # = 1 GB a token; at 5 GB/s 5 tokens/s, over a 1 s target step 5x.
    device = Device(4_000_000_000, 1_000_000, 5e9, 5)
    records = _records(1.0, 2.6, 6.0, None)
    with caplog.at_level(logging.WARNING, logger="rapid_integrations.bench.bounds"):
        attach_bounds(records, HUMP, device)
    within, slack, over, untimed = records
    assert within["speculation_bound"] == pytest.approx(2.5)
    assert within["speculation_bound_tokens"] == 5 and within["widest_pass"] == 5
    assert within["bandwidth_bound"] == pytest.approx(5.0)
    assert within["achieved_over_speculation_bound"] == pytest.approx(0.4)
    assert within["achieved_over_bandwidth_bound"] == pytest.approx(0.2)
    assert not within["bound_exceeded"]
    assert not slack["bound_exceeded"]  # 1.04 of the bound: within the timing's slack
    assert over["bound_exceeded"] and over["achieved_over_bandwidth_bound"] == pytest.approx(1.2)
    assert untimed["achieved_over_speculation_bound"] is None and not untimed["bound_exceeded"]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "m2" in warned[0] and "bandwidth_bound x1.20" in warned[0]
    assert "speculation_bound x2.40" in warned[0]


def test_exceeds_only_past_the_slack():
    assert not exceeds(None) and not exceeds(1.0) and not exceeds(1.05)
    assert exceeds(1.06)


def test_the_read_rate_is_a_positive_rate():
    rate = read_bytes_per_second(torch.device("cpu"), nbytes=1 << 20, repeats=2)
    assert 1e6 < rate < 1e14


def test_weights_read_leave_out_an_untied_input_embedding():
    _, large = tiny_pair(vocab_size=300, window=64)  # untied: the head is its own matrix
    total = sum(p.numel() * p.element_size() for p in large.parameters())
    total += sum(b.numel() * b.element_size() for b in large.buffers())
    embed = large.get_input_embeddings().weight
    assert weights_read_bytes(large) == total - embed.numel() * embed.element_size()
    large.lm_head.weight = embed  # tied: the head reads the whole table every step
    tied = sum(p.numel() * p.element_size() for p in large.parameters())
    tied += sum(b.numel() * b.element_size() for b in large.buffers())
    assert weights_read_bytes(large) == tied


def test_the_speed_table_marks_a_row_over_a_bound():
    from rapid_integrations.bench.tables import _speed_table

    row = {
        "suite": "long",
        "task": "rewrite",
        "context_label": 16384,
        "label": "rapid eta=5",
        "method": "rapid",
        "end_to_end_seconds": 60.0,
        "end_to_end_over_lc": 0.4,
        "end_to_end_over_prompt_lookup": None,
        "context_tokens": 16000.0,
        "draft_context_tokens": 500.0,
        "prefill_seconds": 0.0,
        "decode_tokens_per_second": 10.0,
        "speedup_vs_lc": 3.0,
        "acceptance_rate": 0.9,
        "peak_memory_bytes": None,
        "achieved_over_speculation_bound": 0.5,
        "achieved_over_bandwidth_bound": 1.3,
    }
    table = _speed_table([row])
    assert "achieved / speculation bound | achieved / bandwidth bound" in table
    assert "| long | 16K | rewrite | rapid eta=5 | 0.40 | – | 60.0 | 16000 |" in table
    assert "| 0.5 | 1.3 **over the bound** |" in table
