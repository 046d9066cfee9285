"""ChatRapid, RapidLLM and RapidRetrieverAdapter on tiny random models: wiring, not quality.

Each adapter call is checked against the engine called directly with the same settings, so
these tests pin what the adapters pass through (prompt, stop, overrides, retriever) and what
they report (text, usage, metadata), in a few seconds.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import (
    AIMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import InMemoryVectorStore
from pydantic import Field, ValidationError
from transformers import PreTrainedTokenizerBase

from langchain_rapid import ChatRapid, RapidLLM, RapidRetrieverAdapter, RapidTimeoutError
from langchain_rapid._base import aiter_in_thread
from langchain_rapid.chat_models import to_chat_messages
from rapid_integrations import (
    ContextWindowExceededError,
    RapidConfigError,
    RapidEngine,
    RapidError,
    RapidInputError,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

PROMPT = "abc def"
MESSAGES = [{"role": "user", "content": PROMPT}]
# The tiny models stop early on their own; ignoring EOS gives texts long enough to cut.
LONG = {"max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_engine(target: Any, tok: PreTrainedTokenizerBase) -> RapidEngine:
    return RapidEngine(target, tokenizer=tok)


@pytest.fixture
def chat(tiny_engine: RapidEngine) -> ChatRapid:
    return ChatRapid(engine=tiny_engine, max_tokens=40, rapid_config={"ignore_eos": True})


@pytest.fixture
def llm(tiny_engine: RapidEngine) -> RapidLLM:
    return RapidLLM(engine=tiny_engine, max_tokens=40, rapid_config={"ignore_eos": True})


class TokenCounter(BaseCallbackHandler):
    """Collects the tokens LangChain callbacks receive."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


class FixedRetriever(BaseRetriever):
    """A LangChain retriever that returns fixed documents and records its queries."""

    documents: list[Document]
    queries: list[str] = Field(default_factory=list)

    def _get_relevant_documents(self, query: str, **kwargs: Any) -> list[Document]:
        self.queries.append(query)
        return self.documents


def documents(*texts: str) -> list[Document]:
    return [Document(page_content=text) for text in texts]


def stop_inside(text: str) -> str:
    """A stop string that occurs in the middle of `text`."""
    return text[len(text) // 2 : len(text) // 2 + 2]


# ---- construction -----------------------------------------------------------------------------


def test_construction_loads_nothing() -> None:
    chat = ChatRapid(model="/nowhere/model", max_tokens=8)
    assert chat._handle.built is None
    assert chat._get_ls_params()["ls_model_name"] == "model"
    assert ChatRapid()._identifying_params["model"] == "SmolLM2-135M-Instruct"


def test_model_object_loads_its_engine_once_on_first_call(
    target: Any, draft: Any, tok: PreTrainedTokenizerBase
) -> None:
    chat = ChatRapid(model=target, draft_model=draft, tokenizer=tok, max_tokens=4)
    assert chat._handle.built is None
    assert chat._identifying_params["draft_model"] == "LlamaForCausalLM"
    chat.batch([PROMPT, PROMPT], config={"max_concurrency": 2})
    engine = chat.get_engine()
    assert engine.target is target
    assert engine.draft is draft
    assert chat.invoke(PROMPT).response_metadata["model_name"] == "LlamaForCausalLM"
    assert chat.get_engine() is engine


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        ({"eta": -1}, RapidConfigError, "eta: must be"),
        ({"gamma": 0}, RapidConfigError, "gamma: must be"),
        ({"mode": "fast"}, RapidConfigError, "mode: must be 'rapid'"),
        ({"rapid_config": {"residual": "nope"}}, RapidConfigError, "residual: must be"),
        ({"rapid_config": {"bogus": 1}}, RapidConfigError, "bogus: unknown RapidConfig field"),
        ({"rapid_config": {"eta": 1.0}}, RapidConfigError, "the field of the same name"),
        ({"draft_precision": "int4"}, RapidConfigError, "draft_precision: must be"),
        ({"target_precision": "int4"}, RapidConfigError, "target_precision: must be"),
        ({"draft_device": "cpu"}, RapidConfigError, "draft_device: applies to a separate"),
        ({"dtype": "float8"}, RapidConfigError, "dtype: "),
        ({"model_kwargs": ["x"]}, ValidationError, "valid dictionary"),
        ({"timeout": 0}, ValidationError, "greater than 0"),
        ({"api_key": "x"}, ValidationError, "Extra inputs are not permitted"),
        ({"retriever": 42}, RapidInputError, "retriever must be"),
    ],
)
def test_invalid_parameters_fail_at_construction(
    params: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        ChatRapid(**params)


def test_engine_and_model_are_exclusive(tiny_engine: RapidEngine) -> None:
    for given in ({"model": "/some/model"}, {"model_kwargs": {"revision": "main"}}):
        with pytest.raises(RapidConfigError, match="not both") as caught:
            RapidLLM(engine=tiny_engine, **given)
        assert caught.value.field == "engine"


def test_rapid_kwargs_still_works_with_a_deprecation_warning(tiny_engine: RapidEngine) -> None:
    with pytest.warns(DeprecationWarning, match="`rapid_kwargs` is deprecated.*`rapid_config`"):
        chat = ChatRapid(engine=tiny_engine, max_tokens=40, rapid_kwargs={"ignore_eos": True})
    assert chat.rapid_config == {"ignore_eos": True}
    assert chat.invoke(PROMPT).content == tiny_engine.generate(MESSAGES, **LONG).text


def test_tokens_are_counted_with_the_models_tokenizer_without_weights(
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Any,
    tok: PreTrainedTokenizerBase,
    tiny_engine: RapidEngine,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr("rapid_integrations.engine.rapid_engine.load_model", refuse)
    chat = ChatRapid(model=str(tiny_model_dir))
    assert chat.profile is not None and chat.profile["max_input_tokens"] == 512
    assert chat.get_token_ids("abc def") == tok.encode("abc def", add_special_tokens=False)
    assert chat.get_num_tokens("abc def") == 7  # one token per character, not GPT-2's 2
    messages = [SystemMessage("ab"), HumanMessage("cd")]
    as_dicts = [{"role": "system", "content": "ab"}, {"role": "user", "content": "cd"}]
    assert chat.get_num_tokens_from_messages(messages) == tiny_engine.count_tokens(as_dicts)
    assert RapidLLM(model=str(tiny_model_dir)).get_num_tokens("abc") == 3


def test_cache_key_holds_the_retriever_and_the_draft_settings(tiny_engine: RapidEngine) -> None:
    first, second = FixedRetriever(documents=[]), FixedRetriever(documents=[])
    key = ChatRapid(engine=tiny_engine, retriever=first)._identifying_params
    assert key == ChatRapid(engine=tiny_engine, retriever=first)._identifying_params
    assert key != ChatRapid(engine=tiny_engine, retriever=second)._identifying_params
    assert key != ChatRapid(engine=tiny_engine)._identifying_params
    loaded = ChatRapid(model="m", draft_model="d")._identifying_params
    assert loaded["draft_model"] == "d"
    assert (
        loaded != ChatRapid(model="m", draft_model="d", draft_precision="int8")._identifying_params
    )
    assert loaded != ChatRapid(model="m", draft_model="e")._identifying_params
    int4 = ChatRapid(model="m", draft_model="d", target_precision="int4-weight")
    assert loaded != int4._identifying_params
    quantized = ChatRapid(model="m", model_kwargs={"load_in_8bit": True})._identifying_params
    assert loaded != quantized


# ---- ChatRapid --------------------------------------------------------------------------------


def test_invoke_matches_the_engine(chat: ChatRapid, tiny_engine: RapidEngine) -> None:
    reply = chat.invoke(PROMPT)
    expected = tiny_engine.generate(MESSAGES, **LONG)
    assert reply.content == expected.text
    meta = reply.response_metadata
    assert reply.usage_metadata == {
        "input_tokens": tiny_engine.count_tokens(MESSAGES),
        "output_tokens": len(expected.token_ids),
        "total_tokens": tiny_engine.count_tokens(MESSAGES) + len(expected.token_ids),
        "input_token_details": {"cache_read": meta["rapid_stats"]["cached_prefix_tokens"]},
    }
    assert meta["finish_reason"] == "length"
    assert meta["model_provider"] == "rapid"
    assert meta["model_name"] == tiny_engine.model_name
    assert meta["rapid_stats"]["mode"] == "rapid"
    assert meta["rapid_stats"]["new_tokens"] == len(expected.token_ids)


def test_prefix_cache_reads_and_the_provider_are_where_langchain_reads_them(
    chat: ChatRapid,
) -> None:
    """`usage_metadata["input_token_details"]["cache_read"]`: the prompt tokens the engine's
    prefix cache served, where ChatOpenAI reports its prompt cache (the second call on one
    prompt reads them); `response_metadata["model_provider"]` on every message and chunk, as
    ChatOpenAI's "openai" and ChatOllama's "ollama"."""
    prompt = "abc def " * 40
    first, second = (chat.invoke(prompt, max_tokens=2) for _ in range(2))
    for reply in (first, second):
        cached = reply.response_metadata["rapid_stats"]["cached_prefix_tokens"]
        assert reply.usage_metadata["input_token_details"] == {"cache_read": cached}
    assert (
        0
        < second.usage_metadata["input_token_details"]["cache_read"]
        < second.usage_metadata["input_tokens"]
    )
    chunks = list(chat.stream(prompt, max_tokens=4))
    assert {c.response_metadata["model_provider"] for c in chunks} == {"rapid"}
    merged = sum(chunks[1:], chunks[0])
    assert merged.response_metadata["model_provider"] == "rapid"
    assert merged.usage_metadata["input_token_details"]["cache_read"] > 0


def test_stop_from_constructor_invoke_and_bind(chat: ChatRapid, tiny_engine: RapidEngine) -> None:
    stop = stop_inside(tiny_engine.generate(MESSAGES, **LONG).text)
    expected = tiny_engine.generate(MESSAGES, stop=[stop], **LONG).text
    assert stop not in expected
    via_constructor = chat.model_copy(update={"stop": [stop]}).invoke(PROMPT)
    assert via_constructor.content == expected
    assert via_constructor.response_metadata["finish_reason"] == "stop"
    assert chat.invoke(PROMPT, stop=[stop]).content == expected
    assert chat.bind(stop=[stop]).invoke(PROMPT).content == expected


def test_call_stop_replaces_constructor_stop(chat: ChatRapid, tiny_engine: RapidEngine) -> None:
    full = tiny_engine.generate(MESSAGES, **LONG).text
    never = "~~"  # not in the tiny alphabet: cannot be generated
    constructed = chat.model_copy(update={"stop": [stop_inside(full)]})
    assert constructed.invoke(PROMPT, stop=[never]).content == full


def test_per_call_overrides_reach_the_engine(chat: ChatRapid) -> None:
    reply = chat.invoke(PROMPT, eta=0.0, gamma=3, max_tokens=7, mode="sd")
    stats = reply.response_metadata["rapid_stats"]
    assert (stats["eta"], stats["gamma"], stats["mode"], stats["new_tokens"]) == (0.0, 3, "sd", 7)
    assert reply.response_metadata["finish_reason"] == "length"


def test_draft_prompt_per_call_skips_retrieval(chat: ChatRapid, tiny_engine: RapidEngine) -> None:
    stats = chat.invoke(PROMPT, draft_prompt="abc").response_metadata["rapid_stats"]
    assert stats["draft_context_tokens"] == tiny_engine.count_tokens("abc")


def test_unknown_call_argument_names_itself(chat: ChatRapid) -> None:
    with pytest.raises(RapidConfigError, match="frequency_penalty"):
        chat.invoke(PROMPT, frequency_penalty=0.5)


def test_temperature_and_seed_sample_reproducibly(chat: ChatRapid) -> None:
    first = chat.invoke(PROMPT, temperature=1.0, seed=7)
    again = chat.invoke(PROMPT, temperature=1.0, seed=7)
    assert first.content == again.content
    assert first.response_metadata["rapid_stats"]["seed"] == 7


def test_stream_chunks_add_up_to_invoke(chat: ChatRapid) -> None:
    counter = TokenCounter()
    chunks = list(chat.stream(PROMPT, config={"callbacks": [counter]}))
    assert "".join(c.content for c in chunks) == chat.invoke(PROMPT).content
    assert len(chunks) > 2
    assert chunks[-1].chunk_position == "last"
    assert chunks[-1].usage_metadata is not None
    assert [c.usage_metadata for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert "".join(counter.tokens) == chat.invoke(PROMPT).content


def test_streaming_flag_sends_tokens_to_callbacks_on_invoke(chat: ChatRapid) -> None:
    counter = TokenCounter()
    streaming = chat.model_copy(update={"streaming": True})
    streaming.model_fields_set.add("streaming")  # model_copy does not mark it as set
    reply = streaming.invoke(PROMPT, config={"callbacks": [counter]})
    assert len(counter.tokens) > 2
    assert "".join(counter.tokens) == reply.content


def test_messages_map_to_chat_roles() -> None:
    messages = [
        SystemMessage("rules"),
        HumanMessage([{"type": "text", "text": "ab"}, "cd"]),
        AIMessage("ok"),
        ChatMessage(role="user", content="again"),
        HumanMessage("named", name="someone"),
    ]
    assert to_chat_messages(messages) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "abcd"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
        {"role": "user", "content": "named"},
    ]


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (FunctionMessage("42", name="add"), "FunctionMessage is not supported"),
        (ChatMessage(role="critic", content="hm"), "ChatMessage is not supported"),
        (
            HumanMessage([{"type": "image", "url": "https://example.com/a.png"}]),
            "'image' content is not supported",
        ),
    ],
)
def test_unsupported_messages_raise_input_errors(chat: ChatRapid, message: Any, match: str) -> None:
    with pytest.raises(RapidInputError, match=match):
        chat.invoke([HumanMessage("hi"), message])


def test_batch_with_concurrency_matches_sequential(chat: ChatRapid) -> None:
    prompts = ["abc", "def", "fed cba", "a b c"]
    sequential = [chat.invoke(p).content for p in prompts]
    batched = chat.batch(prompts, config={"max_concurrency": 3})
    assert [m.content for m in batched] == sequential


def test_prompt_over_the_window_raises_unless_truncation_is_chosen(chat: ChatRapid) -> None:
    too_long = "abc " * 200  # 800 tokens for a 512-position model
    with pytest.raises(ContextWindowExceededError) as caught:
        chat.invoke(too_long)
    assert caught.value.context_window == 512
    head_tail = chat.model_copy(update={"rapid_config": {"truncation": "head_tail"}})
    assert head_tail.invoke(too_long, max_tokens=4).usage_metadata["input_tokens"] < 512


def test_timeout_stops_generation(chat: ChatRapid) -> None:
    slow = chat.model_copy(update={"timeout": 1e-9})
    with pytest.raises(RapidTimeoutError) as caught:
        slow.invoke(PROMPT)
    assert isinstance(caught.value, RapidError)
    assert isinstance(caught.value, TimeoutError)


# ---- async --------------------------------------------------------------------------------------


async def test_async_calls_match_sync(chat: ChatRapid) -> None:
    expected = chat.invoke(PROMPT).content
    assert (await chat.ainvoke(PROMPT)).content == expected
    chunks = [c async for c in chat.astream(PROMPT)]
    assert "".join(c.content for c in chunks) == expected
    assert chunks[-1].usage_metadata is not None
    assert [m.content for m in await chat.abatch([PROMPT, PROMPT])] == [expected, expected]


async def test_async_generation_leaves_the_event_loop_free(chat: ChatRapid) -> None:
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    async def generate() -> None:
        await chat.ainvoke(PROMPT, max_tokens=300)
        done.set()

    started = time.perf_counter()
    await asyncio.gather(ticker(), generate())
    # A blocked loop would tick once; a free one ticks throughout the generation.
    assert ticks > 10, (ticks, time.perf_counter() - started)


async def test_abandoned_async_stream_closes_its_generator() -> None:
    closed = asyncio.Event()
    loop = asyncio.get_running_loop()

    def numbers() -> Iterator[int]:
        try:
            yield from range(10**9)
        finally:
            loop.call_soon_threadsafe(closed.set)

    async for number in aiter_in_thread(numbers):
        if number == 3:
            break
    await asyncio.wait_for(closed.wait(), timeout=5)


async def test_async_stream_reraises_worker_errors() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise RapidInputError("bad prompt")

    with pytest.raises(RapidInputError, match="bad prompt"):
        [item async for item in aiter_in_thread(failing)]


# ---- RapidLLM -----------------------------------------------------------------------------------


def test_llm_invoke_matches_the_engine(llm: RapidLLM, tiny_engine: RapidEngine) -> None:
    expected = tiny_engine.generate(MESSAGES, **LONG)  # one user turn: the tokenizer has a template
    assert llm.invoke(PROMPT) == expected.text
    result = llm.generate([PROMPT, PROMPT])
    info = result.generations[0][0].generation_info
    assert info is not None
    assert info["finish_reason"] == "length"
    assert info["rapid_stats"]["new_tokens"] == len(expected.token_ids)
    assert info["usage"]["input_tokens"] == expected.prompt_tokens
    assert result.llm_output is not None
    assert result.llm_output["token_usage"]["completion_tokens"] == 2 * len(expected.token_ids)


def test_llm_raw_completion_sends_the_string_as_it_is(
    llm: RapidLLM, tiny_engine: RapidEngine
) -> None:
    raw = llm.model_copy(update={"raw_completion": True})
    expected = tiny_engine.generate(PROMPT, **LONG)
    assert raw.invoke(PROMPT) == expected.text != llm.invoke(PROMPT)
    assert raw._identifying_params != llm._identifying_params


def test_llm_without_a_chat_template_sends_the_string(
    target: Any, tok: PreTrainedTokenizerBase
) -> None:
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    engine = RapidEngine(target, tokenizer=plain)
    assert (
        RapidLLM(engine=engine, max_tokens=8).invoke(PROMPT)
        == engine.generate(PROMPT, max_new_tokens=8).text
    )


def test_llm_stop_strings(llm: RapidLLM, tiny_engine: RapidEngine) -> None:
    stop = stop_inside(tiny_engine.generate(MESSAGES, **LONG).text)
    expected = tiny_engine.generate(MESSAGES, stop=[stop], **LONG).text
    assert llm.invoke(PROMPT, stop=[stop]) == expected
    assert llm.bind(stop=[stop]).invoke(PROMPT) == expected
    assert llm.model_copy(update={"stop": [stop]}).invoke(PROMPT) == expected


def test_llm_streams_to_callbacks(llm: RapidLLM) -> None:
    counter = TokenCounter()
    pieces = list(llm.stream(PROMPT, config={"callbacks": [counter]}))
    assert "".join(pieces) == llm.invoke(PROMPT)
    assert "".join(counter.tokens) == llm.invoke(PROMPT)
    assert len(counter.tokens) > 2


async def test_llm_async(llm: RapidLLM) -> None:
    expected = llm.invoke(PROMPT)
    assert await llm.ainvoke(PROMPT) == expected
    assert "".join([piece async for piece in llm.astream(PROMPT)]) == expected


def test_llm_ls_params(llm: RapidLLM) -> None:
    params = llm._get_ls_params(stop=["x"], temperature=0.5)
    assert params["ls_model_type"] == "llm"
    assert params["ls_provider"] == "rapid"
    assert params["ls_stop"] == ["x"]
    assert (params["ls_temperature"], params["ls_max_tokens"]) == (0.5, 40)


# ---- retriever adapter -------------------------------------------------------------------------


def test_adapter_wraps_a_vector_store_with_search_kwargs() -> None:
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_texts(["alpha", "beta", "gamma"])
    adapter = RapidRetrieverAdapter(store, search_kwargs={"k": 2})
    passages = adapter.retrieve("alpha")
    assert len(passages) == 2
    assert "alpha" in passages


def test_adapter_restores_document_order_from_start_index() -> None:
    docs = [
        Document("third", metadata={"source": "a", "start_index": 30}),
        Document("other", metadata={"source": "b", "start_index": 0}),
        Document("first", metadata={"source": "a", "start_index": 0}),
    ]
    adapter = RapidRetrieverAdapter(FixedRetriever(documents=docs))
    assert adapter.retrieve("q") == ["first", "third", "other"]


def test_adapter_keeps_rank_without_start_index() -> None:
    adapter = RapidRetrieverAdapter(FixedRetriever(documents=documents("b", "a")))
    assert adapter.retrieve("q") == ["b", "a"]


def test_adapter_rejects_other_sources() -> None:
    with pytest.raises(RapidInputError, match="BaseRetriever or VectorStore"):
        RapidRetrieverAdapter(["not", "a", "store"])  # type: ignore[arg-type]
    with pytest.raises(RapidInputError, match="search_kwargs"):
        RapidRetrieverAdapter(FixedRetriever(documents=[]), search_kwargs={"k": 1})


def test_chat_retriever_feeds_the_draft(tiny_engine: RapidEngine) -> None:
    retriever = FixedRetriever(documents=documents("abc abc"))
    chat = ChatRapid(
        engine=tiny_engine, retriever=retriever, max_tokens=8, rapid_config={"retrieval_budget": 8}
    )
    assert isinstance(chat.retriever, RapidRetrieverAdapter)
    history = [HumanMessage("abc def " * 20), AIMessage("fed"), HumanMessage("def abc")]
    stats = chat.invoke(history, query="abc").response_metadata["rapid_stats"]
    assert retriever.queries == ["abc"], "the LangChain retriever was not asked the query"
    assert stats["retrieval_fallback"] is None
    assert 0 < stats["retrieved_tokens"] <= 8
    assert stats["draft_context_tokens"] < stats["target_context_tokens"]
