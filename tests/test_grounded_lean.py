"""eta_rule="grounded" (docs/algorithm.md section 2.3): a verify row leans toward the draft only
where the draft's top token continues a run of C^S; every other row follows the target.

The runs are checked on hand-made ids (an off-by-one in the window shows), and on tiny models
a greedy call is replayed without a cache: at each position whose run is not in the draft's
context the output is the target's own greedy token, and the call's `grounded_rows` counts
exactly the positions whose run is.
"""

from __future__ import annotations

import pytest
import torch

from rapid_integrations import RapidConfig, RapidEngine
from rapid_integrations.sample.grounding import Grounding
from tests.tiny import greedy_picks

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

V = 200


def tops(*ids: int) -> torch.Tensor:
    """q rows [len(ids), V] whose argmax are `ids`."""
    q = torch.full((len(ids), V), 0.1 / V)
    q[torch.arange(len(ids)), torch.tensor(ids)] = 0.9
    return q


def test_a_row_leans_where_its_two_tokens_before_and_the_drafts_top_occur_in_cs():
    grounding = Grounding(context=[10, 11, 12, 13, 14, 15], sequence=[1, 2, 10, 11])
    # Row 0 follows (10, 11): 12 continues the run, 13 does not. Row 1 follows (11, x0).
    x = torch.tensor([12, 99])
    assert grounding.rows(x, tops(12, 13, 14)).tolist() == [True, True, False]
    assert grounding.rows(x, tops(13, 13, 14)).tolist() == [False, True, False]
    assert grounding.rows(torch.tensor([12, 13]), tops(12, 13, 14)).tolist() == [True] * 3
    assert grounding.rows(torch.tensor([], dtype=torch.long), tops(12)).tolist() == [True]
    grounding.commit([12, 13])  # the sequence now ends (12, 13)
    assert grounding.rows(torch.tensor([14]), tops(14, 15)).tolist() == [True, True]
    assert grounding.rows(torch.tensor([14]), tops(12, 15)).tolist() == [False, True]


def test_a_run_never_joins_the_prompt_to_tokens_the_context_lacks():
    grounding = Grounding(context=[5, 6], sequence=[5, 6])  # shorter than a run: none
    assert grounding.rows(torch.tensor([7]), tops(7, 8)).tolist() == [False, False]


@pytest.fixture(scope="module")
def engines(tok, target, draft):
    """Greedy engines with a strong lean and no guard that hands rows back to p: every row
    that leans toward a draft that disagrees takes the draft's side."""
    cfg = RapidConfig(
        eta=20.0,
        max_new_tokens=24,
        ignore_eos=True,
        confidence_guard=False,
        tail_guard="none",
        lookup_ngram=0,
    )
    grounded = RapidEngine(target, draft, tokenizer=tok, config=cfg.replace(eta_rule="grounded"))
    return grounded, RapidEngine(target, draft, tokenizer=tok, config=cfg)


PROMPTS = ["la la la ghi la la la ghi abc", "abc def. abc def. ghi", "k.j.i hhh ab k.j.i hhh"]


def draft_ids(prompt: list[int], target, draft, vocab: int) -> list[int]:
    """A draft prompt that opens with a run the first row can continue: the prompt's last two
    ids and a token w, then the prompt, for a w that the draft then predicts and the target
    does not (any w, if none does: the rows still follow the target)."""
    target_pick = greedy_picks(target, prompt, [0], vocab)[0]
    for w in range(vocab):
        ids = [prompt[-2], prompt[-1], w, *prompt]
        if w != target_pick and greedy_picks(draft, ids, [0], vocab)[0] == w:
            return ids
    return prompt[2:]


def test_only_rows_whose_run_is_in_cs_leave_the_targets_greedy(engines, target, draft, tok):
    grounded, fixed = engines
    vocab = len(tok)
    leaned = held_back = 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        cs = draft_ids(ids, target, draft, vocab)
        out = grounded.generate(ids, cs)
        y = out.token_ids
        p_top = greedy_picks(target, ids, y, vocab)
        q_top = greedy_picks(draft, cs, y, vocab)
        runs = {tuple(cs[i : i + 3]) for i in range(len(cs) - 2)}
        seq = ids + y
        in_cs = [(*seq[len(ids) + t - 2 : len(ids) + t], q_top[t]) in runs for t in range(len(y))]
        for t, token in enumerate(y):
            if not in_cs[t]:
                assert token == p_top[t], (prompt, t)
                held_back += q_top[t] != p_top[t]  # the fixed rule would lean here
        assert out.stats.grounded_rows == sum(in_cs), prompt
        leaned += sum(g and q != p for g, q, p in zip(in_cs, q_top, p_top, strict=True))
        assert fixed.generate(ids, cs).stats.grounded_rows == 0
    assert held_back > 0  # the rule kept the target where the fixed rule leans
    assert leaned > 0  # and leaned where the run is in C^S and the models disagree
