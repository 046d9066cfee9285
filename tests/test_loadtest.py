"""The figures of `scripts/loadtest.py` from synthetic requests (no model, no engine).

The engines hand out each token of a verify pass as a delta of its own, back to back: counted
one by one, most inter-token latencies read zero and p50 ITL was 0 ms in the first smoke run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("loadtest", ROOT / "scripts" / "loadtest.py")
loadtest = importlib.util.module_from_spec(_spec)
sys.modules["loadtest"] = loadtest  # dataclasses look their module up there
_spec.loader.exec_module(loadtest)


def test_one_pass_deltas_are_one_burst():
    # 3 passes: 4 tokens at t=1, 3 at t=1.1, 1 at t=1.3 (each pass's deltas microseconds apart)
    arrivals = [1.0, 1.00001, 1.00002, 1.00003, 1.1, 1.10001, 1.10002, 1.3]
    sample = loadtest.Sample(sent=0.5, arrivals=arrivals, tokens=8)
    assert loadtest.bursts(arrivals) == [1.0, 1.1, 1.3]
    assert loadtest.gaps(sample) == pytest.approx([0.1, 0.2])
    assert loadtest.tpot(sample) == pytest.approx(0.3 / 7)  # the first token excluded
    at_once = loadtest.Sample(sent=0.5, arrivals=arrivals[:4], tokens=4)
    assert loadtest.gaps(at_once) == [] and loadtest.tpot(at_once) is None  # not 0 ms


def test_figures():
    samples = [
        loadtest.Sample(0.0, [1.0, 1.2, 1.4], tokens=3, cached=90, prompt=100),
        loadtest.Sample(0.0, [2.0, 2.5], tokens=2, cached=100, prompt=100),
    ]
    f = loadtest.figures("batched", "decode", 2, seconds=2.5, samples=samples)
    assert (f.requests, f.output_tokens, f.tokens_per_second) == (2, 5, 2.0)
    assert (f.ttft_p50, f.ttft_p95) == (1.5, pytest.approx(1.95))
    assert f.itl_p50 == 0.2 and f.tpot_p95 == pytest.approx(0.485)
    assert f.cache_hit_rate == 0.95 and f.prompt_tokens == 100
    unknown = [loadtest.Sample(0.0, [1.0], tokens=1, cached=None, prompt=100)]
    one = loadtest.figures("hf-batch", "decode", 1, seconds=1.0, samples=unknown)
    assert one.cache_hit_rate is None and one.itl_p50 is None and one.tpot_p50 is None
