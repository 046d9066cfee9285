"""Mutation sweep: plant each known bug in a scratch copy of the repository and check that the
fast tests catch it (docs/reliability.md, "Mutation sweep").

    python scripts/mutants.py            # every mutant
    python scripts/mutants.py NAME ...   # some of them

Each mutant replaces one snippet of the engine's source (it must occur exactly once; a snippet
that no longer applies is reported as an ERROR, so a refactor that moves the code must update
this list) and runs the test files that should catch it, stopping at the first failure. Exit
status 0 only if the unmutated copy passes and every mutant is caught. Not part of `make test`:
it takes minutes. `tests/test_mutants.py` checks that every snippet still applies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # what a reviewer would call it
    path: str  # file under the repository root
    old: str  # snippet, occurring exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments that must catch it


ORACLE = "tests/test_verdict_oracle.py"
FOLLOWING = "rapid_integrations/retrieval/following.py"
FOLLOWING_TESTS = "tests/test_retrieval_following.py"
DISTRIBUTION = "tests/test_engine_distribution.py"
BATCH = "tests/test_batch.py"
SHARED = "tests/test_shared_prefix.py"
EXACT = "tests/test_engine_exact.py"
COMPILED = "tests/test_compiled.py"
COPIES = "tests/test_copy_prices.py"
_SAMPLED_ROW = "dist = residual(p[n], ph[n], q[n], cfg.residual) if n < gamma else ph[gamma]"
_ACCEPT = (
    "n = accepted_count(x, ph[:gamma].gather(1, idx)[:, 0], q[:gamma].gather(1, idx)[:, 0], u)"
)
_Q = "return log_probs(logits, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p).exp()"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "greedy-emits-argmax-p",
        "greedy, eta > 0: after a rejection emit argmax p instead of argmax p_hat",
        "rapid_integrations/sample/verify.py",
        "    return n, y[n : n + 1]",
        "    return n, z.argmax(-1)[n : n + 1]",
        (ORACLE,),
    ),
    Mutant(
        "accept-with-p",
        "acceptance computed with p instead of p_hat",
        "rapid_integrations/sample/verify.py",
        _ACCEPT,
        _ACCEPT.replace("ph[:gamma].gather", "p[:gamma].gather"),
        (ORACLE,),
    ),
    Mutant(
        "residual-row-0",
        "the residual taken from row 0 instead of the rejection row n",
        "rapid_integrations/sample/verify.py",
        _SAMPLED_ROW,
        _SAMPLED_ROW.replace("(p[n], ph[n], q[n]", "(p[0], ph[0], q[0]"),
        (ORACLE,),
    ),
    Mutant(
        "p-hat-from-q-row-0",
        "p_hat of every row built from q's row 0",
        "rapid_integrations/sample/verify.py",
        "ph = p_hat(logp, q, cfg.eta",
        "ph = p_hat(logp, q[:1].expand_as(q), cfg.eta",
        (ORACLE,),
    ),
    Mutant(
        "q-temperature-twice",
        "temperature applied twice to the draft's q",
        "rapid_integrations/spec_decode/drafting.py",
        _Q,
        _Q.replace("logits,", "logits / cfg.temperature,"),
        (DISTRIBUTION + "::test_proposer_q_is_the_drafts_own_filtered_distribution",),
    ),
    Mutant(
        "top-p-not-on-q",
        "top-p applied to p but not to q",
        "rapid_integrations/spec_decode/drafting.py",
        _Q,
        _Q.replace("cfg.top_p,", "1.0,"),
        (DISTRIBUTION + "::test_proposer_q_is_the_drafts_own_filtered_distribution",),
    ),
    Mutant(
        "draft-crop-off-by-one",
        "the draft cache cropped one token too many after a rejection",
        "rapid_integrations/spec_decode/drafting.py",
        "self.state.rollback(max(0, self._fed - accepted))",
        "self.state.rollback(max(0, self._fed + 1 - accepted))",
        ("tests/test_engine_exact.py::test_proposer_cache_follows_every_verdict",),
    ),
    Mutant(
        "accept-without-q",
        "acceptance with probability p_hat(x) instead of min(1, p_hat(x) / q(x))",
        "rapid_integrations/sample/verify.py",
        _ACCEPT,
        _ACCEPT.replace("q[:gamma].gather(1, idx)[:, 0]", "torch.ones_like(u)"),
        (ORACLE,),
    ),
    Mutant(
        "wrong-bonus-row",
        "the bonus token drawn at row gamma - 1 instead of row gamma",
        "rapid_integrations/sample/verify.py",
        _SAMPLED_ROW,
        _SAMPLED_ROW.replace("else ph[gamma]", "else ph[gamma - 1]"),
        (ORACLE,),
    ),
    Mutant(
        "residual-rules-swapped",
        "the 'paper' and 'exact' residual rules swapped",
        "rapid_integrations/sample/sampling.py",
        '    if rule == "paper":',
        '    if rule == "exact":',
        (ORACLE,),
    ),
    Mutant(
        "no-tail-guard",
        "the paper's tail guard never applied",
        "rapid_integrations/sample/sampling.py",
        '    if tail_guard == "paper":',
        '    if tail_guard == "never":',
        (ORACLE,),
    ),
    Mutant(
        "confidence-guard-flipped",
        "the confidence guard keeps p where the draft is the surer one",
        "rapid_integrations/sample/sampling.py",
        "target_sure = p.amax(dim=-1) >= q.amax(dim=-1)",
        "target_sure = p.amax(dim=-1) <= q.amax(dim=-1)",
        (ORACLE,),
    ),
    Mutant(
        "no-end-guard",
        "the end guard dropped from the verdict",
        "rapid_integrations/sample/verify.py",
        "return ph if end_ids is None else end_guard(ph, p, end_ids)",
        "return ph",
        (ORACLE,),
    ),
    Mutant(
        "sliding-layer-shows-everything",
        "a sliding-window layer attends to every cached token, not its window",
        "rapid_integrations/runtime/kv.py",
        "return self.keys[..., start:, :], self.values[..., start:, :]",
        "return self.keys, self.values",
        ("tests/test_kv_layouts.py",),
    ),
    Mutant(
        "grammar-mask-off-the-draft",
        "the grammar mask (and penalty) left off the draft: q keeps forbidden tokens",
        "rapid_integrations/engine/rapid_engine.py",
        'shaping = self._constraints(plan, self.draft, "the draft model")',
        "shaping = None",
        ("tests/test_grammar.py::test_eta_positive_first_token_follows_the_masked_law",),
    ),
    Mutant(
        "grammar-matcher-not-rolled-back",
        "the grammar matcher not rolled back to the kept drafts after a rejection",
        "rapid_integrations/structured_output/constraints.py",
        "self._matcher.rollback(sum(self._moves[kept:]))",
        "self._matcher.rollback(0)",
        ("tests/test_grammar.py::test_eta0_greedy_equals_target_greedy_under_the_grammar",),
    ),
    Mutant(
        "prefix-cache-ignores-weights",
        "the prefix cache keyed by the model object only, not its weights",
        "rapid_integrations/runtime/prefix_cache.py",
        "and self.weights == weights\n",
        "\n",
        (
            "tests/test_prefix_cache.py::test_weights_changed_in_place_or_converted_never_serve_stale_kv",
        ),
    ),
    Mutant(
        "bonus-from-p",
        "the bonus token drawn from p, though q has a row there",
        "rapid_integrations/sample/verify.py",
        _SAMPLED_ROW,
        _SAMPLED_ROW.replace("else ph[gamma]", "else p[gamma]"),
        (ORACLE,),
    ),
    Mutant(
        "vet-greedy-keeps-every-copy",
        "greedy, the draft keeps copies that are not its argmax: drafts the target must reject",
        "rapid_integrations/spec_decode/drafting.py",
        "keep = rows[:k].argmax(-1) == copies",
        "keep = copies >= 0",
        (
            "tests/test_engine_adaptive.py::test_vetting_greedy_keeps_the_copies_the_draft_would_draft",
        ),
    ),
    Mutant(
        "vet-keeps-every-copy",
        "the draft keeps every copy without the chance q gives it, so drafts are not from q",
        "rapid_integrations/spec_decode/drafting.py",
        "keep = u < q.gather(1, copies[:, None])[:, 0]",
        "keep = u < 2",
        ("tests/test_engine_adaptive.py::test_vetting_a_copy_drafts_from_q",),
    ),
    Mutant(
        "schedule-ignores-copies",
        "the measured gamma prices a pass by its picks alone, blind to the copies they bring",
        "rapid_integrations/spec_decode/schedule.py",
        "return gamma + min(gamma * per_pick, self._most_copies)",
        "return float(gamma)",
        ("tests/test_engine_adaptive.py::test_measured_gamma_counts_the_copies_a_pick_brings",),
    ),
    Mutant(
        "memory-never-remeasures",
        "a length where drafting once lost decodes without drafting for good: never measured again",
        "rapid_integrations/spec_decode/schedule_memory.py",
        " or kept.calls_left == 0:",
        ":",
        ("tests/test_schedule_memory.py",),
    ),
    Mutant(
        "bonus-row-without-q",
        "the draft stops before x_k, so a model pass's bonus row has no q and follows p",
        "rapid_integrations/spec_decode/drafting.py",
        "self.reads_ahead = config.eta > 0 and constraints is None",
        "self.reads_ahead = False",
        (
            "tests/test_engine_adaptive.py::"
            "test_eta_positive_greedy_is_argmax_p_hat_at_every_position",
        ),
    ),
    Mutant(
        "packed-positions-of-the-first",
        "a packed pass places every segment at the first sequence's positions",
        "rapid_integrations/runtime/kv.py",
        "torch.arange(len(i), device=i.device) + s.cache.get_seq_length()",
        "torch.arange(len(i), device=i.device) + states[0].cache.get_seq_length()",
        (BATCH,),
    ),
    Mutant(
        "packed-kv-to-the-next-sequence",
        "a packed pass appends each segment's KV to the next sequence's cache",
        "rapid_integrations/runtime/kv.py",
        "for cache, (start, end) in zip(self.caches, self.bounds, strict=True):",
        "for cache, (start, end) in zip(self.caches[1:] + self.caches[:1], self.bounds):",
        (BATCH,),
    ),
    Mutant(
        "batch-rows-to-the-next-call",
        "a batch step settles each call on the next call's rows (verdict and rollback)",
        "rapid_integrations/batching/runner.py",
        "for i, rows in zip(group, sent, strict=True):",
        "for i, rows in zip(group, [*sent[1:], *sent[:1]], strict=True):",
        (BATCH,),
    ),
    Mutant(
        "varlen-attends-to-the-first",
        "packed attention reads the first sequence's KV for every segment",
        "rapid_integrations/runtime/attention.py",
        "kvs = [layout.kv(module.layer_idx, i) for i in range(len(layout.bounds))]",
        "kvs = [layout.kv(module.layer_idx, 0) for i in range(len(layout.bounds))]",
        (BATCH,),
    ),
    Mutant(
        "shared-prefix-merged-evenly",
        "the shared-prefix split merges the prefix's and the own tokens' attention half and half",
        "rapid_integrations/runtime/attention.py",
        "weights = torch.softmax(sums, dim=0)",
        "weights = torch.full_like(sums, 1 / len(partials))",
        (SHARED,),
    ),
    Mutant(
        "shared-prefix-rows-swapped",
        "the calls that read one prefix together get each other's share of its attention",
        "rapid_integrations/runtime/attention.py",
        "for i, o, s in zip(members, out.split(sizes, 2), lse.split(sizes, 2), strict=True):",
        "for i, o, s in zip(members[::-1], out.split(sizes, 2), lse.split(sizes, 2), strict=True):",
        (SHARED,),
    ),
    Mutant(
        "shared-prefix-mask-off-by-one",
        "at the shared-prefix split the own tokens' causal mask is one token late: a draft sees the next",
        "rapid_integrations/runtime/attention.py",
        "return mask, None if mask is None else mask[..., kv - key.shape[-2] :]",
        "return mask, None if mask is None else mask[..., kv - key.shape[-2] - 1 : -1]",
        (SHARED,),
    ),
    Mutant(
        "split-keys-misaligned",
        "the split decode attention reads its runs as if heads and runs were one axis",
        "rapid_integrations/runtime/attention.py",
        "return x[0, :, :cut].unflatten(1, (runs, length)).transpose(0, 1)",
        "return x[0, :, :cut].reshape(runs, x.shape[1], length, x.shape[-1])",
        (EXACT,),
    ),
    Mutant(
        "split-keys-lose-the-rest",
        "the split decode attention drops the keys left over after its runs",
        "rapid_integrations/runtime/attention.py",
        "    if cut < keys:\n",
        "    if False:\n",
        (EXACT,),
    ),
    Mutant(
        "compiled-skips-guards",
        "a compiled draft pass runs its graph on a cache that fails the graph's guards",
        "rapid_integrations/runtime/compiled.py",
        "passed[several] = graph.guard_check(input_ids.clone(), cache)",
        "passed[several] = True",
        (COMPILED,),
    ),
    Mutant(
        "compiled-overflows",
        "a compiled draft pass runs its graph with no room left in the buffers",
        "rapid_integrations/runtime/compiled.py",
        " or length + width > first.capacity:",
        ":",
        (COMPILED,),
    ),
    Mutant(
        "compiled-drops-arguments",
        "a compiled draft pass runs its graph on a call with an argument the graph ignores",
        "rapid_integrations/runtime/compiled.py",
        'plain = kwargs.keys() <= {self._param, "use_cache", "logits_to_keep"}',
        "plain = True",
        (COMPILED,),
    ),
    Mutant(
        "compiled-short-cache",
        "a compiled draft pass runs its graph on a cache shorter than the graphs hold for",
        "rapid_integrations/runtime/compiled.py",
        "if length < MIN_LENGTH or width",
        "if width",
        (COMPILED,),
    ),
    Mutant(
        "bf16-weight-prefills-in-bf16",
        "a bf16-weight draft runs the bf16 kernel on every pass, a prefill chunk without native bf16 too",
        "rapid_integrations/models/weight_only.py",
        "if torch.compiler.is_compiling() or NATIVE_BF16 or self._few(x):",
        "if True:",
        ("tests/test_weight_only.py",),
    ),
    Mutant(
        "bf16-weight-guards-on-width",
        "a compiled bf16-weight draft traces its width test: a guard that recompiles",
        "rapid_integrations/models/weight_only.py",
        "if torch.compiler.is_compiling() or NATIVE_BF16 or self._few(x):",
        "if NATIVE_BF16 or self._few(x) or torch.compiler.is_compiling():",
        ("tests/test_weight_only.py",),
    ),
    Mutant(
        "bf16-weight-decodes-in-float32",
        "a bf16-weight draft multiplies one-token passes in float32 without native bf16",
        "rapid_integrations/models/weight_only.py",
        "return x.numel() <= HALF_ROWS * self.in_features",
        "return x.numel() < self.in_features",
        ("tests/test_weight_only.py",),
    ),
    Mutant(
        "copies-priced-without-their-chance",
        "every copy is read wherever a token costs less than a pass, kept or not",
        "rapid_integrations/spec_decode/copy_prices.py",
        "return sum(chance >= self._price for chance in self._curve.kept_chances(room))",
        "return sum(1.0 >= self._price for chance in self._curve.kept_chances(room))",
        (COPIES,),
    ),
    Mutant(
        "unread-lookup-learned-backwards",
        "a lookup not read is learned as kept where the draft's pick differs from the copy",
        "rapid_integrations/spec_decode/drafting.py",
        "self._prices.learn(1, int(draft == copy))",
        "self._prices.learn(1, int(draft != copy))",
        (COPIES,),
    ),
    Mutant(
        "sampled-calls-priced",
        "a sampled call reads the copies its engine prices: its draws differ by engine and load",
        "rapid_integrations/spec_decode/drafting.py",
        "priced = config.greedy",
        "priced = True",
        (
            COPIES,
            "tests/test_engine_api.py::test_a_drawn_seed_fits_javascript_numbers_and_replays_the_call",
        ),
    ),
    Mutant(
        "copies-priced-below-free",
        "copies are priced however little a token costs: two engines read different copies",
        "rapid_integrations/spec_decode/copy_prices.py",
        "if self._price is None or self._price < self.FREE:",
        "if self._price is None:",
        (COPIES,),
    ),
    Mutant(
        "token-price-over-the-wide-pass",
        "the draft's token price divides by the wide pass's seconds, not the one-token pass's",
        "rapid_integrations/spec_decode/drafting.py",
        "return max(0.0, (wide - one) / ((PRICE_WIDTH - 1) * one))",
        "return max(0.0, (wide - one) / ((PRICE_WIDTH - 1) * wide))",
        (COPIES,),
    ),
    Mutant(
        "lean-without-retrieval",
        "a draft that read the target's own prompt still leans p_hat toward its rounding",
        "rapid_integrations/engine/planning.py",
        "if draft_ids != ids or cfg.eta == 0.0:",
        "if draft_ids == ids or cfg.eta == 0.0:",
        ("tests/test_no_lean.py",),
    ),
    Mutant(
        "grounding-window-off-by-one",
        "eta_rule grounded: a row's run read one token late (the token before it skipped)",
        "rapid_integrations/sample/grounding.py",
        "(*seq[i : i + width], top)",
        "(*seq[i + 1 : i + 1 + width], top)",
        ("tests/test_grounded_lean.py",),
    ),
    Mutant(
        "grounding-ignored",
        "eta_rule grounded: rows outside C^S's runs lean all the same",
        "rapid_integrations/sample/verify.py",
        "ph = ph if lean is None else torch.where(lean[:, None], ph, p)",
        "ph = ph",
        (ORACLE + "::test_rows_that_do_not_lean_follow_p",),
    ),
    Mutant(
        "grounding-tail-stale",
        "eta_rule grounded: the committed tokens never extend the sequence the runs start from",
        "rapid_integrations/engine/step.py",
        "        request.grounding.commit(committed)",
        "        pass",
        ("tests/test_grounded_lean.py",),
    ),
    Mutant(
        "cache-scores-head-off-by-one",
        "retrievers attention and following: a chunk's mass is read from the head after each"
        " probed one",
        "rapid_integrations/retrieval/attention.py",
        "return span_mass(mass_by_position(attention, self.heads), self.spans)",
        "return span_mass(mass_by_position(attention, [(a, (h + 1) % 4) for a, h in self.heads]),"
        " self.spans)",
        (FOLLOWING_TESTS,),
    ),
    Mutant(
        "cache-scores-chunk-boundaries",
        "retrievers attention and following: each chunk's mass summed one token late",
        "rapid_integrations/retrieval/attention.py",
        "return span_mass(mass_by_position(attention, self.heads), self.spans)",
        "return span_mass(mass_by_position(attention, self.heads),"
        " [(a + 1, b + 1) for a, b in self.spans])",
        (FOLLOWING_TESTS,),
    ),
    Mutant(
        "following-stale-scores",
        "retriever following: a change of C^S keeps the retriever's old scores, so the draft's"
        " prompt is packed from the chunks it had",
        FOLLOWING,
        "        self.retriever.attention_scores = scores\n",
        "",
        (FOLLOWING_TESTS,),
    ),
    Mutant(
        "following-rebuild-drops-a-token",
        "retriever following: the rebuilt draft reads the answer but its last committed token",
        "rapid_integrations/engine/rapid_engine.py",
        "self.draft, draft_ids + committed, left",
        "self.draft, draft_ids + committed[:-1], left",
        (FOLLOWING_TESTS,),
    ),
)


def apply(mutant: Mutant, root: Path) -> None:
    """Plant `mutant` in the copy at `root`; ValueError if its snippet does not occur once."""
    path = root / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise ValueError(
            f"{mutant.name}: snippet occurs {text.count(mutant.old)} times in {mutant.path}"
        )
    path.write_text(text.replace(mutant.old, mutant.new))


def copy_repo(dest: Path) -> None:
    """The working tree's tracked and untracked (not ignored) files, copied to `dest`."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def run_tests(root: Path, tests: tuple[str, ...]) -> tuple[bool, float]:
    """(passed, seconds) of the given tests in the copy at `root`, stopping at the first failure."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        cwd=root,
        env=env,
        capture_output=True,
    )
    return result.returncode == 0, time.perf_counter() - start


def main(names: list[str]) -> int:
    chosen = [m for m in MUTANTS if not names or m.name in names]
    failures = 0
    with tempfile.TemporaryDirectory(prefix="rapid-mutants-") as tmp:
        clean = Path(tmp) / "clean"
        copy_repo(clean)
        passed, seconds = run_tests(clean, tuple(sorted({t for m in chosen for t in m.tests})))
        print(f"baseline (no mutant): {'pass' if passed else 'FAIL'} in {seconds:.0f} s")
        if not passed:
            return 1
        print("| mutant | bug | tests | result | seconds |\n|---|---|---|---|---|")
        for m in chosen:
            work = Path(tmp) / m.name
            shutil.copytree(clean, work)
            try:
                apply(m, work)
            except ValueError as exc:
                print(f"| {m.name} | {m.bug} | - | ERROR: {exc} | - |")
                failures += 1
                continue
            survived, seconds = run_tests(work, m.tests)
            failures += survived
            tests = ", ".join(f"`{t.removeprefix('tests/')}`" for t in m.tests)
            verdict = "not caught" if survived else "caught"
            print(f"| {m.name} | {m.bug} | {tests} | {verdict} | {seconds:.0f} |", flush=True)
            shutil.rmtree(work)
    print(f"{len(chosen) - failures} of {len(chosen)} mutants caught")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
