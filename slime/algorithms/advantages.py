"""Advantage estimators, run per sample on CPU over the whole rollout batch, before packing.

Layout:
    rewards       (N,)   float, one scalar reward per sample
    group_ids     (N,)   long, samples of one prompt share an id; groups may differ in size
    response_mask (N, T) 1 = response token that carries loss; padded rows. Zeros inside a row
                         (e.g. tool-output tokens in a multi-turn sample) are not actions: returns
                         and GAE skip over them, and their advantage is 0.

Sequence-level estimators return (N,) (the caller broadcasts to the sample's tokens); token-level
ones return (N, T). Batch statistics (REINFORCE++ whitening) are over everything passed in, so
pass the whole step's batch, not a micro-batch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_rewards(rewards: Tensor, group_ids: Tensor | None = None) -> None:
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a 1-D float tensor (N,), got {rewards.dtype} {tuple(rewards.shape)}")
    if group_ids is not None and group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} must match rewards {tuple(rewards.shape)}")


def _check_token_layout(response_mask: Tensor, n: int, **others: Tensor | None) -> None:
    if response_mask.dim() != 2 or response_mask.shape[0] != n:
        raise ValueError(f"response_mask must be (N={n}, T), got {tuple(response_mask.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != response_mask.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must match response_mask {tuple(response_mask.shape)}")


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Dense group index (N,) in 0..G-1 and G, for ids that need not be contiguous."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    return inv, (int(inv.max()) + 1 if inv.numel() else 0)


def _group_sum(x: Tensor, inv: Tensor, num_groups: int) -> Tensor:
    """Sum of x over each sample's group, gathered back to (N,)."""
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inv, x)[inv]


def _group_is_constant(x: Tensor, inv: Tensor, num_groups: int) -> Tensor:
    """(N,) bool: all rewards of the sample's group are equal (includes groups of size 1).

    Exact max == min test rather than std == 0: rounding in the mean would otherwise leave tiny
    nonzero advantages in groups that carry no signal.
    """
    empty = torch.zeros(num_groups, dtype=x.dtype, device=x.device)
    gmax = empty.scatter_reduce(0, inv, x, reduce="amax", include_self=False)
    gmin = empty.scatter_reduce(0, inv, x, reduce="amin", include_self=False)
    return (gmax == gmin)[inv]


def _group_metrics(rewards: Tensor, adv: Tensor, constant: Tensor, count: Tensor) -> dict[str, Tensor]:
    # Each sample contributes 1/count, so these sums count groups, not samples.
    num_groups = (1.0 / count).sum().clamp(min=1)
    return {
        "reward_mean": rewards.mean(),
        "adv_abs_mean": adv.abs().mean(),
        "zero_adv_group_frac": (constant.float() / count).sum() / num_groups,
    }


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO: (r - group mean) / (group std + eps). normalize_std=False gives Dr.GRPO (no std division).

    The std is the UNBIASED sample std (divides by n - 1), matching torch.std and the common
    GRPO implementations. Groups of size 1 and groups whose rewards are all equal get exactly 0.
    Shapes: rewards (N,) float, group_ids (N,) long. Returns advantages (N,).
    Metrics: reward_mean, adv_abs_mean, zero_adv_group_frac (groups with no learning signal).
    """
    _check_rewards(rewards, group_ids)
    inv, num_groups = _group_index(group_ids)
    r = rewards.double()  # float64 statistics: float32 squares overflow past ~1e19
    count = _group_sum(torch.ones_like(r), inv, num_groups)
    adv = r - _group_sum(r, inv, num_groups) / count
    if normalize_std:
        std = torch.sqrt(_group_sum(adv.square(), inv, num_groups) / (count - 1).clamp(min=1))
        adv = adv / (std + eps)
    adv = adv.to(rewards.dtype)
    constant = _group_is_constant(rewards, inv, num_groups)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv, _group_metrics(rewards, adv, constant, count)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """RLOO: r_i minus the mean reward of the OTHER samples of its group (unbiased baseline).

    Groups of size 1 (no other sample) and constant groups get 0.
    Shapes: rewards (N,) float, group_ids (N,) long. Returns advantages (N,).
    """
    _check_rewards(rewards, group_ids)
    inv, num_groups = _group_index(group_ids)
    r = rewards.double()  # as GRPO: float32 group sums overflow for rewards near its range, and lose digits
    count = _group_sum(torch.ones_like(r), inv, num_groups)
    total = _group_sum(r, inv, num_groups)
    adv = (r - (total - r) / (count - 1).clamp(min=1)).to(rewards.dtype)
    constant = _group_is_constant(rewards, inv, num_groups)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv, _group_metrics(rewards, adv, constant, count)


def masked_whiten(x: Tensor, mask: Tensor, *, eps: float = 1e-8, mean: Tensor | float | None = None,
                  var: Tensor | float | None = None) -> Tensor:
    """(x - mean) / (std + eps) over mask > 0 (biased std); 0 where mask == 0.

    `mean` and `var` default to the statistics of x over the mask; pass them when x is one rank's
    share of a larger batch (the batch's statistics, reduced over ranks by the caller). Float64 and
    two-pass (var of x - mean, not E[x^2] - mean^2, which cancels): equal float32 values sum
    exactly, so they centre to exactly 0 and whiten to 0.
    """
    keep = mask > 0
    n = keep.sum().clamp(min=1)
    zeros = torch.zeros_like(x, dtype=torch.float64)
    if mean is None:
        mean = torch.where(keep, x.double(), zeros).sum() / n
    centred = torch.where(keep, x.double() - mean, zeros)
    if var is None:
        var = centred.square().sum() / n
    std = torch.as_tensor(var, dtype=torch.float64, device=x.device).sqrt()
    return torch.where(keep, centred / (std + eps), zeros).to(x.dtype)


def _masked_discounted_cumsum(x: Tensor, mask: Tensor, discount: float) -> Tensor:
    """out_t = x_t + discount * out_{t'} over masked positions, t' = next masked position; 0 off-mask.

    Shapes: x, mask (N, T) -> (N, T). Unmasked positions are skipped, so steps are counted in
    actions (response tokens), not in raw positions.
    """
    keep = mask > 0
    x = torch.where(keep, x, torch.zeros_like(x))
    if discount == 1.0:  # fast path: reverse cumsum
        return torch.where(keep, x.flip(1).cumsum(1).flip(1), torch.zeros_like(x))
    out = torch.zeros_like(x)
    carry = torch.zeros_like(x[:, 0])
    for t in range(x.shape[1] - 1, -1, -1):
        carry = torch.where(keep[:, t], x[:, t] + discount * carry, carry)
        out[:, t] = torch.where(keep[:, t], carry, torch.zeros_like(carry))
    return out


def reinforce_pp_returns(
    rewards: Tensor,
    response_mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    group_ids: Tensor | None = None,
) -> Tensor:
    """REINFORCE++'s token-level returns before whitening (see reinforce_pp_advantages).

    Shapes: rewards (N,), response_mask (N, T), kl (N, T) or None, group_ids (N,) or None -> (N, T).
    """
    _check_rewards(rewards, group_ids)
    _check_token_layout(response_mask, rewards.shape[0], kl=kl)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")

    keep = response_mask > 0
    scores = rewards
    if group_ids is not None:
        inv, num_groups = _group_index(group_ids)
        r = rewards.double()  # exact group sums: a constant group scores exactly 0
        count = _group_sum(torch.ones_like(r), inv, num_groups)
        scores = (r - _group_sum(r, inv, num_groups) / count).to(rewards.dtype)
    # Last response token per row; rows without any response token receive nothing.
    num_pos = keep.shape[1]
    if num_pos == 0:  # every response empty: no token to reward
        return torch.zeros(keep.shape, dtype=rewards.dtype, device=rewards.device)
    last = num_pos - 1 - keep.flip(1).to(torch.int64).argmax(dim=1)  # (N,)
    has_response = keep.any(dim=1)
    token_rewards = torch.zeros(keep.shape, dtype=rewards.dtype, device=rewards.device)
    rows = torch.arange(keep.shape[0], device=rewards.device)
    token_rewards[rows, last] = torch.where(has_response, scores, torch.zeros_like(scores))
    if kl is not None and kl_coef != 0.0:
        kl = torch.where(keep, kl.to(rewards.dtype), torch.zeros_like(token_rewards))
        token_rewards = token_rewards - kl_coef * kl
    return _masked_discounted_cumsum(token_rewards, response_mask, gamma)


def reinforce_pp_advantages(
    rewards: Tensor,
    response_mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    group_ids: Tensor | None = None,
    eps: float = 1e-8,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE++ (Hu 2025): whitened token-level returns, no critic.

    Token reward = r_i at the sample's last response token, minus kl_coef * kl_t at every
    response token (KL-in-reward). Returns are discounted by gamma over response tokens and then
    whitened over ALL response tokens of the batch (biased std). With group_ids
    (REINFORCE++-baseline) the group-mean reward is subtracted from r_i first.

    Shapes: rewards (N,), response_mask (N, T), kl (N, T) or None, group_ids (N,) or None.
    Returns advantages (N, T), 0 where response_mask == 0.
    Metrics: reward_mean, return_mean (before whitening), adv_abs_mean.
    """
    returns = reinforce_pp_returns(rewards, response_mask, kl=kl, kl_coef=kl_coef, gamma=gamma, group_ids=group_ids)
    adv = masked_whiten(returns, response_mask, eps=eps)
    n = (response_mask > 0).sum().clamp(min=1)
    metrics = {
        "reward_mean": rewards.mean(),
        "return_mean": returns.sum() / n,
        "adv_abs_mean": adv.abs().sum() / n,
    }
    return adv, metrics


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
    """Generalised Advantage Estimation over response tokens (PPO with a critic).

    delta_t = r_t + gamma * V_{t'} - V_t and A_t = delta_t + gamma * lam * A_{t'}, where t' is the
    next response position (V = 0 past the last one, i.e. the episode ends there). Returns
    R_t = A_t + V_t are the critic's targets. Not whitened; use masked_whiten if wanted.

    Shapes: token_rewards, values, response_mask (N, T). Returns (advantages, returns), each
    (N, T) and 0 where response_mask == 0.
    Metrics: adv_abs_mean, return_mean, value_mean (masked means).
    """
    _check_token_layout(response_mask, response_mask.shape[0], token_rewards=token_rewards, values=values)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")

    keep = response_mask > 0
    token_rewards, values = token_rewards.detach(), values.detach()
    zeros = torch.zeros_like(values)
    # Next response position's value for every t: reverse running "latest value seen".
    next_values = torch.zeros_like(values)
    carry = zeros[:, 0]
    for t in range(values.shape[1] - 1, -1, -1):
        next_values[:, t] = carry
        carry = torch.where(keep[:, t], values[:, t], carry)
    deltas = torch.where(keep, token_rewards + gamma * next_values - values, zeros)
    adv = _masked_discounted_cumsum(deltas, response_mask, gamma * lam)
    returns = torch.where(keep, adv + values, zeros)

    n = keep.sum().clamp(min=1)
    metrics = {
        "adv_abs_mean": adv.abs().sum() / n,
        "return_mean": returns.sum() / n,
        "value_mean": torch.where(keep, values, zeros).sum() / n,
    }
    return (adv, returns), metrics
