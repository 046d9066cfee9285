"""`EngineArgs`: how to load a `RapidEngine`'s models, written once and checked before any
weights load (after vLLM's `EngineArgs`).

The engine's constructor, `RapidEngine.from_default`, both framework adapters and the CLI take
these options by the same names; each reads the list from here (`LOADING_FIELDS`) and checks
values with `EngineArgs.check`, which raises `RapidConfigError` naming the argument. Importing
this module loads neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rapid_integrations.config import DRAFT_PRECISIONS, TARGET_PRECISIONS, RapidConfig, check_choice
from rapid_integrations.errors import RapidConfigError

if TYPE_CHECKING:
    from rapid_integrations.models.loading import LoadOptions


@dataclass(frozen=True)
class EngineArgs:
    """The loading options of a `RapidEngine` (its constructor documents each).

    model / draft_model: a transformers model, a local folder, a `.gguf` file or a hub id
    (model None: the embedded SmolLM2-135M-Instruct; draft_model None: self-speculation).
    tokenizer: an object, a folder or hub id (loaded with `tokenizer_kwargs`), or None to find
    it next to the model. device / draft_device / dtype place and cast what is loaded;
    draft_precision / target_precision pick lower-precision copies (`config.DRAFT_PRECISIONS`,
    `config.TARGET_PRECISIONS`); model_kwargs / draft_model_kwargs go to `from_pretrained`;
    compile_draft runs the draft's decode passes through torch.compile.
    """

    model: Any = None
    draft_model: Any = None
    tokenizer: Any = None
    device: Any = None
    draft_device: Any = None
    dtype: Any = None
    draft_precision: str | None = None
    target_precision: str | None = None
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    draft_model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tokenizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    compile_draft: bool | None = None

    @property
    def self_draft(self) -> bool:
        """Whether the target drafts too (no separate draft model)."""
        return self.draft_model is None or self.draft_model is self.model

    def options(self) -> dict[str, Any]:
        """The options besides the models and tokenizer, as `RapidEngine`'s keyword arguments
        (None and empty ones left out: the engine's defaults apply)."""
        models = ("model", "draft_model", "tokenizer")
        return {
            name: value
            for name in LOADING_FIELDS
            if name not in models and (value := getattr(self, name)) is not None and value != {}
        }

    def check(
        self, config: RapidConfig | Mapping[str, Any] | None = None
    ) -> tuple[RapidConfig, LoadOptions, LoadOptions]:
        """The engine's config and the target's and draft's load options, every argument
        checked before anything loads (`RapidConfigError` naming the argument). `config` is a
        `RapidConfig` or a dict of its fields."""
        from rapid_integrations.models.loading import LoadOptions

        if config is not None and not isinstance(config, (RapidConfig, Mapping)):
            raise RapidConfigError(
                "config", f"must be a RapidConfig or a dict of its fields, got {config!r}"
            )
        if self.compile_draft is not None and not isinstance(self.compile_draft, bool):
            raise RapidConfigError(
                "compile_draft", f"must be True or False, got {self.compile_draft!r}"
            )
        if not isinstance(config, RapidConfig):
            config = RapidConfig().replace(**(config or {}))
        target = LoadOptions.check(
            self.device, self.dtype, self.model_kwargs or None, self.tokenizer_kwargs or None
        )
        draft = LoadOptions.check(
            self.draft_device,
            self.dtype,
            self.draft_model_kwargs or None,
            prefix="draft_",
            default_device=self.device,
        )
        if self.self_draft and draft.model_kwargs:
            raise RapidConfigError(
                "draft_model_kwargs", "apply only when the draft is loaded from a folder or hub id"
            )
        self._check_draft_precision(target if self.self_draft else draft)
        self._check_target_precision(target)
        return config, target, draft

    def _check_draft_precision(self, drafting: LoadOptions) -> None:
        """`RapidConfigError("draft_precision")` for a value not in `DRAFT_PRECISIONS` or a
        drafting model that cannot be copied."""
        if self.draft_precision is None:
            return
        check_choice("draft_precision", self.draft_precision, DRAFT_PRECISIONS)
        if self.draft_precision not in ("auto", "none") and drafting.places_model:
            raise RapidConfigError(
                "draft_precision",
                "cannot copy a device-mapped or quantized model; quantize the draft with "
                "draft_model_kwargs instead",
            )

    def _check_target_precision(self, target: LoadOptions) -> None:
        """`RapidConfigError("target_precision")` for a value not in `TARGET_PRECISIONS` or a
        target that cannot be copied; `RapidConfigError("draft_precision")` for a self-draft
        asked to run as another copy than a lower-precision target's own."""
        if self.target_precision is None:
            return
        check_choice("target_precision", self.target_precision, TARGET_PRECISIONS)
        if self.target_precision in ("auto", "none"):
            return
        if target.places_model:
            raise RapidConfigError(
                "target_precision",
                "cannot copy a device-mapped or quantized target; load it with its own "
                "quantization_config in model_kwargs instead",
            )
        if self.self_draft and self.draft_precision not in (None, "auto", "none"):
            raise RapidConfigError(
                "draft_precision",
                f"under self-speculation the draft is the {self.target_precision!r} target "
                "itself; leave draft_precision 'auto' (or 'none'), or pass a separate draft model",
            )


LOADING_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineArgs))
"""The loading options by name, in `EngineArgs`' order: the one list the adapters and the CLI
read."""
