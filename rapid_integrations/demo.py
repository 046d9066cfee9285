"""`make demo`: one question about a long bundled document, RAPID beside the target alone.

The document (~5.7K tokens of Python standard-library docstrings) hides one field note; the
question asks about it. The target reads the whole document, the draft only what the built-in
retriever pulls out of it.
"""

from __future__ import annotations

import argparse

from rapid_integrations.config import DTYPES
from rapid_integrations.demo_data import ANSWER_KEYWORD, QUESTION, demo_document, demo_messages
from rapid_integrations.engine.rapid_engine import RapidEngine
from rapid_integrations.output.outputs import RapidOutput
from rapid_integrations.output.stats_format import format_stats


def _report(label: str, out: RapidOutput) -> None:
    verdict = "correct" if ANSWER_KEYWORD in out.text.lower() else "wrong"
    print(f"\n== {label} ({verdict})\n{out.text.strip()}\n   {format_stats(out)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="auto", help="model dtype: " + ", ".join(DTYPES))
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
