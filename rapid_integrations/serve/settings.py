"""What a server (or each Ray replica) is started with, and loading its engine and collections."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapid_integrations.errors import RapidConfigError

if TYPE_CHECKING:
    from rapid_integrations.engine.rapid_engine import RapidEngine

    from .collection import Collection

API_KEY_ENV = "RAPID_API_KEY"


@dataclass(frozen=True)
class ServeSettings:
    """Server settings (plain data: a Ray replica receives a pickled copy).

    model / draft / device / dtype: as `rapid ask` takes them (None model: the embedded
    SmolLM2); compile_draft: `RapidEngine`'s (a request decoded alone drafts through the
    compiled passes; a batch's packed draft passes stay eager, and its drafts copy a stored
    prefix rather than share it); served_model_name: the id clients pass as `model`;
    max_running: requests decoded together (the batch size); max_waiting: requests that may
    wait for a slot (more get 429); request_timeout: seconds from arrival to the last token
    (504 after); api_key: required as `Authorization: Bearer KEY` on every route but /health
    (None: open); collections: (name, path) pairs.
    """

    model: str | None = None
    draft: str | None = None
    device: str | None = None
    dtype: str = "auto"
    compile_draft: bool = False
    served_model_name: str = "rapid"
    max_running: int = 4
    max_waiting: int = 64
    request_timeout: float = 600.0
    api_key: str | None = None
    collections: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name, low in (("max_running", 1), ("max_waiting", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise RapidConfigError(name, f"must be an integer >= {low}, got {value!r}")
        if not self.request_timeout > 0:
            raise RapidConfigError("request_timeout", f"must be > 0, got {self.request_timeout!r}")

    def with_env_api_key(self) -> ServeSettings:
        """These settings, with the API key from `RAPID_API_KEY` when none was given."""
        from dataclasses import replace

        return replace(self, api_key=self.api_key or os.environ.get(API_KEY_ENV) or None)

    def load_engine(self) -> RapidEngine:
        """The engine: `model` (a folder, GGUF or hub id), else the embedded SmolLM2."""
        from rapid_integrations.engine.rapid_engine import RapidEngine
        from rapid_integrations.models.loading import ensure_default_model

        device, dtype, compiled = self.device, self.dtype, self.compile_draft
        if self.model:
            return RapidEngine(
                self.model, self.draft, device=device, dtype=dtype, compile_draft=compiled
            )
        ensure_default_model(progress=False)
        return RapidEngine.from_default(
            self.draft, device=device, dtype=dtype, compile_draft=compiled
        )

    def load_collections(self, engine: RapidEngine) -> dict[str, Collection]:
        from .collection import load_collection

        return {name: load_collection(name, path, engine) for name, path in self.collections}


def process_replica_id() -> str:
    """This process's name in responses when not under Ray: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"
