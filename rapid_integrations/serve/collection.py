"""Server-side document collections: a long document named by requests (`collection`).

The target reads the document (inserted as a user turn before the conversation, so that
requests about it share a prompt prefix and the prefix cache pays off); the draft's C^S is
retrieved from a FAISS index over it, built once when the server starts instead of on every
request (docs/algorithm.md section 1: C^S are the passages of C most relevant to the query).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapid_integrations.errors import RapidInputError

if TYPE_CHECKING:
    from rapid_integrations.engine.rapid_engine import RapidEngine

TEXT_SUFFIXES = (".txt", ".md", ".rst")
"""Files of a collection folder that are read (in name order)."""


@dataclass(frozen=True)
class Collection:
    """A named document and the retriever of its passages (`retrieve(query) -> list[str]`)."""

    name: str
    text: str
    retriever: Any

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` with the document as a user turn after the leading system messages."""
        head = 0
        while head < len(messages) and messages[head]["role"] == "system":
            head += 1
        document = {"role": "user", "content": f"Document ({self.name}):\n{self.text}"}
        return [*messages[:head], document, *messages[head:]]

    def prompt(self, prompt: str) -> str:
        """A completion prompt with the document before it."""
        return f"Document ({self.name}):\n{self.text}\n\n{prompt}"


def read_collection(path: str | Path) -> str:
    """The text of a file, or of a folder's text files joined by blank lines."""
    path = Path(path).expanduser()
    files = (
        sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES) if path.is_dir() else [path]
    )
    if not files or not all(p.is_file() for p in files):
        raise RapidInputError(
            f"collection {path}: no such file, or a folder without {TEXT_SUFFIXES} files"
        )
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in files)
    if not text.strip():
        raise RapidInputError(f"collection {path}: the documents are empty")
    return text


def load_collection(name: str, path: str | Path, engine: RapidEngine) -> Collection:
    """Read `path` and index it with the engine's retrieval settings (bundled MiniLM embedder
    unless `retrieval_embedder` says otherwise)."""
    from rapid_integrations.retrieval import FaissContextRetriever

    text = read_collection(path)
    return Collection(
        name, text, FaissContextRetriever.from_config(text, engine.tokenizer, engine.config)
    )
