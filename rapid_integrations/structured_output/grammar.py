"""Grammars for constrained decoding, enforced with xgrammar (docs/algorithm.md section 10).

A `Grammar` is built (and checked) without a tokenizer; `GrammarCompiler` turns it into
token-level matchers for one engine's tokenizer, compiling each grammar once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

from rapid_integrations.errors import GrammarError


@dataclass(frozen=True)
class Grammar:
    """What a call's output must match. Build one with a constructor:

    `Grammar.json_schema(schema)`, `Grammar.regex(pattern)`, `Grammar.ebnf(text)`,
    `Grammar.json_object()`, `Grammar.union(*grammars)`. `kind` and `source` identify it
    (equal grammars compile once); `schema` is the JSON schema for json_schema grammars (None
    otherwise).
    """

    kind: str
    source: str
    schema: dict[str, Any] | None = field(compare=False, hash=False)
    xgrammar: xgr.Grammar = field(compare=False, hash=False, repr=False)

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | str, *, any_whitespace: bool = False
    ) -> Grammar:
        """JSON matching `schema` (a dict or its JSON text).

        any_whitespace=False writes compact JSON (", " and ": " separators): a model free to
        add whitespace can pad a document forever, and nothing parses differently.
        """
        parsed = _parse_schema(schema)
        text = json.dumps(parsed)
        built = _build(
            "JSON schema",
            lambda: xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace),
        )
        return cls("json_schema", f"{any_whitespace}:{text}", parsed, built)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's JSON mode)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching the regular expression `pattern` as a whole."""
        _require_str(pattern, "regex pattern")
        return cls("regex", pattern, None, _build("regex", lambda: xgr.Grammar.from_regex(pattern)))

    @classmethod
    def ebnf(cls, text: str, root_rule: str = "root") -> Grammar:
        """Text of the EBNF grammar `text` (GBNF style, as xgrammar reads it) from `root_rule`."""
        _require_str(text, "EBNF grammar")
        built = _build(
            "EBNF grammar", lambda: xgr.Grammar.from_ebnf(text, root_rule_name=root_rule)
        )
        return cls("ebnf", f"{root_rule}:{text}", None, built)

    @classmethod
    def structural_tag(cls, tag: Mapping[str, Any]) -> Grammar:
        """An xgrammar structural tag (`{"type": "structural_tag", "format": {...}}`): text
        with tagged regions such as tool calls (`tools` builds its call grammars so)."""
        text = json.dumps(tag)
        built = _build("structural tag", lambda: xgr.Grammar.from_structural_tag(text))
        return cls("structural_tag", text, None, built)

    @classmethod
    def union(cls, *grammars: Grammar) -> Grammar:
        """Text matching any one of `grammars` as a whole (tool calls or an answer in a
        schema, `Tools.grammar`)."""
        source = json.dumps([[g.kind, g.source] for g in grammars])
        built = _build("union", lambda: xgr.Grammar.union(*(g.xgrammar for g in grammars)))
        return cls("union", source, None, built)


class GrammarCompiler:
    """Token-level matchers for one tokenizer; each grammar is compiled once and cached.

    stop_ids: the ids that end generation; a matcher allows them once the grammar is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> None:
        self._stop = sorted(stop_ids)
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self._stop or None
        )
        self._compiler = xgr.GrammarCompiler(self._info)
        self._compiled: dict[Grammar, xgr.CompiledGrammar] = {}

    def matcher(self, grammar: Grammar) -> xgr.GrammarMatcher:
        """A fresh matcher at the start of `grammar`."""
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = _build(
                f"{grammar.kind} grammar", lambda: self._compiler.compile_grammar(grammar.xgrammar)
            )
            self._compiled[grammar] = compiled
        return xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop or None)


def _parse_schema(schema: Mapping[str, Any] | str) -> dict[str, Any]:
    """The schema as a dict, checked against its JSON Schema metaschema."""
    import jsonschema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"invalid JSON schema: not JSON ({exc})") from exc
    if not isinstance(schema, Mapping):
        raise GrammarError(f"invalid JSON schema: expected an object, got {type(schema).__name__}")
    schema = dict(schema)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise GrammarError(f"invalid JSON schema: {exc.message}") from exc
    return schema


def _require_str(value: object, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise GrammarError(f"the {what} must be a non-empty string, got {value!r:.80}")


def _build(what: str, build: Any) -> Any:
    """Run an xgrammar step, turning its errors into `GrammarError` naming `what`."""
    try:
        return build()
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise GrammarError(f"xgrammar cannot compile this {what}: {reason}") from exc
