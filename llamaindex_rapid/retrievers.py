"""`RapidRetrieverAdapter`: a LlamaIndex retriever or index as the engine's `ContextRetriever`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.indices.base import BaseIndex
from llama_index.core.schema import MetadataMode, NodeWithScore

from rapid_integrations import RapidInputError

if TYPE_CHECKING:
    from rapid_integrations.retrieval import ContextRetriever


class RapidRetrieverAdapter:
    """Feeds the draft with what a LlamaIndex retriever finds for the query.

    `source` is any LlamaIndex `BaseRetriever`, or an index, which is turned into one with
    ``index.as_retriever(**retriever_kwargs)`` (for a `VectorStoreIndex`, e.g.
    ``similarity_top_k=3``). `retrieve(query)` returns the node texts, most relevant first,
    without metadata (the draft reads text, as the target does). Nodes scoring under
    `min_score` are dropped when the retriever reports scores.
    """

    def __init__(
        self,
        source: BaseRetriever | BaseIndex,
        *,
        min_score: float | None = None,
        **retriever_kwargs: Any,
    ) -> None:
        if isinstance(source, BaseIndex):
            source = source.as_retriever(**retriever_kwargs)
        elif retriever_kwargs:
            raise RapidInputError(
                f"retriever options {sorted(retriever_kwargs)} apply only when an index is given"
            )
        if not isinstance(source, BaseRetriever):
            raise RapidInputError(
                "RapidRetrieverAdapter needs a LlamaIndex BaseRetriever or index, got "
                f"{type(source).__name__}"
            )
        self.retriever = source
        self.min_score = min_score

    def retrieve(self, query: str) -> list[str]:
        """Texts of the nodes the wrapped retriever returns for `query`."""
        return [_text(n) for n in self.retriever.retrieve(query) if self._keeps(n)]

    def _keeps(self, node: NodeWithScore) -> bool:
        return self.min_score is None or node.score is None or node.score >= self.min_score

    def __repr__(self) -> str:
        return f"RapidRetrieverAdapter({type(self.retriever).__name__})"


def _text(node: NodeWithScore) -> str:
    return node.node.get_content(metadata_mode=MetadataMode.NONE)


def as_context_retriever(
    value: ContextRetriever | BaseRetriever | BaseIndex | None,
) -> ContextRetriever | None:
    """A LlamaIndex retriever or index wrapped in the adapter; anything else (None, or an
    object with `retrieve(query) -> list[str]`) as given."""
    if isinstance(value, (BaseRetriever, BaseIndex)):
        return RapidRetrieverAdapter(value)
    if value is not None and not callable(getattr(value, "retrieve", None)):
        raise RapidInputError(
            "retriever must be a LlamaIndex retriever or index, or have retrieve(query) -> list[str]"
        )
    return value
