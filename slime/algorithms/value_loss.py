"""Critic loss for PPO with GAE (flattened micro-batch layout, see policy_loss.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from slime.algorithms.policy_loss import _check_same_shape, masked_mean


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    *,
    clip: float | None = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO value loss 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old + clamp(v - old, +/-clip).

    Taking the max keeps the critic from moving far from the values that produced the
    advantages in one step. clip=None gives the plain 0.5 * (v - R)^2.
    Shapes: all inputs (T,). Returns per-token loss (T,); reduce it with aggregate_loss.
    Metrics (local masked means): value_clip_frac (the clipped term was larger), value_loss,
    value_mean.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, loss_mask=loss_mask)
    if clip is not None and clip <= 0:
        raise ValueError(f"value clip must be > 0 or None (no clipping), got {clip}")

    err = (values - returns).square()
    if clip is None:
        loss = 0.5 * err
        clipped = torch.zeros_like(err, dtype=torch.bool)
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (values_clipped - returns).square()
        loss = 0.5 * torch.maximum(err, err_clipped)
        # where the clamp acted: elsewhere old + (v - old) may round off v, and err_clipped pass err by a hair
        clipped = ((values - old_values).abs() > clip) & (err_clipped > err)

    with torch.no_grad():
        metrics = {
            "value_clip_frac": masked_mean(clipped.float(), loss_mask),
            "value_loss": masked_mean(loss, loss_mask),
            "value_mean": masked_mean(values, loss_mask),
        }
    return loss, metrics
