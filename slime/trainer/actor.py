"""The actor: an HF causal LM in a DeepSpeed ZeRO-3 engine, trained on packed micro-batches.

Loss normalisation is explicit: every micro-batch contributes its additive share of the global
loss (normalisers are global token/sequence counts of the optimizer step), and the share is
multiplied by dp because DeepSpeed averages gradients over data-parallel ranks. So the gradient
does not depend on how samples were split over ranks and micro-batches.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

import deepspeed
import torch

from slime.algorithms.policy_loss import aggregate_loss, ppo_policy_loss
from slime.config import Config
from slime.data.batch import MicroBatch, build_micro_batch
from slime.data.packing import plan_micro_batches
from slime.data.sample import Sample
from slime.distributed.ds_config import build_ds_config
from slime.distributed.parallel_dims import ParallelDims
from slime.models.attention import resolve_attn_implementation
from slime.models.loading import load_causal_lm, resolve_dtype
from slime.models.policy import PolicyModel
from slime.rollout.weight_sync import iter_gathered_buckets

logger = logging.getLogger(__name__)


def lr_lambda(cfg, total_steps: int):
    """Linear warmup, then constant or cosine decay to min_lr (as a multiplier of the peak lr)."""
    warmup, floor = cfg.warmup_steps, cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


class Actor:
    def __init__(self, cfg: Config, dims: ParallelDims):
        self.cfg, self.dims = cfg, dims
        dtype = resolve_dtype(cfg.model.dtype)
        self.ds_config = build_ds_config(cfg, bf16=dtype == torch.bfloat16)
        self.attn = resolve_attn_implementation(cfg.model.attn_implementation)
        hf = load_causal_lm(cfg.model, attn_implementation=self.attn, dtype=dtype)
        if cfg.model.gradient_checkpointing:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf.config.use_cache = False
        self.model = PolicyModel(hf)
        total = cfg.train.num_steps * cfg.train.num_mini_batches
        self.engine, *_ = deepspeed.initialize(
            model=self.model, model_parameters=[p for p in self.model.parameters() if p.requires_grad],
            config=self.ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.train, total)))
        self.device = dims.device

    # -- forward passes -------------------------------------------------------------------------

    def _forward(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        mb = mb.to(self.device)
        return self.engine(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
                           temperature=self.cfg.rollout.temperature, chunk_size=self.cfg.train.logits_chunk_size)

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per-sample response logprobs under the current weights, for the whole global batch.

        The batch is split over dp ranks with the (larger) no-grad budget, and results are
        all-gathered so every rank ends with logprobs for every sample.
        """
        budget = self.cfg.train.logprob_max_tokens_per_gpu or 2 * self.cfg.train.max_tokens_per_gpu
        plan = plan_micro_batches([s.total_len for s in samples], max_tokens=budget, dp_size=self.dims.dp)
        mine: dict[int, list[float]] = {}
        for idx in plan[self.dims.dp_rank]:
            mb = build_micro_batch(samples, idx)
            logp, _ = self._forward(mb)
            mine.update(zip(mb.indices, mb.split(logp)))
        merged: dict[int, list[float]] = {}
        for part in self.dims.all_gather_objects(mine):
            merged.update(part)
        return [merged[i] for i in range(len(samples))]

    # -- training -------------------------------------------------------------------------------

    def forward_backward(self, samples: Sequence[Sample], old_logprobs: Sequence[Sequence[float]] | None) -> dict:
        """Accumulate gradients of one optimizer step's loss over this rank's micro-batches.

        `samples` is the step's GLOBAL batch (identical on every rank); this rank packs and
        processes its share. Returns local metric sums (to be all-reduced).
        """
        algo = self.cfg.algo
        plan = plan_micro_batches([s.total_len for s in samples], max_tokens=self.cfg.train.max_tokens_per_gpu,
                                  dp_size=self.dims.dp)
        my_plan = plan[self.dims.dp_rank]
        num_tokens = sum(sum(s.loss_mask) for s in samples)
        num_seqs = len(samples)
        sums = {"loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "entropy": 0.0, "loss_tokens": 0.0,
                "train_tokens": 0.0, "micro_batches": float(len(my_plan)),
                "real_token_fraction": 0.0}
        for k, idx in enumerate(my_plan):
            mb = build_micro_batch(samples, idx)
            self.engine.set_gradient_accumulation_boundary(k == len(my_plan) - 1)
            logp, entropy = self._forward(mb)
            mask, seq_ids = mb.loss_mask.to(logp.device), mb.seq_ids.to(logp.device)
            if algo.policy_loss == "sft":
                per_token, m = -logp, {"clip_frac": 0.0, "ppo_kl": 0.0}
            else:
                old = mb.token_values([old_logprobs[i] for i in idx]).to(logp.device)
                adv = mb.token_values([[samples[i].advantage] * len(samples[i].response_ids) for i in idx])
                per_token, m = ppo_policy_loss(logp, old, adv.to(logp.device), mask,
                                               clip_low=algo.clip_low, clip_high=algo.clip_high)
            agg = dict(mode=algo.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, constant=algo.loss_agg_constant)
            loss = aggregate_loss(per_token, mask, seq_ids, **agg)
            ent_loss = aggregate_loss(entropy, mask, seq_ids, **agg)
            total = loss - algo.entropy_coef * ent_loss if algo.entropy_coef else loss
            self.engine.backward(total * self.dims.dp)
            n_local = float(mask.sum())
            sums["loss"] += loss.item()
            sums["pg_clipfrac"] += float(m["clip_frac"]) * n_local
            sums["ppo_kl"] += float(m["ppo_kl"]) * n_local
            sums["entropy"] += float((entropy.detach() * mask).sum())
            sums["loss_tokens"] += n_local
            sums["train_tokens"] += mb.num_tokens
            sums["real_token_fraction"] += mb.num_tokens / self.cfg.train.max_tokens_per_gpu
        return sums

    def optimizer_step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def train(self, samples: Sequence[Sample], old_logprobs: Sequence[Sequence[float]] | None) -> dict:
        """One rollout batch: num_mini_batches optimizer steps. Returns global metrics."""
        n_mini = self.cfg.train.num_mini_batches
        if len(samples) < n_mini * self.dims.dp:
            raise ValueError(f"{len(samples)} samples cannot fill train.num_mini_batches={n_mini} x dp={self.dims.dp}")
        bounds = [round(i * len(samples) / n_mini) for i in range(n_mini + 1)]
        totals: dict[str, float] = {}
        grad_norms = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            sums = self.forward_backward(samples[a:b], old_logprobs[a:b] if old_logprobs else None)
            grad_norms.append(self.optimizer_step())
            for key, value in sums.items():
                totals[key] = totals.get(key, 0.0) + value
        keys = sorted(totals)
        reduced = dict(zip(keys, self.dims.all_reduce_sum([totals[k] for k in keys])))
        ntok = max(reduced["loss_tokens"], 1.0)
        n_mb = max(reduced["micro_batches"], 1.0)
        return {
            "train/loss": reduced["loss"] / n_mini,
            "train/pg_clipfrac": reduced["pg_clipfrac"] / ntok,
            "train/ppo_kl": reduced["ppo_kl"] / ntok,
            "train/entropy": reduced["entropy"] / ntok,
            "train/grad_norm": sum(grad_norms) / len(grad_norms),
            "train/lr": self.engine.get_lr()[0],
            "train/tokens": reduced["train_tokens"],
            "train/micro_batches_per_rank": reduced["micro_batches"] / self.dims.dp / n_mini,
            "train/budget_fill": reduced["real_token_fraction"] / n_mb,
        }

    # -- weights out ------------------------------------------------------------------------------

    def gathered_weight_buckets(self):
        """Full HF-named tensors in buckets of rollout.sync_bucket_mb (collective: call on every rank)."""
        bucket_bytes = int(self.cfg.rollout.sync_bucket_mb * 2**20)
        return iter_gathered_buckets(self.engine.module, bucket_bytes=bucket_bytes)

    def export_hf(self, out_dir: str, tokenizer) -> None:
        """Write an HF model directory that `from_pretrained` loads (collective; rank 0 writes)."""
        state = {}
        for bucket in self.gathered_weight_buckets():
            if self.dims.is_main:
                state.update((name, t.cpu()) for name, t in bucket)
        if self.dims.is_main:
            hf = self.engine.module.hf
            hf.save_pretrained(out_dir, state_dict=state)
            tokenizer.save_pretrained(out_dir)
        self.dims.barrier()
