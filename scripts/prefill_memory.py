"""Peak memory and time of one long prefill, alone in its process (the bench's memory bound).

Loads the embedded model, YaRN-stretched past its 8K window when the prompt needs it, reads a
prompt of `--tokens` tokens of the bench's haystack text and decodes 4 tokens. It prints the
resident set before the call, its peak during the call (sampled every 50 ms), and the bound of
docs/performance.md ("Other bounds"): weights + the call's KV + 1 GiB. Unlike a bench record's
peak, nothing else is loaded in the process: no embedder, and no second engine.

Usage: RAPID_NUM_THREADS=2 python scripts/prefill_memory.py --tokens 32768 [--mode lc]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

from rapid_integrations import RapidEngine
from rapid_integrations.bench.haystack import leading_text
from rapid_integrations.bench.models import load_rope_scaled
from rapid_integrations.models.loading import ensure_default_model

GIB = 2**30


def resident() -> float:
    """This process's resident set in GiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--mode", default="lc")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    args = parser.parse_args()
    folder = ensure_default_model()
    dtype = getattr(torch, args.dtype)
    model, _ = load_rope_scaled(folder, args.tokens + 64, torch.device("cpu"), dtype, "yarn")
    engine = RapidEngine(model, tokenizer=str(folder), config={"max_new_tokens": 4})
    prompt = (
        leading_text(engine.tokenizer, args.tokens) + "\nQuestion: what is this about?\nAnswer:"
    )
    peak, done = [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    before = resident()
    sampler.start()
    start = time.perf_counter()
    out = engine.generate(prompt, mode=args.mode, ignore_eos=True)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = out.stats.target_context_tokens * 2 * model.config.num_hidden_layers
    kv *= model.config.num_key_value_heads * model.config.head_dim * dtype.itemsize
    bound = (weights + kv) / GIB + 1
    print(
        f"{args.mode} {out.stats.target_context_tokens} tokens, {args.dtype}: {seconds:.1f} s; "
        f"resident before {before:.2f} GiB, peak {peak[0]:.2f} GiB; bound {bound:.2f} GiB "
        f"(peak / bound {peak[0] / bound:.2f})"
    )


if __name__ == "__main__":
    main()
