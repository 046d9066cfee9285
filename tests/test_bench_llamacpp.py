"""The llama.cpp bench methods (bench/llamacpp.py) without llama-cpp-python: the import guard,
the arguments llama.cpp gets, the timing arithmetic on a fake `Llama` of the same interface,
and the records' fields; one slow test runs the real library where it is installed."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Generator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rapid_integrations import ContextWindowExceededError, RapidConfig, RapidConfigError
from rapid_integrations.bench import llamacpp
from rapid_integrations.bench.bounds import widest_pass
from rapid_integrations.bench.methods import (
    DEFAULT_METHODS,
    LLAMA_METHODS,
    METHODS,
    OPT_IN_METHODS,
    PROMPT_LOOKUP_TOKENS,
    Measurement,
    Method,
    measure_llamacpp,
)
from rapid_integrations.bench.runner import BenchSettings, long_methods
from rapid_integrations.errors import VocabularyMismatchError

PROMPT_COST = 0.01  # fake seconds per prompt token
PASS_COST = 0.1  # fake seconds per decode pass
GGUF = Path("/models/smol.gguf")


class Clock:
    """A fake `time.perf_counter`: the fake Llama's evals advance it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeLlama:
    """`llama_cpp.Llama` as the methods use it. Greedy continuation: `answer`, cycled. The
    prompt's eval costs PROMPT_COST a token; each later pass PASS_COST, evaluates its token and
    `drafts` lookup drafts, and emits 1 + `accepted` tokens (llama-cpp-python's `generate`
    loop: eval, then yield what the pass confirmed)."""

    def __init__(self, tokenizer: Any, clock: Clock, answer: Sequence[int], **kwargs: Any) -> None:
        self.tokenizer, self.clock, self.answer = tokenizer, clock, list(answer)
        self.kwargs = kwargs
        self.vocab = kwargs.pop("vocab", len(tokenizer))
        self.drafts = kwargs.pop("drafts", 0)
        self.accepted = kwargs.pop("accepted", 0)
        self.evals: list[int] = []
        self.closed = False
        self.sampling: dict[str, Any] = {}

    def n_vocab(self) -> int:
        return self.vocab

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text.decode(), add_special_tokens=False)

    def reset(self) -> None:
        self.evals.clear()

    def eval(self, tokens: Sequence[int]) -> None:
        self.clock.now += PROMPT_COST * len(tokens) if not self.evals else PASS_COST
        self.evals.append(len(tokens))

    def generate(self, tokens: Sequence[int], **sampling: Any) -> Generator[int, Any, None]:
        self.sampling = sampling
        self.eval(tokens)
        emitted = 0
        while True:
            for _ in range(1 if emitted == 0 else 1 + self.accepted):
                yield self.answer[emitted % len(self.answer)]
                emitted += 1
            self.eval([0] * (1 + self.drafts))

    def close(self) -> None:
        self.closed = True


class FakeLookup:
    def __init__(self, max_ngram_size: int, num_pred_tokens: int) -> None:
        self.max_ngram_size, self.num_pred_tokens = max_ngram_size, num_pred_tokens


def fake_library(tok: Any, answer: Sequence[int], **behaviour: Any) -> SimpleNamespace:
    """A stand-in for the llama_cpp module; `made` keeps the Llamas it built."""
    made: list[FakeLlama] = []

    def build(**kwargs: Any) -> FakeLlama:
        made.append(FakeLlama(tok, Clock(), answer, **behaviour, **kwargs))
        return made[-1]

    speculative = SimpleNamespace(LlamaPromptLookupDecoding=FakeLookup)
    return SimpleNamespace(Llama=build, llama_speculative=speculative, made=made)


def fake_engine(tok: Any, window: int = 256, rope: dict[str, Any] | None = None) -> Any:
    config = SimpleNamespace(rope_parameters=rope or {"rope_type": "default"})
    return SimpleNamespace(
        context_window=window,
        target=SimpleNamespace(config=config),
        tokenizer=tok,
        vocab_size=len(tok),
        eos_token_ids=frozenset({tok.eos_token_id}),
    )


# ---- names, the import guard, settings ------------------------------------------------------


def test_the_llama_methods_are_opt_in_names():
    assert set(LLAMA_METHODS) <= set(METHODS) and set(LLAMA_METHODS) <= set(OPT_IN_METHODS)
    assert not set(LLAMA_METHODS) & set(DEFAULT_METHODS)
    assert not set(LLAMA_METHODS) & set(BenchSettings.preset("long").methods)


def test_without_the_library_the_methods_are_skipped_with_one_log_line(monkeypatch, caplog):
    find_spec = llamacpp.importlib.util.find_spec
    missing = lambda name: None if name == llamacpp.LIBRARY else find_spec(name)  # noqa: E731
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", missing)
    llamacpp.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=llamacpp.__name__):
            settings = BenchSettings(methods=("lc", "llama.cpp", "llama.cpp-lookup"))
            assert [m.name for m in settings.method_list()] == ["lc"]
            long = dataclasses.replace(BenchSettings.preset("long"), methods=settings.methods)
            assert [m.name for m in long_methods(long)] == ["lc"]
    finally:
        llamacpp.available.cache_clear()
    (line,) = caplog.messages
    assert 'pip install "rapid-integrations[llamacpp]"' in line and "minutes" in line


def test_with_the_library_the_named_methods_run_after_the_engine_ones(monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    names = ("lc", "rapid", "hf-pld", "llama.cpp", "llama.cpp-lookup")
    settings = BenchSettings(methods=names, etas=(5.0,))
    assert [m.label for m in settings.method_list()] == [
        "lc",
        "rapid eta=5",
        "hf-pld",
        "llama.cpp",
        "llama.cpp-lookup",
    ]
    long = dataclasses.replace(BenchSettings.preset("long"), methods=names, gammas=())
    ran = [m.name for m in long_methods(long)]
    assert ran[0] == "lc" and ran[-3:] == ["hf-pld", "llama.cpp", "llama.cpp-lookup"]


def test_the_methods_need_a_gguf_model(monkeypatch, tmp_path):
    monkeypatch.setattr(llamacpp, "default_gguf_path", lambda: GGUF)
    assert llamacpp.gguf_file(None) == GGUF
    assert llamacpp.gguf_file("~/m.gguf") == Path("~/m.gguf").expanduser()
    assert llamacpp.gguf_file(str(tmp_path)) is None
    assert BenchSettings(methods=("llama.cpp",)).gguf() == GGUF
    assert BenchSettings(methods=("lc",)).gguf() is None
    for bad in ({"model": str(tmp_path)}, {"tiny_models": True}):
        with pytest.raises(RapidConfigError, match="methods"):
            BenchSettings(methods=("lc", "llama.cpp"), **bad)


def test_llamas_passes_do_not_widen_the_bounds_of_the_engines_passes():
    config = RapidConfig()
    lookup = Method("llama.cpp-lookup")
    assert widest_pass(config, [Method("lc"), Method("llama.cpp"), lookup]) == 1


# ---- the arguments llama.cpp gets -----------------------------------------------------------


def test_rope_scaling_maps_to_llamas_arguments():
    assert llamacpp.rope_kwargs({"rope_type": "default", "rope_theta": 1e5}) == {}
    assert llamacpp.rope_kwargs({}) == {}
    linear = llamacpp.rope_kwargs({"rope_type": "linear", "factor": 2})
    assert linear == {"rope_scaling_type": 1, "rope_freq_scale": 0.5}
    yarn = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8192}
    assert llamacpp.rope_kwargs({**yarn, "rope_theta": 1e5, "beta_fast": 16.0}) == {
        "rope_scaling_type": 2,
        "rope_freq_scale": 0.25,
        "yarn_orig_ctx": 8192,
        "yarn_beta_fast": 16.0,
    }
    for bad in ({"rope_type": "dynamic", "factor": 2}, {**yarn, "attention_factor": 1.5}):
        with pytest.raises(RapidConfigError, match=r"llama\.cpp cannot"):
            llamacpp.rope_kwargs(bad)


def test_the_context_holds_prompt_and_answer_within_the_targets_window():
    assert llamacpp.context_size(100, 48, 8192) == 148
    assert llamacpp.context_size(8180, 48, 8192) == 8192  # the answer cut as the engine cuts it
    with pytest.raises(ContextWindowExceededError, match="8192"):
        llamacpp.context_size(8192, 48, 8192)
    args = llamacpp.llama_kwargs(GGUF, 148, 2, {"rope_type": "linear", "factor": 2}, 10)
    assert args == {
        "model_path": str(GGUF),
        "n_ctx": 158,
        "n_threads": 2,
        "n_threads_batch": 2,
        "logits_all": True,  # the lookup's draft reads every position's logits
        "verbose": False,
        "rope_scaling_type": 1,
        "rope_freq_scale": 0.5,
    }


def test_load_adds_the_prompt_lookup_draft_only_for_the_lookup_method(tok):
    lib = fake_library(tok, [2])
    plain = llamacpp.load(GGUF, 100, 2, {}, 0, lib)
    lookup = llamacpp.load(GGUF, 100, 2, {}, PROMPT_LOOKUP_TOKENS, lib)
    assert "draft_model" not in plain.kwargs  # type: ignore[attr-defined]
    assert not plain.kwargs["logits_all"] and lookup.kwargs["logits_all"]  # type: ignore[attr-defined]
    draft = lookup.kwargs["draft_model"]  # type: ignore[attr-defined]
    assert (draft.max_ngram_size, draft.num_pred_tokens) == (2, PROMPT_LOOKUP_TOKENS)


def test_a_gguf_of_another_vocabulary_is_refused(tok):
    llamacpp.check_vocabulary(FakeLlama(tok, Clock(), [2]), tok, len(tok))
    with pytest.raises(VocabularyMismatchError, match="tokens"):
        llamacpp.check_vocabulary(FakeLlama(tok, Clock(), [2], vocab=99), tok, len(tok))
    other = FakeLlama(tok, Clock(), [2])
    other.tokenize = lambda text, add_bos=True, special=False: [3, 4]  # type: ignore[method-assign]
    with pytest.raises(VocabularyMismatchError, match="probe"):
        llamacpp.check_vocabulary(other, tok, len(tok))


# ---- timing arithmetic and the end of an answer ---------------------------------------------


def _generate(tok: Any, answer: Sequence[int], llama_kw: dict[str, Any] | None = None, **kw: Any):
    clock = Clock()
    llama = FakeLlama(tok, clock, answer, **(llama_kw or {}))
    kw = {"max_new_tokens": 5, "eos": frozenset({0}), **kw}
    return llamacpp.generate(llama, list(range(2, 102)), tok, clock=clock, **kw), llama


def test_prefill_is_the_prompts_eval_and_decode_the_passes_after(tok):
    run, llama = _generate(tok, tok.encode("abcdefgh"))
    assert llama.sampling == {
        "temp": 0.0,
        "top_k": 1,
        "top_p": 1.0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
    }
    assert run.prefill_seconds == pytest.approx(100 * PROMPT_COST)
    assert run.first_token_seconds == pytest.approx(100 * PROMPT_COST)
    assert run.total_seconds == pytest.approx(100 * PROMPT_COST + 4 * PASS_COST)
    assert (run.text, run.finish_reason, run.passes, run.drafted, run.accepted) == (
        "abcde",
        "length",
        5,
        0,
        0,
    )


def test_generation_ends_at_eos_or_a_stop_string_unless_eos_is_ignored(tok):
    answer = [*tok.encode("ab.cd"), 0]
    run, _ = _generate(tok, answer, max_new_tokens=10)
    assert (run.text, run.finish_reason, len(run.tokens)) == ("ab.cd", "eos", 5)
    run, _ = _generate(tok, answer, max_new_tokens=10, stop=(".",))
    assert (run.text, run.finish_reason, run.tokens) == ("ab", "stop", tok.encode("ab."))
    run, _ = _generate(tok, answer, max_new_tokens=8, eos=frozenset())
    assert len(run.tokens) == 8 and run.tokens[5] == 0


def test_lookup_passes_count_drafted_and_accepted_tokens(tok):
    """The prompt's pass emits 1 token, each later pass its own and 3 accepted drafts."""
    lookup = {"drafts": 10, "accepted": 3}
    run, llama = _generate(tok, tok.encode("abcdefghijk"), lookup, max_new_tokens=9)
    assert llama.evals == [100, 11, 11]
    assert (run.passes, run.drafted, run.accepted) == (3, 20, 6)
    assert run.total_seconds == pytest.approx(100 * PROMPT_COST + 2 * PASS_COST)
    run, llama = _generate(tok, tok.encode("abcdefghijk"), lookup, max_new_tokens=3)
    assert llama.evals == [100, 11] and (run.passes, run.accepted) == (2, 1)  # cut mid-pass


def test_the_record_of_a_llamacpp_call(tok):
    lib = fake_library(tok, [*tok.encode("bead cafe"), 0], drafts=10, accepted=1)
    engine = fake_engine(tok)
    ids = list(range(2, 42))
    method = Method("llama.cpp-lookup")
    run = measure_llamacpp(engine, method, ids, GGUF, max_new_tokens=48, library=lib)
    assert isinstance(run, Measurement)
    (llama,) = lib.made
    assert llama.closed and llama.kwargs["n_ctx"] == len(ids) + 48 + PROMPT_LOOKUP_TOKENS
    assert llama.kwargs["n_threads"] >= 1 and llama.kwargs["model_path"] == str(GGUF)
    assert (run.answer, run.finish_reason, run.new_tokens) == ("bead cafe", "eos", 9)
    assert run.context_tokens == len(ids) and run.draft_context_tokens == 0
    assert run.prefill_seconds >= 0 and run.time_to_first_token >= run.prefill_seconds
    assert run.decode_seconds >= 0 and run.peak_memory_bytes and run.baseline_memory_bytes
    # 10 yielded (9 and the eos): the prompt's pass and 5 passes of 1 + 1 accepted, minus one
    assert (run.target_forward_passes, run.drafted_tokens) == (6, 50)
    assert run.accepted_tokens == 4 and run.acceptance_rate == pytest.approx(4 / 50)
    assert run.gamma is None and run.forward_seconds is None


def test_a_prompt_past_the_window_is_refused_before_loading(tok):
    lib = fake_library(tok, [2])
    with pytest.raises(ContextWindowExceededError, match=r"llama\.cpp"):
        measure_llamacpp(
            fake_engine(tok, 32), Method("llama.cpp"), [2] * 40, GGUF, max_new_tokens=4, library=lib
        )
    assert lib.made == []


# ---- the real library, where it is installed ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", LLAMA_METHODS)
def test_the_real_library_decodes_the_embedded_gguf(smol_engine, name):
    """A short greedy call on the GGUF the embedded model ships as, its prompt longer than
    one llama.cpp batch (512 tokens: the lookup's logits array once held only that many);
    skipped without llama-cpp-python (`pip install "rapid-integrations[llamacpp]"`)."""
    pytest.importorskip(llamacpp.LIBRARY)
    from rapid_integrations.demo_data import demo_excerpt
    from rapid_integrations.models.loading import default_gguf_path
    from rapid_integrations.tokens import encode_prompt

    engine = smol_engine
    text = demo_excerpt(3000) + "\nList three colors of the rainbow."
    ids = encode_prompt([{"role": "user", "content": text}], engine.tokenizer, engine.vocab_size)
    assert len(ids) > 512
    gguf = default_gguf_path()
    run = measure_llamacpp(engine, Method(name), ids, gguf, max_new_tokens=8, ignore_eos=True)
    assert run.new_tokens == 8 and run.answer.strip() and run.finish_reason == "length"
    assert run.prefill_seconds > 0 and run.decode_tokens_per_second
    assert run.peak_memory_bytes and run.target_forward_passes >= 1
