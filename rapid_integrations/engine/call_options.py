"""`CallOptions`: everything one engine call takes besides its prompt, checked by name.

Every entry point (`RapidEngine.generate` / `stream` in their keyword form, the LangChain and
LlamaIndex adapters, the server) turns its per-call options into one flat mapping of names and
builds this object with `CallOptions.of`, so a misspelt option fails there, naming itself,
before anything runs. Framework-free and light: no torch import.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from rapid_integrations.config import FIELD_NAMES, Mode, check_mode
from rapid_integrations.errors import RapidConfigError

if TYPE_CHECKING:
    from rapid_integrations.structured_output.grammar import Grammar
    from rapid_integrations.tokens import Prompt


class _Unset(enum.Enum):
    ENGINE_RETRIEVER = "the engine's retriever"


ENGINE_RETRIEVER = _Unset.ENGINE_RETRIEVER
"""`CallOptions.retriever` when the call names none: the engine's own (`retriever=None` is the
built-in retriever over the prompt, even on an engine that has one)."""


def _frozen(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(config))


@dataclass(frozen=True)
class CallOptions:
    """One call's options: how it decodes (`mode`, `draft_prompt`), what feeds the draft
    (`retriever`, `query`), what the output must match (`grammar`, or `tools` with
    `tool_choice` and `parallel_tool_calls`; docs/algorithm.md sections 10-11), and `config`:
    `RapidConfig` fields applied over the engine's config for this call only.

    `draft_prompt` None builds the draft's prompt by retrieval; `query` None lets the retriever
    take the prompt's last question. Values are checked where they are used (the engine plans
    the call before decoding); names are checked here.
    """

    mode: Mode = "rapid"
    draft_prompt: Prompt | None = None
    retriever: Any = ENGINE_RETRIEVER
    query: str | None = None
    grammar: Grammar | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_mode(self.mode)
        _check_names(self.config, FIELD_NAMES, "RapidConfig field")
        object.__setattr__(self, "config", _frozen(self.config))

    @classmethod
    def of(cls, names: Mapping[str, Any]) -> CallOptions:
        """Options from one flat mapping: this class's fields by name, any other name a
        `RapidConfig` field. An unknown name raises `RapidConfigError` naming it."""
        _check_names(names, CALL_NAMES | FIELD_NAMES, "call option")
        config = {k: v for k, v in names.items() if k in FIELD_NAMES}
        return cls(**{k: v for k, v in names.items() if k in CALL_NAMES}, config=config)

    @classmethod
    def resolve(cls, options: CallOptions | None, names: Mapping[str, Any]) -> CallOptions:
        """`options` as given, or built from `names` (the keyword form); not both at once."""
        if options is None:
            return cls.of(names)
        if names:
            raise RapidConfigError(
                sorted(names)[0], "pass options=CallOptions(...) or keyword options, not both"
            )
        if not isinstance(options, CallOptions):
            raise RapidConfigError("options", f"must be a CallOptions, got {options!r}")
        return options

    @classmethod
    def for_call(
        cls,
        options: CallOptions | None,
        draft_prompt: Prompt | None,
        mode: Mode | None,
        overrides: Mapping[str, Any],
    ) -> CallOptions:
        """The options of a call made as `generate(prompt, draft_prompt, mode, options=,
        **overrides)` (the engine's and the batch runner's signature): `options`, or the
        keyword form's names built into them."""
        given = {"draft_prompt": draft_prompt, "mode": mode}
        return cls.resolve(
            options, {**{k: v for k, v in given.items() if v is not None}, **overrides}
        )


def _check_names(names: Mapping[str, Any], known: frozenset[str], what: str) -> None:
    unknown = sorted(set(names) - known)
    if unknown:
        raise RapidConfigError(
            ", ".join(unknown), f"unknown {what}; known: {', '.join(sorted(known))}"
        )


CALL_NAMES: frozenset[str] = frozenset(
    f.name for f in dataclasses.fields(CallOptions) if f.name != "config"
)
"""The names `CallOptions.of` takes besides `RapidConfig` fields: mode, retriever, tools, ..."""
