"""A live `rapid serve` on a loopback port over a tiny random model saved to a folder.

The server runs uvicorn in a thread of the test process (so tests can patch the engine and
watch its caches); clients reach it over real HTTP. `reference` is an in-process engine
loaded from the same folder: the answers must equal its own.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rapid_integrations import RapidEngine
from rapid_integrations.serve import ServeSettings, create_app
from rapid_integrations.serve.calls import EngineCall
from tests.tiny import char_tokenizer, tiny_llama

MODEL = "tiny"
DTYPE = "float32"


def save_tiny_model(
    folder: Path, tok: PreTrainedTokenizerFast | None = None, window: int = 1024
) -> Path:
    """A tiny random Llama with a `window`-token context and its character tokenizer (default
    `char_tokenizer()`), saved as a model folder."""
    tok = tok or char_tokenizer()
    tiny_llama(len(tok), seed=1, window=window, dtype=torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


class LiveServer:
    """uvicorn serving `app` on a free loopback port, in a thread."""

    def __init__(self, app: Any, shutdown_timeout: float = 5) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self) -> RapidEngine:
        return self.app.state.server.engine

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@contextmanager
def live_server(
    served_model_dir: Path, shutdown_timeout: float = 5, **settings: Any
) -> Iterator[LiveServer]:
    """A server over a fresh engine loaded from `served_model_dir`."""
    engine = RapidEngine(str(served_model_dir), dtype=DTYPE, device="cpu")
    app = create_app(engine, ServeSettings(**{"served_model_name": MODEL, **settings}))
    with LiveServer(app, shutdown_timeout) as server:
        yield server


def recorded_calls(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> list[EngineCall]:
    """The engine calls `server` makes from now on, in order, recorded where they start
    (batched or in a thread of their own)."""
    served = server.app.state.server
    seen: list[EngineCall] = []
    events = served.events

    def recording(call: EngineCall) -> Any:
        seen.append(call)
        return events(call)

    monkeypatch.setattr(served, "events", recording)
    return seen


def metric(text: str, name: str) -> float:
    """The value of an unlabelled metric in Prometheus text format."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def metrics_of(server: LiveServer) -> str:
    return httpx.get(server.url + "/metrics").text


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
