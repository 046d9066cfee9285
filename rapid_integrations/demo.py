"""`make demo`: one question about a long bundled document, RAPID beside the target alone.

The document (~5.7K tokens of Python standard-library docstrings) hides one field note; the
question asks about it. The target reads the whole document, the draft only what the built-in
retriever pulls out of it.
"""

from __future__ import annotations

import argparse
from importlib import resources

from .cli import format_stats
from .engine import RapidEngine
from .outputs import RapidOutput

QUESTION = "Where is the spare key to the observatory on Kestrel Hill kept?"
ANSWER_KEYWORD = "teapot"


def demo_document() -> str:
    return (
        resources.files("rapid_integrations").joinpath("data/demo_document.txt").read_text("utf-8")
    )


def demo_messages(document: str, question: str = QUESTION) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You answer questions about documents."},
        {"role": "user", "content": f"Document:\n{document}\n\nQuestion: {question}"},
    ]


def _report(label: str, out: RapidOutput) -> None:
    verdict = "correct" if ANSWER_KEYWORD in out.text.lower() else "wrong"
    print(f"\n== {label} ({verdict})\n{out.text.strip()}\n   {format_stats(out)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="auto", help="model dtype: auto, bfloat16, float32")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    # No prefix reuse between the two runs: each pays its own prefill, as a first call would.
    engine = RapidEngine.from_default(
        dtype=args.dtype, max_new_tokens=args.max_new_tokens, stop=("\n\n",), prefix_cache_bytes=0
    )
    messages = demo_messages(demo_document())
    print(f"Question: {QUESTION}")
    rapid = engine.generate(messages, mode="rapid")
    _report("RAPID (draft reads the retrieved context)", rapid)
    target = engine.generate(messages, mode="lc")
    _report("target alone (reads everything)", target)
    speedup = rapid.stats.decode_tokens_per_second / max(
        target.stats.decode_tokens_per_second, 1e-9
    )
    print(f"\nRAPID decode speed: {speedup:.2f}x the target alone")
    return 0 if ANSWER_KEYWORD in rapid.text.lower() else 1


if __name__ == "__main__":
    raise SystemExit(main())
