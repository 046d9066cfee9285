"""`RapidRetrieverAdapter`: a LangChain retriever or vector store as the draft's context source.

The engine asks a `ContextRetriever` for passages (`retrieve(query) -> list[str]`) and packs them
into the draft's short context C^S, while the target keeps reading the whole prompt. This adapter
lets the vector store a chain already has play that part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore

from rapid_integrations import RapidInputError

if TYPE_CHECKING:
    from rapid_integrations.retrieval import ContextRetriever


class RapidRetrieverAdapter:
    """Serve a LangChain `BaseRetriever` or `VectorStore` as a RAPID `ContextRetriever`.

    Args:
        source: the retriever, or a vector store (searched through `as_retriever`).
        search_kwargs: search options for a vector store, e.g. `{"k": 8}`; a retriever
            already carries its own.

    Passages come back in the store's ranking, except that documents which all carry a
    `start_index` (text splitters' `add_start_index=True`) are put back in document order,
    the order RAPID gives the draft (the paper keeps retrieved chunks in their original order).
    """

    def __init__(
        self, source: BaseRetriever | VectorStore, *, search_kwargs: dict[str, Any] | None = None
    ) -> None:
        if isinstance(source, VectorStore):
            source = source.as_retriever(search_kwargs=search_kwargs or {})
        elif not isinstance(source, BaseRetriever):
            raise RapidInputError(
                "RapidRetrieverAdapter takes a LangChain BaseRetriever or VectorStore, "
                f"got {type(source).__name__}"
            )
        elif search_kwargs is not None:
            raise RapidInputError("search_kwargs applies to a VectorStore; configure the retriever")
        self.retriever: BaseRetriever = source

    def retrieve(self, query: str) -> list[str]:
        """The text of the documents the LangChain retriever returns for `query`."""
        return [doc.page_content for doc in _document_order(self.retriever.invoke(query))]

    def __repr__(self) -> str:
        return f"RapidRetrieverAdapter({self.retriever!r})"


def as_context_retriever(source: object) -> ContextRetriever:
    """A LangChain retriever or store wrapped in the adapter; a `ContextRetriever` as it is."""
    if isinstance(source, (BaseRetriever, VectorStore)):
        return RapidRetrieverAdapter(source)
    if callable(getattr(source, "retrieve", None)):
        return cast("ContextRetriever", source)  # duck-typed: the protocol's module loads faiss
    raise RapidInputError(
        "retriever must be a LangChain BaseRetriever or VectorStore, or an object with "
        f"retrieve(query) -> list[str]; got {type(source).__name__}"
    )


def _document_order(docs: Sequence[Document]) -> list[Document]:
    """Documents by (source, start_index) when every one has a start_index; else unchanged.

    Sources keep the rank of their best document, so the most relevant source still leads.
    """
    if not all("start_index" in doc.metadata for doc in docs):
        return list(docs)
    rank: dict[Any, int] = {}
    for doc in docs:
        rank.setdefault(doc.metadata.get("source"), len(rank))
    return sorted(docs, key=lambda d: (rank[d.metadata.get("source")], d.metadata["start_index"]))
