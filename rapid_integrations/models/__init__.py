"""Model loading: the embedded SmolLM2 and MiniLM packages, conversion, and weight-only copies.

`load_default`, `ensure_default_model`, `default_embedder_path` and `default_model_dir` are the
public loaders, importable from here; they load lazily, so importing this package costs nothing
until one is used. `python -m rapid_integrations.models` converts the embedded model once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rapid_integrations.models.loading import (
        default_embedder_path,
        default_model_dir,
        ensure_default_model,
        load_default,
    )

__all__ = ["default_embedder_path", "default_model_dir", "ensure_default_model", "load_default"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rapid_integrations.models import loading

        return getattr(loading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
