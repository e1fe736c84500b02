"""Hand-computed checks for slime.algorithms (advantages, losses, KL, rollout correction).

Expected numbers are written out or derived with plain-Python loops/math that do not reuse the
implementation, so a wrong formula (sign, normaliser, stop-gradient) fails here.
"""

from __future__ import annotations

import math

import pytest
import torch

from slime.algorithms import (
    aggregate_loss,
    cispo_policy_loss,
    clipped_value_loss,
    gae_advantages,
    grpo_advantages,
    gspo_policy_loss,
    kl_estimate,
    ppo_policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    rollout_correction,
)

F = torch.float64


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=F)


def close(actual: torch.Tensor | float, expected: list[float] | float, tol: float = 1e-6) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F), torch.as_tensor(expected, dtype=F), atol=tol, rtol=0)


def plain_whiten(xs: list[float], eps: float = 1e-8) -> list[float]:
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return [(x - mean) / (std + eps) for x in xs]


# ---------------------------------------------------------------- advantages

# Three groups with non-contiguous ids and sizes 3, 1, 2.
REWARDS = [1.0, 0.0, 0.0, 5.0, 2.0, 4.0]
GROUPS = [7, 7, 7, 3, 9, 9]


def test_grpo_unbiased_std_and_unequal_groups():
    adv, metrics = grpo_advantages(t(REWARDS), torch.tensor(GROUPS))
    # group 7: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    # group 3: single sample -> 0;  group 9: mean 3, unbiased std sqrt(2)
    s7, s9 = math.sqrt(1 / 3), math.sqrt(2)
    close(adv, [(2 / 3) / s7, (-1 / 3) / s7, (-1 / 3) / s7, 0.0, -1 / s9, 1 / s9], tol=1e-5)
    close(metrics["zero_adv_group_frac"], 1 / 3)
    close(metrics["reward_mean"], 2.0)


def test_dr_grpo_is_grpo_without_std():
    adv, _ = grpo_advantages(t(REWARDS), torch.tensor(GROUPS), normalize_std=False)
    close(adv, [2 / 3, -1 / 3, -1 / 3, 0.0, -1.0, 1.0])


def test_grpo_constant_group_is_exactly_zero():
    # 0.1 is inexact in binary: a mean-based test would leave ~1e-17 / (1e-17 + eps) residue.
    adv, metrics = grpo_advantages(t([0.1, 0.1, 0.1, 1.0, 0.0]), torch.tensor([0, 0, 0, 1, 1]))
    assert torch.equal(adv[:3], torch.zeros(3))
    close(metrics["zero_adv_group_frac"], 0.5)


def test_rloo_leave_one_out():
    adv, _ = rloo_advantages(t(REWARDS), torch.tensor(GROUPS))
    # group 7: 1 - (0+0)/2, 0 - (1+0)/2, ...; group 9: 2 - 4, 4 - 2
    close(adv, [1.0, -0.5, -0.5, 0.0, -2.0, 2.0])


# Row 0: three response tokens then padding; row 1: a masked hole (tool output) at position 1.
RESP_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]], dtype=F)


def test_reinforce_pp_kl_in_reward_gamma_one():
    kl = t([[0.1, 0.2, 0.3, 9.0], [0.5, 9.0, 0.4, 9.0]])
    adv, _ = reinforce_pp_advantages(t([1.0, -1.0]), RESP_MASK, kl=kl, kl_coef=0.5, gamma=1.0)
    # token rewards row0: [-0.05, -0.1, 1 - 0.15]; row1: [-0.25, -, -1 - 0.2]
    # returns (reverse sums): row0 [0.70, 0.75, 0.85]; row1 [-1.45, -, -1.2]
    w = plain_whiten([0.70, 0.75, 0.85, -1.45, -1.2])
    close(adv, [[w[0], w[1], w[2], 0.0], [w[3], 0.0, w[4], 0.0]])


def test_reinforce_pp_discount_skips_masked_positions():
    adv, _ = reinforce_pp_advantages(t([1.0, -1.0]), RESP_MASK, gamma=0.5)
    # row0 returns [0.25, 0.5, 1]; row1: the hole is not an action, so t=0 is one step before t=2.
    w = plain_whiten([0.25, 0.5, 1.0, -0.5, -1.0])
    close(adv, [[w[0], w[1], w[2], 0.0], [w[3], 0.0, w[4], 0.0]])


def test_reinforce_pp_baseline_subtracts_group_mean():
    # rewards [3, 1] in one group -> scores [1, -1]; same as plain REINFORCE++ on [1, -1].
    adv, _ = reinforce_pp_advantages(t([3.0, 1.0]), RESP_MASK, gamma=0.5, group_ids=torch.tensor([4, 4]))
    w = plain_whiten([0.25, 0.5, 1.0, -0.5, -1.0])
    close(adv, [[w[0], w[1], w[2], 0.0], [w[3], 0.0, w[4], 0.0]])
    plain, _ = reinforce_pp_advantages(t([3.0, 1.0]), RESP_MASK, gamma=0.5)
    assert not torch.allclose(plain, adv)


def test_gae_hand_computed():
    rewards = t([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 2.0, 0.0]])
    values = t([[0.5, 0.6, 0.7, 9.0], [0.2, 9.0, 0.4, 9.0]])
    (adv, ret), _ = gae_advantages(rewards, values, RESP_MASK, gamma=0.9, lam=0.8)
    # row0: deltas [0.9*0.6-0.5, 0.9*0.7-0.6, 1-0.7] = [0.04, 0.03, 0.3]
    #       A2 = 0.3, A1 = 0.03 + 0.72*0.3 = 0.246, A0 = 0.04 + 0.72*0.246 = 0.21712
    # row1: hole skipped; deltas t2 = 2 - 0.4 = 1.6, t0 = 0.9*0.4 - 0.2 = 0.16; A0 = 0.16 + 0.72*1.6
    close(adv, [[0.21712, 0.246, 0.3, 0.0], [1.312, 0.0, 1.6, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0, 0.0], [1.512, 0.0, 2.0, 0.0]])


# ---------------------------------------------------------------- policy losses

# Token ratios [1.5, 0.5, 0.5, 1.1, 4.0] and a masked garbage token (ratio e^50).
OLD = [-1.0, -1.2, -0.7, -2.0, -3.0, -1.0]
RATIOS = [1.5, 0.5, 0.5, 1.1, 4.0]
LOGP = [o + math.log(r) for o, r in zip(OLD, RATIOS)] + [49.0]
ADV = [1.0, 1.0, -1.0, -2.0, -1.0, 5.0]
MASK = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_ppo_loss_values_clip_frac_and_gradients():
    logp = t(LOGP).requires_grad_()
    loss, metrics = ppo_policy_loss(logp, t(OLD), t(ADV), t(MASK), clip_low=0.2, clip_high=0.2)
    # t0: max(-1.5, -1.2) clipped; t1: max(-0.5, -0.8); t2: max(0.5, 0.8) clipped;
    # t3: -(-2)*1.1 both sides equal -> not clipped; t4: max(4.0, 1.2) = 4.0
    close(loss[:5], [-1.2, -0.5, 0.8, 2.2, 4.0])
    close(metrics["clip_frac"], 2 / 5)
    close(metrics["dual_clip_frac"], 0.0)
    close(metrics["ppo_kl"], sum(-math.log(r) for r in RATIOS) / 5)
    seq_ids = torch.zeros(6, dtype=torch.long)
    aggregate_loss(loss, t(MASK), seq_ids, mode="token_mean", num_tokens=1, num_seqs=1).backward()
    # d/dlogp of -A*r is -A*r where unclipped, 0 where the clip is active.
    close(logp.grad, [0.0, -0.5, 0.0, 2.2, 4.0, 0.0])


def test_ppo_clip_higher_and_dual_clip():
    logp = t(LOGP).requires_grad_()
    loss, metrics = ppo_policy_loss(logp, t(OLD), t(ADV), t(MASK), clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # t0 now clipped at 1.28; t4 (A<0, ratio 4) capped by the dual clip at -c*A = 3.
    close(loss[:5], [-1.28, -0.5, 0.8, 2.2, 3.0])
    close(metrics["dual_clip_frac"], 1 / 5)
    loss[4].backward()
    assert logp.grad[4] == 0.0


def test_gspo_sequence_ratio_and_token_gradients():
    # Two packed sequences of unequal length; token 5 is a masked garbage token of seq 1.
    log_ratio = [0.1, -0.2, 0.4, 0.3, 0.1, 5.0]
    old = t([-1.0, -2.0, -0.5, -1.5, -0.3, -1.0])
    logp = (old + t(log_ratio)).requires_grad_()
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, mask = t([1.0, 1.0, 1.0, -1.0, -1.0, -1.0]), t([1, 1, 1, 1, 1, 0])
    loss, metrics = gspo_policy_loss(logp, old, adv, mask, seq_ids, clip_low=0.05, clip_high=0.05)
    s0, s1 = math.exp(0.3 / 3), math.exp(0.4 / 2)  # length-normalised sequence ratios
    # seq0: A>0 and s0 = 1.105 > 1.05 -> clipped to -1.05; seq1: A<0, s1 > 1.05 -> unclipped s1.
    close(loss[:5], [-1.05, -1.05, -1.05, s1, s1])
    close(metrics["clip_frac"], 3 / 5)
    (loss * mask).sum().backward()
    # GSPO-token: d loss_t / d logp_t = -A * s_i (not s_i / |y_i| spread over the sequence).
    close(logp.grad, [0.0, 0.0, 0.0, s1, s1, 0.0])
    assert s0 > 1.05


def test_gspo_no_gradient_between_tokens():
    old = t([-1.0, -2.0, -0.5])
    logp = (old + t([0.01, -0.02, 0.0])).requires_grad_()
    adv, mask, seq_ids = t([1.0, 1.0, 1.0]), t([1, 1, 1]), torch.zeros(3, dtype=torch.long)
    loss, _ = gspo_policy_loss(logp, old, adv, mask, seq_ids, clip_low=0.2, clip_high=0.2)
    loss[0].backward()
    s = math.exp(-0.01 / 3)
    close(logp.grad, [-s, 0.0, 0.0])


def test_cispo_loss_and_gradient_is_clamped_ratio_times_advantage():
    old = t([-1.0, -1.2, -0.7, -1.0])
    ratios = [1.5, 0.5, 1.1]
    logp = (old + t([math.log(r) for r in ratios] + [30.0])).requires_grad_()
    adv, mask = t([1.0, -1.0, 2.0, 7.0]), t([1, 1, 1, 0])
    loss, metrics = cispo_policy_loss(logp, old, adv, mask, clip_high=0.2)
    weights = [1.2, 0.5, 1.1]  # no lower bound by default
    close(loss[:3], [-w * a * lp for w, a, lp in zip(weights, [1.0, -1.0, 2.0], logp.tolist())])
    close(metrics["clip_frac"], 1 / 3)
    num_tokens = 7  # global count: other micro-batches hold the rest
    agg = aggregate_loss(loss, mask, torch.tensor([0, 0, 1, 1]), mode="token_mean", num_tokens=num_tokens, num_seqs=2)
    agg.backward()
    close(logp.grad, [-1.2 * 1.0 / 7, -0.5 * -1.0 / 7, -1.1 * 2.0 / 7, 0.0])

    loss_low, _ = cispo_policy_loss(logp.detach(), old, adv, mask, clip_high=0.2, clip_low=0.2)
    close(loss_low[1], -0.8 * -1.0 * logp[1].item())


# ---------------------------------------------------------------- aggregation


def test_aggregate_loss_hand_computed():
    loss, mask = t([1, 2, 3, 4, 5, 6]), t([1, 1, 0, 1, 1, 1])
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 2])
    kw = dict(num_tokens=10, num_seqs=4)
    close(aggregate_loss(loss, mask, seq_ids, mode="token_mean", **kw), (1 + 2 + 4 + 5 + 6) / 10)
    close(aggregate_loss(loss, mask, seq_ids, mode="seq_mean_token_mean", **kw), (1.5 + 4.5 + 6) / 4)
    close(aggregate_loss(loss, mask, seq_ids, mode="seq_mean_token_sum_norm", constant=2.0, **kw), 18 / 8)


def _plain_global_loss(seqs: list[list[tuple[float, float]]], mode: str, constant: float) -> float:
    """Reference over the whole step: seqs[i] = [(loss, mask), ...]."""
    num_tokens = sum(m for s in seqs for _, m in s)
    if mode == "token_mean":
        return sum(l * m for s in seqs for l, m in s) / num_tokens
    sums = [sum(l * m for l, m in s) for s in seqs]
    if mode == "seq_mean_token_sum_norm":
        return sum(sums) / (constant * len(seqs))
    return sum(x / sum(m for _, m in s) for x, s in zip(sums, seqs)) / len(seqs)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregate_loss_invariant_to_micro_batch_split(mode):
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 7, 1, 5, 2]
    seqs = [[(torch.randn(1, generator=gen).item(), float(i % 4 != 1)) for i in range(n)] for n in lengths]
    num_tokens = sum(m for s in seqs for _, m in s)
    kw = dict(mode=mode, num_tokens=num_tokens, num_seqs=len(seqs), constant=4.0)

    def pack(group: list[list[tuple[float, float]]]):
        flat = [x for s in group for x in s]
        ids = torch.tensor([i for i, s in enumerate(group) for _ in s])
        return t([l for l, _ in flat]), t([m for _, m in flat]), ids

    whole = aggregate_loss(*pack(seqs), **kw)
    split = aggregate_loss(*pack([seqs[3], seqs[0]]), **kw) + aggregate_loss(*pack([seqs[1], seqs[4], seqs[2]]), **kw)
    reference = _plain_global_loss(seqs, mode, 4.0)
    close(whole, reference, tol=1e-12)
    close(split, reference, tol=1e-12)


def test_aggregate_seq_mean_with_sequence_split_needs_full_counts():
    loss, mask = t([1.0, 2.0, 3.0, 4.0]), t([1, 1, 1, 1])
    kw = dict(mode="seq_mean_token_mean", num_tokens=4, num_seqs=1)
    whole = aggregate_loss(loss, mask, torch.zeros(4, dtype=torch.long), **kw)
    counts = t([4.0])
    zeros = torch.zeros(2, dtype=torch.long)
    parts = aggregate_loss(loss[:2], mask[:2], zeros, seq_token_counts=counts, **kw) + aggregate_loss(
        loss[2:], mask[2:], zeros, seq_token_counts=counts, **kw
    )
    close(whole, 2.5)
    close(parts, 2.5)


def test_aggregate_rejects_bad_input():
    x, ids = t([1.0]), torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="mode"):
        aggregate_loss(x, x, ids, mode="mean", num_tokens=1, num_seqs=1)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_loss(x, x, ids, mode="token_mean", num_tokens=0, num_seqs=1)


# ---------------------------------------------------------------- KL, value loss, rollout correction


def test_kl_estimators():
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])  # log(pi/ref) = [0.5, -1.0]
    close(kl_estimate(logp, ref, kind="k1"), [0.5, -1.0])
    close(kl_estimate(logp, ref, kind="k2"), [0.125, 0.5])
    close(kl_estimate(logp, ref, kind="k3"), [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 2.0])
    # log(ref/pi) = -30 and +30 are clamped to -10 / +10 before exp.
    close(kl_estimate(t([0.0, -30.0]), t([-30.0, 0.0]), kind="k3"), [math.exp(-10) + 9, math.exp(10) - 11], tol=1e-6)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, kind="k4")


def test_clipped_value_loss():
    values, old, returns = t([1.2, 0.5, 1.1, 1e30]), t([0.8, 0.8, 1.0, 0.0]), t([1.5, 0.0, 3.0, 0.0])
    loss, metrics = clipped_value_loss(values, old, returns, t([1, 1, 1, 0]), clip=0.2)
    # t0: v_clip 1.0 -> 0.5*max(0.09, 0.25); t1: v_clip 0.6 -> 0.5*max(0.25, 0.36); t2: inside -> 0.5*3.61
    close(loss[:3], [0.125, 0.18, 1.805])
    close(metrics["value_clip_frac"], 2 / 3)
    close(metrics["value_loss"], (0.125 + 0.18 + 1.805) / 3)
    # inside the clip range, old + (v - old) rounds off v (float32) and its error passes v's by a hair: not clipped
    v, o, r = (torch.tensor([x]) for x in (0.0015595387667417526, 0.07563036680221558, -0.3927062749862671))
    assert (o + (v - o).clamp(-0.2, 0.2) - r).square() > (v - r).square()
    assert clipped_value_loss(v, o, r, torch.tensor([1.0]), clip=0.2)[1]["value_clip_frac"] == 0


# seq 0: 3 tokens; seq 1: 2 loss tokens plus a masked garbage token.
D = [0.1, 0.5, -0.2, -1.0, -0.5, 30.0]
TIS_MASK = t([1, 1, 1, 1, 1, 0])
TIS_IDS = torch.tensor([0, 0, 0, 1, 1, 1])
ROLLOUT = t([-1.0, -2.0, -0.3, -0.9, -1.4, -2.0])
OLD_LP = ROLLOUT + t(D)


def _tis(level: str, mode: str):
    return rollout_correction(OLD_LP, ROLLOUT, TIS_MASK, TIS_IDS, level=level, mode=mode, low=0.5, high=1.5)


@pytest.mark.parametrize(
    "level,mode,expected",
    [
        ("token", "truncate", [math.exp(0.1), 1.5, math.exp(-0.2), 0.5, math.exp(-0.5), 1.0]),
        ("token", "mask", [math.exp(0.1), 0.0, math.exp(-0.2), 0.0, math.exp(-0.5), 1.0]),
        # seq sums 0.4 (inside the band) and -1.5 -> e^-1.5 = 0.22 below low
        ("sequence", "truncate", [math.exp(0.4)] * 3 + [0.5, 0.5, 1.0]),
        ("sequence", "mask", [math.exp(0.4)] * 3 + [0.0, 0.0, 1.0]),
        # seq means 0.4/3 and -0.75 -> e^-0.75 = 0.47 below low
        ("geometric", "truncate", [math.exp(0.4 / 3)] * 3 + [0.5, 0.5, 1.0]),
        ("geometric", "mask", [math.exp(0.4 / 3)] * 3 + [0.0, 0.0, 1.0]),
        ("off", "truncate", [1.0] * 6),
    ],
)
def test_rollout_correction_weights(level, mode, expected):
    weights, metrics = _tis(level, mode)
    close(weights, expected)
    assert not weights.requires_grad
    close(metrics["tis_mean_weight"], sum(expected[:5]) / 5)
    n_clipped = {"token": 2, "sequence": 2, "geometric": 2, "off": 0}[level]
    close(metrics["tis_clip_frac"], n_clipped / 5)
    # Mismatch diagnostics do not depend on level/mode and ignore the masked garbage token.
    close(metrics["train_rollout_logprob_abs_diff"], sum(abs(d) for d in D[:5]) / 5)
    close(metrics["train_rollout_kl"], sum(math.exp(d) - d - 1 for d in D[:5]) / 5)


def test_rollout_correction_long_sequence_does_not_overflow():
    n = 40
    rollout = torch.full((n,), -5.0, dtype=F)
    old = rollout + 50.0  # summed log-ratio 2000: exp() would be inf
    args = (old, rollout, torch.ones(n, dtype=F), torch.zeros(n, dtype=torch.long))
    w_trunc, _ = rollout_correction(*args, level="sequence", mode="truncate", low=0.0, high=2.0)
    w_mask, metrics = rollout_correction(*args, level="sequence", mode="mask", low=0.0, high=2.0)
    close(w_trunc, [2.0] * n)
    close(w_mask, [0.0] * n)
    close(metrics["tis_clip_frac"], 1.0)


def test_a_sample_without_loss_tokens_is_not_counted_by_the_per_sequence_means():
    """An all-observation turn (loss mask all 0) adds nothing to seq_mean_token_mean; the mini-batch's num_seqs,
    the normaliser, must not count it either (as verl's seq_mask), or it shrinks every other sequence's weight
    (1/3 instead of 1/2 here)."""
    from one_rank import OneRank
    from slime.data.sample import Sample
    from slime.trainer.layout import Layout, distribute

    masks = ([1, 1, 0], [0, 0, 0], [0, 1, 1])
    samples = [Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], response_mask=m) for m in masks]
    mini = distribute(samples, OneRank(), Layout(packing=True, max_tokens=64, micro_batch_size=1)).mini_batches[0]
    assert (mini.num_loss_tokens, mini.num_seqs) == (4, 2)
    per_token = torch.tensor([1.0, 3.0, 100.0, 100.0, 100.0, 100.0, 100.0, 5.0, 7.0])
    loss = aggregate_loss(per_token, torch.tensor([m for ms in masks for m in ms]), torch.arange(3).repeat_interleave(3),
                          mode="seq_mean_token_mean", num_tokens=mini.num_loss_tokens, num_seqs=mini.num_seqs)
    assert loss.item() == (2.0 + 6.0) / 2  # the token means of samples 0 and 2, averaged
