"""The adapters' calls share the engine's batch (rapid_integrations/batching/batcher.py, docs/algorithm.md
section 14): LangChain `batch()` / `abatch()` of `ChatRapid` and `RapidLLM`, and concurrent
LlamaIndex `acomplete` / `achat` / stream calls, decode together on one `BatchRunner`, and each
answer is the one its call gets alone; an engine that cannot be packed runs them as before.

A slowed-down forward keeps the calls decoding long enough to overlap; a spy on
`BatchRunner.step` records how many calls each step carried (the batch really packed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from langchain_core.callbacks import BaseCallbackHandler
from llama_index.core.base.llms.types import ChatMessage

from langchain_rapid import ChatRapid
from langchain_rapid import RapidLLM as LangChainLLM
from llamaindex_rapid import RapidLLM as LlamaIndexLLM
from rapid_integrations import BatchRunner, ContextWindowExceededError, RapidConfig, RapidEngine
from tests.hardening import patched_forward, slow_down
from tests.tiny import char_tokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

STEP_SECONDS = 0.003  # added to every forward pass, so that the calls overlap
PROMPTS = ["abc def", "k", "fed cba. abc", "a b c d e f g h"]
TOO_LONG = "abc " * 200  # 800 tokens for a 512-token window


@pytest.fixture(scope="module")
def engine() -> RapidEngine:
    tok = char_tokenizer()
    target = tiny_llama(len(tok), seed=11, dtype=torch.float32, scale=0.5)
    draft = tiny_llama(len(tok), seed=12, layers=1, dtype=torch.float32, scale=0.5)
    config = RapidConfig(eta=0.0, temperature=0.0, max_new_tokens=16, ignore_eos=True)
    return RapidEngine(target, draft, tokenizer=tok, config=config)


@pytest.fixture
def widths(monkeypatch: pytest.MonkeyPatch, engine: RapidEngine) -> Iterator[list[int]]:
    """The calls each `BatchRunner.step` carried, while the forward is slowed down."""
    seen: list[int] = []
    step = BatchRunner.step

    def spy(runner: BatchRunner) -> int:
        seen.append(len(runner.running))
        return step(runner)

    monkeypatch.setattr(BatchRunner, "step", spy)
    with patched_forward(engine.target, slow_down(STEP_SECONDS)):
        yield seen


class Ends(BaseCallbackHandler):
    """The texts of the runs a handler saw end, and how many started."""

    def __init__(self) -> None:
        self.started = 0
        self.texts: list[str] = []

    def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
        self.started += 1

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.texts.append(response.generations[0][0].text)


def test_chat_batch_decodes_together_and_each_answer_is_its_invoke(
    engine: RapidEngine, widths: list[int]
) -> None:
    """`ChatRapid.batch` with a config per input: the inputs share steps, each answer is its
    own `invoke`'s, and each input's callbacks see its own run only."""
    chat = ChatRapid(engine=engine)
    alone = [chat.invoke(p).content for p in PROMPTS]
    assert max(widths, default=0) == 1, "an invoke alone is a batch of one"
    handlers = [Ends() for _ in PROMPTS]
    widths.clear()
    batched = chat.batch(PROMPTS, config=[{"callbacks": [h]} for h in handlers])
    assert max(widths, default=0) > 1, "the inputs shared steps"
    assert [m.content for m in batched] == alone
    assert [(h.started, h.texts) for h in handlers] == [(1, [a]) for a in alone]


def test_chat_abatch_with_a_bad_input_returns_its_error_and_the_others_answers(
    engine: RapidEngine, widths: list[int]
) -> None:
    """`abatch(..., return_exceptions=True)`: the prompt over the window is its error, as
    LangChain's `Runnable.abatch` gives it; the others decode together and equal `invoke`."""
    chat = ChatRapid(engine=engine)
    alone = [chat.invoke(p).content for p in PROMPTS]
    widths.clear()
    inputs = [*PROMPTS[:2], TOO_LONG, *PROMPTS[2:]]
    out = asyncio.run(chat.abatch(inputs, return_exceptions=True))
    assert isinstance(out[2], ContextWindowExceededError)
    assert [m.content for m in out[:2] + out[3:]] == alone
    assert max(widths, default=0) > 1


def test_llm_batch_starts_every_prompt_before_reading_one_and_keeps_their_order(
    engine: RapidEngine, widths: list[int]
) -> None:
    """`RapidLLM.batch` (one `generate` of every prompt, `BaseLLM.batch`) and `abatch`: the
    prompts decode together, answers in the prompts' order, each its own `invoke`'s; chunks
    of `max_concurrency` decode together too."""
    llm = LangChainLLM(engine=engine, raw_completion=True)
    alone = [llm.invoke(p) for p in PROMPTS]
    widths.clear()
    assert llm.batch(PROMPTS) == alone
    assert max(widths, default=0) == len(PROMPTS), "every prompt was in the batch at once"
    widths.clear()
    assert asyncio.run(llm.abatch(PROMPTS)) == alone
    assert max(widths, default=0) == len(PROMPTS)
    widths.clear()
    assert llm.batch(PROMPTS, config={"max_concurrency": 2}) == alone
    assert max(widths, default=0) == 2


def test_llm_batch_with_a_bad_prompt_fails_every_input_as_baseLLM_does(
    engine: RapidEngine, widths: list[int]
) -> None:
    """`BaseLLM.batch` runs the prompts as one `generate`: a prompt that cannot start fails
    every input (`return_exceptions=True` returns that error for each), and the calls started
    before it are stopped: the batch empties."""
    llm = LangChainLLM(engine=engine, raw_completion=True)
    out = llm.batch([PROMPTS[0], TOO_LONG, PROMPTS[1]], return_exceptions=True)
    assert all(isinstance(e, ContextWindowExceededError) for e in out)
    assert llm.invoke(PROMPTS[1]) == LangChainLLM(engine=engine, raw_completion=True).invoke(
        PROMPTS[1]
    )
    assert widths[-1] == 1, "the calls of the failed batch had left"


def test_llamaindex_concurrent_async_calls_share_the_batch(
    engine: RapidEngine, widths: list[int]
) -> None:
    """`acomplete`, `achat`, `astream_complete` and `astream_chat` from coroutines at once:
    one batch, and each answer is its own sequential call's."""
    llm = LlamaIndexLLM(engine=engine, raw_completion=True)
    messages = [ChatMessage(role="user", content=p) for p in PROMPTS[2:]]
    completions = [llm.complete(p).text for p in PROMPTS[:2]]
    chats = [llm.chat([m]).message.content for m in messages]
    widths.clear()

    async def streamed(responses: Any) -> str:
        text = ""
        async for response in await responses:
            text += response.delta or ""
        return text

    async def together() -> list[Any]:
        return await asyncio.gather(
            llm.acomplete(PROMPTS[0]),
            llm.achat([messages[0]]),
            streamed(llm.astream_complete(PROMPTS[1])),
            streamed(llm.astream_chat([messages[1]])),
        )

    done, chatted, streamed_text, streamed_chat = asyncio.run(together())
    assert max(widths, default=0) > 1, "the coroutines' calls shared steps"
    assert done.text == completions[0]
    assert chatted.message.content == chats[0]
    assert streamed_text == completions[1]
    assert streamed_chat == chats[1]


def test_an_engine_that_cannot_be_packed_runs_the_batch_call_by_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eager attention cannot be packed: `batch()` and concurrent LlamaIndex calls decode
    each call by itself (no runner steps), with the same answers."""
    tok = char_tokenizer()
    target = tiny_llama(len(tok), seed=11, dtype=torch.float32, scale=0.5)
    target.config._attn_implementation = "eager"  # the engine switches SDPA models only
    eager = RapidEngine(target, tokenizer=tok, config=RapidConfig(max_new_tokens=8, eta=0.0))
    stepped: list[int] = []
    monkeypatch.setattr(BatchRunner, "step", lambda runner: stepped.append(1) or 0)
    chat = ChatRapid(engine=eager)
    assert [m.content for m in chat.batch(PROMPTS)] == [chat.invoke(p).content for p in PROMPTS]
    llm = LlamaIndexLLM(engine=eager, raw_completion=True)

    async def together() -> list[Any]:
        return await asyncio.gather(*(llm.acomplete(p) for p in PROMPTS))

    assert [r.text for r in asyncio.run(together())] == [llm.complete(p).text for p in PROMPTS]
    assert stepped == []
