"""Real LangChain chains on the embedded SmolLM2: LCEL, RAG over FAISS, chat history, batch.

The RAG test prints the acceptance rate and decode speed of RAPID against the same chain on the
target alone (run with `-s` to see them; they are also attached to the test report).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from langchain_community.vectorstores import FAISS
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.outputs import LLMResult
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder, PromptTemplate
from langchain_core.runnables import Runnable
from langchain_text_splitters import RecursiveCharacterTextSplitter

from langchain_rapid import ChatRapid, RapidLLM, RapidRetrieverAdapter
from rapid_integrations import RapidEngine
from rapid_integrations.bench.recall import haystack
from tests.langchain_fixtures import ANSWER, NEEDLE, MiniLMEmbeddings, long_document

pytestmark = pytest.mark.slow

SYSTEM = "Answer the question using the document. Be brief."
QA_PROMPT = ChatPromptTemplate.from_messages(
    [("system", SYSTEM), ("human", "Document:\n{document}\n\nQuestion: {question}")]
)


class LastResult(BaseCallbackHandler):
    """Keeps the `LLMResult` of the last model run in a chain."""

    def __init__(self) -> None:
        self.result: LLMResult | None = None

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        self.result = response


@pytest.fixture(scope="module")
def document(smol_engine: RapidEngine) -> str:
    return long_document(smol_engine.tokenizer)


def answer_and_stats(chat: ChatRapid) -> Runnable[dict[str, str], dict[str, Any]]:
    """prompt | model | (answer text, RapidStats): an LCEL chain that also shows the run's stats."""

    def stats(message: AIMessage) -> dict[str, Any]:
        return message.response_metadata["rapid_stats"]

    return QA_PROMPT | chat | {"answer": StrOutputParser(), "stats": stats}


def test_lcel_chain_answers_about_a_long_document(smol_engine: RapidEngine, document: str) -> None:
    chain = answer_and_stats(ChatRapid(engine=smol_engine, max_tokens=32))
    result = chain.invoke({"document": document, "question": NEEDLE.question})
    assert ANSWER in result["answer"]
    stats = result["stats"]
    # The built-in retriever cut the document out of the draft's prompt.
    assert stats["mode"] == "rapid"
    assert stats["draft_context_tokens"] < stats["target_context_tokens"] / 5


def test_rag_chain_vector_store_supplies_the_draft_context(
    smol_engine: RapidEngine, document: str, record_property: Callable[[str, Any], None]
) -> None:
    splitter = RecursiveCharacterTextSplitter(chunk_size=400, add_start_index=True)
    store = FAISS.from_documents(splitter.create_documents([document]), MiniLMEmbeddings())
    retriever = RapidRetrieverAdapter(store, search_kwargs={"k": 2})
    chat = ChatRapid(engine=smol_engine, retriever=retriever, max_tokens=32)
    inputs = {"document": document, "question": NEEDLE.question}

    rapid = answer_and_stats(chat).invoke(inputs)
    target_alone = answer_and_stats(chat.model_copy(update={"mode": "lc"})).invoke(inputs)

    assert ANSWER in rapid["answer"]
    stats = rapid["stats"]
    assert stats["retrieval_fallback"] is None, "the vector store was not used"
    assert 0 < stats["retrieved_tokens"] <= 2 * 400
    assert stats["draft_context_tokens"] < stats["target_context_tokens"] / 3
    assert stats["drafted_tokens"] > 0
    report = {
        "context_tokens": stats["target_context_tokens"],
        "draft_context_tokens": stats["draft_context_tokens"],
        "rapid_acceptance_rate": round(stats["acceptance_rate"], 3),
        "rapid_decode_tokens_per_second": round(stats["decode_tokens_per_second"], 2),
        "lc_decode_tokens_per_second": round(target_alone["stats"]["decode_tokens_per_second"], 2),
        "rapid_answer": rapid["answer"],
        "lc_answer": target_alone["answer"],
    }
    record_property("rag_chain", report)
    print(f"\nRAG chain, RAPID vs target alone: {report}")


def test_multi_turn_history_recalls_an_early_fact(smol_engine: RapidEngine) -> None:
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "You are a helpful assistant."),
            MessagesPlaceholder("history"),
            ("human", "{input}"),
        ]
    )
    chain = prompt | ChatRapid(engine=smol_engine, max_tokens=24)
    history = InMemoryChatMessageHistory()

    def turn(text: str) -> AIMessage:
        reply = chain.invoke({"history": history.messages, "input": text})
        history.add_user_message(text)
        history.add_message(reply)
        return reply

    turn("Note for later: the locker code is 4721.")
    # A long conversation after the fact: earlier turns the draft only sees by retrieval.
    paragraphs = haystack(1000, smol_engine.tokenizer)
    for paragraph in paragraphs:
        history.add_user_message("Summarize this for me:\n" + paragraph)
        history.add_ai_message(paragraph.split(".")[0] + ".")
    reply = turn("What is the locker code? Answer with the number.")

    assert ANSWER in reply.text
    stats = reply.response_metadata["rapid_stats"]
    assert stats["draft_context_tokens"] < stats["target_context_tokens"] / 3
    assert len(history.messages) == 2 * (len(paragraphs) + 2)


def test_batch_with_concurrency_returns_what_sequential_calls_return(
    smol_engine: RapidEngine,
) -> None:
    chain = ChatRapid(engine=smol_engine, max_tokens=24) | StrOutputParser()
    questions = ["What is 2 + 2?", "Name a colour.", "Say hello in French."]
    sequential = [chain.invoke(q) for q in questions]
    assert chain.batch(questions, config={"max_concurrency": 3}) == sequential


def test_llm_chain_with_a_string_prompt(smol_engine: RapidEngine, document: str) -> None:
    prompt = PromptTemplate.from_template(
        "Read the document and answer the question.\n\n{document}\n\nQuestion: {question}\nAnswer:"
    )
    llm = RapidLLM(engine=smol_engine, max_tokens=32, stop=["\n"])
    seen = LastResult()
    answer = (prompt | llm | StrOutputParser()).invoke(
        {"document": document, "question": NEEDLE.question}, config={"callbacks": [seen]}
    )
    assert ANSWER in answer
    assert "\n" not in answer
    assert seen.result is not None
    info = seen.result.generations[0][0].generation_info or {}
    assert info["finish_reason"] in ("stop", "eos")
    stats = info["rapid_stats"]
    assert stats["draft_context_tokens"] < stats["target_context_tokens"] / 5
