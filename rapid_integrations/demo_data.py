"""The bundled demo document, its question, and the chat prompt every document question uses.

Framework-free and torch-free: `make demo`, `rapid ask/chat` and the benchmark's tasks all
build their prompts here without importing one another.
"""

from __future__ import annotations

from importlib import resources

QUESTION = "Where is the spare key to the observatory on Kestrel Hill kept?"
ANSWER_KEYWORD = "teapot"
SYSTEM_PROMPT = "You answer questions about documents."


def demo_document() -> str:
    """The ~5.7K-token bundled document (stdlib docstrings hiding one field note)."""
    return (
        resources.files("rapid_integrations").joinpath("data/demo_document.txt").read_text("utf-8")
    )


def demo_excerpt(chars: int = 6000) -> str:
    """About `chars` characters of the bundled document centred on its field note (6000
    characters are about 1.7K tokens): the same question at a third of the prefill."""
    document = demo_document()
    at = document.index(ANSWER_KEYWORD)
    return document[max(0, at - chars // 2) : at + chars // 2]


def demo_messages(
    document: str, question: str = QUESTION, system: str = SYSTEM_PROMPT
) -> list[dict[str, str]]:
    """A `system` turn and one user turn holding `document`, then `question`."""
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Document:\n{document}\n\nQuestion: {question}"},
    ]
