"""One line of a call's stats for a shell user, shared by `rapid ask/chat` and `make demo`."""

from __future__ import annotations

from rapid_integrations.output.outputs import RapidOutput, RapidStats


def format_stats(out: RapidOutput) -> str:
    """One line of stats for a shell user (seconds, tokens)."""
    s: RapidStats = out.stats
    parts = [
        f"[{s.mode}] {s.new_tokens} tokens ({out.finish_reason})",
        f"decode {s.decode_tokens_per_second:.1f} tok/s",
        f"prefill {s.prefill_seconds:.1f} s",
        f"first token {s.time_to_first_token:.1f} s",
        f"target context {s.target_context_tokens} tokens",
    ]
    if s.draft_context_tokens:
        parts.append(f"draft context {s.draft_context_tokens} tokens")
    if s.drafted_tokens:
        parts.append(f"acceptance {s.acceptance_rate:.2f} (eta {s.eta:g}, gamma {s.gamma})")
    if s.retrieval_fallback:
        parts.append(f"retrieval fell back: {s.retrieval_fallback}")
    return " | ".join(parts)
