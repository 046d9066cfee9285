"""RapidLLM and RapidRetrieverAdapter on tiny random models: the LlamaIndex surface, fast.

The tiny target has a 512-token window and a character tokenizer with a chat template, so
every path (completion, chat, streaming, async, retrieval, overflow) runs in milliseconds.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from llama_index.core import (
    Document,
    MockEmbedding,
    SummaryIndex,
    VectorStoreIndex,
    get_response_synthesizer,
)
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

import rapid_integrations.adapters.handle as handle_module
from llamaindex_rapid import RapidLLM, RapidRetrieverAdapter
from rapid_integrations import (
    ContextWindowExceededError,
    ModelNotFoundError,
    RapidConfig,
    RapidConfigError,
    RapidEngine,
    RapidInputError,
)
from rapid_integrations.adapters.timeouts import RapidTimeoutError

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = "abc def. ghi jkl abc."
MESSAGES = [
    ChatMessage(role="developer", content="be brief."),
    ChatMessage(role="user", content="abc def"),
    ChatMessage(role="assistant", content="ghi"),
    ChatMessage(role="user", content="jkl abc"),
]
AS_DICTS = [
    {"role": "system", "content": "be brief."},
    {"role": "user", "content": "abc def"},
    {"role": "assistant", "content": "ghi"},
    {"role": "user", "content": "jkl abc"},
]


@pytest.fixture(scope="module")
def engine(tok: Any, target: Any, draft: Any) -> RapidEngine:
    return RapidEngine(target, draft, tokenizer=tok, config=RapidConfig(**GREEDY))


@pytest.fixture
def llm(engine: RapidEngine) -> RapidLLM:
    return RapidLLM(engine=engine)


class SpyRetriever:
    """A ContextRetriever that records the queries it is asked."""

    def __init__(self, passages: list[str]) -> None:
        self.passages = passages
        self.queries: list[str] = []

    def retrieve(self, query: str) -> list[str]:
        self.queries.append(query)
        return self.passages


class ListRetriever(BaseRetriever):
    """A LlamaIndex retriever over fixed scored texts."""

    def __init__(self, scored: list[tuple[str, float]]) -> None:
        super().__init__()
        self.scored = scored

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=t), score=s) for t, s in self.scored]


# -- construction and metadata --------------------------------------------------------------


def refuse_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any weight loading fail the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr("rapid_integrations.engine.rapid_engine.load_model", refuse)
    monkeypatch.setattr("rapid_integrations.models.loading.load_default", refuse)
    monkeypatch.setattr("rapid_integrations.models.loading.ensure_default_model", refuse)


def test_constructing_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_loading(monkeypatch)
    RapidLLM()
    RapidLLM(model="/no/such/model", eta=1.0, generate_kwargs={"top_p": 0.9})
    monkeypatch.undo()
    with pytest.raises(ModelNotFoundError):
        RapidLLM(model="/no/such/model").get_engine()


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"mode": "fast"}, "mode"),
        ({"eta": -1}, "eta"),
        ({"generate_kwargs": {"gamma": 0}}, "gamma"),
        ({"generate_kwargs": {"num_beams": 4}}, "num_beams"),
        ({"generate_kwargs": {"bogus": 1}}, "bogus"),
        ({"rapid_config": {"residual": "nope"}}, "residual"),
        ({"temperature": 0.5, "generate_kwargs": {"temperature": 0.7}}, "temperature"),
        ({"stopping_ids": [2]}, "stopping_ids"),
        ({"timeout": 0}, "timeout"),
        ({"draft_precision": "int4"}, "draft_precision"),
        ({"target_precision": "int4"}, "target_precision"),
        ({"api_key": "x"}, "api_key"),
        ({"temprature": 0.5}, "temprature"),
    ],
)
def test_invalid_arguments_raise_config_errors_naming_them(
    arguments: dict[str, Any], field: str
) -> None:
    with pytest.raises(RapidConfigError) as caught:
        RapidLLM(**arguments)
    assert caught.value.field == field


def test_an_engine_with_model_arguments_is_one_error(engine: RapidEngine) -> None:
    for given in ({"model": "some/model"}, {"model_kwargs": {"revision": "x"}}, {"dtype": "bf16"}):
        with pytest.raises(RapidConfigError, match="not both") as caught:
            RapidLLM(engine=engine, **given)
        assert caught.value.field == "engine"
    with pytest.raises(RapidInputError, match="retrieve"):
        RapidLLM(engine=engine, retriever=object())


def test_old_names_work_with_a_deprecation_warning(target: Any, tok: Any) -> None:
    with pytest.warns(DeprecationWarning, match="`target` is deprecated.*`model`"):
        llm = RapidLLM(target=target, tokenizer=tok)
    with pytest.warns(DeprecationWarning, match="`engine` is deprecated.*`get_engine\\(\\)`"):
        assert llm.engine.target is target
    with pytest.warns(DeprecationWarning, match="`draft` is deprecated.*`draft_model`"):
        assert RapidLLM(target, draft=target, tokenizer=tok).get_engine().draft is target
    with pytest.warns(DeprecationWarning, match="`config` is deprecated.*`rapid_config`"):
        old = RapidLLM(target, tokenizer=tok, config=RapidConfig(gamma=3, max_new_tokens=5))
    assert old._overrides == {"gamma": 3, "max_new_tokens": 5}
    assert old.complete(PROMPT).raw["rapid_stats"]["gamma"] == 3


def test_metadata_reads_the_model_config_without_weights(
    monkeypatch: pytest.MonkeyPatch, tok: Any, target: Any, tmp_path: Any
) -> None:
    target.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    refuse_loading(monkeypatch)
    meta = RapidLLM(model=str(tmp_path), max_new_tokens=24).metadata
    assert (meta.context_window, meta.num_output, meta.is_chat_model) == (512, 24, True)
    assert meta.model_name == tmp_path.name
    given = RapidLLM(model_name=str(tmp_path), context_window=300, is_chat_model=False).metadata
    assert (given.context_window, given.is_chat_model, given.model_name) == (
        300,
        False,
        str(tmp_path),
    )


def test_a_call_past_its_timeout_raises(engine: RapidEngine) -> None:
    with pytest.raises(RapidTimeoutError):
        RapidLLM(engine=engine, timeout=1e-9).complete(PROMPT)
    assert RapidLLM(engine=engine, timeout=60).complete(PROMPT).text


def test_metadata_is_the_engines(engine: RapidEngine) -> None:
    meta = RapidLLM(engine=engine, generate_kwargs={"max_new_tokens": 7}).metadata
    assert meta.context_window == engine.context_window == 512
    assert meta.num_output == 7
    assert meta.is_chat_model
    assert meta.model_name == engine.model_name


# -- completion ------------------------------------------------------------------------------


def test_complete_returns_the_engine_output_and_stats(llm: RapidLLM, engine: RapidEngine) -> None:
    response = llm.complete(PROMPT)
    expected = engine.generate([{"role": "user", "content": PROMPT}])  # the template's user turn
    assert response.text == expected.text
    stats = response.raw["rapid_stats"]
    assert stats == response.additional_kwargs["rapid_stats"]
    assert stats["new_tokens"] == len(expected.token_ids) == GREEDY["max_new_tokens"]
    assert response.raw["finish_reason"] == "length"
    assert response.raw["usage"] == {
        "prompt_tokens": expected.prompt_tokens,
        "completion_tokens": len(expected.token_ids),
    }


def test_per_call_and_constructor_overrides_reach_the_engine(engine: RapidEngine) -> None:
    llm = RapidLLM(engine=engine, mode="lc", generate_kwargs={"max_new_tokens": 3})
    assert llm.complete(PROMPT).raw["rapid_stats"]["mode"] == "lc"
    assert llm.complete(PROMPT).raw["usage"]["completion_tokens"] == 3
    assert llm.complete(PROMPT, max_new_tokens=5).raw["usage"]["completion_tokens"] == 5


def test_stream_complete_yields_cumulative_text_and_deltas(llm: RapidLLM) -> None:
    chunks = list(llm.stream_complete(PROMPT))
    final = llm.complete(PROMPT).text
    assert "".join(c.delta or "" for c in chunks) == chunks[-1].text == final
    assert all(
        c.text == "".join(x.delta or "" for x in chunks[: i + 1]) for i, c in enumerate(chunks)
    )
    assert chunks[-1].delta == "" and chunks[-1].raw["rapid_stats"]["new_tokens"] > 0
    assert all(c.raw is None for c in chunks[:-1])


def test_closing_a_stream_early_is_clean(llm: RapidLLM) -> None:
    stream = llm.stream_complete(PROMPT)
    next(stream)
    stream.close()
    assert llm.complete(PROMPT).text  # the engine is still usable


# -- chat ------------------------------------------------------------------------------------


def test_chat_passes_role_content_messages(
    llm: RapidLLM, engine: RapidEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    stream = handle_module.batched_stream  # the engine's stream, in its batch
    monkeypatch.setattr(
        handle_module, "batched_stream", lambda e, p, o: seen.append(p) or stream(e, p, o)
    )
    response = llm.chat(MESSAGES)
    assert seen == [AS_DICTS]
    assert response.message.role == "assistant"
    assert response.message.content == engine.generate(AS_DICTS).text
    assert response.raw["rapid_stats"]["target_context_tokens"] == engine.count_tokens(AS_DICTS)


def test_stream_chat_matches_chat(llm: RapidLLM) -> None:
    chunks = list(llm.stream_chat(MESSAGES))
    assert chunks[-1].message.content == llm.chat(MESSAGES).message.content
    assert "".join(c.delta or "" for c in chunks) == chunks[-1].message.content
    assert chunks[-1].raw["rapid_stats"]["new_tokens"] > 0


def test_without_a_chat_template_messages_are_flattened(tok: Any, target: Any) -> None:
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    llm = RapidLLM(engine=RapidEngine(target, tokenizer=plain, config=RapidConfig(**GREEDY)))
    assert not llm.metadata.is_chat_model
    flat = llm.messages_to_prompt(MESSAGES)
    assert llm.chat(MESSAGES).message.content == llm.complete(flat, formatted=True).text


# -- async -----------------------------------------------------------------------------------


async def test_async_calls_match_sync_and_leave_the_loop_free(llm: RapidLLM) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    beat = asyncio.create_task(ticker())
    response = await llm.acomplete(PROMPT, max_new_tokens=150)
    beat.cancel()
    assert ticks > 3  # the loop kept running while the engine decoded
    assert response.text == llm.complete(PROMPT, max_new_tokens=150).text
    chat = await llm.achat(MESSAGES)
    assert chat.message.content == llm.chat(MESSAGES).message.content


async def test_async_streams_match_sync(llm: RapidLLM) -> None:
    completion = [c async for c in await llm.astream_complete(PROMPT)]
    assert completion[-1].text == llm.complete(PROMPT).text
    chat = [c async for c in await llm.astream_chat(MESSAGES)]
    assert chat[-1].message.content == llm.chat(MESSAGES).message.content
    assert chat[-1].raw["rapid_stats"]["new_tokens"] > 0


# -- retrieval and query extraction ---------------------------------------------------------


def _qa_llm(engine: RapidEngine, retriever: Any) -> RapidLLM:
    # A small budget makes the tiny prompts "long": their middle is retrieved for.
    return RapidLLM(engine=engine, retriever=retriever, generate_kwargs={"retrieval_budget": 8})


CONTEXT = "abc def ghi. " * 20
QUESTION = "jkl abc def?"


def test_query_is_read_from_a_filled_qa_template(engine: RapidEngine) -> None:
    spy = SpyRetriever(["ghi jkl."])
    response = _qa_llm(engine, spy).complete(
        DEFAULT_TEXT_QA_PROMPT.format(context_str=CONTEXT, query_str=QUESTION), formatted=True
    )
    assert spy.queries == [QUESTION]
    stats = response.raw["rapid_stats"]
    assert stats["draft_context_tokens"] < stats["target_context_tokens"] // 2


def test_chat_qa_template_context_is_replaced_for_the_draft(engine: RapidEngine) -> None:
    spy = SpyRetriever(["ghi jkl."])
    # The user turn alone: with its system message it would not fit the tiny 512-char window.
    messages = CHAT_TEXT_QA_PROMPT.format_messages(context_str=CONTEXT, query_str=QUESTION)[1:]
    response = _qa_llm(engine, spy).chat(messages)
    assert spy.queries == [QUESTION]
    stats = response.raw["rapid_stats"]
    assert stats["retrieved_tokens"] > 0
    assert stats["draft_context_tokens"] < stats["target_context_tokens"] // 2


def test_a_custom_template_is_a_query_extractor(engine: RapidEngine) -> None:
    spy = SpyRetriever(["ghi jkl."])
    template = "Notes:\n{context_str}\n***\nAsk: {query_str}\nReply:"
    llm = RapidLLM(
        engine=engine,
        retriever=spy,
        query_extractor=[template],
        generate_kwargs={"retrieval_budget": 8},
    )
    llm.complete(template.format(context_str=CONTEXT, query_str=QUESTION), formatted=True)
    assert spy.queries == [QUESTION]


def test_an_explicit_query_or_query_fn_wins_over_extraction(engine: RapidEngine) -> None:
    spy = SpyRetriever(["ghi jkl."])
    llm = _qa_llm(engine, spy)
    prompt = DEFAULT_TEXT_QA_PROMPT.format(context_str=CONTEXT, query_str=QUESTION)
    llm.complete(prompt, formatted=True, query="abc")
    llm.complete(prompt, formatted=True, query_fn=lambda text: "def")
    assert spy.queries == ["abc", "def"]


# -- context window ---------------------------------------------------------------------------


def test_a_prompt_beyond_the_window_raises_with_sizes(engine: RapidEngine) -> None:
    with pytest.raises(ContextWindowExceededError, match=r"600 tokens.*512 tokens") as err:
        RapidLLM(engine=engine, raw_completion=True).complete("a" * 600)
    assert (err.value.prompt_tokens, err.value.context_window) == (600, 512)


def test_overflow_inside_a_compact_query_engine_is_raised_not_swallowed(llm: RapidLLM) -> None:
    # LlamaIndex's compact synthesizer turns a ValueError from the LLM into "Empty Response".
    synthesizer = get_response_synthesizer(
        llm=llm,
        response_mode="compact",
        prompt_helper=PromptHelper(context_window=100_000, num_output=12),
    )
    index = SummaryIndex.from_documents([Document(text="abc def ghi. " * 200)])
    engine = index.as_query_engine(llm=llm, response_synthesizer=synthesizer)
    with pytest.raises(ContextWindowExceededError):
        engine.query("abc?")


# -- callbacks ---------------------------------------------------------------------------------


def test_token_counting_handler_reads_the_usage(engine: RapidEngine) -> None:
    counter = TokenCountingHandler()
    llm = RapidLLM(engine=engine, callback_manager=CallbackManager([counter]))
    response = llm.complete(PROMPT)
    assert counter.completion_llm_token_count == response.raw["usage"]["completion_tokens"]
    assert counter.prompt_llm_token_count == response.raw["usage"]["prompt_tokens"]


# -- retriever adapter --------------------------------------------------------------------------


def test_adapter_returns_node_texts_best_first_and_filters_scores() -> None:
    source = ListRetriever([("best", 0.9), ("weak", 0.1), ("good", 0.5)])
    assert RapidRetrieverAdapter(source).retrieve("q") == ["best", "weak", "good"]
    assert RapidRetrieverAdapter(source, min_score=0.3).retrieve("q") == ["best", "good"]


def test_adapter_turns_an_index_into_a_retriever() -> None:
    index = VectorStoreIndex(
        [TextNode(text=t) for t in ("abc", "def", "ghi")], embed_model=MockEmbedding(embed_dim=8)
    )
    adapter = RapidRetrieverAdapter(index, similarity_top_k=2)
    assert len(adapter.retrieve("abc")) == 2
    assert RapidLLM(retriever=index)._retriever.retrieve("abc")


def test_adapter_rejects_what_it_cannot_wrap() -> None:
    with pytest.raises(RapidInputError, match="BaseRetriever"):
        RapidRetrieverAdapter(object())  # type: ignore[arg-type]
    with pytest.raises(RapidInputError, match="only when an index"):
        RapidRetrieverAdapter(ListRetriever([]), similarity_top_k=2)
