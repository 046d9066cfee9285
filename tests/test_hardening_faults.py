"""Faulty models: NaN / inf logits, a foreign vocabulary, out of memory, interrupted prefills.

Each fault is injected into one model instance's forward (`tests.hardening`). Every test checks
the error (a `RapidError` subclass with an actionable message, or the untouched original when
it is not the engine's to translate), that nothing was emitted or cached from the fault, that
the failed call's KV caches are gone, and that the same engine then gives the reference output.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from langchain_rapid import ChatRapid
from llamaindex_rapid import RapidLLM
from rapid_integrations import (
    DeviceOutOfMemoryError,
    NumericalError,
    RapidConfig,
    RapidEngine,
    RapidError,
    VocabularyMismatchError,
)
from rapid_integrations.cli import EXIT_ERROR, main
from tests.hardening import fail_past, patched_forward, poison_logits, track_caches
from tests.test_cli import tiny_args
from tests.tiny import reference_greedy, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

PROMPT, DRAFT_PROMPT = "hello kab def", "kab def"
DOC = "abc def ghi jkl. " * 6
SETTINGS = {
    "greedy": {"eta": 0.0},
    "leaning": {"eta": 5.0},
    "sampled": {"eta": 2.0, "temperature": 1.0, "top_p": 0.9, "seed": 7},
}


@pytest.fixture(scope="module")
def models(tok: PreTrainedTokenizerBase) -> dict[str, PreTrainedModel]:
    """This module's own pair (faults patch instances; the session's models stay clean)."""
    return {"target": tiny_llama(len(tok), seed=1), "draft": tiny_llama(len(tok), seed=2, layers=1)}


@pytest.fixture
def engine(models: dict[str, PreTrainedModel], tok: PreTrainedTokenizerBase) -> RapidEngine:
    cfg = RapidConfig(max_new_tokens=24, ignore_eos=True, gamma=4, prefill_chunk_size=16)
    return RapidEngine(models["target"], models["draft"], tokenizer=tok, config=cfg)


# ---- NaN and infinite logits ------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_non_finite_logits_raise_before_anything_is_sampled(
    engine: RapidEngine,
    models: dict[str, PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
    value: float,
    role: str,
    setting: str,
) -> None:
    caches = track_caches(monkeypatch)
    want = engine.generate(PROMPT, DRAFT_PROMPT, **SETTINGS[setting]).text
    shown = []
    # Call 1 is the prefill (its logits are never read); call 3 is in the middle of decoding.
    with patched_forward(models[role], poison_logits(3, value)):
        stream = engine.stream(PROMPT, DRAFT_PROMPT, **SETTINGS[setting])
        with pytest.raises(NumericalError, match="NaN or infinite logits") as caught:
            shown.extend(stream)
    assert isinstance(caught.value, RapidError)
    if role == "draft":
        assert "the draft model" in str(caught.value) or SETTINGS[setting]["eta"] > 0
    assert want.startswith("".join(shown))  # only tokens from before the fault were shown
    del stream, caught
    assert caches.alive() == 0
    assert engine.generate(PROMPT, DRAFT_PROMPT, **SETTINGS[setting]).text == want


# ---- a draft with another vocabulary ---------------------------------------------------------


def test_foreign_vocabulary_is_rejected_at_every_entry_point(
    tok: PreTrainedTokenizerBase,
    models: dict[str, PreTrainedModel],
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """The engine rejects it at construction (test_engine_api); the adapters, which load on
    first use, at the first call; the CLI exits 1 with the reason."""
    narrow = tiny_llama(len(tok) - 4, seed=3)
    with pytest.raises(VocabularyMismatchError, match="share a vocabulary"):
        ChatRapid(model=models["target"], draft_model=narrow, tokenizer=tok).invoke("abc")
    with pytest.raises(VocabularyMismatchError, match="share a vocabulary"):
        RapidLLM(models["target"], narrow, tok).complete("abc")
    narrow.save_pretrained(tmp_path / "narrow")
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    argv = ["ask", str(doc), "-q", "abc?", *tiny_args(tiny_model_dir)]
    assert main([*argv, "--draft", str(tmp_path / "narrow")]) == EXIT_ERROR


# ---- out of memory ------------------------------------------------------------------------------

# What CUDA and the CPU allocator raise (made fresh per test: a raised error keeps its frames).
OUT_OF_MEMORY = {
    "cuda": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."),
    "cpu": lambda: RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 4503599627370496 bytes."
    ),
}
OTHER_FAULTS = {"ctrl-c": KeyboardInterrupt, "kernel": lambda: RuntimeError("kernel failed")}


@pytest.mark.parametrize("device", OUT_OF_MEMORY)
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_out_of_memory_is_a_clear_error_and_the_engine_recovers(
    engine: RapidEngine,
    models: dict[str, PreTrainedModel],
    tok: PreTrainedTokenizerBase,
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    phase: str,
) -> None:
    caches = track_caches(monkeypatch)
    error = OUT_OF_MEMORY[device]()
    engine.generate(DOC + "warm.", "def")
    assert len(engine.prefix_cache) > 0
    prompt = DOC + "ghi " * 10 + "what is abc."
    n = len(tok.encode(prompt))
    limit = 40 if phase == "prefill" else n + 6  # the third prefill chunk, or a verify pass
    with patched_forward(models["target"], fail_past(limit, error)):
        with pytest.raises(DeviceOutOfMemoryError) as caught:
            engine.generate(prompt, "abc")
        # Held errors do not hold memory: the failed call's caches are already gone.
        assert caches.alive() == 0
    failure = caught.value
    assert isinstance(failure, RapidError) and isinstance(failure, MemoryError)
    assert failure.__cause__ is error
    assert f"{n}-token prompt" in str(failure) and "prefill_chunk_size (now 16)" in str(failure)
    assert len(engine.prefix_cache) == 0  # emptied to give memory back
    out = engine.generate(prompt, "abc", eta=0.0)
    assert out.stats.cached_prefix_tokens == 0  # no half-prefilled entry was kept
    assert out.token_ids == reference_greedy(models["target"], tok.encode(prompt), 24, len(tok))


@pytest.mark.parametrize("fault", OTHER_FAULTS)
def test_interrupted_prefill_stores_no_prefix_and_other_errors_pass_through(
    engine: RapidEngine,
    models: dict[str, PreTrainedModel],
    tok: PreTrainedTokenizerBase,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    """Ctrl-C or a failing kernel mid-prefill propagates unchanged (only running out of
    memory is translated), and the prompt's half-read KV is never offered for reuse."""
    caches = track_caches(monkeypatch)
    error = OTHER_FAULTS[fault]()
    engine.generate(DOC + "warm.", "def")
    shared = len(tok.encode(DOC)) + 1  # "warm." and "what" share their first letter
    prompt = DOC + "what is " + "kab " * 20
    injected = patched_forward(models["target"], fail_past(shared + 40, error))
    with injected, pytest.raises(type(error)) as caught:
        engine.generate(prompt, "kab")
    assert caught.value is error and not isinstance(caught.value, RapidError)
    del caught, error
    assert caches.alive() == 0
    out = engine.generate(prompt, "kab", eta=0.0)
    assert out.stats.cached_prefix_tokens == shared  # the warm-up's prefix, nothing more
    assert out.token_ids == reference_greedy(models["target"], tok.encode(prompt), 24, len(tok))


def test_a_stream_validates_its_call_before_the_first_token(engine: RapidEngine) -> None:
    """Bad input raises at `stream()`, not at the first `next()`, like `generate`."""
    with pytest.raises(RapidError):
        engine.stream("", "a")
    with pytest.raises(RapidError):
        engine.stream("abc", "a", max_new_tokens=0)
