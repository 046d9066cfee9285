"""KV bytes held by users on one document: a shared prefix against a copy each
(docs/algorithm.md section 14.1).

    PYTHONPATH=. python scripts/shared_prefix_memory.py [--users 8] [--tokens 8000]

Loads the embedded SmolLM2-135M, prefills it once on a document of `--tokens` tokens (the
bundled demo document, repeated to length), then starts each user's sequence on the document
and its own question, with room for `--answer` answer tokens, from the prefix cache. Counts the
bytes of the buffers the sequences hold (each buffer once, `kv.held_bytes`), with
the shared prefix and with one user's bytes times the users (the copy path: each call a full
buffer). One prefill; no decoding, no timing.
"""

from __future__ import annotations

import argparse

import torch

from rapid_integrations.demo_data import demo_document
from rapid_integrations.models.loading import load_default
from rapid_integrations.runtime.attention import use_rapid_attention
from rapid_integrations.runtime.kv import KVState, held_bytes
from rapid_integrations.runtime.prefix_cache import PrefixCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=8)
    # 8000: the document, a question and the answer fit the model's 8192-token window.
    parser.add_argument("--tokens", type=int, default=8000, help="document tokens")
    parser.add_argument("--answer", type=int, default=128, help="answer tokens per user")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model, tok = load_default(dtype=args.dtype)
    use_rapid_attention(model)
    ids = tok.encode(demo_document())
    doc = (ids * (args.tokens // len(ids) + 1))[: args.tokens]
    prompts = [
        doc + tok.encode(f"\nQuestion {i}: what does part {i} say?") for i in range(args.users)
    ]
    prefixes = PrefixCache()
    vocab = model.config.vocab_size
    with torch.inference_mode():  # as the engine runs: no autograd graph
        states = [
            KVState.start(model, p, vocab, 512, len(p) + args.answer, prefixes, 1 << 40)
            for p in prompts
        ]
    one, shared = held_bytes(states[:1]), held_bytes(states)
    mib = 2**20
    print(f"{args.users} users, {args.tokens}-token document, {args.answer} answer tokens each")
    print(f"shared tokens per later user: {[s.shared_tokens for s in states[1:]]}")
    print(
        f"one user: {one / mib:.1f} MiB; {args.users} x one user: {args.users * one / mib:.1f} MiB"
    )
    print(
        f"{args.users} users sharing: {shared / mib:.1f} MiB ({args.users * one / shared:.1f}x less)"
    )


if __name__ == "__main__":
    main()
