"""The call contract (`CallOptions`) and the adapters' shared engine handle (`EngineHandle`).

Exactness of the calls themselves is pinned by the engine, adapter and server tests; these pin
what the contract promises: every name checked when the options are built, the object frozen,
and the engine built once (the tokenizer alone for counting) however many threads ask first.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from langchain_rapid import ChatRapid
from llamaindex_rapid import RapidLLM as LlamaIndexLLM
from rapid_integrations import CallOptions, RapidConfig, RapidConfigError, RapidEngine
from rapid_integrations.adapters.handle import EngineHandle
from rapid_integrations.adapters.params import LoadSpec
from rapid_integrations.engine.call_options import CALL_NAMES, ENGINE_RETRIEVER

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)


def test_every_name_is_a_call_option_or_a_config_field() -> None:
    names = {f.name: f.default for f in dataclasses.fields(RapidConfig)}
    options = CallOptions.of({"mode": "sd", "query": "q", **names})
    assert (options.mode, options.query, options.retriever) == ("sd", "q", ENGINE_RETRIEVER)
    assert dict(options.config) == names
    assert CALL_NAMES.isdisjoint(names)


def test_unknown_names_are_named_with_the_known_ones() -> None:
    with pytest.raises(RapidConfigError) as caught:
        CallOptions.of({"bogus": 1, "eta": 1.0, "zzz": 2})
    assert caught.value.field == "bogus, zzz"
    message = str(caught.value)
    assert "unknown call option" in message
    assert all(name in message for name in ("eta", "tool_choice", "retriever", "truncation"))
    with pytest.raises(RapidConfigError, match=r"^bogus: unknown RapidConfig field"):
        CallOptions(config={"bogus": 1})
    with pytest.raises(RapidConfigError, match=r"^mode: must be"):
        CallOptions.of({"mode": "fast"})


def test_options_are_frozen() -> None:
    options = CallOptions.of({"eta": 1.0, "tools": [{"type": "function"}]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.mode = "lc"  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.config["eta"] = 2.0  # type: ignore[index]
    config = {"eta": 1.0}
    kept = CallOptions(config=config)
    config["eta"] = 9.0  # the caller's dict changing later changes nothing
    assert kept.config["eta"] == 1.0


def test_options_or_the_keyword_form_not_both() -> None:
    options = CallOptions.of({"eta": 1.0})
    assert CallOptions.resolve(options, {}) is options
    assert CallOptions.resolve(None, {"gamma": 2}).config == {"gamma": 2}
    with pytest.raises(RapidConfigError, match=r"^gamma: pass options="):
        CallOptions.resolve(options, {"gamma": 2})
    with pytest.raises(RapidConfigError, match=r"^options: must be a CallOptions"):
        CallOptions.resolve({"eta": 1.0}, {})  # type: ignore[arg-type]


def test_the_engine_takes_options_as_it_takes_keywords(target: Any, tok: Any) -> None:
    engine = RapidEngine(target, tokenizer=tok)
    names = {"mode": "sd", "gamma": 3, "max_new_tokens": 12, "ignore_eos": True}
    options = CallOptions.of(names)
    out = engine.generate("kab def ghi", options=options)
    assert out.stats.mode == "sd" and len(out.token_ids) == 12
    assert out.token_ids == engine.generate("kab def ghi", **names).token_ids
    assert "".join(engine.stream("kab def ghi", options=options)) == out.text
    with pytest.raises(RapidConfigError, match=r"^mode: pass options="):
        engine.generate("kab def ghi", mode="lc", options=options)


# ---- the engine handle ---------------------------------------------------------------------


class _Loads:
    """Counts `LoadSpec.build` and `LoadSpec.load_tokenizer` calls; each build takes a while,
    so that threads asking at once all arrive while the first is still building."""

    def __init__(self) -> None:
        self.built: list[Any] = []
        self.tokenizers = 0
        self.tokenizer = object()

    def build(self, tokenizer: Any = None) -> object:
        time.sleep(0.05)
        self.built.append(tokenizer)
        return object()

    def load_tokenizer(self) -> object:
        self.tokenizers += 1
        return self.tokenizer


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> _Loads:
    counter = _Loads()
    monkeypatch.setattr(LoadSpec, "build", lambda _, tokenizer=None: counter.build(tokenizer))
    monkeypatch.setattr(LoadSpec, "load_tokenizer", lambda _: counter.load_tokenizer())
    return counter


ADAPTERS = {
    "handle": lambda: EngineHandle(None, {"model": "/nowhere/model"}),
    "ChatRapid": lambda: ChatRapid(model="/nowhere/model"),
    "llamaindex RapidLLM": lambda: LlamaIndexLLM(model="/nowhere/model"),
}


def _get(adapter: Any) -> Any:
    return adapter.get() if isinstance(adapter, EngineHandle) else adapter.get_engine()


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_concurrent_first_calls_build_one_engine(loads: _Loads, adapter: str) -> None:
    made = ADAPTERS[adapter]()
    start = threading.Barrier(8)
    engines: list[Any] = []

    def first_call() -> None:
        start.wait()
        engines.append(_get(made))

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(loads.built) == 1
    assert len(engines) == 8 and all(e is engines[0] for e in engines)


def test_the_tokenizer_loads_alone_and_once(loads: _Loads) -> None:
    handle = EngineHandle(None, {"model": "/nowhere/model"})
    assert handle.tokenizer() is handle.tokenizer() is loads.tokenizer
    assert (loads.tokenizers, loads.built) == (1, [])
    assert handle.built is None
    handle.get()
    assert loads.built == [loads.tokenizer]  # the build reuses it: no second load


def test_a_given_engine_brings_its_own_models() -> None:
    engine: Any = object()
    assert EngineHandle(engine, {}).get() is engine
    with pytest.raises(RapidConfigError, match=r"^engine: pass either a ready engine"):
        EngineHandle(engine, {"model": "/nowhere/model"})
