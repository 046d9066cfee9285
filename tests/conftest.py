"""Shared fixtures: tiny random models for exactness, the embedded SmolLM2 for quality."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs one pytest-xdist worker per core (docs/reliability.md, "Running the tests"):
# each worker, and the subprocesses its tests start, keeps to one torch thread. Two workers of
# two threads on two cores collapse: torch's OpenMP threads busy-wait for each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A test that asks for two threads (tests/test_deterministic.py) shares the cores with the
    # other worker: its OpenMP threads spinning for a descheduled peer cost it half its time
    # (the SmolLM2 observatory test beside one busy process: 65.6 s, passive 33.7 s).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from hypothesis import settings

from tests.tiny import char_tokenizer, tiny_llama

# The same examples on every run: a property test may not pass or fail by luck in CI.
settings.register_profile("deterministic", derandomize=True, deadline=None)
settings.load_profile("deterministic")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # were torch imported before this file, the variable came too late
# Engines keep torch's count rather than one chosen by the machine's load (rapid_integrations/
# threads.py): float32 sums reduce in another order on another count.
os.environ.setdefault("RAPID_NUM_THREADS", str(torch.get_num_threads()))


# The slowest files, slowest first (`pytest --durations=0`, summed per file). `make test`
# hands whole files to its workers in collection order (`--dist loadfile
# --no-loadscope-reorder`), the next to whichever worker is free: starting with the longest
# keeps every worker busy to the end instead of one running a long file alone (longest
# processing time first). A stale order costs only that balance, never a test.
SLOWEST_FIRST = (
    "test_compiled.py",
    "test_langchain_standard.py",
    "test_deterministic.py",
    "test_engine_exact.py",
    "test_engine_distribution.py",
    "test_bench.py",
    "test_serve_ray.py",
    "test_langchain_chains.py",
    "test_llamaindex_docs.py",
    "test_engine_adaptive.py",
    "test_grammar.py",
    "test_reasoning.py",
    "test_serve_tools.py",
    "test_tools.py",
    "test_retrieval_faiss.py",
    "test_bench_llamacpp.py",
    "test_kv_layouts.py",
    "test_langchain_agents.py",
    "test_system_message_context.py",
    "test_verdict_oracle.py",
    "test_agents_sdk.py",
    "test_retrieval_attention.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Collect the slowest files first, in `SLOWEST_FIRST`'s order (the sort is stable: the
    other files, and every file's own tests, keep their order)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Exempt what collection loaded (torch, transformers, LangChain, LlamaIndex, the test
    modules: over half a million objects) from the cyclic garbage collector: every full
    collection walked them all, and the tests that collect to prove a cache was freed
    (tests/hardening.py) paid it each time. Measured on the hardening and SmolLM2 LlamaIndex
    tests: 12 s of their 80 s in collections, 2.5 s frozen. Objects made later, fixtures'
    engines among them, are collected as before."""
    gc.freeze()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models and tensors: a thread pool only adds synchronization (its threads spin
    waiting: 30 times slower on a busy machine). Every module whose tests run tiny models uses
    it (`pytestmark`); those on the embedded models keep torch's pool, which their matrices fill.
    Module-wide, so that a module's shared engines and expected outputs come from the same
    thread count as its tests (float32 sums reduce in another order on another count). Under
    pytest-xdist every worker already has one thread, and this changes nothing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="session")
def target(tok):
    return tiny_llama(len(tok), seed=1)


@pytest.fixture(scope="session")
def draft(tok):
    return tiny_llama(len(tok), seed=2, layers=1)


@pytest.fixture(scope="module")
def eager(tok):
    """A tiny target (3 layers) whose attention transformers returns (eager): the oracle of
    the retrievers that read the target's attention."""
    model = tiny_llama(len(tok), seed=5, layers=3)
    model.set_attn_implementation("eager")
    return model


@pytest.fixture(scope="module")
def retrieving(target, draft, tok):
    """eta = 0 engines with a C^S budget far under the prompts' middles (tests/
    test_retrieval_attention.prompt), the embedder a hashing one."""
    from rapid_integrations import RapidConfig, RapidEngine
    from tests.retrieval_fixtures import HashingEmbedder

    cfg = RapidConfig(
        eta=0.0,
        max_new_tokens=24,
        ignore_eos=True,
        retrieval_budget=24,
        retrieval_embedder=HashingEmbedder(),
        retrieval_threshold=0.0,
    )
    return {
        "self": RapidEngine(target, tokenizer=tok, config=cfg),
        "separate": RapidEngine(target, draft, tokenizer=tok, config=cfg),
    }


@pytest.fixture(scope="module")
def engines(tok, target, draft):
    """eta = 0 engines on the tiny pair: self-speculation and a separate draft."""
    from rapid_integrations import RapidConfig, RapidEngine

    cfg = RapidConfig(eta=0.0, max_new_tokens=24, ignore_eos=True)
    return {
        "self": RapidEngine(target, tokenizer=tok, config=cfg),
        "separate": RapidEngine(target, draft, tokenizer=tok, config=cfg),
    }


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Llama (float64, 512-token window; the `target` fixture's weights) with its
    character tokenizer, for loading from a folder."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(len(char_tokenizer()), seed=1).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def smol():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32."""
    from rapid_integrations.models.loading import load_default

    return load_default(dtype="float32")


@pytest.fixture(scope="session")
def smol_bf16():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct in bf16, the dtype the engine
    loads it in by default on this CPU (a 2K-token prefill on one thread: a third of fp32's)."""
    from rapid_integrations.models.loading import load_default

    return load_default(dtype="bfloat16")


@pytest.fixture(scope="session")
def smol_engine(smol):
    from rapid_integrations import RapidEngine

    model, tokenizer = smol
    return RapidEngine(model, tokenizer=tokenizer)


@pytest.fixture(scope="session")
def _default_engine():
    from rapid_integrations import RapidEngine

    return RapidEngine.from_default()


@pytest.fixture(scope="module")
def default_engine(_default_engine):
    """The engine `RapidEngine.from_default()` builds, as a user gets it: SmolLM2 in the
    machine's default dtype (bf16 here) with the default draft (its int4 copy). Built once a
    worker; each module starts from an empty prefix cache, since a prefix another module left
    there would be read instead of computed, which rounds otherwise in bf16, and which modules
    share a worker varies from run to run."""
    _default_engine.prefix_cache.clear()
    return _default_engine


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory):
    """A tiny random Llama and its character tokenizer saved as a model folder (serve tests)."""
    from tests.serve_fixtures import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def reference(served_model_dir):
    """An in-process engine over `served_model_dir`: what the served answers must equal."""
    from rapid_integrations import RapidEngine
    from tests.serve_fixtures import DTYPE

    return RapidEngine(str(served_model_dir), dtype=DTYPE, device="cpu")
