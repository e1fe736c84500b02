"""Property tests for the invariants stated in slime/data/packing.py."""
from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from collections import defaultdict

import pytest

from slime.data.packing import (
    default_cost,
    flatten_plan,
    packing_stats,
    padded_fixed_batches,
    plan_micro_batches,
    restore_order,
)

SEEDS = range(200)


def _lengths(rng: random.Random, n: int, cap: int, kind: str) -> list[int]:
    if kind == "lognormal":  # long-tailed, like RL responses
        return [min(cap, 1 + int(rng.lognormvariate(rng.uniform(3, 7), rng.uniform(0.3, 1.5))))
                for _ in range(n)]
    if kind == "uniform":
        return [rng.randint(1, cap) for _ in range(n)]
    # Many responses cut at the length limit with a budget of one full-length sample: most
    # micro-batches hold a single sample, the regime where equal counts are hardest.
    p_cut = rng.uniform(0.3, 1.0)
    return [cap if rng.random() < p_cut else rng.randint(1, cap) for _ in range(n)]


def _instance(seed: int) -> dict:
    """A random instance that has a plan (see the plan_micro_batches docstring for which)."""
    rng = random.Random(seed)
    dp = rng.choice([1, 2, 3, 8])
    max_tokens = rng.choice([64, 512, 4096, 16384])
    kind = rng.choice(["lognormal", "uniform", "truncated"])
    n = rng.randint(40 * dp, 400 if dp < 8 else 800)
    groups = None
    if rng.random() < 0.5:
        size = rng.choice([4, 8])
        if kind == "truncated":
            # Equal groups in a count divisible by dp; ragged groups there can be infeasible.
            n = max(1, n // (size * dp)) * size * dp
            groups = [i // size for i in range(n)]
        else:  # ragged, as left after per-sample filtering
            groups = [rng.randrange(n // size) for _ in range(n)]
    cost_fn = rng.choice([default_cost, lambda n: float(n), lambda n: float(n * n)])
    owners = None
    if groups is None and rng.random() < 0.5:  # rank-local batches: where each sample was generated
        if rng.random() < 0.5:
            owners = [i * dp // n for i in range(n)]  # equal contiguous shares, as after rollout
        else:
            owners = [rng.randrange(dp) for _ in range(n)]  # ragged, as after dynamic sampling
    return dict(lengths=_lengths(rng, n, max_tokens, kind), max_tokens=max_tokens, dp_size=dp,
                groups=groups, min_micro_batches=rng.choice([1, 1, 2, 5]), cost_fn=cost_fn, owners=owners)


@pytest.mark.parametrize("seed", SEEDS)
def test_plan_invariants(seed):
    kw = _instance(seed)
    lengths, max_tokens = kw["lengths"], kw["max_tokens"]
    plan = plan_micro_batches(**kw)

    assert len(plan) == kw["dp_size"]
    assert sorted(flatten_plan(plan)) == list(range(len(lengths)))  # each index exactly once
    counts = {len(rank) for rank in plan}
    assert len(counts) == 1, f"ranks run different numbers of micro-batches: {counts}"
    assert counts.pop() >= kw["min_micro_batches"]
    for rank in plan:
        for mb in rank:
            assert mb, "empty micro-batch"
            assert sum(lengths[i] for i in mb) <= max_tokens
    if kw["groups"] is not None:
        rank_of_group = defaultdict(set)
        for r, rank in enumerate(plan):
            for i in flatten_plan([rank]):
                rank_of_group[kw["groups"][i]].add(r)
        split = {g: rs for g, rs in rank_of_group.items() if len(rs) > 1}
        assert not split, f"groups spread over ranks: {split}"


@pytest.mark.parametrize("seed", SEEDS)
def test_deterministic_and_order_restored(seed):
    kw = _instance(seed)
    plan = plan_micro_batches(**kw)
    again = plan_micro_batches(**{**kw, "lengths": tuple(kw["lengths"])})
    assert plan == again

    values = [("sample", i) for i in flatten_plan(plan)]  # per-sample results in plan order
    assert restore_order(plan, values) == [("sample", i) for i in range(len(kw["lengths"]))]


def test_same_plan_under_different_hash_seeds():
    """Every rank computes the plan independently; set/dict-hash order must not leak in."""
    script = (
        "import json, random\n"
        "from slime.data.packing import plan_micro_batches\n"
        "rng = random.Random(7)\n"
        "lengths = [rng.randint(1, 900) for _ in range(300)]\n"
        "groups = [f'prompt-{rng.randrange(60)}' for _ in lengths]\n"
        "plan = plan_micro_batches(lengths, max_tokens=1024, dp_size=3, groups=groups)\n"
        "print(json.dumps(plan))\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plans = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": repo}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, check=True).stdout
        plans.append(json.loads(out))
    assert plans[0] == plans[1]


@pytest.mark.parametrize("cost_fn", [default_cost, lambda n: float(n)])
def test_compute_balanced_on_large_lognormal_batches(cost_fn):
    for seed in range(20):
        rng = random.Random(seed)
        lengths = [rng.randint(50, 300) + min(4096, int(rng.lognormvariate(6.0, 1.0)))
                   for _ in range(512)]
        plan = plan_micro_batches(lengths, max_tokens=16384, dp_size=8, cost_fn=cost_fn)
        stats = packing_stats(lengths, plan, max_tokens=16384, cost_fn=cost_fn)
        assert stats["compute_imbalance"] <= 1.01, (seed, stats)
        # Whole groups of 8 as units leave 8 units per rank; KK alone reaches ~1.05 here.
        groups = [i // 8 for i in range(len(lengths))]
        plan = plan_micro_batches(lengths, max_tokens=16384, dp_size=8, groups=groups,
                                  cost_fn=cost_fn)
        stats = packing_stats(lengths, plan, max_tokens=16384, cost_fn=cost_fn)
        assert stats["compute_imbalance"] <= 1.02, (seed, stats)


@pytest.mark.parametrize("dp", [2, 8])
def test_owners_keep_samples_in_place_and_balance_as_well(dp):
    """Starting from where rollout left the samples moves few of them and balances as well as KK."""
    for seed in range(20):
        rng = random.Random(seed)
        lengths = [rng.randint(50, 300) + min(4096, int(rng.lognormvariate(6.0, 1.0))) for _ in range(512)]
        owners = [i * dp // len(lengths) for i in range(len(lengths))]
        plan = plan_micro_batches(lengths, max_tokens=16384, dp_size=dp, owners=owners)
        stats = packing_stats(lengths, plan, max_tokens=16384)
        assert stats["compute_imbalance"] <= 1.01, (seed, stats)
        moved = sum(owners[i] != r for r, rank in enumerate(plan) for mb in rank for i in mb)
        free = plan_micro_batches(lengths, max_tokens=16384, dp_size=dp)
        moved_free = sum(owners[i] != r for r, rank in enumerate(free) for mb in rank for i in mb)
        assert moved <= 0.1 * len(lengths) < moved_free, (seed, moved, moved_free)


def test_owners_are_checked():
    with pytest.raises(ValueError, match="owners"):
        plan_micro_batches([5, 5], max_tokens=10, dp_size=2, owners=[0, 2])


def test_compute_balanced_over_many_ranks_with_a_long_tail():
    """Long-CoT tail (up to the 16k budget) over 64 ranks: KK alone reaches ~1.10 here."""
    rng = random.Random(1)
    lengths = [min(16384, rng.randint(50, 300) + int(rng.lognormvariate(6.0, 1.0)))
               for _ in range(8192)]
    plan = plan_micro_batches(lengths, max_tokens=16384, dp_size=64)
    stats = packing_stats(lengths, plan, max_tokens=16384)
    assert stats["compute_imbalance"] <= 1.02, stats


def test_overlong_sample_names_index_length_budget_and_fix():
    lengths = [10, 20, 101, 5]
    with pytest.raises(ValueError) as err:
        plan_micro_batches(lengths, max_tokens=100, dp_size=1)
    msg = str(err.value)
    assert "sample 2" in msg and "101" in msg and "100" in msg
    assert "train.max_tokens_per_gpu" in msg and "rollout.max_response_len" in msg


@pytest.mark.parametrize("kw", [
    dict(lengths=[5] * 7, max_tokens=100, dp_size=8),  # fewer samples than ranks
    dict(lengths=[5] * 8, max_tokens=100, dp_size=4, min_micro_batches=3),
    # Every sample fills a micro-batch, so ranks need 2 and 1 micro-batches; 3 samples cannot
    # give both ranks 2 non-empty ones.
    dict(lengths=[60, 60, 60], max_tokens=100, dp_size=2),
    dict(lengths=[5] * 16, max_tokens=100, dp_size=4, groups=[0] * 8 + [1] * 8),
])
def test_too_few_samples_says_what_to_change(kw):
    with pytest.raises(ValueError, match="fewer data-parallel ranks"):
        plan_micro_batches(**kw)


@pytest.mark.parametrize("seed", range(300))
def test_allow_empty_pads_short_ranks_with_empty_micro_batches_at_the_end(seed):
    """Small counts, most not divisible by dp, budgets that fit one or two samples (the regime where non-empty
    plans fail): every sample once, equal micro-batch counts, empty ones only after a rank's real ones, none
    at all where a plan without them exists (then the same plan)."""
    rng = random.Random(seed)
    dp, max_tokens = rng.choice([2, 3, 4]), 100
    lengths = [rng.choice([rng.randint(1, 100), 100, rng.randint(40, 60)]) for _ in range(rng.randint(1, 12))]
    owners = [rng.randrange(dp) for _ in lengths] if rng.random() < 0.5 else None
    kw = dict(max_tokens=max_tokens, dp_size=dp, owners=owners, min_micro_batches=rng.choice([1, 1, 2]))
    plan = plan_micro_batches(lengths, allow_empty=True, **kw)
    assert sorted(flatten_plan(plan)) == list(range(len(lengths)))
    assert len({len(rank) for rank in plan}) == 1 and len(plan[0]) >= kw["min_micro_batches"]
    for rank in plan:
        real = [mb for mb in rank if mb]
        assert rank[:len(real)] == real, "an empty micro-batch before a real one"
        assert all(sum(lengths[i] for i in mb) <= max_tokens for mb in real)
    try:
        strict = plan_micro_batches(lengths, **kw)
    except ValueError:
        assert any(not mb for rank in plan for mb in rank)
    else:
        assert plan == strict


def test_allow_empty_plans_what_too_few_samples_cannot():
    assert plan_micro_batches([60, 60, 60], max_tokens=100, dp_size=2, allow_empty=True) == [[[0], [2]], [[1], []]]
    assert plan_micro_batches([5], max_tokens=100, dp_size=2, allow_empty=True) == [[[0]], [[]]]
    # a lone sample stays on the rank that generated it: one-sample mini-batches stay spread over the ranks
    assert plan_micro_batches([5], max_tokens=100, dp_size=2, allow_empty=True, owners=[1]) == [[[]], [[0]]]
    assert plan_micro_batches([60, 60, 60], max_tokens=100, dp_size=2, allow_empty=True,
                              owners=[1, 1, 0]) == [[[2], []], [[0], [1]]]
    with pytest.raises(ValueError, match="allow_empty"):
        plan_micro_batches([5, 5], max_tokens=100, dp_size=2, groups=[0, 1], allow_empty=True)
    # the padded layout: contiguous shares rounded down, the shorter rank's micro-batches end with a dummy
    assert padded_fixed_batches([3, 4, 5], micro_batch_size=1, dp_size=2, allow_empty=True) == [[[0], []],
                                                                                                [[1], [2]]]
    # ... unless the ranks hold shares of those sizes already: then nothing moves
    for owners, plan in (([0], [[[0]], [[]]]), ([1], [[[]], [[0]]]), ([0, 0, 1], [[[0], [1]], [[2], []]]),
                         ([0, 1, 1], [[[0], []], [[1], [2]]]), ([0, 0, 0], [[[0], []], [[1], [2]]])):
        got = padded_fixed_batches([3, 4, 5][:len(owners)], micro_batch_size=1, dp_size=2, allow_empty=True,
                                   owners=owners)
        assert got == plan, owners
    lengths = [3, 4, 5]
    stats = packing_stats(lengths, padded_fixed_batches(lengths, micro_batch_size=1, dp_size=2, allow_empty=True),
                          padded=True, cost_fn=float)
    assert stats["real_token_fraction"] == 1.0 and stats["lockstep_imbalance"] == pytest.approx((4 + 5) / 6)  # ranks cost 3 and 9


@pytest.mark.parametrize("lengths, dp, min_mb", [
    ([26, 24, 34, 100, 100], 3, 1),
    ([100, 52, 98, 100, 100, 4, 35, 100], 3, 2),
])
def test_plan_found_when_balancing_ranks_first_leaves_one_short(lengths, dp, min_mb):
    """Cost-balanced ranks get 2/2/1 samples here and a 2-sample rank needs 2 micro-batches;
    a plan still exists (packing all samples first), and the planner must find it."""
    plan = plan_micro_batches(lengths, max_tokens=100, dp_size=dp, min_micro_batches=min_mb)
    assert sorted(flatten_plan(plan)) == list(range(len(lengths)))
    assert {len(rank) for rank in plan} == {min_mb}
    assert all(mb and sum(lengths[i] for i in mb) <= 100 for rank in plan for mb in rank)


def test_ragged_groups_retry_with_balanced_sample_counts():
    """Every sample fills a micro-batch; cost balancing over these groups leaves a rank with
    fewer samples than another needs micro-batches, but a 44/44 split exists."""
    rng = random.Random(0)
    sizes = [2, 2, 2, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 6, 10]
    groups = [g for g, size in enumerate(sizes) for _ in range(size)]
    lengths = [64 if rng.random() < 0.8 else rng.randint(33, 64) for _ in groups]
    plan = plan_micro_batches(lengths, max_tokens=64, dp_size=2, groups=groups)
    assert [len(rank) for rank in plan] == [44, 44]
    assert all(len({groups[i] for i in flatten_plan([rank])} & {groups[i] for i in
               flatten_plan([other])}) == 0 for rank in plan[:1] for other in plan[1:])


def test_min_micro_batches_splits_into_non_empty_batches():
    lengths = [3, 1, 4, 1, 5, 9, 2, 6]
    plan = plan_micro_batches(lengths, max_tokens=1000, dp_size=2, min_micro_batches=4)
    assert [len(rank) for rank in plan] == [4, 4]
    assert all(len(mb) == 1 for rank in plan for mb in rank)


def test_padded_baseline_layout_and_stats_by_hand():
    lengths = [1, 3, 2, 2, 4, 4, 1, 1]
    plan = padded_fixed_batches(lengths, micro_batch_size=3, dp_size=2)
    assert plan == [[[0, 1, 2], [3]], [[4, 5, 6], [7]]]
    stats = packing_stats(lengths, plan, padded=True, cost_fn=lambda n: float(n * n))
    # processed tokens: 3*3 + 1*2 + 3*4 + 1*1 = 24; real tokens 18
    assert stats["real_token_fraction"] == pytest.approx(18 / 24)
    # rank costs: 3*9 + 4 = 31 and 3*16 + 1 = 49 -> max/mean = 49/40
    assert stats["compute_imbalance"] == pytest.approx(49 / 40)
    # lockstep: step 0 max(27, 48) + step 1 max(4, 1) = 52, over mean 40
    assert stats["lockstep_imbalance"] == pytest.approx(52 / 40)
    assert stats["num_micro_batches"] == 2 and stats["max_micro_batch_tokens"] == 12
    with pytest.raises(ValueError, match="multiple of the data-parallel size"):
        padded_fixed_batches(lengths, micro_batch_size=3, dp_size=3)


def test_packed_stats_by_hand():
    lengths = [6, 4, 5, 5]
    plan = [[[0, 1]], [[2, 3]]]
    stats = packing_stats(lengths, plan, max_tokens=20, cost_fn=lambda n: float(n))
    assert stats["real_token_fraction"] == 1.0
    assert stats["budget_fill"] == pytest.approx(0.5)
    assert stats["compute_imbalance"] == pytest.approx(1.0)


def test_extra_cost_counts_in_the_balance():
    """Image patches cost vision-tower work the length does not show: four equal-length samples, two of them
    with heavy extra cost, split one heavy + one light per rank, not both heavy on one rank."""
    lengths = [100, 100, 100, 100]
    plain = plan_micro_batches(lengths, max_tokens=1000, dp_size=2, owners=[0, 0, 1, 1])
    assert sorted(i for mb in plain[0] for i in mb) == [0, 1]  # balanced already: nothing moves
    heavy = plan_micro_batches(lengths, max_tokens=1000, dp_size=2, owners=[0, 0, 1, 1],
                               extra_cost=[5e6, 5e6, 0.0, 0.0])
    ranks = [{i for mb in rank for i in mb} for rank in heavy]
    assert all(len(r & {0, 1}) == 1 for r in ranks), heavy
    with pytest.raises(ValueError, match="extra_cost"):
        plan_micro_batches(lengths, max_tokens=1000, dp_size=2, extra_cost=[1.0])


def _grpo_batch(seed: int, prompts: int = 12, n: int = 8, empty_every: int = 0):
    """A GRPO-like batch: n samples per prompt, long prompts, short responses (with empty_every, every
    empty_every-th empty and the one after it a single token); -> (Samples, their row lengths, Prompts)."""
    from slime.data.sample import Sample

    rng = random.Random(seed)
    samples = []
    for g in range(prompts):
        prompt = [rng.randint(5, 250) for _ in range(rng.randint(100, 400))]
        for k in range(n):
            short = (g * n + k) % empty_every if empty_every else None
            r = short if short in (0, 1) else rng.randint(1, 120)
            samples.append(Sample(prompt_ids=prompt, response_ids=[rng.randint(5, 250) for _ in range(r)],
                                  group_id=g))
    rng.shuffle(samples)
    lengths = [s.row_len for s in samples]
    return samples, lengths, [(tuple(s.prompt_ids), len(s.prompt_ids)) for s in samples]


@pytest.mark.parametrize("seed", range(20))
def test_micro_batch_tokens_are_the_tokens_build_micro_batch_lays_out(seed):
    """The planner's count of a micro-batch with shared prompts against the builder's row, exactly, for random
    subsets in any order (siblings together and apart, responses of none, one and more tokens)."""
    from slime.data.batch import build_micro_batch
    from slime.data.packing import _Bin, micro_batch_tokens

    samples, lengths, prompts = _grpo_batch(seed, prompts=4, n=6, empty_every=5)
    assert {0, 1} <= {len(s.response_ids) for s in samples}
    rng = random.Random(seed)
    for _ in range(10):
        idx = rng.sample(range(len(samples)), rng.randint(1, len(samples)))
        for order in (idx, sorted(idx)):
            built = build_micro_batch(samples, order, share_prompts=True)
            assert micro_batch_tokens(order, lengths, prompts) == built.input_ids.numel()
        assert micro_batch_tokens(idx, lengths) == sum(lengths[i] for i in idx) == \
            build_micro_batch(samples, idx).input_ids.numel()
        b = _Bin()  # the planner's running count, sample by sample in any order
        for i in idx:
            b.add(i, lengths, prompts)
            assert b.tokens == micro_batch_tokens(b.items, lengths, prompts)


def test_a_sample_one_token_over_the_budget_fits_its_row():
    """A sample's row leaves out its response's last token (a target only): a sample of max_tokens + 1 tokens fills
    a micro-batch of max_tokens exactly; one token more does not fit, and the error says so."""
    from one_rank import OneRank
    from slime.data.sample import Sample
    from slime.trainer.layout import Layout, distribute

    layout = Layout(packing=True, max_tokens=8, micro_batch_size=1, budget_key="train.max_tokens_per_gpu")
    samples = [Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7, 8, 9])]
    mini = distribute(samples, OneRank(), layout).mini_batches[0]
    assert mini.micro == [[0]] and mini.num_processed == layout.build(samples, [0]).input_ids.numel() == 8
    with pytest.raises(ValueError, match=r"a sample of 9 tokens .* train.max_tokens_per_gpu=8 = 8 tokens"):
        distribute([Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7, 8, 9, 10])], OneRank(), layout)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_plans_with_shared_prompts_fill_micro_batches_by_the_tokens_they_hold(seed, dp):
    from slime.data.packing import micro_batch_tokens, pack_each_rank

    _, lengths, prompts = _grpo_batch(seed)
    max_tokens = 2048
    owners = [i * dp // len(lengths) for i in range(len(lengths))]
    shared = plan_micro_batches(lengths, max_tokens=max_tokens, dp_size=dp, owners=owners, prompts=prompts)
    plain = plan_micro_batches(lengths, max_tokens=max_tokens, dp_size=dp, owners=owners)
    assert sorted(flatten_plan(shared)) == list(range(len(lengths)))
    assert len({len(mbs) for mbs in shared}) == 1
    for mbs in shared:
        for mb in mbs:
            assert mb and micro_batch_tokens(mb, lengths, prompts) <= max_tokens
    assert len(shared[0]) < len(plain[0])  # 100-400-token prompts, 8 samples each: far fewer micro-batches
    if dp == 1:  # a prompt's samples packed together: as few micro-batches as the tokens, each prompt once, need
        assert len(shared[0]) == -(-micro_batch_tokens(range(len(lengths)), lengths, prompts) // max_tokens)
    by_rank = [[i for mb in mbs for i in mb] for mbs in plain]
    in_place = pack_each_rank([[lengths[i] for i in r] for r in by_rank], max_tokens=max_tokens,
                              prompts_by_rank=[[prompts[i] for i in r] for r in by_rank])
    for rank, mbs in enumerate(in_place):
        local_lengths, local_prompts = [lengths[i] for i in by_rank[rank]], [prompts[i] for i in by_rank[rank]]
        assert sorted(i for mb in mbs for i in mb) == list(range(len(by_rank[rank])))
        assert all(micro_batch_tokens(mb, local_lengths, local_prompts) <= max_tokens for mb in mbs if mb)


def test_balancing_counts_a_shared_prompt_once():
    """Rank 0 made three prompts of 10 tokens, rank 1 one of 300 tokens whose two samples share it. Summed whole
    lengths call the ranks even (740 and 700 tokens) where rank 0 runs 730 tokens and rank 1 400; counting each
    shared prompt once, the planner moves a sample and the ranks run 580 and 550."""
    from slime.data.packing import micro_batch_tokens

    lengths = [210, 210, 20, 110, 210, 60, 310, 310]
    prompts = [(0, 10), (0, 10), (1, 10), (1, 10), (2, 10), (2, 10), (3, 300), (3, 300)]
    owners = [0, 0, 0, 0, 1, 1, 1, 1]
    kw = dict(max_tokens=4096, dp_size=2, owners=owners, cost_fn=lambda n: default_cost(n, hidden_size=64))

    def rank_tokens(plan):
        return [micro_batch_tokens([i for mb in mbs for i in mb], lengths, prompts) for mbs in plan]

    by_whole_lengths = plan_micro_batches(lengths, **kw)  # the ranks balancing whole lengths picks
    assert rank_tokens(by_whole_lengths) == [730, 400]
    assert packing_stats(lengths, by_whole_lengths, cost_fn=kw["cost_fn"], prompts=prompts)["compute_imbalance"] > 1.2
    plan = plan_micro_batches(lengths, prompts=prompts, **kw)
    assert rank_tokens(plan) == [580, 550]
    assert packing_stats(lengths, plan, cost_fn=kw["cost_fn"], prompts=prompts)["compute_imbalance"] < 1.02


# Four prompts of two samples each: prompt 0 of 100 tokens, the others of 20.
WHOLE_PROMPTS_CASE = ([364, 120, 59, 67, 149, 101, 81, 52],
                      [(0, 100), (0, 100), (1, 20), (1, 20), (2, 20), (2, 20), (3, 20), (3, 20)])


def test_balancing_keeps_a_prompts_samples_together_where_that_is_more_even(monkeypatch):
    """Rank 0 made prompts 0 (100 tokens) and 1, rank 1 prompts 2 and 3 (20 tokens each), two samples each.
    Balancing sample by sample prices a sample at its response and half its prompt, and swaps sample 1 (of prompt
    0) for sample 7 (of prompt 3): both prompts then run on both ranks, and the ranks' cost is 1.17x their mean.
    With each prompt's samples as one unit, prompt 0 stays whole on rank 0 and the rest goes to rank 1: 1.05x."""
    import slime.data.packing as packing

    lengths, prompts = WHOLE_PROMPTS_CASE
    cost = functools.partial(default_cost, hidden_size=64)
    kw = dict(max_tokens=4096, dp_size=2, owners=[0, 0, 0, 0, 1, 1, 1, 1], cost_fn=cost, prompts=prompts)

    def imbalance(plan):
        return packing_stats(lengths, plan, cost_fn=cost, prompts=prompts)["compute_imbalance"]

    plan = plan_micro_batches(lengths, **kw)
    assert plan == [[[0, 1]], [[2, 3, 4, 5, 6, 7]]]
    assert imbalance(plan) < 1.05
    monkeypatch.setattr(packing, "PROMPTS_TOGETHER_GAIN", float("inf"))  # sample by sample only, as before
    split = plan_micro_batches(lengths, **kw)
    assert split == [[[0, 2, 3, 7]], [[1, 4, 5, 6]]]
    assert imbalance(split) > 1.15


def test_whole_prompts_are_balanced_from_where_they_are():
    """The case above with the ranks' roles swapped: rank 1 made prompts 0 and 1. Keeping prompts whole, balancing
    from where they are moves prompt 1 (two samples) to rank 0; balancing them from scratch would put prompt 0 on
    rank 0, as above, and move all eight."""
    lengths, prompts = WHOLE_PROMPTS_CASE
    owners = [1, 1, 1, 1, 0, 0, 0, 0]
    plan = plan_micro_batches(lengths, max_tokens=4096, dp_size=2, owners=owners, prompts=prompts,
                              cost_fn=functools.partial(default_cost, hidden_size=64))
    assert plan == [[[2, 3, 4, 5, 6, 7]], [[0, 1]]]


def _finishes(fn, seconds: float = 60.0):
    """fn's result, or a failure (not a hang) if it is still running after `seconds`: it ran in microseconds."""
    import threading

    out = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "still planning: the balancing loop did not terminate"
    return out[0]


def test_balancing_with_fractional_costs_terminates():
    """_even_out accepted an exchange whose delta equalled the gap (it only swaps which rank is heavy) when rounding
    made delta one ulp smaller: with fractional costs (shared prompts' (m-1)/m, image patches') the same sample
    moved back and forth for ever, every rank spinning in the same step's plan. 3 of 1000 GRPO-like plans hung."""
    from slime.trainer.layout import Layout

    layout = Layout(packing=True, max_tokens=2048, micro_batch_size=1, hidden_size=64, share_prompts=True)
    plan = _finishes(lambda: layout.plan([83, 25, 83], 2, owners=[0, 0, 1], prompts=[(b"p", 20)] * 3))
    assert sorted(i for rank in plan for mb in rank for i in mb) == [0, 1, 2]
    patches = _finishes(lambda: plan_micro_batches(  # image patch costs, no shared prompts
        [60, 70, 30, 30, 70, 70], max_tokens=200, dp_size=2, owners=[0, 0, 1, 1, 1, 1], allow_empty=True,
        extra_cost=[63651.84, 0.0, 0.0, 0.0, 254607.36, 254607.36],
        cost_fn=functools.partial(default_cost, hidden_size=896)))
    assert sorted(i for rank in patches for mb in rank for i in mb) == list(range(6))
    rng = random.Random(1)

    def many():
        for _ in range(300):
            dp, n = rng.choice([2, 3, 4]), rng.choice([2, 3, 4, 8])
            lengths, prompts = [], []
            for p in range(rng.choice([1, 2, 3, 4, 5, 8])):
                prompt_len = rng.choice([12, 20, 33])
                for _ in range(n):
                    lengths.append(prompt_len + rng.choice([rng.randint(1, 64), 64, 64]) - 1)
                    prompts.append(((p,), prompt_len))
            owners = [i * dp // len(lengths) for i in range(len(lengths))]
            layout = Layout(packing=True, max_tokens=2048, micro_batch_size=1, share_prompts=True,
                            hidden_size=rng.choice([64, 896, 4096]))
            plan = layout.plan(lengths, dp, owners=owners, prompts=prompts)
            assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(lengths)))

    _finishes(many, seconds=120.0)


def test_real_token_fraction_counts_the_padding_sequence_parallel_adds():
    """Under parallel.sp a packed row is padded to a multiple of sp (build_micro_batch's pad segment): the kernels
    process those tokens too. train/real_token_fraction read 1.0 there."""
    lengths = [3, 4, 5]
    plan = [[[0, 1], [2], []]]  # 7 -> 8 and 5 -> 8 tokens at sp=4; an empty (dummy) micro-batch counts none
    assert packing_stats(lengths, plan, pad_to=4)["real_token_fraction"] == 12 / 16
    assert packing_stats(lengths, plan)["real_token_fraction"] == 1.0
    assert packing_stats(lengths, plan, pad_to=4, padded=True)["real_token_fraction"] == 12 / 13  # 2 x 4 + 5


def test_a_sample_that_cannot_be_pickled_to_another_rank_is_named_with_what_to_put_in_metadata():
    """Rank 0 of two holds every sample, so distribute moves some to rank 1: one whose metadata holds a lock
    (a generate function's client) fails to pickle, and the error says what Sample.metadata may hold."""
    import pickle
    import threading

    from one_rank import OneRank
    from slime.data.sample import Sample
    from slime.trainer.layout import Layout, distribute

    class RankZeroOfTwo(OneRank):
        dp, world_size = 2, 2

        def all_gather_objects(self, obj, group=None):
            return [obj, []]  # rank 1 generated nothing

        def exchange_objects(self, outgoing, group=None):  # pickled as ParallelDims does, before sending
            return {r: pickle.loads(pickle.dumps(v)) for r, v in outgoing.items()} and {}

    layout = Layout(packing=True, max_tokens=64, micro_batch_size=1, budget_key="train.max_tokens_per_gpu")
    plain = [Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6]) for _ in range(4)]
    assert distribute(plain, RankZeroOfTwo(), layout).moved == 2
    locked = [Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6], metadata={"client": threading.Lock()})
              for _ in range(4)]
    with pytest.raises(TypeError, match=r"a sample cannot be pickled to move to the rank that trains it "
                                        r"\(TypeError: cannot pickle '_thread.lock' object\): .* plain data"):
        distribute(locked, RankZeroOfTwo(), layout)
