"""Policy-gradient losses and the packing-invariant loss aggregation.

Every loss here works on ONE packed micro-batch flattened over response tokens:

    logprobs, old_logprobs, advantages, loss_mask : (T,)   loss_mask is 1.0 where a token carries loss
    seq_ids                                        : (T,)   long, each token's sample index 0..S-1

Losses return a per-token loss (T,) that is NOT yet reduced; `aggregate_loss` turns it into the
micro-batch's share of the step loss using normalisers that the caller computes once per
optimizer step. Sequence-level operations (GSPO ratio, per-sequence means) assume every
sequence lies wholly inside the micro-batch it appears in.

Metrics are detached 0-dim tensors, masked means over the tokens of THIS micro-batch
(local, not global); average them over micro-batches/ranks for logging. They stay tensors so
that logging does not force a device sync per micro-batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
LOG_RATIO_CLAMP = 20.0
"""Log importance ratios are clamped to +/- this before exp (as verl and OpenRLHF do): past ~88.7 a
float32 ratio is inf, and inf times a zero advantage or a zero mask is NaN in the loss or its gradient.
e^20 is far outside any clip range, so clipped tokens are unaffected."""


def _ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask>0; 0 when the mask is empty. Garbage (nan/inf) at masked-out positions is ignored."""
    keep = mask > 0
    return torch.where(keep, x, torch.zeros_like(x)).sum() / keep.sum().clamp(min=1)


def segment_sum(x: Tensor, seq_ids: Tensor, num_segments: int | None = None) -> Tensor:
    """Per-sequence sums of a flat (T,) tensor -> (S,), with S = max(seq_ids) + 1 unless given."""
    if num_segments is None:
        num_segments = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    out = torch.zeros(num_segments, dtype=x.dtype, device=x.device)
    return out.index_add_(0, seq_ids, x)


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"expected 1-D tensors of one shape (flattened micro-batch), got {shapes}")


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1) so that 1 - clip_low > 0, got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO pessimistic surrogate max(-A r, -A clip(r)) and a bool mask of where the clip won."""
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(pg_unclipped, pg_clipped), pg_clipped > pg_unclipped


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level clipped PPO surrogate; asymmetric clip_low/clip_high gives DAPO's clip-higher.

    Shapes: all inputs (T,). Returns per-token loss (T,).
    dual_clip c > 1 (Ye et al. 2020): for A < 0 the loss is min(max(...), -c*A), bounding how
    hard a very off-policy token (ratio >> 1) can be pushed down.
    Metrics (local masked means): clip_frac (the 1 +/- eps clip was active), dual_clip_frac,
    ppo_kl = mean(old_logprobs - logprobs), pg_loss.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask)
    _check_clip(clip_low, clip_high)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")

    ratio = _ratio(logprobs - old_logprobs)
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        pg_dual = -advantages * dual_clip
        negative = advantages < 0
        dual_clipped = negative & (loss > pg_dual)
        loss = torch.where(negative, torch.minimum(loss, pg_dual), loss)

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(clipped.float(), loss_mask),
            "dual_clip_frac": masked_mean(dual_clipped.float(), loss_mask),
            "ppo_kl": masked_mean(old_logprobs - logprobs, loss_mask),
            "pg_loss": masked_mean(loss, loss_mask),
        }
    return loss, metrics


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): clip a length-normalised sequence ratio instead of token ratios.

    s_i = exp(mean_{t in seq i} (logp_t - old_t)). Per token the paper's GSPO-token form is used:
    s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t]), whose value is s_i and whose gradient w.r.t.
    logp_t is s_i (no gradient flows between tokens). The clip is the PPO one on s_{i,t}, so with
    a sequence-constant advantage a whole sequence is clipped or not. Pair with
    loss_agg="seq_mean_token_mean" to get the paper's objective. Typical clips are ~3e-4 / 4e-4.

    Shapes: all inputs (T,), seq_ids long. Returns per-token loss (T,).
    Metrics (local masked means over tokens): clip_frac, ppo_kl, pg_loss.
    """
    _check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask, seq_ids=seq_ids
    )
    _check_clip(clip_low, clip_high)

    keep = loss_mask > 0
    log_ratio = torch.where(keep, logprobs - old_logprobs, torch.zeros_like(logprobs))
    seq_len = segment_sum(keep.to(logprobs.dtype), seq_ids).clamp(min=1)  # (S,)
    seq_log_ratio = (segment_sum(log_ratio, seq_ids) / seq_len).detach()  # (S,)
    ratio = _ratio(seq_log_ratio[seq_ids]) * torch.exp(logprobs - logprobs.detach())  # (T,) value = s_i
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(clipped.float(), loss_mask),
            "ppo_kl": masked_mean(old_logprobs - logprobs, loss_mask),
            "pg_loss": masked_mean(loss, loss_mask),
        }
    return loss, metrics


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_high: float,
    clip_low: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): REINFORCE weighted by a clipped, stop-gradient importance ratio.

    loss_t = -sg(clamp(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t, so every token keeps a
    gradient (-w_t * A_t); PPO instead zeroes clipped tokens. The paper sets no lower bound
    (clip_low=None). The loss VALUE is not a surrogate objective (it scales with logp); only its
    gradient is meaningful.

    Shapes: all inputs (T,). Returns per-token loss (T,).
    Metrics (local masked means): clip_frac (weight was clamped), ppo_kl, is_weight_mean.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask)
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if clip_low is not None and not 0.0 <= clip_low <= 1.0:
        raise ValueError(f"clip_low must be in [0, 1] or None (no lower bound), got {clip_low}")

    with torch.no_grad():
        ratio = _ratio(logprobs - old_logprobs)
        weight = ratio.clamp(min=None if clip_low is None else 1.0 - clip_low, max=1.0 + clip_high)
    loss = -weight * advantages * logprobs

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((weight != ratio).float(), loss_mask),
            "ppo_kl": masked_mean(old_logprobs - logprobs, loss_mask),
            "is_weight_mean": masked_mean(weight, loss_mask),
        }
    return loss, metrics


def aggregate_loss(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    seq_ids: Tensor,
    *,
    mode: str,
    num_tokens: float | int | Tensor,
    num_seqs: float | int | Tensor,
    constant: float = 1.0,
    seq_token_counts: Tensor | None = None,
) -> Tensor:
    """This micro-batch's additive share of the optimizer-step loss.

    Shapes: per_token_loss, loss_mask, seq_ids (T,). Returns a 0-dim tensor.

    num_tokens / num_seqs are GLOBAL: the number of loss tokens / sequences in the whole
    optimizer step, over all micro-batches and all data-parallel ranks. Then
        token_mean               = sum_t(l_t * m_t) / num_tokens
        seq_mean_token_mean      = sum_i(mean_{t in i} l_t) / num_seqs
        seq_mean_token_sum_norm  = sum_i(sum_{t in i} l_t) / (constant * num_seqs)   (Dr.GRPO)
    are sums over the micro-batch's tokens/sequences, so summing the returned values over every
    micro-batch and rank gives exactly the global loss, whatever the packing.

    The caller must undo the engine's averaging: DeepSpeed divides gradients by the dp world
    size when it all-reduces them (and, with scale_wrt_gas, by gradient_accumulation_steps in
    backward), so multiply this value by dp_size (and by gas if backward scales) before backward.

    Per-sequence means need each sequence's full loss-token count; by default it is counted from
    loss_mask here, which is right when a sequence is not split across micro-batches or
    sequence-parallel ranks. Otherwise pass seq_token_counts (S,). num_seqs counts the sequences
    with at least one loss token (the trainer's MiniBatch.num_seqs; verl's seq_mask): one with none
    contributes nothing, and counting it would shrink every other sequence's weight.
    """
    _check_same_shape(per_token_loss=per_token_loss, loss_mask=loss_mask, seq_ids=seq_ids)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {LOSS_AGG_MODES}")
    for name, value in (("num_tokens", num_tokens), ("num_seqs", num_seqs), ("constant", constant)):
        if not isinstance(value, Tensor) and value <= 0:
            raise ValueError(f"{name} must be > 0 (a global count over the optimizer step), got {value}")

    keep = loss_mask > 0
    masked = torch.where(keep, per_token_loss * loss_mask, torch.zeros_like(per_token_loss))
    if mode == "token_mean":
        return masked.sum() / num_tokens
    if mode == "seq_mean_token_sum_norm":
        return masked.sum() / (constant * num_seqs)

    seq_sums = segment_sum(masked, seq_ids)  # (S,)
    num_local = seq_sums.numel()
    if seq_token_counts is None:
        counts = segment_sum(keep.to(masked.dtype), seq_ids, num_segments=num_local)
    elif seq_token_counts.numel() < num_local:
        raise ValueError(f"seq_token_counts has {seq_token_counts.numel()} entries but seq_ids reaches {num_local - 1}")
    else:
        counts = seq_token_counts[:num_local].to(masked.dtype)
    return (seq_sums / counts.clamp(min=1)).sum() / num_seqs
