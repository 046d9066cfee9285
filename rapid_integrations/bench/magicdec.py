"""The `magicdec` bench method: MagicDec-style self-speculation (Chen et al. 2024), a
retrieval-free baseline. The target drafts for itself over a StreamingLLM cache, the attention sinks and a
recent window of the prompt (Xiao et al. 2023), and the full target verifies at eta 0.

The engine already verifies any draft context given as ids (mode "rapid", docs/algorithm.md
sections 2.1-2.3, C^S given by the caller), so the method is that mode on an engine whose
draft is the target itself, with C^S the streaming selection of the prompt's ids (positions
renumbered from 0, as StreamingLLM's rolling cache does), eta 0 (every emitted token follows
the target: greedy output is lc's, section 4) and no lookup copies (the method's own drafts
only). The window does not roll during a call: the draft's context grows by the tokens it
decodes, at most `max_new_tokens`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from rapid_integrations.engine.rapid_engine import RapidEngine

SINKS = 16
"""Prompt tokens kept at the start: the attention sinks."""
WINDOW = 512
"""Prompt tokens kept at the end: the recent window."""
OPTIONS = (("lookup_ngram", 0),)
"""`RapidConfig` overrides of the method: its drafts are the target's own, never copies."""

_SELF_DRAFTING: weakref.WeakKeyDictionary[RapidEngine, RapidEngine] = weakref.WeakKeyDictionary()


def streaming_ids(ids: Sequence[int], sinks: int = SINKS, window: int = WINDOW) -> list[int]:
    """The StreamingLLM selection of `ids`: the first `sinks` and the last `window` (all of
    them when they fit)."""
    if len(ids) <= sinks + window:
        return list(ids)
    return [*ids[:sinks], *ids[len(ids) - window :]]


def self_drafting(engine: RapidEngine) -> RapidEngine:
    """An engine on `engine`'s target, tokenizer and config whose draft is that target itself
    (no lower-precision copy), sharing `engine`'s prefix cache (entries are keyed by model);
    one per engine."""
    if engine not in _SELF_DRAFTING:
        twin = RapidEngine(
            engine.target,
            tokenizer=engine.tokenizer,
            config=engine.config,
            draft_precision="none",
            target_precision="none",
        )
        twin.prefix_cache = engine.prefix_cache
        _SELF_DRAFTING[engine] = twin
    return _SELF_DRAFTING[engine]
