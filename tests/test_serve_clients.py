"""Real clients against a live `rapid serve`: LangChain's `ChatOpenAI` in an LCEL chain and
LlamaIndex's `OpenAILike` in a query engine. Their answers equal the in-process engine's for
the same messages and settings (the openai SDK itself: tests/test_serve_api.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rapid_integrations import RapidEngine
from rapid_integrations.serve.calls import EngineCall
from tests.serve_fixtures import MODEL, LiveServer, live_server, recorded_calls

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

SYSTEM = "be brief."


@pytest.fixture(scope="module")
def server(served_model_dir: Path) -> Iterator[LiveServer]:
    with live_server(served_model_dir) as live:
        yield live


@pytest.fixture
def calls(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> list[EngineCall]:
    return recorded_calls(server, monkeypatch)


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.9, "seed": 7}],
    ids=["greedy", "seeded"],
)
def test_langchain_chat_openai_in_an_lcel_chain(
    server: LiveServer, reference: RapidEngine, sampling: dict[str, Any]
) -> None:
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="unused",
        max_tokens=10,
        max_retries=0,
        **sampling,
    )
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "a bad {thing}")])
    chain = prompt | llm | StrOutputParser()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a bad cafe"}]
    expected = reference.generate(messages, max_new_tokens=10, **sampling)
    assert chain.invoke({"thing": "cafe"}) == expected.text
    assert "".join(chain.stream({"thing": "cafe"})) == expected.text
    message = (prompt | llm).invoke({"thing": "cafe"})
    assert message.usage_metadata["input_tokens"] == expected.prompt_tokens
    assert message.usage_metadata["output_tokens"] == len(expected.token_ids)
    assert message.response_metadata["token_usage"]["rapid"]["new_tokens"] == len(
        expected.token_ids
    )


def test_langchain_passes_rapid_options_through_extra_body(
    server: LiveServer, reference: RapidEngine
) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=10,
        extra_body={"eta": 1.5, "gamma": 3, "mode": "sd"},
    )
    message = llm.invoke([("human", "jade lake")])
    expected = reference.generate(
        [{"role": "user", "content": "jade lake"}], mode="sd", gamma=3, eta=1.5, max_new_tokens=10
    )
    assert message.content == expected.text
    stats = message.response_metadata["token_usage"]["rapid"]
    assert (stats["mode"], stats["gamma"], stats["eta"]) == ("sd", 3, 0.0)  # sd sets eta = 0


async def test_langchain_async_streaming(server: LiveServer, reference: RapidEngine) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=10
    )
    text = "".join([chunk.content async for chunk in llm.astream([("human", "a cab")])])
    assert (
        text == reference.generate([{"role": "user", "content": "a cab"}], max_new_tokens=10).text
    )


def test_llamaindex_openai_like_in_a_query_engine(
    server: LiveServer, reference: RapidEngine, calls: list[EngineCall]
) -> None:
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        model=MODEL,
        api_base=server.url + "/v1",
        api_key="unused",
        is_chat_model=True,
        context_window=1024,
        max_tokens=12,
        temperature=0.0,
        max_retries=0,
        additional_kwargs={"extra_body": {"gamma": 3, "eta": 2.0}},  # RAPID options
    )
    documents = [Document(text="the jade cab faded by the lake."), Document(text="a bead cafe.")]
    index = VectorStoreIndex.from_documents(documents, embed_model=MockEmbedding(embed_dim=8))
    engine = index.as_query_engine(llm=llm, similarity_top_k=2)
    answer = engine.query("where did the cab fade?")
    assert len(calls) == 1
    sent = calls[0].prompt
    assert "the jade cab faded by the lake." in sent[-1]["content"]  # retrieved context reached it
    config = calls[0].options.config
    assert (config["gamma"], config["eta"]) == (3, 2.0)
    expected = reference.generate(sent, max_new_tokens=12, temperature=0.0, gamma=3, eta=2.0)
    assert str(answer) == expected.text.strip() or str(answer) == expected.text
    streaming = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=True)
    streamed = streaming.query("where did the cab fade?")
    assert "".join(streamed.response_gen) == expected.text


def test_the_readme_serve_example_runs_as_written(
    served_model_dir: Path, reference: RapidEngine
) -> None:
    """The README's "Serve" section, run as written against a live server (its URL swapped in)."""
    from tests.doc_examples import DOCS, python_sections

    code = dict(python_sections(DOCS.parent / "README.md"))["Serve"]
    assert 'base_url="http://127.0.0.1:8000/v1"' in code and 'model="rapid"' in code
    with live_server(served_model_dir, served_model_name="rapid") as live:
        namespace: dict[str, Any] = {}
        exec(code.replace("http://127.0.0.1:8000", live.url), namespace)
        expected = reference.generate([{"role": "user", "content": "Hello!"}])
        assert namespace["llm"].invoke("Hello!").content == expected.text
