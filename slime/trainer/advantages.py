"""From rewards (and KL, values) to per-token advantages on the global batch, for every estimator.

Glue between `Sample`s and the pure tensor functions in slime/algorithms: pads per-sample lists
into (N, T) tensors, calls the estimator, writes `sample.advantages` (and `returns` for GAE).
"""
from __future__ import annotations

import torch

from slime.algorithms.advantages import gae_advantages, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from slime.algorithms.kl import kl_estimate
from slime.config import AlgoConfig
from slime.data.sample import Sample


def pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def compute_advantages(samples: list[Sample], cfg: AlgoConfig) -> dict:
    """Set per-token `advantages` on every sample (the whole global batch); returns metrics."""
    width = max(len(s.response_ids) for s in samples)
    mask = pad([s.loss_mask for s in samples], width)  # (N, T)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # (N,)
    groups = torch.tensor([s.group_id for s in samples], dtype=torch.long)
    kl = None
    if cfg.kl_in_reward:
        kl = kl_estimate(pad([s.old_logprobs for s in samples], width), pad([s.ref_logprobs for s in samples], width),
                         kind=cfg.kl_estimator) * mask  # (N, T)
    est = cfg.advantage_estimator
    metrics: dict = {}
    if est in ("grpo", "dr_grpo", "rloo"):
        if kl is not None:  # sequence-level estimators: the summed KL penalises the scalar reward
            rewards = rewards - cfg.kl_coef * kl.sum(-1)
        if est == "rloo":
            adv, metrics = rloo_advantages(rewards, groups)
        else:
            adv, metrics = grpo_advantages(rewards, groups, normalize_std=cfg.normalize_std and est == "grpo")
        token_adv = adv[:, None].expand(-1, width)
    elif est in ("reinforce_pp", "reinforce_pp_baseline"):
        token_adv, metrics = reinforce_pp_advantages(
            rewards, mask, kl=kl, kl_coef=cfg.kl_coef if kl is not None else 0.0, gamma=cfg.gamma,
            group_ids=groups if est == "reinforce_pp_baseline" else None)
    elif est == "gae":
        last = (mask * torch.arange(width)).argmax(-1)  # (N,) position of each row's last loss token
        token_rewards = torch.zeros(len(samples), width)
        token_rewards[torch.arange(len(samples)), last] = rewards
        if kl is not None:
            token_rewards = token_rewards - cfg.kl_coef * kl
        (token_adv, returns), metrics = gae_advantages(token_rewards, pad([s.values for s in samples], width), mask,
                                                       gamma=cfg.gamma, lam=cfg.lam)
        for s, row in zip(samples, returns):
            s.returns = row[:len(s.response_ids)].tolist()
    else:
        raise ValueError(f"algo.advantage_estimator={est!r} is not supported")
    for s, row in zip(samples, token_adv):
        s.advantages = row[:len(s.response_ids)].tolist()
    if kl is not None:
        metrics["kl_reward_penalty"] = float((cfg.kl_coef * kl).sum(-1).mean())
    valid = mask > 0
    metrics["advantage_mean"] = float(token_adv[valid].mean()) if valid.any() else 0.0
    return {f"adv/{k}": float(v) for k, v in metrics.items()}
