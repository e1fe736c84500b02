"""Per-token KL estimators (Schulman, "Approximating KL Divergence", 2020).

With samples x ~ pi (the policy that produced `logprobs`) and log r = ref_logprobs - logprobs:
    k1 = -log r            unbiased for KL(pi || ref), high variance, can be negative
    k2 = 0.5 * (log r)^2   biased, low variance; its gradient is that of KL(pi || ref) in expectation
    k3 = r - 1 - log r     unbiased and always >= 0 (GRPO's KL loss)
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    *,
    kind: str = "k3",
    clamp: float | None = 10.0,
) -> Tensor:
    """Per-token KL(pi || ref) estimate, same shape as the inputs (e.g. (T,) or (N, T)).

    Returns only the tensor (no metrics): it is unreduced, so the caller masks/aggregates it
    (e.g. with aggregate_loss for a KL loss, or subtracts kl_coef * it from token rewards).
    For k3 the log-ratio is clamped to [-clamp, clamp] before exp, since a single token with a
    huge ratio would otherwise overflow; clamp=None disables it. k1/k2 have no exp and are not clamped.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_ESTIMATORS}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ")
    if clamp is not None and clamp <= 0:
        raise ValueError(f"clamp must be > 0 or None, got {clamp}")

    log_ratio = logprobs - ref_logprobs  # log(pi / ref)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    neg = -log_ratio  # log(ref / pi)
    if clamp is not None:
        neg = neg.clamp(-clamp, clamp)
    return torch.exp(neg) - neg - 1.0
