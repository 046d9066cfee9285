"""The identity on the real embedded model (fp32): eta = 0 greedy is SmolLM2's own greedy."""

from __future__ import annotations

import pytest

from tests.tiny import greedy_mismatches

pytestmark = pytest.mark.slow

DOC = (
    "The Lighthouse Keeper's Log. Day one: the fog rolled in at dawn and the bell rang twice. "
    "Day two: a fishing boat named Marigold anchored in the bay; its captain, Ines Varga, "
    "asked for fresh water. Day three: the lamp's wick was replaced and the lens polished. "
)
QUESTION = "Who was the captain of the Marigold?"
MESSAGES = [
    {"role": "system", "content": "You answer questions about documents."},
    {"role": "user", "content": f"Document:\n{DOC}\n\nQuestion: {QUESTION}"},
]


def test_eta0_greedy_equals_smollm2_greedy_without_cache(smol, smol_engine):
    model, tokenizer = smol
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    )
    draft_prompt = [
        MESSAGES[0],
        {"role": "user", "content": f"{DOC[80:200]}\n\nQuestion: {QUESTION}"},
    ]
    outputs = []
    for gamma in (3, 8):
        out = smol_engine.generate(
            MESSAGES, draft_prompt, eta=0.0, gamma=gamma, max_new_tokens=20, ignore_eos=True
        )
        outputs.append(out.token_ids)
        assert out.stats.accepted_tokens > 0  # the draft really proposed and was verified
    # SmolLM2's greedy decoding without a cache, checked in one pass over prompt and answer
    # (tests/tiny.greedy_mismatches) rather than 20 passes of reference_greedy: the same check.
    assert len(outputs[0]) == 20 and greedy_mismatches(model, ids, outputs[0], len(tokenizer)) == []
    assert outputs[1] == outputs[0]


def test_rapid_answers_from_the_document(smol_engine):
    out = smol_engine.generate(MESSAGES, MESSAGES, max_new_tokens=24)
    assert "Ines" in out.text or "Varga" in out.text
    assert out.finish_reason in ("eos", "length")
