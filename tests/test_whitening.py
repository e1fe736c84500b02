"""Numerics of REINFORCE++ whitening and GRPO group statistics against float64 references.

Small spreads on large rewards (E[x^2] - mean^2 cancels in float32), all-equal rewards (must give
exactly 0, as GRPO/RLOO do) and rewards whose squares overflow float32. References are plain-Python
float64 on the float32-rounded inputs the trainer actually sees.
"""
from __future__ import annotations

import math
import threading

import pytest
import torch

from one_rank import OneRank
from slime.algorithms import grpo_advantages, reinforce_pp_advantages
from slime.config import AlgoConfig
from slime.data.sample import Sample
from slime.trainer.advantages import compute_advantages


def f32(xs: list[float]) -> list[float]:
    return torch.tensor(xs, dtype=torch.float32).tolist()


def whiten64(xs: list[float], eps: float = 1e-8) -> list[float]:
    mean = math.fsum(xs) / len(xs)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))
    return [(x - mean) / (std + eps) for x in xs]


def samples(rewards: list[float], lengths: list[int], groups: list[int] | None = None) -> list[Sample]:
    return [Sample(prompt_ids=[1], response_ids=[5] * n, reward=r, index=i, group_id=groups[i] if groups else 0)
            for i, (r, n) in enumerate(zip(rewards, lengths))]


class Ranks:
    """`world` threads that meet in each collective: every rank gets the sums / the gathered list."""

    def __init__(self, world: int):
        # A rank that fails breaks the barrier (after 120 s) instead of leaving the others waiting forever.
        self.world, self.barrier, self.slots = world, threading.Barrier(world, timeout=120), [None] * world

    def _exchange(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def dims(self, rank: int):
        ranks = self

        class Dims(OneRank):
            world_size = ranks.world

            def all_gather_objects(self, obj, group=None):
                return ranks._exchange(rank, obj)

            def all_reduce_tensors(self, values, group=None, op=None):
                parts = ranks._exchange(rank, {k: float(v.double()) for k, v in values.items()})
                return {k: math.fsum(p[k] for p in parts) for k in values}

        return Dims()


def run_ranks(shards: list[list[Sample]], cfg: AlgoConfig) -> None:
    ranks = Ranks(len(shards))
    threads = [threading.Thread(target=compute_advantages, args=(shard, cfg, ranks.dims(r)))
               for r, shard in enumerate(shards)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def token_advantages(batch: list[Sample]) -> list[float]:
    return [a for s in batch for a in s.advantages.tolist()]


# Rewards 1e-4 apart on a scale of 100: float32 E[x^2] - mean^2 is 0 or negative here.
SMALL_SPREAD = [100.0, 100.01, 100.0, 100.01]
LENGTHS = [3, 2, 4, 1]


@pytest.mark.parametrize("world", [1, 2])
def test_trainer_reinforce_pp_small_spread_matches_float64(world):
    batch = samples(SMALL_SPREAD, LENGTHS)
    cfg = AlgoConfig(advantage_estimator="reinforce_pp")
    if world == 1:
        compute_advantages(batch, cfg, OneRank())
    else:
        run_ranks([batch[:1], batch[1:]], cfg)  # the mean / variance must be the batch's, not a rank's
    # gamma = 1, no KL: every token's return is its sample's reward.
    expected = whiten64([r for r, n in zip(f32(SMALL_SPREAD), LENGTHS) for _ in range(n)])
    torch.testing.assert_close(torch.tensor(token_advantages(batch), dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0)


def test_reinforce_pp_advantages_small_spread_matches_float64():
    adv, _ = reinforce_pp_advantages(torch.tensor(SMALL_SPREAD), torch.ones(4, 3))
    expected = whiten64(f32(SMALL_SPREAD))
    torch.testing.assert_close(adv.double(), torch.tensor(expected, dtype=torch.float64)[:, None].expand(4, 3),
                               atol=1e-5, rtol=0)


# Constant groups whose float32 group mean is not the reward: 8 x 0.7579544 and 2 x 0.5.
CONSTANT_GROUPS = ([0.7579544029403025] * 8 + [0.5] * 2, [0] * 8 + [1] * 2)


@pytest.mark.parametrize("estimator, rewards, groups", [
    ("reinforce_pp", [0.1] * 4, None),
    ("reinforce_pp_baseline", *CONSTANT_GROUPS),
])
def test_trainer_equal_values_whiten_to_exactly_zero(estimator, rewards, groups):
    """Nothing to learn (all rewards, or all groups, equal): exactly 0, as GRPO/RLOO give."""
    batch = samples(rewards, [3] * len(rewards), groups)
    compute_advantages(batch, AlgoConfig(advantage_estimator=estimator), OneRank())
    assert all(a == 0.0 for a in token_advantages(batch))


@pytest.mark.parametrize("rewards, groups", [([0.1] * 4, None), CONSTANT_GROUPS])
def test_reinforce_pp_advantages_equal_values_exactly_zero(rewards, groups):
    gids = None if groups is None else torch.tensor(groups)
    adv, _ = reinforce_pp_advantages(torch.tensor(rewards), torch.ones(len(rewards), 3), group_ids=gids)
    assert torch.equal(adv, torch.zeros_like(adv))


@pytest.mark.parametrize("rewards", [[0.0, 1e20], [3e38, 3e38, -3e38]])
def test_grpo_group_statistics_do_not_overflow(rewards):
    adv, _ = grpo_advantages(torch.tensor(rewards), torch.zeros(len(rewards), dtype=torch.long))
    xs = f32(rewards)
    mean = math.fsum(xs) / len(xs)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1))  # unbiased, as GRPO
    expected = [(x - mean) / (std + 1e-6) for x in xs]
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("estimator", ["rloo", "dr_grpo", "reinforce_pp"])
def test_reward_mean_is_the_task_rewards_with_kl_in_the_reward(estimator):
    """With algo.kl_in_reward the estimator sees rewards minus the KL penalty; adv/reward_mean stays the task
    reward's mean (the penalty has its own metric)."""
    batch = samples([1.0, 0.0, 1.0, 0.0], [3] * 4)
    for s in batch:
        s.old_logprobs = torch.full((3,), -1.0)
        s.ref_logprobs = torch.full((3,), -1.5)
    metrics = compute_advantages(batch, AlgoConfig(advantage_estimator=estimator, kl_in_reward=True, kl_coef=0.1,
                                                   kl_estimator="k1", normalize_std=False), OneRank())
    assert metrics["adv/reward_mean"] == 0.5
    assert metrics["adv/kl_reward_penalty"] == pytest.approx(0.1 * 0.5 * 3)


@pytest.mark.parametrize("world", [1, 2])
def test_gae_advantages_are_whitened_over_every_rank(world):
    """verl's and OpenRLHF's GAE: advantages whitened over the batch's response tokens (the mean and variance of
    every rank's), the critic's returns not; algo.gae_whiten=false keeps the raw GAE."""
    def batch():
        out = samples([1.0, 0.0, 0.5, 2.0], LENGTHS)
        for i, s in enumerate(out):
            s.values = torch.linspace(0.1 * i, 0.3, len(s.response_ids))
        return out

    raw = batch()
    compute_advantages(raw, AlgoConfig(advantage_estimator="gae", gae_whiten=False, gamma=0.9, lam=0.8), OneRank())
    whitened = batch()
    cfg = AlgoConfig(advantage_estimator="gae", gamma=0.9, lam=0.8)
    if world == 1:
        compute_advantages(whitened, cfg, OneRank())
    else:
        run_ranks([whitened[:1], whitened[1:]], cfg)
    torch.testing.assert_close(torch.tensor(token_advantages(whitened), dtype=torch.float64),
                               torch.tensor(whiten64(token_advantages(raw)), dtype=torch.float64), atol=1e-6, rtol=0)
    for a, b in zip(raw, whitened):
        assert torch.equal(a.returns, b.returns)
    assert abs(math.fsum(token_advantages(raw))) > 1  # whitening changed something


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_a_rank_without_samples_takes_part_and_changes_nothing(estimator):
    """A step's batch can hold fewer samples than ranks (dynamic sampling kept one group): a rank with none runs
    the collectives with the others, and the advantages are those of one rank holding the whole batch."""
    def batch():
        out = samples([1.0, 0.0, 0.5, 2.0], LENGTHS, groups=[0, 0, 1, 1])
        for i, s in enumerate(out):
            s.values = torch.linspace(0.1 * i, 0.3, len(s.response_ids))
        return out

    cfg = AlgoConfig(advantage_estimator=estimator)
    whole, split = batch(), batch()
    compute_advantages(whole, cfg, OneRank())
    run_ranks([split, []], cfg)
    assert token_advantages(split) == pytest.approx(token_advantages(whole), abs=1e-6)


def test_rloo_group_sums_in_float64_do_not_overflow():
    """Rewards near float32's range (accepted by the finite check) sum in float64, as GRPO's do: the float32 sum
    2e38 + 2e38 overflowed to inf and every advantage of the group was -inf."""
    from slime.algorithms import rloo_advantages

    adv, _ = rloo_advantages(torch.tensor([2e38, 2e38, 0.0]), torch.tensor([0, 0, 0]))
    torch.testing.assert_close(adv, torch.tensor([1e38, 1e38, -2e38]))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_a_batch_of_empty_responses_gets_empty_advantages(estimator):
    """A custom generate function may return nothing for every prompt of a rank: each estimator gives empty
    advantages (argmax over a width of 0 failed in REINFORCE++ and GAE)."""
    batch = samples([1.0, 0.0], [0, 0])
    for s in batch:
        s.values = torch.zeros(0)
    compute_advantages(batch, AlgoConfig(advantage_estimator=estimator), OneRank())
    assert [s.advantages.shape for s in batch] == [torch.Size([0])] * 2


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_adv_abs_mean_is_a_token_mean_for_every_estimator(estimator):
    """GRPO and RLOO reported the mean |advantage| per sample, REINFORCE++ and GAE per token: one metric name, two
    meanings. Every estimator's is the mean over the loss tokens now (here: 1 + 5 + 2 tokens of unequal |adv|)."""
    batch = samples([1.0, 0.0, 0.0], [1, 5, 2])
    metrics = compute_advantages(batch, AlgoConfig(advantage_estimator=estimator), OneRank())
    tokens = token_advantages(batch)
    assert len(tokens) == 8 and len({abs(round(a, 6)) for a in tokens}) > 1
    assert metrics["adv/adv_abs_mean"] == pytest.approx(sum(abs(a) for a in tokens) / 8, rel=1e-6)
