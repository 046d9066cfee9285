"""Aggregate tokens per second of one batch with drafting as asked, without drafting, and
under the load cap (docs/algorithm.md section 14.2).

    PYTHONPATH=. python scripts/load_cap.py [--users 8] [--tokens 48] [--rounds 3] [--chars 1500]

The embedded SmolLM2-135M (self-speculation, its default draft), `--users` calls, each the
bundled demo document's first `--chars` characters (about 4 per token) and its own question,
greedy at eta 0, decoded by one `BatchRunner`: "drafting" (no costs: each call drafts as
asked), "plain" (mode lc: the target alone, the same batch without drafting) and `--rounds`
batches under the load cap on one `BatchCosts` kept across them (as a server's runner keeps
it), the caps each picked and its measured lines. A first call alone reads the document, and
a first batch, not reported, warms the process.
"""

from __future__ import annotations

import argparse
import time

from rapid_integrations import BatchRunner, RapidEngine
from rapid_integrations.config import Mode
from rapid_integrations.demo_data import demo_document
from rapid_integrations.spec_decode.batch_caps import BatchCosts

QUESTIONS = [
    "What is this about?",
    "Summarize it.",
    "Who is named?",
    "List the key points.",
    "What happens first?",
    "What is the date?",
    "Give one quote.",
    "What is the conclusion?",
]


def decode(engine: RapidEngine, prompts: list, costs: BatchCosts | None, mode: Mode) -> BatchRunner:
    """One batch of `prompts` (prefills included), timed: prints its output tokens per second."""
    runner = BatchRunner(engine, costs)
    ids = [runner.submit(p, mode=mode) for p in prompts]
    start = time.perf_counter()
    runner.run()
    seconds = time.perf_counter() - start
    tokens = sum(len(runner.outputs[i].token_ids) for i in ids)
    name = "plain" if mode == "lc" else "load cap" if costs else "drafting"
    print(f"{name:9s} {tokens / seconds:6.1f} tok/s", end="", flush=True)
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chars", type=int, default=1500)
    args = parser.parse_args()
    engine = RapidEngine.from_default(max_new_tokens=args.tokens, eta=0.0, ignore_eos=True)
    document = demo_document()[: args.chars]
    prompts = [
        [{"role": "user", "content": f"{document}\n\n{QUESTIONS[i % len(QUESTIONS)]}"}]
        for i in range(args.users)
    ]
    # The document read once, alone (as a server's collection is): every call's prompt then
    # reads its KV in place, one copy for the batch (docs/algorithm.md section 14.1).
    engine.generate([{"role": "user", "content": f"{document}\n\nSay hello."}], max_new_tokens=2)
    decode(engine, prompts, None, "sd")
    print(" (warm-up)")
    modes: tuple[Mode, ...] = ("sd", "lc")
    for mode in modes:
        decode(engine, prompts, None, mode)
        print()
    costs = BatchCosts()
    for _ in range(args.rounds):
        caps = dict(decode(engine, prompts, costs, "sd").caps)
        verify, draft = costs.verify.seconds, costs.draft.seconds
        print(
            f"  caps {caps}; t(8) {verify(8):.3f} s, t(72) {verify(72):.3f} s,"
            f" d(8) {draft(8):.3f} s"
        )


if __name__ == "__main__":
    main()
