"""The parts of a call's output (docs/algorithm.md section 13): committed tokens become
reasoning text, answer text and, with tools, content and streamed tool-call fragments.

`Gate` is the reasoning section as a token-level automaton over the markers' token ids: the
engine's `Sections` routes tokens with it, and `constraints.Constraints` uses the same one to
keep the grammar off the section. `CallSplitter` takes the call markup out of the answer text
and streams each call's arguments as they are written.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

from rapid_integrations.config import RapidConfig
from rapid_integrations.output.outputs import CallFragment, Delta, ToolCall
from rapid_integrations.structured_output.tools import CALL_CLOSE, CALL_OPEN
from rapid_integrations.tokens import Detokenizer, partial_stop_suffix

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Place(NamedTuple):
    """Where the output stands against the section: "before" (the output so far is the first
    `matched` tokens of the start marker; nothing decided yet), "inside" (`spent` tokens since
    the start marker, of which the last `matched` begin the end marker) or "after" (the answer:
    the section has ended, or the output did not begin with one)."""

    phase: Literal["before", "inside", "after"]
    matched: int = 0
    spent: int = 0


ANSWER = Place("after")


@dataclass(frozen=True)
class Gate:
    """The reasoning section of one call: the markers' token ids, the thinking budget
    (`max_reasoning_tokens`, tokens between the markers; None: no limit) and `first`, where
    the output begins: inside when the prompt left a section open (a template that ends its
    generation prompt with the start marker)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    budget: int | None
    first: Place

    @classmethod
    def for_call(
        cls, tokenizer: PreTrainedTokenizerBase, cfg: RapidConfig, prompt: Sequence[int]
    ) -> Gate | None:
        """The call's gate, or None when reasoning is off: `cfg.reasoning` False, or None and
        the chat template has no start marker."""
        start, end = cfg.reasoning_markers
        template = getattr(tokenizer, "chat_template", None)
        if cfg.reasoning is False or (
            cfg.reasoning is None and not (isinstance(template, str) and start in template)
        ):
            return None
        ids = [tuple(tokenizer.encode(m, add_special_tokens=False)) for m in (start, end)]
        opened = _last(prompt, ids[0])
        first = (
            Place("inside") if opened >= 0 and _last(prompt, ids[1]) < opened else Place("before")
        )
        return cls(ids[0], ids[1], cfg.max_reasoning_tokens, first)

    def step(self, place: Place, token: int) -> Place:
        """The place after `token`."""
        if place.phase == "before":
            if token != self.start[place.matched]:
                return ANSWER
            matched = place.matched + 1
            return Place("inside") if matched == len(self.start) else Place("before", matched)
        if place.phase == "inside":
            matched = self._end_match(place.matched, token)
            if matched == len(self.end):
                return ANSWER
            return Place("inside", matched, place.spent + 1)
        return place

    def opens(self, place: Place, token: int) -> bool:
        """Whether `token` at `place` goes on with the start marker (so no grammar reads it)."""
        return place.phase == "before" and token == self.start[place.matched]

    def room(self, place: Place) -> int | None:
        """The most tokens that may be committed from `place` before the budget forces the end
        marker (None: no bound)."""
        if self.budget is None or place.phase == "after":
            return None
        if place.phase == "before":
            return len(self.start) - place.matched + self.budget
        return self.budget - place.spent

    def _end_match(self, matched: int, token: int) -> int:
        """How many tokens of the end marker the section ends with, after `token` follows
        the first `matched` of them (a marker that overlaps itself may restart partway)."""
        seen = (*self.end[:matched], token)
        for k in range(min(len(seen), len(self.end)), 0, -1):
            if seen[-k:] == self.end[:k]:
                return k
        return 0


def _last(ids: Sequence[int], marker: tuple[int, ...]) -> int:
    """Where `marker` last occurs in `ids` (-1: nowhere)."""
    n = len(marker)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i : i + n]) == marker:
            return i
    return -1


class Sections:
    """A call's committed tokens -> `Delta`s of reasoning text, answer text and call fragments.

    Stop strings apply to the answer only; marker tokens appear in no text. Tokens that may
    still be a marker's are held back until they are known not to be (`finish` releases them).
    `ids` are every committed token (markers included); `reasoning_tokens` those of the section.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop: Sequence[str],
        gate: Gate | None,
        tools: bool,
    ) -> None:
        self.ids: list[int] = []
        self.reasoning_tokens = 0
        self._gate = gate
        self.place = gate.first if gate else ANSWER
        self._answer = Detokenizer(tokenizer, stop)
        self._thought: Detokenizer | None = None
        if self.place.phase == "inside":
            self._thought = Detokenizer(tokenizer)
        self._tokenizer = tokenizer
        self._held: list[int] = []  # tokens that may still be a marker's
        self.calls = CallSplitter() if tools else None

    @property
    def stopped(self) -> bool:
        """The answer reached a stop string."""
        return self._answer.stopped

    @property
    def reasoning(self) -> str | None:
        """The section's text so far (None: no section)."""
        return None if self._thought is None else self._thought.text

    @property
    def text(self) -> str:
        """The answer so far (content without call markup, with tools)."""
        return self.calls.text if self.calls else self._answer.text

    def room(self) -> int | None:
        """Tokens the thinking budget lets the next pass commit (None: no bound)."""
        return self._gate.room(self.place) if self._gate else None

    def forced(self, room: int) -> list[int]:
        """The end marker's tokens (at most `room`) once the budget is spent, else []."""
        if self._gate is None or self._gate.room(self.place) != 0:
            return []
        return list(self._gate.end[:room])

    def push(self, token: int) -> Delta:
        """Commit one token; return what it releases."""
        self.ids.append(token)
        if self._gate is None or self.place.phase == "after":
            return self._to_answer([token])
        before, self.place = self.place, self._gate.step(self.place, token)
        if before.phase == "before":
            return self._opening(token)
        self.reasoning_tokens += 1
        self._held.append(token)
        if self.place.phase == "after":  # the end marker is complete
            self._held = []
            return Delta(reasoning=self._thought_finish())
        keep = self.place.matched
        free, self._held = (
            self._held[: len(self._held) - keep],
            self._held[len(self._held) - keep :],
        )
        return Delta(reasoning="".join(self._thought_push(t) for t in free))

    def finish(self) -> Delta:
        """Release everything held back: the call has ended."""
        held, self._held = self._held, []
        if self.place.phase == "inside":
            reasoning = "".join(self._thought_push(t) for t in held) + self._thought_finish()
            return Delta(reasoning=reasoning)
        out = self._to_answer(held, final=True)
        if self.calls is None:
            return out
        text, fragments = self.calls.finish()
        return Delta(out.text + text, tool_calls=out.tool_calls + fragments)

    def _opening(self, token: int) -> Delta:
        """A token read before anything was decided: held while it spells the start marker."""
        if self.place.phase == "before":
            self._held.append(token)
            return Delta()
        if self.place.phase == "inside":
            self.reasoning_tokens += len(self._held) + 1
            self._held = []
            self._thought = Detokenizer(self._tokenizer)
            return Delta()
        held, self._held = [*self._held, token], []
        return self._to_answer(held)

    def _thought_push(self, token: int) -> str:
        assert self._thought is not None
        return self._thought.push(token)

    def _thought_finish(self) -> str:
        assert self._thought is not None
        return self._thought.finish()

    def _to_answer(self, tokens: list[int], final: bool = False) -> Delta:
        text = "".join(self._answer.push(t) for t in tokens if not self._answer.stopped)
        if final:
            text += self._answer.finish()
        if self.calls is None:
            return Delta(text)
        shown, fragments = self.calls.push(text)
        return Delta(shown, tool_calls=fragments)


# A call's markup as the tools' grammar writes it, up to its arguments: the name is read from
# it, and the arguments' text streams from where it ends (the lookahead: the header is whole).
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
_CLOSING = re.compile(r"\s*")


@dataclass
class _OpenCall:
    """The call being read: its index, and once the header is read, its id, name and how much
    of its argument text has streamed."""

    index: int
    id: str | None = None
    name: str | None = None
    sent: int = 0


class CallSplitter:
    """Answer text deltas -> the content without call markup, and each call's fragments
    (docs/algorithm.md section 11).

    Content: holds back a tail that could still begin `<tool_call>`, everything inside a call,
    and whitespace next to calls or at the end, so the deltas concatenate to the content alone
    (`text`). Calls: the first fragment comes once `{"name": ..., "arguments": ` is read, then
    the argument text as it arrives, less a tail that may be the `}` closing the markup's
    object; `calls` are the complete calls, their `arguments_json` the fragments joined. A call
    in another JSON layout is sent whole when it closes; one cut off (or not JSON) is not a
    call, though its fragments were streamed.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._held = ""  # whitespace waiting for text after it
        self._call: _OpenCall | None = None
        self._after_call = False
        self._opened = 0
        self.text = ""
        self.calls: list[ToolCall] = []

    def push(self, delta: str) -> tuple[str, tuple[CallFragment, ...]]:
        """Take one delta; return the content now safe to show and the new fragments."""
        self._buffer += delta
        shown: list[str] = []
        fragments: list[CallFragment] = []
        while True:
            if self._call is not None:
                if not self._read_call(fragments):
                    break
                continue
            start = self._buffer.find(CALL_OPEN)
            if start >= 0:
                shown.append(self._show(self._buffer[:start]))
                self._buffer = self._buffer[start + len(CALL_OPEN) :]
                self._call, self._held = _OpenCall(self._opened), ""
                self._opened += 1
                continue
            keep = len(self._buffer) - partial_stop_suffix(self._buffer, [CALL_OPEN])
            shown.append(self._show(self._buffer[:keep]))
            self._buffer = self._buffer[keep:]
            break
        return self._record("".join(shown)), tuple(fragments)

    def finish(self) -> tuple[str, tuple[CallFragment, ...]]:
        """The end of the text: a partial or unclosed call and trailing whitespace drop."""
        tail = "" if self._call is not None else self._buffer.rstrip()
        self._buffer = ""
        return (self._record(self._show(tail)) if tail else ""), ()

    def _read_call(self, fragments: list[CallFragment]) -> bool:
        """Read the open call's buffer; True once the call closed (the buffer holds what
        follows it)."""
        call = self._call
        assert call is not None
        if call.id is None:
            header = _HEADER.match(self._buffer)
            if header:
                call.id, call.name = f"call_{secrets.token_hex(12)}", json.loads(header[1])
                fragments.append(CallFragment(call.index, call.id, call.name, ""))
                self._buffer = self._buffer[header.end() :]
        end = self._buffer.find(CALL_CLOSE)
        body = self._buffer if end < 0 else self._buffer[:end]
        if call.id is None:
            if end >= 0:
                self._whole(body, fragments)
        else:
            if end < 0:
                upto = _streamable(body)
            else:  # the markup's object closes with the last "}" before the close tag
                upto = body.rfind("}") if body.rstrip().endswith("}") else len(body)
            if upto > call.sent:
                fragments.append(CallFragment(call.index, None, None, body[call.sent : upto]))
                call.sent = upto
            if end >= 0:
                self._keep(call.id, call.name, body[: call.sent])
        if end < 0:
            return False
        self._buffer = self._buffer[end + len(CALL_CLOSE) :]
        self._call, self._after_call = None, True
        return True

    def _whole(self, body: str, fragments: list[CallFragment]) -> None:
        """A closed call whose header was never read: parsed whole, sent as one fragment."""
        assert self._call is not None
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
            return
        arguments = value.get("arguments")
        text = json.dumps(arguments if isinstance(arguments, dict) else {})
        call_id = f"call_{secrets.token_hex(12)}"
        fragments.append(CallFragment(self._call.index, call_id, value["name"], text))
        self._keep(call_id, value["name"], text)

    def _keep(self, call_id: str, name: str | None, arguments: str) -> None:
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return
        if isinstance(value, dict) and name is not None:
            self.calls.append(ToolCall(call_id, name, value, arguments))

    def _show(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        return body

    def _record(self, shown: str) -> str:
        self.text += shown
        return shown


def _streamable(arguments: str) -> int:
    """How much of an open call's argument text can stream: all but trailing whitespace (the
    openai SDK's partial JSON parser fails on a piece that ends in it) and a last "}" that
    only whitespace and a beginning of the close tag follow (it may close the markup's
    object)."""
    upto = len(arguments.rstrip())
    brace = arguments.rfind("}")
    if brace < 0:
        return upto
    rest = arguments[brace + 1 :]
    space = _CLOSING.match(rest)
    tail = rest[space.end() :] if space else rest
    return brace if CALL_CLOSE.startswith(tail) else upto
