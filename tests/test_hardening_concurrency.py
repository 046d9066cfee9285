"""Many calls at once, and consumers that walk away: results equal the same calls made one by
one, and an abandoned generation frees its thread and its KV caches.

One engine (and its prefix cache) serves every call. Calls mix modes, eta > 0 (so the draft's
cache shapes the output: cross-talk between draft caches would change tokens, not just speed),
seeded sampling, streams and failing calls; acceptance counts are compared too. The existing
`test_prefix_cache.py` runs 4 threads on eta = 0 greedy, where only the target matters.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import pytest
from llama_index.core.llms import ChatMessage
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from langchain_rapid import ChatRapid
from langchain_rapid import RapidLLM as LangChainLLM
from llamaindex_rapid import RapidLLM as LlamaIndexLLM
from rapid_integrations import RapidConfig, RapidEngine, RapidError
from tests.hardening import idle_threads, patched_forward, settle_threads, slow_down, track_caches

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

DOC = "abc def ghi jkl. " * 8
QUESTIONS = ["what is a.", "and b d.", "kab.", "def ghi."]
CALLS: list[tuple[str, dict[str, Any]]] = [
    *((q, {"mode": "rapid"}) for q in QUESTIONS),
    *((q, {"mode": "rapid", "eta": 0.0}) for q in QUESTIONS[:2]),
    *((q, {"mode": "sd"}) for q in QUESTIONS[2:]),
    *((q, {"mode": m}) for q, m in zip(QUESTIONS[:2], ["lc", "rag"], strict=True)),
    *((q, {"temperature": 1.0, "top_p": 0.9, "seed": s}) for s, q in enumerate(QUESTIONS)),
    ("", {}),  # fails: empty prompt
    ("abc", {"max_new_tokens": 0}),  # fails: invalid value
]
THREADS = 8


@pytest.fixture
def engine(target: PreTrainedModel, draft: PreTrainedModel, tok: PreTrainedTokenizerBase):
    cfg = RapidConfig(eta=4.0, gamma=4, max_new_tokens=20, ignore_eos=True)
    return RapidEngine(target, draft, tokenizer=tok, config=cfg)


def call(engine: RapidEngine, index: int) -> tuple[Any, ...]:
    """Call `index` of CALLS, by generate (even) or stream (odd): ids, acceptance, or error."""
    question, kwargs = CALLS[index]
    prompt = DOC + question if question else question
    try:
        if index % 2:
            stream = engine.stream(prompt, "ghi " + question, **kwargs)
            text = "".join(stream)
            out = stream.output
            assert out is not None and text == out.text
        else:
            out = engine.generate(prompt, "ghi " + question, **kwargs)
    except RapidError as error:
        return (type(error).__name__,)
    return out.text, out.token_ids, out.stats.drafted_tokens, out.stats.accepted_tokens


def test_threads_match_sequential_calls_with_the_prefix_cache(engine: RapidEngine) -> None:
    order = list(range(len(CALLS))) * 2  # each call twice: the second finds its prefix cached
    sequential = [call(engine, i) for i in order]
    assert sum(len(r) == 1 for r in sequential) == 4  # the failing calls did fail
    engine.prefix_cache.clear()
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        concurrent = list(pool.map(lambda i: call(engine, i), order))
    assert concurrent == sequential


# ---- asyncio through the frameworks ----------------------------------------------------------


async def chat_ainvoke(engine: RapidEngine, prompt: str) -> str:
    return str((await ChatRapid(engine=engine).ainvoke(prompt)).content)


async def llm_ainvoke(engine: RapidEngine, prompt: str) -> str:
    return await LangChainLLM(engine=engine).ainvoke(prompt)


async def chat_astream(engine: RapidEngine, prompt: str) -> str:
    return "".join([str(c.content) async for c in ChatRapid(engine=engine).astream(prompt)])


async def index_acomplete(engine: RapidEngine, prompt: str) -> str:
    return (await LlamaIndexLLM(engine=engine).acomplete(prompt)).text


async def index_achat(engine: RapidEngine, prompt: str) -> str:
    message = ChatMessage(role="user", content=prompt)
    return str((await LlamaIndexLLM(engine=engine).achat([message])).message.content)


async def index_astream(engine: RapidEngine, prompt: str) -> str:
    return [c.text async for c in await LlamaIndexLLM(engine=engine).astream_complete(prompt)][-1]


ASYNC_CALLS = [chat_ainvoke, llm_ainvoke, chat_astream, index_acomplete, index_achat, index_astream]


async def test_asyncio_tasks_match_sequential_calls(engine: RapidEngine) -> None:
    jobs = [(method, DOC + q) for method in ASYNC_CALLS for q in QUESTIONS]
    sequential = [await method(engine, prompt) for method, prompt in jobs]
    engine.prefix_cache.clear()
    together = await asyncio.gather(*(method(engine, prompt) for method, prompt in jobs))
    assert list(together) == sequential


# ---- consumers that stop reading -------------------------------------------------------------


@pytest.fixture
def slow_engine(engine: RapidEngine) -> Iterator[RapidEngine]:
    """The engine with a target 10 ms slower per pass and 400 tokens to write: even with every
    draft accepted, 80 passes outlast the 0.3 s after which the tests walk away."""
    engine.config = engine.config.replace(max_new_tokens=400)
    with patched_forward(engine.target, slow_down(0.01)):
        yield engine


def test_an_engine_stream_closed_or_dropped_halfway_frees_its_caches(
    engine: RapidEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches = track_caches(monkeypatch)
    stream = engine.stream(DOC + "kab.", "kab")
    next(stream)
    assert caches.alive() == 2  # target and draft
    stream.close()
    assert caches.alive() == 0
    stream = engine.stream(DOC + "kab.", "kab")
    next(stream)
    del stream  # dropped without close(): garbage collection closes the generator
    assert caches.alive() == 0


def test_sync_framework_streams_abandoned_halfway_free_their_caches(
    engine: RapidEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches = track_caches(monkeypatch)
    for chunks in (
        ChatRapid(engine=engine).stream(DOC + "kab."),
        LangChainLLM(engine=engine).stream(DOC + "kab."),
        LlamaIndexLLM(engine=engine).stream_complete(DOC + "kab."),
        LlamaIndexLLM(engine=engine).stream_chat([ChatMessage(role="user", content="kab")]),
    ):
        next(chunks)
        assert caches.alive() > 0
        chunks.close()
        assert caches.alive() == 0


def open_chat_stream(engine: RapidEngine) -> AsyncIterator[Any]:
    return ChatRapid(engine=engine).astream(DOC + "kab.")


async def open_index_stream(engine: RapidEngine) -> AsyncIterator[Any]:
    return await LlamaIndexLLM(engine=engine).astream_complete(DOC + "kab.")


async def read_three(chunks: AsyncIterator[Any] | Awaitable[AsyncIterator[Any]], how: str) -> None:
    """Read three chunks, then stop reading: leave the loop, or wait until cancelled."""
    stream = await chunks if inspect.isawaitable(chunks) else chunks
    count = 0
    async for _ in stream:
        count += 1
        if count == 3 and how == "break":
            break
        if count == 3:
            await asyncio.sleep(3600)


@pytest.mark.parametrize("opener", [open_chat_stream, open_index_stream])
@pytest.mark.parametrize("how", ["break", "cancel"])
async def test_async_streams_abandoned_halfway_free_threads_and_caches(
    slow_engine: RapidEngine,
    monkeypatch: pytest.MonkeyPatch,
    opener: Callable[[RapidEngine], Any],
    how: str,
) -> None:
    """An abandoned async stream's worker thread stops after its step in flight and closes the
    engine's generator, without waiting for the event loop to close."""
    # Any thread the loop or LangChain keep for themselves is up before the count.
    await ChatRapid(engine=slow_engine, max_tokens=1).ainvoke("abc")
    baseline = idle_threads()
    caches = track_caches(monkeypatch)
    for _ in range(3):
        reader = asyncio.create_task(read_three(opener(slow_engine), how))
        if how == "cancel":
            await asyncio.sleep(0.3)
            reader.cancel()
        with pytest.raises(asyncio.CancelledError) if how == "cancel" else nullcontext():
            await reader
    await asyncio.sleep(0.05)  # lets the loop finalize what the readers left behind
    assert settle_threads(baseline) == baseline
    assert caches.alive() == 0


async def test_timed_out_async_calls_stop_decoding(
    slow_engine: RapidEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`asyncio.wait_for` around `acomplete` / `ainvoke` (an agent's timeout) stops the
    generation as well, instead of decoding on in a thread nobody waits for."""
    await ChatRapid(engine=slow_engine, max_tokens=1).ainvoke("abc")
    baseline = idle_threads()
    caches = track_caches(monkeypatch)
    for slow in (index_acomplete(slow_engine, DOC), chat_ainvoke(slow_engine, DOC)):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(slow, timeout=0.3)
    assert settle_threads(baseline) == baseline
    assert caches.alive() == 0
