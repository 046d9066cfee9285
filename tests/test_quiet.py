"""A quiet start: `rapid --help`, importing the engine and building one print nothing of other
libraries' on stderr, and the documented switch (quiet.py) brings their output back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTREE_NOISE = "is an Enum subclass"

BUILD = """
import logging, sys
if sys.argv[1] == "debug":
    logging.getLogger("rapid_integrations").setLevel(logging.DEBUG)
from rapid_integrations.engine.rapid_engine import RapidEngine
engine = RapidEngine(sys.argv[2]) if len(sys.argv) > 2 else RapidEngine.from_default()
"""
# A document long enough that the draft reads it through retrieval (over the 512-token
# budget: about 650 tokens), so the embedder loads and encodes; no longer, for its prefill.
CALL = """
document = " ".join(f"Fact {i}: the code word of box {i} is w{i * 7}." for i in range(40))
out = engine.generate(document + "\\nWhat is the code word of box 3?", max_new_tokens=4)
assert out.stats.retrieved_tokens > 0  # the embedder loaded and encoded
"""


def _stderr(*command: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    env.pop("TQDM_DISABLE", None)
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=True
    )
    return done.stderr


def test_rapid_help_prints_nothing():
    rapid = str(Path(sys.executable).with_name("rapid"))
    for args in ([], ["ask"], ["serve"]):
        assert _stderr(rapid, *args, "--help") == ""


@pytest.mark.slow
def test_importing_and_building_the_default_engine_and_a_rapid_call_print_nothing(
    smol, tiny_model_dir
):
    # The process starts by importing the engine (BUILD): its empty stderr is also the check
    # that the import alone prints nothing, which needed a process (and 10 s of imports) of
    # its own before.
    assert _stderr(sys.executable, "-c", BUILD + CALL, "quiet") == ""
    # The logger at debug brings the third-party warnings and the loading bars back (any load
    # shows them: a tiny model's is seconds quicker than the default engine's).
    loud = _stderr(sys.executable, "-c", BUILD, "debug", str(tiny_model_dir))
    assert PYTREE_NOISE in loud and "Loading weights" in loud
