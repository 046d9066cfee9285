"""A request -> one engine call (`EngineCall`); an engine output -> OpenAI response objects.

Finish reasons: the engine's "eos" and "stop" are OpenAI's "stop"; "length" and "tool_calls"
stay. `usage` carries the call's `RapidStats` under the extension field `usage.rapid` (plus
the replica that served it), in every response and in the last chunk of a stream that asked
for usage (`stream_options.include_usage`). Tools and `response_format` become the engine's
`tools=` / `tool_choice=` / `grammar=` (docs/algorithm.md sections 10-11). `logprobs` and
`top_logprobs` (chat) or `logprobs: int` (completions) become the engine's `logprobs=` and
`top_logprobs=` (section 12), always passed, so that a call computes only what it asked for;
each choice's `logprobs` then has OpenAI's shape, in every chunk of a stream too.

`n` choices are n engine calls on the request's prompt (decoded side by side in the batch), each
answered under its own `index`, in chunks too. A request's `seed` is choice 0's; each later
choice gets a seed derived from it (`choice_options`), so that sampled choices differ and a
request repeats with its seed; greedy choices are identical. `usage` counts the prompt once and
the completions of every choice (OpenAI's and vLLM's counts); `usage.rapid` is choice 0's stats.

Reasoning (docs/algorithm.md section 13) comes back in vLLM's names: `message.reasoning_content`
and `delta.reasoning_content`, counted in `usage.completion_tokens_details.reasoning_tokens`; an
assistant message's `reasoning_content` in a request reaches the chat template, which renders
or drops it. Legacy completions return the raw text: reasoning is off there unless a request
asks for it. Tool calls stream as OpenAI's deltas: a call's first chunk has its index, id,
type and name, the next ones pieces of its arguments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from rapid_integrations.config import MAX_TOP_LOGPROBS, RapidConfig
from rapid_integrations.engine.call_options import CallOptions
from rapid_integrations.errors import GrammarError, RapidConfigError, RapidError
from rapid_integrations.output.openai_logprobs import (
    openai_chat_logprobs,
    openai_completion_logprobs,
)
from rapid_integrations.output.outputs import CallFragment, Delta, RapidOutput, TokenLogprob
from rapid_integrations.structured_output.tools import Tools
from rapid_integrations.tokens import Prompt

from .collection import Collection
from .errors import ServeError, unsupported
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _Request

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "tool_calls": "tool_calls"}


@dataclass(frozen=True)
class EngineCall:
    """One `engine.stream(prompt, options=options)` call, and how to answer it."""

    kind: str  # "chat", "text" or "responses"
    prompt: Prompt
    options: CallOptions
    stream: bool
    include_usage: bool
    model: str
    n: int = 1  # choices: one engine call each (checked by `check_choices`)
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    echo: dict[str, Any] = field(default_factory=dict)  # request fields a response repeats


def chat_call(request: ChatCompletionRequest, collections: Mapping[str, Collection]) -> EngineCall:
    """The engine call of a chat completion request; raises `ServeError` for what is refused."""
    messages = [_message(m, i) for i, m in enumerate(request.messages)]
    draft = request.draft_prompt
    draft_prompt = (
        [_message(m, i) for i, m in enumerate(draft)] if isinstance(draft, list) else draft
    )
    overrides = _overrides(request, request.max_completion_tokens or request.max_tokens)
    overrides |= _tool_options(request) | _response_format(request)
    overrides |= _logprob_options(bool(request.logprobs), request.top_logprobs or 0)
    collection = _collection(request, collections, overrides)
    prompt = collection.messages(messages) if collection else messages
    return _call("chat", request, prompt, draft_prompt, overrides)


def completion_call(
    request: CompletionRequest, collections: Mapping[str, Collection]
) -> EngineCall:
    """The engine call of a (legacy) completion request."""
    if request.echo:
        raise unsupported("echo", "echoing the prompt is not supported")
    if request.suffix:
        raise unsupported("suffix", "insertion (suffix) is not supported")
    if request.best_of not in (None, 1):
        raise unsupported("best_of", "only best_of=1 is supported")
    prompt = cast(Prompt, request.prompt)  # a list of strings is unwrapped next
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise unsupported("prompt", "one prompt per request (a list of one string at most)")
        prompt = prompt[0]
    overrides = _overrides(request, request.max_tokens) | _completion_logprobs(request.logprobs)
    if not {"reasoning", "max_reasoning_tokens"} & overrides.keys():
        overrides["reasoning"] = False  # the raw text, as vLLM's completions return it
    collection = _collection(request, collections, overrides)
    if collection:
        if not isinstance(prompt, str):
            raise unsupported("prompt", "a collection needs a string prompt")
        prompt = collection.prompt(prompt)
    draft = request.draft_prompt
    if isinstance(draft, list):
        raise ServeError(
            422,
            "draft_prompt: must be a string for /v1/completions",
            param="draft_prompt",
            code="invalid_value",
        )
    return _call("text", request, prompt, draft, overrides)


def _call(
    kind: str,
    request: _Request,
    prompt: Prompt,
    draft_prompt: Prompt | None,
    overrides: dict[str, Any],
) -> EngineCall:
    stream_options = request.stream_options
    options = CallOptions.of(
        {"mode": request.mode or "rapid", "draft_prompt": draft_prompt, **overrides}
    )
    return EngineCall(
        kind=kind,
        prompt=prompt,
        options=options,
        stream=bool(request.stream),
        include_usage=bool(stream_options and stream_options.include_usage),
        model=request.model,
        n=1 if request.n is None else request.n,
    )


def _overrides(request: _Request, max_tokens: int | None) -> dict[str, Any]:
    """`RapidConfig` overrides of the call (values are checked by the engine)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise unsupported(name, "penalties are not supported (send 0 or omit it)")
    if request.logit_bias:
        raise unsupported("logit_bias", "logit_bias is not supported")
    openai = {
        "max_new_tokens": max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stop": request.stop,
        "seed": request.seed,
        "query": request.query,
    }
    return {k: v for k, v in openai.items() if v is not None} | request.rapid_options()


def check_choices(n: int, most: int) -> None:
    """400 for an `n` outside 1..`most` (the server's running limit: every choice is a
    sequence of the batch), with OpenAI's error codes for it."""
    if n < 1:
        raise ServeError(
            400, f"n: must be at least 1, got {n}", param="n", code="integer_below_min_value"
        )
    if n > most:
        raise ServeError(
            400,
            f"n: at most {most} choices (this server's --max-running), got {n}",
            param="n",
            code="integer_above_max_value",
        )


def choice_options(call: EngineCall) -> list[CallOptions]:
    """The engine options of each of the call's `n` choices: the call's own, with a seed of
    its own per choice when the request gave one (`choice_seed`); without one, every call
    draws a fresh seed of its own."""
    seed = call.options.config.get("seed")
    if seed is None:
        return [call.options] * call.n
    config = call.options.config
    return [
        dataclasses.replace(call.options, config={**config, "seed": choice_seed(seed, i)})
        for i in range(call.n)
    ]


def choice_seed(seed: int, index: int) -> int:
    """Choice 0 keeps the request's seed (its answer is the n=1 answer); choice i a 63-bit
    hash of (seed, i), so that no choice shares the stream of another, nor of a request sent
    with a nearby seed."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _logprob_options(logprobs: bool, top_logprobs: int) -> dict[str, Any]:
    """The engine's `logprobs=` and `top_logprobs=`, checked here so that a bad value is a 400
    naming its field (top_logprobs above 20, negative, or without logprobs), as OpenAI's."""
    options: dict[str, Any] = {"logprobs": logprobs, "top_logprobs": top_logprobs}
    try:
        RapidConfig(**options)
    except RapidConfigError as exc:
        raise ServeError(400, str(exc), param=exc.field, code="invalid_value") from exc
    return options


def _completion_logprobs(logprobs: int | None) -> dict[str, Any]:
    """A legacy completion's `logprobs: N`: each token's log-probability and the N most likely
    alternatives (0 to 20; OpenAI's own legacy endpoint stops at 5, vLLM's at 20)."""
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ServeError(
            400,
            f"logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {logprobs}",
            param="logprobs",
            code="invalid_value",
        )
    return _logprob_options(logprobs is not None, logprobs or 0)


def _tool_options(request: ChatCompletionRequest) -> dict[str, Any]:
    """The engine's `tools=`, `tool_choice=` and `parallel_tool_calls=` (False: the grammar
    allows one call, so decoding ends after it), checked here first so that an error names its
    field (`tools`, then `tool_choice`); the engine checks them again as it plans the call."""
    if request.tools is None and request.tool_choice is None:
        return {}
    for param, choice in (("tools", None), ("tool_choice", request.tool_choice)):
        try:
            Tools.parse(request.tools, choice)
        except RapidError as exc:
            raise _invalid(param, exc) from exc
    one = {"parallel_tool_calls": False} if request.parallel_tool_calls is False else {}
    return {"tools": request.tools, "tool_choice": request.tool_choice, **one}


def _response_format(request: ChatCompletionRequest) -> dict[str, Any]:
    """The engine's `grammar=` of OpenAI's `response_format`: json_object (JSON mode) or
    json_schema; none for text. The schema is enforced whether or not it says `strict`; next
    to tools it is what an answer that is no call must match (`Tools.grammar`)."""
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return {}
    from rapid_integrations.structured_output.grammar import (
        Grammar,  # xgrammar loads on first use, as in the engine
    )

    if response_format.type == "json_object":
        return {"grammar": Grammar.json_object()}
    schema = response_format.json_schema.schema_ if response_format.json_schema else None
    if schema is None:
        raise ServeError(
            422,
            "response_format.json_schema.schema: a JSON schema object is required",
            param="response_format.json_schema",
            code="invalid_value",
        )
    try:
        return {"grammar": Grammar.json_schema(schema)}
    except GrammarError as exc:
        raise _invalid("response_format.json_schema.schema", exc) from exc


def _invalid(param: str, exc: RapidError) -> ServeError:
    """400 for the engine refusing the value of `param` (a tool spec, a tool choice, a schema)."""
    return ServeError(400, f"{param}: {exc}", param=param, code="invalid_request")


def _collection(
    request: _Request, collections: Mapping[str, Collection], overrides: dict[str, Any]
) -> Collection | None:
    """The collection the request names (its retriever goes into `overrides`), or None."""
    if request.collection is None:
        return None
    found = collections.get(request.collection)
    if found is None:
        known = ", ".join(sorted(collections)) or "none"
        raise ServeError(
            404,
            f"collection {request.collection!r} not found; this server has: {known}",
            param="collection",
            code="collection_not_found",
        )
    overrides["retriever"] = found.retriever
    return found


def _message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A chat message as the engine takes it: content flattened to one string."""
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise unsupported(f"messages.{index}.content", "only text content parts are supported")
        content = "".join(part.text or "" for part in content)
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content or ""}
    for name in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        if getattr(message, name) is not None:
            out[name] = getattr(message, name)
    return out


# ---- responses ------------------------------------------------------------------------------


def usage(outputs: Sequence[RapidOutput], replica: str) -> dict[str, Any]:
    """OpenAI usage counts of a request's choices (`outputs`, in order): the prompt once (of
    which `prompt_tokens_details.cached_tokens` came from the prefix cache, as choice 0 read
    it), the completions summed; plus the extension field `rapid`: choice 0's stats and the
    replica."""
    prompt = outputs[0].prompt_tokens
    completion = sum(len(o.token_ids) for o in outputs)
    reasoning = sum(o.stats.reasoning_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": outputs[0].stats.cached_prefix_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
        "rapid": {**outputs[0].stats.to_dict(), "replica": replica},
    }


def response(call: EngineCall, outputs: Sequence[RapidOutput], replica: str) -> dict[str, Any]:
    """The whole (non-streamed) response object of the choices' `outputs`, in order."""
    return {
        "id": call.id,
        "object": "chat.completion" if call.kind == "chat" else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": [_choice(call, index, output) for index, output in enumerate(outputs)],
        "usage": usage(outputs, replica),
    }


def _choice(call: EngineCall, index: int, output: RapidOutput) -> dict[str, Any]:
    """One choice of a whole response: its message (chat) or text, finish reason, logprobs."""
    finish = FINISH_REASONS[output.finish_reason]
    if call.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": output.text}
        if output.tool_calls:  # content is null next to calls when there is no text (OpenAI)
            message |= {"content": output.text or None, "tool_calls": tool_calls(output)}
        if output.reasoning is not None:
            message["reasoning_content"] = output.reasoning
        choice = {"index": index, "message": message, "finish_reason": finish}
    else:
        choice = {"index": index, "text": output.text, "finish_reason": finish}
    choice["logprobs"] = choice_logprobs(call, output.logprobs)
    return choice


def choice_logprobs(
    call: EngineCall, entries: Sequence[TokenLogprob] | None, offset: int = 0
) -> dict[str, Any] | None:
    """A choice's `logprobs` in OpenAI's shape for the call's endpoint (None when not asked
    for); `offset` is where the entries' text starts in a streamed completion."""
    if entries is None:
        return None
    if call.kind == "chat":
        return openai_chat_logprobs(entries)
    return openai_completion_logprobs(entries, offset)


def chunk(
    call: EngineCall,
    text: str | None = None,
    finish: str | None = None,
    *,
    role: bool = False,
    entries: Sequence[TokenLogprob] | None = None,
    offset: int = 0,
    reasoning: str = "",
    fragments: Sequence[CallFragment] = (),
    index: int = 0,
) -> dict[str, Any]:
    """One streamed chunk of choice `index`: a text delta (with its tokens' log
    probabilities, `entries`, when the call asked for them; chat: with reasoning text and
    tool-call fragments), the opening role (chat), or the finish reason."""
    if call.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None and (text or not (reasoning or fragments)):
            delta["content"] = text
        if reasoning:
            delta["reasoning_content"] = reasoning
        if fragments:
            delta["tool_calls"] = [_call_delta(f) for f in fragments]
        choice = {"index": index, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish}
        obj = "text_completion"
    choice["logprobs"] = choice_logprobs(call, entries, offset)
    out = {
        "id": call.id,
        "object": obj,
        "created": call.created,
        "model": call.model,
        "choices": [choice],
    }
    if call.include_usage:
        out["usage"] = None
    return out


def tool_calls(output: RapidOutput) -> list[dict[str, Any]]:
    """The output's calls as OpenAI `tool_calls` entries (arguments as JSON text)."""
    return [c.to_openai() for c in output.tool_calls]


def delta_chunks(
    call: EngineCall,
    delta: Delta,
    entries: Sequence[TokenLogprob] | None,
    offset: int,
    index: int = 0,
) -> list[dict[str, Any]]:
    """The chunks of one engine step of choice `index`: its text, reasoning and log probabilities in the first,
    and its call fragments split so that no chunk holds two of one call (the SDK's merge takes
    a chunk's list as it is: a call's opening fragment and its first arguments would be two
    calls)."""
    runs: list[list[CallFragment]] = [[]]
    for fragment in delta.tool_calls:
        if any(f.index == fragment.index for f in runs[-1]):
            runs.append([])
        runs[-1].append(fragment)
    first = chunk(
        call,
        delta.text,
        entries=entries,
        offset=offset,
        reasoning=delta.reasoning,
        fragments=runs[0],
        index=index,
    )
    return [first, *(chunk(call, fragments=run, index=index) for run in runs[1:])]


def _call_delta(fragment: CallFragment) -> dict[str, Any]:
    """A tool-call fragment as OpenAI streams it: the first of a call with its id, type and
    name, the others with argument text alone; the SDK merges them by index."""
    if fragment.id is None:
        return {"index": fragment.index, "function": {"arguments": fragment.arguments}}
    return {
        "index": fragment.index,
        "id": fragment.id,
        "type": "function",
        "function": {"name": fragment.name, "arguments": fragment.arguments},
    }


def usage_chunk(call: EngineCall, outputs: Sequence[RapidOutput], replica: str) -> dict[str, Any]:
    """The last chunk of a stream with `include_usage`: no choices, the usage of all."""
    return {**chunk(call), "choices": [], "usage": usage(outputs, replica)}
