"""`RapidLLM`: a LangChain string-in, string-out LLM that decodes with RAPID."""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import AsyncIterator, Generator, Iterable
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from rapid_integrations import RapidOutput
from rapid_integrations.adapters.params import completion_prompt
from rapid_integrations.adapters.timeouts import TimedRun
from rapid_integrations.output.openai_logprobs import openai_completion_logprobs

from ._base import RapidParams, aiter_in_thread


class RapidLLM(RapidParams, BaseLLM):
    """LLM on a local Hugging Face causal LM, decoded by retrieval-augmented speculation.

    A model whose tokenizer has a chat template (an instruct model) gets the prompt string as
    one user turn, which is how it is asked to answer; `raw_completion=True` sends the string
    as it is, for base models' continuation or prompts formatted by hand. The target reads all
    of it, the draft reads its head and question with the long middle replaced by retrieved
    passages (or passages from `retriever`). Weights load on the first call unless `engine`
    is given.

    Each generation's `generation_info` holds `model_name`, `finish_reason`, `rapid_stats`
    (the run's `RapidStats` as a dict) and `usage`; `llm_output["token_usage"]` sums the
    prompt and completion tokens of the batch.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    raw_completion: bool = False
    """Send the prompt string as it is, without the chat template's user turn."""

    @property
    def _llm_type(self) -> str:
        return "rapid"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self._identifying(), "raw_completion": self.raw_completion}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(**self._ls_params("llm", stop, kwargs))

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        # BaseLLM has no streaming switch of its own: `streaming` decides if tokens reach callbacks.
        callbacks = run_manager if self.streaming else None
        chunks = self._all_chunks(prompts, stop, kwargs, callbacks)
        return self._result(_merged(chunks, len(prompts)))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        callbacks = run_manager if self.streaming else None
        chunks = [item async for item in self._achunks(prompts, stop, kwargs, callbacks)]
        return self._result(_merged(chunks, len(prompts)))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Generator[GenerationChunk, None, None]:
        for _, chunk in self._all_chunks([prompt], stop, kwargs, run_manager):
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        async for _, chunk in self._achunks([prompt], stop, kwargs, run_manager):
            yield chunk

    def _all_chunks(
        self,
        prompts: list[str],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        run_manager: CallbackManagerForLLMRun | None = None,
    ) -> Generator[tuple[int, GenerationChunk], None, None]:
        """Each prompt's chunks (`_chunks`) with its index, one prompt after another. Every
        prompt's call is started before the first is read, so that in the engine's batch they
        decode together (`batch`, `generate`); closing this (or a failure, a prompt that
        cannot start included) stops them all."""
        with contextlib.ExitStack() as runs:
            started = [
                runs.enter_context(
                    contextlib.closing(self._start(self._as_prompt(p), stop, kwargs))
                )
                for p in prompts
            ]
            for index, run in enumerate(started):
                for chunk in self._chunks(run, run_manager):
                    yield index, chunk

    async def _achunks(
        self,
        prompts: list[str],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        run_manager: AsyncCallbackManagerForLLMRun | None,
    ) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """`_all_chunks` run in a worker thread; the event loop stays free between chunks."""
        stream = aiter_in_thread(lambda: self._all_chunks(prompts, stop, kwargs))
        # aclosing: a consumer that stops early stops the worker now, not at garbage collection.
        async with contextlib.aclosing(stream) as items:
            async for index, chunk in items:
                info = chunk.generation_info or {}
                if run_manager and "usage" not in info:  # not the closing chunk
                    await run_manager.on_llm_new_token(
                        chunk.text, chunk=chunk, logprobs=info.get("logprobs")
                    )
                yield index, chunk

    def _chunks(
        self, run: TimedRun, run_manager: CallbackManagerForLLMRun | None = None
    ) -> Generator[GenerationChunk, None, None]:
        """One chunk per engine step of `run` that released text or log probabilities, then
        a last one with the metadata. Log probabilities are in OpenAI's completion LLM's place
        and shape (`generation_info["logprobs"]`: tokens, token_logprobs, top_logprobs,
        text_offset), so that adding the chunks joins the lists."""
        offset = 0  # where the next chunk's tokens start in the text (text_offset)
        for delta in run.deltas():
            if not delta.releases(reasoning=False, calls=False):
                continue
            logprobs = (
                openai_completion_logprobs(delta.logprobs, offset) if delta.logprobs else None
            )
            offset += sum(len(e.token) for e in delta.logprobs)
            chunk = GenerationChunk(
                text=delta.text, generation_info={"logprobs": logprobs} if logprobs else None
            )
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk, logprobs=logprobs)
            yield chunk
        yield GenerationChunk(text="", generation_info=self._generation_info(run.output))

    def _as_prompt(self, prompt: str) -> str | list[dict[str, str]]:
        """The string as one user turn for a model with a chat template, unless raw."""
        return completion_prompt(prompt, self.get_engine().tokenizer, self.raw_completion)

    def _generation_info(self, output: RapidOutput) -> dict[str, Any]:
        """The last chunk's: metadata, usage, a reasoning section's text as
        `reasoning_content` (the text is the answer after it), and an empty `logprobs` when
        the call asked for them (so the key is there even when no token was emitted)."""
        info = {**self._response_metadata(output), "usage": self._usage(output)}
        if output.reasoning is not None:
            info["reasoning_content"] = output.reasoning
        if output.logprobs is not None:
            info["logprobs"] = openai_completion_logprobs(())
        return info

    def _result(self, generations: list[Generation]) -> LLMResult:
        """The batch result, with OpenAI-style token usage that LangChain callbacks sum up."""
        usages = [(g.generation_info or {})["usage"] for g in generations]
        prompt = sum(u["input_tokens"] for u in usages)
        completion = sum(u["output_tokens"] for u in usages)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        return LLMResult(
            generations=[[g] for g in generations],
            llm_output={"token_usage": usage, "model_name": self.model_label},
        )


def _merged(items: Iterable[tuple[int, GenerationChunk]], count: int) -> list[Generation]:
    """The chunks of `count` prompts, each tagged with its prompt's index, as one
    `Generation` per prompt, in the prompts' order."""
    chunks: list[list[GenerationChunk]] = [[] for _ in range(count)]
    for index, chunk in items:
        chunks[index].append(chunk)
    return [_merge(c) for c in chunks]


def _merge(chunks: Iterable[GenerationChunk]) -> Generation:
    """The chunks of one prompt joined into a single `Generation` (LangChain's chunk sum:
    texts and log-probability lists concatenated, the closing chunk's metadata kept)."""
    whole = functools.reduce(operator.add, chunks)
    return Generation(text=whole.text, generation_info=whole.generation_info)
