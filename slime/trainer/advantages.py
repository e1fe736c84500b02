"""From rewards (and KL, values) to per-token advantages, for every estimator, on rank-local samples.

Glue between `Sample`s and the pure tensor functions in slime/algorithms. Each rank holds only its
own samples, and a group may be split over ranks, so:
- sequence-level estimators (GRPO, Dr.GRPO, RLOO, and REINFORCE++-baseline's group baseline) run on
  the gathered vector of per-sample scalars (reward, group, KL sum): a few numbers per sample;
- token-level work (returns, GAE) runs locally; REINFORCE++'s and GAE's whitening use the batch's mean and
  variance reduced over ranks;
- metrics are reduced over ranks, so every rank logs the global figure.
"""
from __future__ import annotations

import torch

from slime.algorithms.advantages import (gae_advantages, grpo_advantages, masked_whiten, reinforce_pp_returns,
                                         rloo_advantages)
from slime.algorithms.kl import kl_estimate
from slime.config import AlgoConfig
from slime.data.sample import Sample
from slime.distributed.parallel_dims import ParallelDims


def pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-sample 1-D tensors -> (N, width), zero padded."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out


def _global_scalars(samples: list[Sample], scores: torch.Tensor, dims: ParallelDims
                    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every rank's (score, group id) in global-index order, and this rank's rows in it."""
    parts = dims.all_gather_objects([(s.index, float(v), s.group_id) for s, v in zip(samples, scores.tolist())])
    rows = sorted((r for part in parts for r in part), key=lambda r: r[0])
    where = {index: k for k, (index, _, _) in enumerate(rows)}
    return (torch.tensor([r[1] for r in rows], dtype=torch.float32), torch.tensor([r[2] for r in rows]),
            [where[s.index] for s in samples])


def _token_means(sums: dict[str, torch.Tensor], count: torch.Tensor, dims: ParallelDims) -> dict[str, float]:
    g = dims.all_reduce_tensors({**sums, "_count": count})
    n = g.pop("_count")
    return {k: v / n if n else float("nan") for k, v in g.items()}  # no loss token: NaN (null), as train/'s


def _whiten_over_ranks(x: torch.Tensor, mask: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """masked_whiten with the mean and variance of the masked entries over every rank (a collective). Two passes in
    float64 (mean, then centred squares): E[x^2] - mean^2 cancels when the spread is small."""
    keep = mask > 0
    values = x[keep].double()
    stats = dims.all_reduce_tensors({"sum": values.sum(), "n": keep.sum()})
    n = max(stats["n"], 1.0)
    mean = stats["sum"] / n
    var = dims.all_reduce_tensors({"sq": (values - mean).square().sum()})["sq"] / n
    return masked_whiten(x, mask, mean=mean, var=var)


def compute_advantages(samples: list[Sample], cfg: AlgoConfig, dims: ParallelDims) -> dict:
    """Set per-token `advantages` on this rank's samples (and `returns` for GAE); global metrics."""
    # at least 1: a rank may hold no sample (dummies only), or only empty responses (a custom generate function)
    width = max([1, *(len(s.response_ids) for s in samples)])
    mask = pad([s.loss_mask for s in samples], width)  # (n, T)
    keep = mask > 0
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # (n,)
    kl = None
    if cfg.kl_in_reward:
        kl = kl_estimate(pad([s.old_logprobs for s in samples], width), pad([s.ref_logprobs for s in samples], width),
                         kind=cfg.kl_estimator) * mask  # (n, T)
    est = cfg.advantage_estimator
    metrics: dict = {}
    token_sums: dict[str, torch.Tensor] = {}
    if est in ("grpo", "dr_grpo", "rloo"):
        scores = rewards if kl is None else rewards - cfg.kl_coef * kl.sum(-1)  # the summed KL penalises the reward
        all_scores, groups, mine = _global_scalars(samples, scores, dims)
        if est == "rloo":
            adv, m = rloo_advantages(all_scores, groups)
        else:
            adv, m = grpo_advantages(all_scores, groups, normalize_std=cfg.normalize_std and est == "grpo")
        metrics.update({k: float(v) for k, v in m.items()})  # over the whole batch already
        token_adv = adv[mine][:, None] * mask  # observation tokens (mask 0) are not actions
        token_sums["adv_abs_mean"] = token_adv[keep].abs().sum()  # per token, as the others' (m's is per sample)
    elif est in ("reinforce_pp", "reinforce_pp_baseline"):
        scores = rewards
        if est == "reinforce_pp_baseline":
            all_rewards, groups, mine = _global_scalars(samples, rewards, dims)
            _, inv = torch.unique(groups, return_inverse=True)
            # float64: exact group sums, so a constant group scores exactly 0
            group_mean = torch.zeros(int(inv.max()) + 1, dtype=torch.float64).index_add_(
                0, inv, all_rewards.double()) / torch.bincount(inv)
            scores = (rewards.double() - group_mean[inv[mine]]).float()
        returns = reinforce_pp_returns(scores, mask, kl=kl, kl_coef=cfg.kl_coef if kl is not None else 0.0,
                                       gamma=cfg.gamma)
        token_adv = _whiten_over_ranks(returns, mask, dims)
        token_sums.update(return_mean=returns[keep].sum(), adv_abs_mean=token_adv[keep].abs().sum())
    elif est == "gae":
        last = (mask * torch.arange(width)).argmax(-1)  # (n,) position of each row's last loss token
        token_rewards = torch.zeros(len(samples), width)
        token_rewards[torch.arange(len(samples)), last] = rewards
        if kl is not None:
            token_rewards = token_rewards - cfg.kl_coef * kl
        (token_adv, returns), _ = gae_advantages(token_rewards, pad([s.values for s in samples], width), mask,
                                                 gamma=cfg.gamma, lam=cfg.lam)
        if cfg.gae_whiten:  # as verl and OpenRLHF: zero mean, unit variance over the batch's response tokens
            token_adv = _whiten_over_ranks(token_adv, mask, dims)
        for s, row in zip(samples, returns):
            s.returns = row[:len(s.response_ids)].clone()
        token_sums.update(adv_abs_mean=token_adv[keep].abs().sum(), return_mean=returns[keep].sum(),
                          value_mean=pad([s.values for s in samples], width)[keep].sum())
    else:
        raise ValueError(f"algo.advantage_estimator={est!r} is not supported")
    for s, row in zip(samples, token_adv):
        s.advantages = row[:len(s.response_ids)].clone()

    token_sums["advantage_mean"] = token_adv[keep].sum()
    metrics.update(_token_means(token_sums, keep.sum(), dims))
    seq = {"reward_mean": rewards.sum(), "n": torch.tensor(float(len(samples)))}
    if kl is not None:
        seq["kl_reward_penalty"] = (cfg.kl_coef * kl).sum()
    seq = dims.all_reduce_tensors(seq)
    n = seq.pop("n")
    for key, value in seq.items():  # the reward's mean before the KL penalty the estimator saw
        if key == "reward_mean" or key not in metrics:
            metrics[key] = value / n
    return {f"adv/{k}": float(v) for k, v in metrics.items()}
