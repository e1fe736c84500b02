"""Per-micro-batch losses of the actor and the critic, from the pure functions in slime/algorithms.

Each returns the micro-batch's additive share of the optimizer step's loss (global normalisers
`num_tokens` / `num_seqs` of the mini-batch over every rank) and metric SUMS as detached tensors
(token-weighted where they are means), which the engine adds up and reduces once per step.
"""
from __future__ import annotations

import torch

from slime.algorithms.importance import rollout_correction
from slime.algorithms.kl import kl_estimate
from slime.algorithms.policy_loss import aggregate_loss, cispo_policy_loss, gspo_policy_loss, ppo_policy_loss
from slime.algorithms.value_loss import clipped_value_loss
from slime.config import AlgoConfig, CriticConfig
from slime.data.batch import MicroBatch

Sums = dict[str, torch.Tensor]


def policy_token_loss(algo: AlgoConfig, logp, old, adv, mask, seq_ids):
    """Per-token policy loss of the configured kind, and its metrics."""
    if algo.policy_loss == "ppo":
        return ppo_policy_loss(logp, old, adv, mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
                               dual_clip=algo.dual_clip)
    if algo.policy_loss == "gspo":
        return gspo_policy_loss(logp, old, adv, mask, seq_ids, clip_low=algo.clip_low, clip_high=algo.clip_high)
    if algo.policy_loss == "cispo":
        return cispo_policy_loss(logp, old, adv, mask, clip_high=algo.clip_high, clip_low=algo.clip_low)
    raise ValueError(f"algo.policy_loss={algo.policy_loss!r} is not a policy-gradient loss")


def actor_loss(algo: AlgoConfig, mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor,
               router: dict | None = None, *, num_tokens: int, num_seqs: int,
               num_processed: int = 1) -> tuple[torch.Tensor, Sums]:
    """Policy loss (+ entropy bonus, + KL loss, x TIS weights), or cross-entropy for SFT; for a mixture of
    experts plus algo.router_aux_loss_coef x the router's load-balancing loss (see `router_terms`)."""
    loss, sums = _actor_loss(algo, mb, logp, entropy, num_tokens=num_tokens, num_seqs=num_seqs)
    if router is not None:
        aux, router_sums = router_terms(router, num_processed=num_processed)
        if algo.router_aux_loss_coef:
            loss = loss + algo.router_aux_loss_coef * aux
        sums.update(router_sums)
    return loss, sums


def router_terms(router: dict, *, num_processed: int) -> tuple[torch.Tensor, Sums]:
    """This forward's share of the step's router aux loss, and metric sums.

    transformers' load_balancing_loss_func balances the tokens of one forward; the step's aux loss is the
    token-weighted mean over the micro-batches (and sp shards) of every rank: each adds aux x n / N, with n
    its tokens and N the mini-batch's tokens over all ranks. The metric sums are `router_`-prefixed (they
    reduce over the whole world)."""
    share = router["aux"] * (router["tokens"].to(router["aux"].device) / max(num_processed, 1))
    # Under sp every peer holds its row's share (each differentiates its own tokens' part): the metric counts one
    return share, {"router_aux": share.detach() / router.get("peers", 1), "router_entropy_sum": router["entropy_sum"],
                   "router_entropy_n": router["entropy_n"].to(share.device),
                   "router_expert_counts": router["expert_counts"]}


def _actor_loss(algo: AlgoConfig, mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor, *,
                num_tokens: int, num_seqs: int) -> tuple[torch.Tensor, Sums]:
    mask, seq_ids = mb.loss_mask, mb.seq_ids
    agg = dict(mode=algo.loss_agg, num_tokens=max(num_tokens, 1), num_seqs=max(num_seqs, 1),
               constant=algo.loss_agg_constant)
    n_local = mask.sum()
    sums: Sums = {"entropy": (entropy.detach() * mask).sum(), "loss_tokens": n_local}
    if algo.policy_loss == "sft":
        loss = aggregate_loss(-logp, mask, seq_ids, **agg)
        sums["loss"] = loss.detach()
        return loss, sums
    old = mb.field("old_logprobs")
    from_update = old is None
    if from_update:  # algo.old_logprobs=train_forward: on-policy, this forward's weights are pi_old
        old = logp.detach()
    per_token, m = policy_token_loss(algo, logp, old, mb.field("advantages"), mask, seq_ids)
    sums.update(pg_clipfrac=m["clip_frac"] * n_local, ppo_kl=m["ppo_kl"] * n_local)
    if algo.dual_clip is not None:  # where the dual clip bounded a negative advantage's loss (not in pg_clipfrac)
        sums["pg_dual_clipfrac"] = m["dual_clip_frac"] * n_local
    if "is_weight_mean" in m:  # CISPO's clamped importance weight
        sums["is_weight_mean"] = m["is_weight_mean"] * n_local
    rollout = mb.field("rollout_logprobs")
    if rollout is not None:
        tis = algo.tis
        weights, tm = rollout_correction(old, rollout, mask, seq_ids, level=tis.level, mode=tis.mode,
                                         low=tis.low, high=tis.high)
        per_token = per_token * weights
        sums.update({k: v * n_local for k, v in tm.items()})
    pg_loss = aggregate_loss(per_token, mask, seq_ids, **agg)
    loss = pg_loss
    if algo.entropy_coef:
        loss = loss - algo.entropy_coef * aggregate_loss(entropy, mask, seq_ids, **agg)
    ref = mb.field("ref_logprobs")
    if ref is not None:
        kl = kl_estimate(logp, ref, kind=algo.kl_estimator)
        if algo.use_kl_loss:
            loss = loss + algo.kl_coef * aggregate_loss(kl, mask, seq_ids, **agg)
        sums["kl_ref"] = (kl.detach() * mask).sum()
        if from_update:  # what the scoring pass would report as rollout/kl_ref_k1
            sums["old_kl_ref_k1"] = ((old - ref) * mask).sum()
    sums.update(loss=loss.detach(), pg_loss=pg_loss.detach())
    return _nan_reaches_gradient(loss, logp), sums


def _nan_reaches_gradient(loss: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """`loss`, with its gradient NaN wherever the loss is not finite. Clipping passes no gradient through a NaN
    (torch.maximum's backward gives 0), so NaN pi_old, advantages or values would make a NaN loss with zero
    gradients, an update DeepSpeed applies; with a NaN gradient it skips the step, which is counted and, repeated,
    stops the run (train.max_skipped_steps). For a finite loss the added term is exactly 0."""
    finite = torch.where(torch.isfinite(output), output, torch.zeros_like(output))  # an -inf logprob: no NaN here
    return loss + (loss.detach() - loss.detach()) * finite.sum()


def critic_loss(critic: CriticConfig, mb: MicroBatch, values: torch.Tensor, *, num_tokens: int,
                num_seqs: int, num_processed: int = 1) -> tuple[torch.Tensor, Sums]:
    """Clipped value loss against the GAE returns, token-mean over the mini-batch."""
    mask = mb.loss_mask
    per_token, m = clipped_value_loss(values, mb.field("values"), mb.field("returns"), mask, clip=critic.value_clip)
    loss = critic.value_loss_coef * aggregate_loss(per_token, mask, mb.seq_ids, mode="token_mean",
                                                   num_tokens=max(num_tokens, 1), num_seqs=max(num_seqs, 1))
    n_local = mask.sum()
    return _nan_reaches_gradient(loss, values), {"value_loss": loss.detach(),
                                                 "value_clipfrac": m["value_clip_frac"] * n_local,
                                                 "loss_tokens": n_local}
