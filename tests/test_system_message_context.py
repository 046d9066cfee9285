"""A long context carried in the system message, on SmolLM2: the draft still reads C^S.

LlamaIndex's chat engines (condense_plus_context, context) put the nodes they retrieve in the
system message and the bare question in the user turn; so does a LangChain prompt with the
document in its system message. The draft must read a short retrieved context there too, from
the retriever adapter or the engine's own retrieval, as it does for a context in the user turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.node_parser import SentenceSplitter

from llamaindex_rapid import RapidLLM, RapidRetrieverAdapter
from rapid_integrations import RapidEngine
from tests.llamaindex_data import ANSWER, GENERATE, QUESTION, long_document

pytest_plugins = ["tests.llamaindex_fixtures"]


class _Stats(BaseEventHandler):
    """The `RapidStats` of every chat call LlamaIndex reports, in order."""

    seen: list[dict[str, Any]] = Field(default_factory=list)

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.seen.append(event.response.raw["rapid_stats"])


class _Recording(RapidRetrieverAdapter):
    """The adapter, remembering the queries it was asked."""

    queries: list[str]

    def retrieve(self, query: str) -> list[str]:
        self.queries.append(query)
        return super().retrieve(query)


@pytest.fixture
def stats() -> Iterator[list[dict[str, Any]]]:
    dispatcher = get_dispatcher()
    handler = _Stats()
    dispatcher.add_event_handler(handler)
    yield handler.seen
    dispatcher.event_handlers.remove(handler)


def _index(embed_model: Any, chunk_size: int) -> VectorStoreIndex:
    splitter = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=0)
    return VectorStoreIndex.from_documents(
        [Document(text=long_document())], embed_model=embed_model, transformations=[splitter]
    )


def _short_draft(stats: dict[str, Any]) -> None:
    print(
        f"\ntarget={stats['target_context_tokens']} draft={stats['draft_context_tokens']} "
        f"retrieved={stats['retrieved_tokens']} acceptance={stats['acceptance_rate']:.2f}"
    )
    assert stats["mode"] == "rapid" and stats["retrieval_fallback"] is None
    assert stats["retrieved_tokens"] > 0
    assert stats["draft_context_tokens"] * 3 < stats["target_context_tokens"]


@pytest.fixture(scope="module")
def chat_index(embed_model: Any) -> VectorStoreIndex:
    """Six 256-token nodes, about 1,500 tokens, reach the system message (the needle's among
    them): longer than the draft's 512-token budget."""
    return _index(embed_model, 256)


@pytest.mark.slow
def test_condense_plus_context_feeds_the_draft_from_the_adapter(
    default_engine: RapidEngine,
    embed_model: Any,
    chat_index: VectorStoreIndex,
    stats: list[dict[str, Any]],
) -> None:
    adapter = _Recording(_index(embed_model, 128), similarity_top_k=2)
    adapter.queries = []
    llm = RapidLLM(engine=default_engine, retriever=adapter, generate_kwargs=GENERATE)
    chat = chat_index.as_chat_engine(chat_mode="condense_plus_context", llm=llm, similarity_top_k=6)
    assert ANSWER in str(chat.chat(QUESTION))
    assert adapter.queries == [QUESTION]
    _short_draft(stats[-1])
    chat.chat("Which warehouse was that code for?")  # its question is condensed first
    assert len(adapter.queries) == 2
    _short_draft(stats[-1])


@pytest.mark.slow
def test_context_chat_engine_retrieves_from_its_system_message(
    rapid_llm: RapidLLM, chat_index: VectorStoreIndex, stats: list[dict[str, Any]]
) -> None:
    chat = chat_index.as_chat_engine(chat_mode="context", llm=rapid_llm, similarity_top_k=6)
    assert ANSWER in str(chat.chat(QUESTION))
    _short_draft(stats[-1])


@pytest.mark.slow
def test_langchain_prompt_with_the_document_in_the_system_message(
    default_engine: RapidEngine,
) -> None:
    from langchain_core.prompts import ChatPromptTemplate

    from langchain_rapid import ChatRapid

    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer from this document.\n\n{document}\n\nAnswer in one sentence."),
            ("human", "{question}"),
        ]
    )
    chat = ChatRapid(engine=default_engine, temperature=0.0, max_tokens=24)
    reply = (prompt | chat).invoke({"document": long_document(), "question": QUESTION})
    assert ANSWER in reply.content
    _short_draft(reply.response_metadata["rapid_stats"])
