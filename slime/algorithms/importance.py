"""Rollout/training mismatch correction (TIS / MIS).

The rollout engine (e.g. vLLM/SGLang, other kernels, lower precision) samples from a policy
pi_rollout that differs slightly from the trainer's pi_old at the same weights. Weighting the
policy loss by pi_old / pi_rollout, truncated (TIS, Yao et al. 2025) or masked outside a trust
band (MIS), corrects for that. Layout: the flattened micro-batch of policy_loss.py.

Usage: per_token_loss = per_token_loss * weights, before aggregate_loss.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from slime.algorithms.kl import kl_estimate
from slime.algorithms.policy_loss import _check_same_shape, masked_mean, segment_sum

TIS_LEVELS = ("off", "token", "sequence", "geometric")
TIS_MODES = ("truncate", "mask")


def rollout_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    level: str,
    mode: str,
    low: float,
    high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached importance weights (T,) for the train/rollout mismatch, plus mismatch metrics.

    log-ratio per token: d_t = old_logprobs - rollout_logprobs. Weight before correction:
        token:     exp(d_t)
        sequence:  exp(sum_{t in seq} d_t)     (every token of the sequence gets it)
        geometric: exp(mean_{t in seq} d_t)
    mode="truncate" clamps the weight into [low, high]; mode="mask" sets it to 0 outside
    [low, high] (drops the token / the whole sequence). level="off" gives all-ones weights.
    Positions with loss_mask == 0 get weight 1 (neutral, finite); the loss mask removes them.
    Sequence levels assume each sequence lies wholly inside this micro-batch.

    Shapes: all inputs (T,), seq_ids long.
    Metrics (always computed, local masked means over tokens):
        tis_mean_weight                 mean of the returned weights
        tis_clip_frac                   fraction of tokens whose weight was truncated/masked
        train_rollout_logprob_abs_diff  mean |d_t|
        train_rollout_kl                k3 estimate of KL(pi_rollout || pi_old) (samples are from rollout)
    """
    _check_same_shape(
        old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, loss_mask=loss_mask, seq_ids=seq_ids
    )
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown rollout-correction level {level!r}; choose one of {TIS_LEVELS}")
    if mode not in TIS_MODES:
        raise ValueError(f"unknown rollout-correction mode {mode!r}; choose one of {TIS_MODES}")
    if not (0.0 <= low <= high and high > 0.0):
        raise ValueError(f"need 0 <= low <= high and high > 0 for the importance-weight band, got {low=}, {high=}")

    with torch.no_grad():
        keep = loss_mask > 0
        log_ratio = torch.where(keep, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs))
        if level == "off":
            weights = torch.ones_like(old_logprobs)
            clipped = torch.zeros_like(keep)
        else:
            if level == "token":
                log_w = log_ratio
            else:
                seq_log_w = segment_sum(log_ratio, seq_ids)  # (S,)
                if level == "geometric":
                    seq_log_w = seq_log_w / segment_sum(keep.to(log_ratio.dtype), seq_ids).clamp(min=1)
                log_w = seq_log_w[seq_ids]
            # Compare in log space: a long sequence's summed log-ratio can overflow exp().
            log_low = math.log(low) if low > 0 else -math.inf
            outside = (log_w < log_low) | (log_w > math.log(high))
            if mode == "truncate":
                weights = torch.exp(log_w.clamp(log_low, math.log(high)))
            else:
                weights = torch.where(outside, torch.zeros_like(log_w), torch.exp(log_w.clamp(max=math.log(high))))
            weights = torch.where(keep, weights, torch.ones_like(weights))
            clipped = outside & keep

        metrics = {
            "tis_mean_weight": masked_mean(weights, loss_mask),
            "tis_clip_frac": masked_mean(clipped.float(), loss_mask),
            "train_rollout_logprob_abs_diff": masked_mean(log_ratio.abs(), loss_mask),
            "train_rollout_kl": masked_mean(kl_estimate(rollout_logprobs, old_logprobs, kind="k3"), loss_mask),
        }
    return weights, metrics
