"""Exactness on a CUDA device before its speed is timed (scripts/gpu-speed.sh runs it first).

The CPU suite proves that with eta = 0 greedy RAPID emits the target's own greedy tokens
(docs/algorithm.md section 2.7) and that a batched call decodes as it would alone (section 14);
CUDA runs other kernels, so both are checked again on the device:

1. tiny random models in float64: RAPID (separate and self draft) against the target's greedy
   choices recomputed without a cache (`tests.tiny.greedy_mismatches`); must be empty;
2. tiny models in float32: calls decoded together by `BatchRunner` against each alone; must match;
3. the embedded model in float32 on a 2K document: RAPID eta 0 against lc, 64 tokens; the first
   differing position is reported (float32 kernels of other shapes may break a near tie).

Exits 1 when check 1 or 2 fails. Usage: python3 scripts/gpu_exact.py [--tiny] [DEVICE]
(--tiny: checks 1 and 2 alone, without the embedded model; DEVICE: default cuda)
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch

from rapid_integrations import BatchRunner, RapidConfig, RapidEngine
from tests.tiny import char_tokenizer, greedy_mismatches, tiny_llama

PROMPTS: list[tuple[str, str, dict[str, Any]]] = [
    ("abc def gh abc def gh abc", "def gh", {"gamma": 4}),
    ("hello. ab cd ab cd ab", "ab cd", {"gamma": 6, "lookup_ngram": 0}),
    ("jkl jkl jkl jkl abc abc abc a", "abc", {"gamma": 3, "prefill_chunk_size": 5}),
    ("k", "k", {"gamma": 9}),
]


def tiny_greedy(device: str) -> int:
    """Check 1: the number of calls whose tokens are not the target's greedy ones."""
    tok = char_tokenizer()
    reference = tiny_llama(len(tok), seed=11)  # on the CPU
    target = copy.deepcopy(reference).to(device)  # type: ignore[arg-type]  # python/typeshed#10653
    draft = tiny_llama(len(tok), seed=12, layers=1).to(device)  # type: ignore[arg-type]  # python/typeshed#10653
    cfg = RapidConfig(eta=0.0, max_new_tokens=40, ignore_eos=True)
    bad = 0
    for name, engine in (
        ("separate", RapidEngine(target, draft, tokenizer=tok, config=cfg, device=device)),
        ("self", RapidEngine(target, tokenizer=tok, config=cfg, device=device)),
    ):
        for prompt, draft_prompt, options in PROMPTS:
            out = engine.generate(prompt, draft_prompt, **options)
            ids = tok(prompt)["input_ids"]
            wrong = greedy_mismatches(reference, ids, out.token_ids, len(tok))
            bad += bool(wrong)
            print(f"tiny {name:8} gamma {options['gamma']}: first mismatch {wrong[:1] or '-'}")
    return bad


def tiny_batched(device: str) -> int:
    """Check 2: the number of calls whose batched tokens differ from their own alone."""
    tok = char_tokenizer()
    target = tiny_llama(len(tok), seed=11, dtype=torch.float32, scale=0.5)
    target.to(device)  # type: ignore[arg-type]  # python/typeshed#10653
    cfg = RapidConfig(eta=0.0, max_new_tokens=14, ignore_eos=True)
    engine = RapidEngine(target, tokenizer=tok, config=cfg, device=device)
    want = [engine.generate(p, d, **o).token_ids for p, d, o in PROMPTS]
    runner = BatchRunner(engine)
    ids = [runner.submit(p, d, **o) for p, d, o in PROMPTS]
    while runner.running:
        runner.step()
    got = [runner.outputs[i].token_ids for i in ids]
    bad = sum(g != w for g, w in zip(got, want, strict=True))
    print(f"tiny batched: {len(PROMPTS) - bad}/{len(PROMPTS)} calls as alone")
    return bad


def embedded(device: str) -> None:
    """Check 3 (reported, not failed): RAPID eta 0 against lc on the embedded model."""
    from rapid_integrations.bench.haystack import leading_text

    engine = RapidEngine.from_default(device=device, dtype="float32")
    document = leading_text(engine.tokenizer, 2048)
    prompt = f"{document}\n\nQuestion: what does the first function return?\nAnswer:"
    lc = engine.generate(prompt, mode="lc", max_new_tokens=64, ignore_eos=True).token_ids
    rapid = engine.generate(prompt, eta=0.0, max_new_tokens=64, ignore_eos=True).token_ids
    first = next((i for i, (a, b) in enumerate(zip(lc, rapid, strict=True)) if a != b), None)
    print(f"embedded float32 2K: rapid eta 0 equals lc for {first or len(lc)}/{len(lc)} tokens")


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--tiny"]
    device = args[0] if args else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here
    bad = tiny_greedy(device) + tiny_batched(device)
    if "--tiny" not in sys.argv:
        embedded(device)
    print("exactness:", "FAILED" if bad else "ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
