"""The OpenAI shapes of `TokenLogprob`s (docs/algorithm.md section 12): chat
`logprobs.content` and legacy completions `logprobs`. Plain data, no torch: the server and
both framework adapters render the engine's entries through these alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rapid_integrations.output.outputs import TokenLogprob

JSON_FLOOR = -9999.0
"""What a log-probability of -inf is reported as in JSON, which has no infinity (vLLM's)."""


def _json(logprob: float) -> float:
    return max(logprob, JSON_FLOOR)


def openai_token(entry: TokenLogprob) -> dict[str, Any]:
    """One entry of chat `logprobs.content`: token, logprob, bytes, top_logprobs (and the
    extension `p_hat_logprob` when it was asked for)."""
    out: dict[str, Any] = {
        "token": entry.token,
        "logprob": _json(entry.logprob),
        "bytes": list(entry.token_bytes),
        "top_logprobs": [
            {"token": t.token, "logprob": _json(t.logprob), "bytes": list(t.token_bytes)}
            for t in entry.top_logprobs
        ],
    }
    if entry.p_hat_logprob is not None:
        out["p_hat_logprob"] = _json(entry.p_hat_logprob)
    return out


def openai_chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs`: {"content": [...], "refusal": None}."""
    return {"content": [openai_token(e) for e in entries], "refusal": None}


def openai_completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A legacy completion's (or chunk's) `logprobs`: tokens, token_logprobs, top_logprobs
    (one {token: logprob} per token) and text_offset (each token's start in the completion
    text, counting from `offset`: the length of the text of earlier chunks), plus the
    extension `p_hat_token_logprobs` when asked for."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    out: dict[str, Any] = {
        "tokens": [e.token for e in entries],
        "token_logprobs": [_json(e.logprob) for e in entries],
        "top_logprobs": [{t.token: _json(t.logprob) for t in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }
    if entries and entries[0].p_hat_logprob is not None:
        out["p_hat_token_logprobs"] = [_json(e.p_hat_logprob or 0.0) for e in entries]
    return out
