"""What a call returns: `RapidOutput` with its `RapidStats`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["eos", "stop", "length", "tool_calls"]


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `id` like "call_<hex>", the tool's `name`, its `arguments`.

    `arguments_json`: the arguments' JSON text, as the model wrote it when it came from the
    output (what its streamed `CallFragment`s concatenate to), else `json.dumps(arguments)`;
    `to_openai` sends exactly it."""

    id: str
    name: str
    arguments: dict[str, Any]
    arguments_json: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.arguments_json:
            object.__setattr__(self, "arguments_json", json.dumps(self.arguments))

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments_json},
        }


@dataclass
class RapidStats:
    """Counters and timings of one call (seconds, tokens). Plain data: `to_dict()` is JSON-ready.

    overhead_fraction: share of decode time spent outside model forward passes (drafting
    and acceptance math, detokenization, Python). grammar_seconds: the part of it spent on
    grammar masks and matcher moves (docs/algorithm.md section 10), both models together.
    lean_skipped: the draft read the target's own prompt (nothing retrieved), so the call ran
    as eta 0 and `eta` says 0.0 (docs/algorithm.md section 1.1). grounded_rows: under
    `eta_rule="grounded"`, the committed tokens whose verify row leaned (the draft's top token
    continued a run of C^S, section 2.3); 0 under the other rules. follow_updates: under
    `retriever="following"`, the times C^S changed as the answer unfolded and the draft's
    short context was rebuilt (retrieved_tokens and draft_context_tokens then describe the
    last C^S); follow_seconds: the wall time of those scorings and rebuilds (section 2.13),
    part of decode_seconds.
    """

    mode: str = "rapid"
    eta: float = 0.0
    lean_skipped: bool = False
    grounded_rows: int = 0
    follow_updates: int = 0
    follow_seconds: float = 0.0
    gamma: int = 0
    seed: int | None = None
    target_context_tokens: int = 0
    draft_context_tokens: int = 0
    retrieved_tokens: int = 0
    retrieval_fallback: str | None = None
    cached_prefix_tokens: int = 0
    draft_cached_prefix_tokens: int = 0
    new_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    target_forward_passes: int = 0
    draft_forward_passes: int = 0
    prefill_seconds: float = 0.0
    time_to_first_token: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens_per_second: float = 0.0
    target_forward_seconds: float = 0.0
    draft_forward_seconds: float = 0.0
    grammar_seconds: float = 0.0
    overhead_fraction: float = 0.0
    mean_accepted_per_pass: float = 0.0
    lookup_offered_tokens: int = 0  # copies the draft read to vet (docs/algorithm.md 2.10)
    lookup_drafted_tokens: int = 0  # of drafted_tokens, those the lookup proposer copied
    lookup_accepted_tokens: int = 0
    # speculate_min_context="auto" measured drafting slower than the target alone and stopped
    # it for the rest of the call (docs/algorithm.md section 2.9).
    speculation_stopped: bool = False
    # The call started from the measured schedule an earlier call at its length left
    # (docs/algorithm.md section 2.11): no plain step timed, and stopped from the first pass
    # if drafting had been stopped.
    schedule_from_earlier_call: bool = False
    # Tokens of the reasoning section, its markers included (docs/algorithm.md section 13);
    # part of new_tokens.
    reasoning_tokens: int = 0

    def finalize(self) -> RapidStats:
        """Fill the derived rates from the counters; returns self."""
        self.acceptance_rate = (
            self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        )
        self.decode_tokens_per_second = (
            self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0
        )
        passes = self.target_forward_passes
        self.mean_accepted_per_pass = self.accepted_tokens / passes if passes else 0.0
        forward = self.target_forward_seconds + self.draft_forward_seconds
        self.overhead_fraction = (
            max(0.0, 1 - forward / self.decode_seconds) if self.decode_seconds else 0.0
        )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability (natural log) under the deciding model (docs/algorithm.md
    section 12).

    token: the token's text (its bytes decoded, U+FFFD standing for a part of a character);
    token_bytes: its exact bytes, which join into the text; logprob: log p(token), the model's
    raw log-softmax; p_hat_logprob: log p_hat(token), the law the verdict decided with (None
    unless asked); top_logprobs: the most likely tokens under p, most likely first (an
    alternative's own `top_logprobs` and `p_hat_logprob` are empty).
    """

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    p_hat_logprob: float | None = None
    top_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class RapidOutput:
    """The generated text and ids (end-of-sequence token and stop string excluded).

    With tools: `text` is the content without call markup, `tool_calls` the parsed calls,
    and `finish_reason` "tool_calls" when the output ended after calls. A structured answer
    or call cut off by `max_new_tokens` has `finish_reason` "length" (and no such call).
    `logprobs`: with `logprobs=True`, one `TokenLogprob` per entry of `token_ids` (call
    markup included); None otherwise.
    `reasoning`: the reasoning section's text, markers excluded (docs/algorithm.md section 13);
    None when the output had no section. `token_ids` hold the section's tokens too.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: RapidStats = field(default_factory=RapidStats)
    prompt_tokens: int = 0
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    reasoning: str | None = None


@dataclass(frozen=True)
class CallFragment:
    """A streamed piece of one tool call, in OpenAI's delta shape (docs/algorithm.md section
    11). A call's first fragment carries its `index` (0, 1, ... in the output), `id` and
    `name`, with `arguments` possibly ""; its later fragments carry only argument text (`id`
    and `name` None). A call's `arguments` fragments concatenate to its final
    `ToolCall.arguments_json`, and `id` is the final `ToolCall.id`."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class Delta:
    """One streamed step of a call: what the tokens committed by one target pass release.

    text: answer text (without call markup when tools are on). reasoning: reasoning text
    released by this step, markers excluded (section 13). tool_calls: tool-call fragments
    (`CallFragment`) released by this step. Every other kind of streamed
    content (reasoning, tool-call fragments, log probabilities) is a field of this one type,
    so a consumer reads one stream, not one per feature.
    logprobs: with `logprobs=True`, the `TokenLogprob`s of the token ids committed since the
    last delta (their text may still be held back, by a stop string's prefix or a character
    not yet complete).
    """

    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    reasoning: str = ""
    tool_calls: tuple[CallFragment, ...] = ()

    def releases(self, reasoning: bool = True, calls: bool = True) -> bool:
        """Whether this step released anything a stream shows: text, log probabilities, and
        (where the stream carries them) reasoning and tool-call fragments."""
        return bool(
            self.text
            or self.logprobs
            or (reasoning and self.reasoning)
            or (calls and self.tool_calls)
        )


class Deltas(list[Delta]):
    """A call's committed deltas not yet handed on: its loop appends (`emit`), whoever
    drives it takes them after each pass (alone: `RapidEngine._run`; batched: `take_deltas`)."""

    def take(self) -> list[Delta]:
        """The deltas appended since the last take, in order; the buffer is left empty."""
        taken = self[:]
        self.clear()
        return taken


class RapidStream(Iterator[str]):
    """Iterator of text deltas; `output` holds the `RapidOutput` once it is exhausted.
    `deltas()` iterates the same call as `Delta` objects instead (use one or the other).

    Closing it (or dropping it) stops generation and frees its KV caches.
    """

    def __init__(self, run: Generator[Delta, None, RapidOutput]) -> None:
        self._run = run
        self.output: RapidOutput | None = None

    def __next__(self) -> str:
        while not (delta := self._next_delta()).text:
            pass  # a step that released no answer text
        return delta.text

    def deltas(self) -> Iterator[Delta]:
        """Every step of the call as a `Delta`, text or not."""
        while True:
            try:
                yield self._next_delta()
            except StopIteration:
                return

    def _next_delta(self) -> Delta:
        try:
            return next(self._run)
        except StopIteration as done:
            self.output = done.value
            raise

    def close(self) -> None:
        self._run.close()

    def __enter__(self) -> RapidStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
