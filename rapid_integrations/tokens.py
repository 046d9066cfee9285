"""Prompt encoding, end-of-sequence ids and incremental detokenization with stop strings."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from rapid_integrations.errors import RapidInputError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = Mapping[str, Any]
Prompt = str | Sequence[int] | Sequence[Message]

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
# Kept for templates that render them: OpenAI's tool keys, and an earlier assistant turn's
# reasoning (vLLM's and Qwen3's `reasoning_content`; docs/algorithm.md section 13).
_EXTRA_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")
# End-of-turn markers of common chat templates; counted as stops only when the tokenizer has them.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def is_chat(prompt: object) -> TypeGuard[Sequence[Message]]:
    """True for a non-empty sequence of role/content mappings."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) for m in prompt)
    )


def check_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Validate chat messages; return them as {role, content} dicts, with the OpenAI tool
    keys (`tool_calls`, `tool_call_id`, `name`) and `reasoning_content` kept for templates
    that render them (a template that does not drops them)."""
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise RapidInputError(
                f"message {i}: unknown role {role!r}; expected one of {sorted(CHAT_ROLES)}"
            )
        if not isinstance(content, str):
            raise RapidInputError(
                f"message {i}: content must be a string, got {type(content).__name__}"
            )
        extra = {k: m[k] for k in _EXTRA_KEYS if m.get(k) is not None}
        out.append({**extra, "role": role, "content": content})
    if not any(m["content"].strip() or m.get("tool_calls") for m in out):
        raise RapidInputError("all chat messages are empty")
    return out


def render_chat(
    messages: Sequence[Message],
    tokenizer: PreTrainedTokenizerBase,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Messages -> the prompt string of the tokenizer's chat template, ready for the assistant.

    template_kwargs: extra arguments of the template (`tools=` for one that renders tools)."""
    if not getattr(tokenizer, "chat_template", None):
        raise RapidInputError("chat messages given but the tokenizer has no chat template")
    # tokenize=False: the rendered string (transformers types every return form together).
    rendered = tokenizer.apply_chat_template(
        check_messages(messages),
        tokenize=False,
        add_generation_prompt=True,
        **(template_kwargs or {}),
    )
    return cast(str, rendered)


def encode_prompt(
    prompt: Prompt,
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """A string, token ids or chat messages -> token ids. Raises `RapidInputError` when unusable.

    template_kwargs go to the chat template (see `render_chat`)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RapidInputError("the prompt is empty")
        return list(tokenizer.encode(prompt))
    if is_chat(prompt):
        text = render_chat(prompt, tokenizer, template_kwargs)
        return list(tokenizer.encode(text, add_special_tokens=False))
    ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    if not isinstance(ids, Sequence) or not ids or isinstance(ids, (str, bytes)):
        raise RapidInputError(
            f"a prompt must be a non-empty string, token ids or chat messages, got {type(prompt).__name__}"
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise RapidInputError(f"token ids must be integers in [0, {vocab_size})")
    return list(ids)


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, generation_configs: Iterable[Any]
) -> frozenset[int]:
    """Every end-of-sequence / end-of-turn id the tokenizer and the generation configs know."""
    ids: set[int] = set()
    for source in (tokenizer, *generation_configs):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    vocab = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_tokens", []))
    ids.update(vocab[t] for t in _END_OF_TURN if t in vocab and t in special)
    return frozenset(ids)


class Detokenizer:
    """Turns committed token ids into text deltas, one token at a time.

    Never emits half a multi-byte character (a decode ending in U+FFFD waits for the next token),
    and holds back any tail that could still grow into a stop string. The concatenated deltas
    equal `tokenizer.decode(ids, skip_special_tokens=True)` cut before the first stop string,
    less a character left incomplete when generation ended mid-way through its bytes.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] decode to text already in self.text
        self._read = 0
        self._emitted = 0

    def _decode(self, ids: list[int]) -> str:
        # One flat id list decodes to one string (a list comes back only for a batch).
        return cast(str, self._tok.decode(ids, skip_special_tokens=True))

    def push(self, token: int) -> str:
        """Add one token; return the text that is now safe to show (may be empty)."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._append(after[len(before) :])
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush everything held back (the generation ended for another reason)."""
        if not self.stopped and self._read < len(self.ids):
            before = self._decode(self.ids[self._prefix : self._read])
            # Unread ids end in an incomplete character (else `push` took them): keep the whole
            # characters before it, drop the replacement marks standing for its bytes.
            self._append(self._decode(self.ids[self._prefix :])[len(before) :].rstrip("\ufffd"))
            self._read = len(self.ids)
        return self._release(final=True)

    def _append(self, piece: str) -> None:
        start = max(0, len(self.text) - max((len(s) for s in self._stop), default=0))
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not (final or self.stopped):
            end -= partial_stop_suffix(self.text, self._stop)
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta


def partial_stop_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
