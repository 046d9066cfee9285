"""An OpenAI-compatible HTTP server for a `RapidEngine` (`rapid serve`), and its Ray Serve
deployment (`rapid serve --ray`). Needs the `serve` extra: `pip install "rapid-integrations[serve]"`.

One file per role (the running requests are decoded together by the package's
`batcher.Batcher`, which the framework adapters share):
  schemas     the request bodies (pydantic) and the RAPID extension fields they accept
  calls       a request -> one engine call; an engine output -> OpenAI response objects
  collection  server-side documents a request can name (FAISS index built at start)
  scheduler   the bounded queue of concurrent sequences (asyncio semaphore + waiting bound)
  metrics     Prometheus counters, gauges and histograms (prometheus-client)
  errors      the OpenAI error shape and which status each failure gets
  app         the FastAPI app and its routes
  settings    what a server (or a Ray replica) is started with; loads the engine
  ray_app     the same app as a Ray Serve deployment with N replicas and session affinity
  server      `rapid serve`: its options, and running the app on uvicorn or Ray Serve

Names load on first use, so that `rapid ask` works without the serve extra installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .settings import ServeSettings

__all__ = ["ServeSettings", "create_app"]
_LAZY = {"create_app": "app", "ServeSettings": "settings"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
