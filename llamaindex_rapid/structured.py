"""Structured output on the constrained path (docs/algorithm.md section 10).

`structured_predict` and its async and streaming variants (and so `as_structured_llm`, which
calls them) send the formatted prompt with the output class's JSON schema as the call's
grammar, so every completed answer is a document of that schema, then validate it into the
class, as llama-index-llms-ollama does with its `format=` schema. A `pydantic_program_mode`
other than the default keeps LlamaIndex's own programs. An answer cut off by the token limit
raises `StructuredOutputError` naming the cause instead of parsing half a document.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse
from llama_index.core.bridge.pydantic import BaseModel
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms.llm import LLM
from llama_index.core.output_parsers.base import OutputParserException
from llama_index.core.program.utils import FlexibleModel, process_streaming_objects
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.types import Model, PydanticProgramMode

from rapid_integrations import RapidConfigError, RapidError

dispatcher = get_dispatcher(__name__)
# Why a structured answer ended before its document was complete, by finish reason.
_CUT_OFF = {
    "length": "the token limit (finish_reason='length'); raise max_new_tokens",
    "stop": "a stop string (finish_reason='stop'); drop the stop strings for structured calls",
}


class StructuredOutputError(RapidError, OutputParserException):
    """A structured answer that ended before its JSON document was complete: cut off by the
    token limit (`finish_reason="length"`) or a stop string (`"stop"`). `text` holds what was
    generated, `finish_reason` why it ended.

    Deliberately not a `ValueError` (as `ContextWindowExceededError`): LlamaIndex's
    synthesizers catch `ValueError` as a parsing failure and answer "Empty Response".
    """

    def __init__(self, output_cls: type[BaseModel], text: str, finish_reason: str) -> None:
        super().__init__(
            f"the {output_cls.__name__} answer was cut off after {len(text)} characters, "
            f"before its JSON was complete, by {_CUT_OFF[finish_reason]}"
        )
        self.text = text
        self.finish_reason = finish_reason


class StructuredByGrammar(LLM):
    """`structured_predict` and its variants with the output class's schema as the grammar."""

    @dispatcher.span
    def structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages, kwargs = self._structured_call(output_cls, prompt, llm_kwargs, prompt_args)
        return parse(output_cls, self.chat(messages, **kwargs))

    @dispatcher.span
    async def astructured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages, kwargs = self._structured_call(output_cls, prompt, llm_kwargs, prompt_args)
        return parse(output_cls, await self.achat(messages, **kwargs))

    @dispatcher.span
    def stream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Generator[Model | FlexibleModel, None, None]:
        """Partial objects (LlamaIndex's `FlexibleModel`, the fields complete so far) while
        the answer streams, then the validated `output_cls` object."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().stream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages, kwargs = self._structured_call(output_cls, prompt, llm_kwargs, prompt_args)
        objects = _Objects(output_cls)
        return (objects.next(r) for r in self.stream_chat(messages, **kwargs))

    @dispatcher.span
    async def astream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> AsyncGenerator[Model | FlexibleModel, None]:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astream_structured_predict(
                output_cls, prompt, llm_kwargs, **prompt_args
            )
        messages, kwargs = self._structured_call(output_cls, prompt, llm_kwargs, prompt_args)
        objects = _Objects(output_cls)
        responses = await self.astream_chat(messages, **kwargs)
        return (objects.next(r) async for r in responses)

    def _structured_call(
        self,
        output_cls: type[BaseModel],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None,
        prompt_args: dict[str, Any],
    ) -> tuple[list[ChatMessage], dict[str, Any]]:
        """The chat messages of one structured call (the prompt formatted, after the LLM's
        system prompt) and its chat() arguments, with the output class's schema as grammar."""
        from rapid_integrations.structured_output.grammar import Grammar

        kwargs = dict(llm_kwargs or {})
        if "grammar" in kwargs:
            raise RapidConfigError(
                "grammar", "structured output builds its grammar from output_cls; pass none"
            )
        kwargs["grammar"] = Grammar.json_schema(output_cls.model_json_schema())
        messages = prompt.format_messages(llm=self, **prompt_args)
        return self._extend_messages(messages), kwargs


def parse(output_cls: type[Model], response: ChatResponse) -> Model:
    """The answer validated into `output_cls`; a cut-off answer raises `StructuredOutputError`."""
    text = response.message.content or ""
    finish_reason = (response.raw or {}).get("finish_reason")
    if finish_reason in _CUT_OFF:
        raise StructuredOutputError(output_cls, text, finish_reason)
    return output_cls.model_validate_json(text)


class _Objects:
    """One structured stream's objects: partial ones while text arrives (LlamaIndex's own
    repair of incomplete JSON), then, from the last response (the one with the finish reason),
    the validated answer."""

    def __init__(self, output_cls: type[BaseModel]) -> None:
        self._output_cls = output_cls
        self._so_far: list[Any] | None = None

    def next(self, response: ChatResponse) -> Any:
        if "finish_reason" in (response.raw or {}):
            return parse(self._output_cls, response)
        partial = process_streaming_objects(
            response, self._output_cls, cur_objects=self._so_far, flexible_mode=True
        )
        self._so_far = [partial]
        return partial
