"""The actor: an HF causal LM in a DeepSpeed ZeRO-3 engine, trained on packed micro-batches.

Loss normalisation is explicit: every micro-batch contributes its additive share of the global
loss (normalisers are global token/sequence counts of the optimizer step); engine_utils scales
it by dp because DeepSpeed averages gradients over data-parallel ranks. So the gradient does not
depend on how samples were split over ranks and micro-batches.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

from slime.algorithms.importance import rollout_correction
from slime.algorithms.kl import kl_estimate
from slime.algorithms.policy_loss import aggregate_loss, cispo_policy_loss, gspo_policy_loss, ppo_policy_loss
from slime.config import AlgoConfig, Config
from slime.data.batch import MicroBatch
from slime.data.sample import Sample
from slime.distributed.ds_config import build_ds_config
from slime.distributed.parallel_dims import ParallelDims
from slime.models.attention import resolve_attn_implementation
from slime.models.loading import load_causal_lm, resolve_dtype
from slime.models.policy import PolicyModel
from slime.rollout.weight_sync import iter_gathered_buckets
from slime.trainer.engine_utils import (accumulate_gradients, init_engine, mini_batches, nograd_layout, per_sample_pass,
                                       train_layout)

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


def load_policy_engine(cfg: Config, dims: ParallelDims, *, trainable: bool):
    """PolicyModel in a ZeRO-3 engine: trainable (actor) or frozen inference-only (reference)."""
    dtype = resolve_dtype(cfg.model.dtype)
    ds_config = build_ds_config(cfg, bf16=dtype == torch.bfloat16)
    hf = load_causal_lm(cfg.model, attn_implementation=resolve_attn_implementation(cfg.model.attn_implementation),
                        dtype=dtype)
    hf.config.use_cache = False
    if not trainable:
        if cfg.algo.ref_offload:
            ds_config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        return init_engine(PolicyModel(hf), ds_config)
    if cfg.model.gradient_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    total = cfg.train.num_steps * cfg.train.num_mini_batches
    return init_engine(PolicyModel(hf), ds_config, lr=cfg.train.lr, lr_lambda=lr_lambda(cfg.train, total))


def policy_forward(engine, cfg: Config, device: torch.device):
    def forward(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        mb = mb.to(device)
        return engine(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
                      temperature=cfg.rollout.temperature, chunk_size=cfg.train.logits_chunk_size)
    return forward


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


class Actor:
    def __init__(self, cfg: Config, dims: ParallelDims):
        self.cfg, self.dims, self.device = cfg, dims, dims.device
        self.engine = load_policy_engine(cfg, dims, trainable=True)
        self._forward = policy_forward(self.engine, cfg, self.device)

    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per-sample response logprobs under the current weights, for the whole global batch."""
        return per_sample_pass(lambda mb: self._forward(mb)[0], samples, self.dims, layout=nograd_layout(self.cfg))

    def forward_backward(self, samples: Sequence[Sample]) -> dict:
        """Accumulate gradients of one optimizer step's loss over this rank's micro-batches.

        `samples` is the step's GLOBAL batch (identical on every rank), with old_logprobs and
        advantages set (and ref_logprobs when a KL loss is used). Returns local metric sums.
        """
        algo = self.cfg.algo
        agg = dict(mode=algo.loss_agg, num_tokens=sum(sum(s.loss_mask) for s in samples), num_seqs=len(samples),
                   constant=algo.loss_agg_constant)

        def loss_fn(mb: MicroBatch):
            rows = [samples[i] for i in mb.indices]
            logp, entropy = self._forward(mb)
            dev = logp.device
            mask, seq_ids = mb.loss_mask.to(dev), mb.seq_ids.to(dev)
            n_local = float(mask.sum())
            if algo.policy_loss == "sft":
                loss = aggregate_loss(-logp, mask, seq_ids, **agg)
                return loss, {"loss": loss.item(), "entropy": float((entropy.detach() * mask).sum()),
                              "loss_tokens": n_local}
            old = mb.token_values([s.old_logprobs for s in rows]).to(dev)
            adv = mb.token_values([s.advantages for s in rows]).to(dev)
            per_token, m = policy_token_loss(algo, logp, old, adv, mask, seq_ids)
            sums = {"pg_clipfrac": float(m["clip_frac"]) * n_local, "ppo_kl": float(m["ppo_kl"]) * n_local}
            if rows[0].rollout_logprobs is not None:
                rollout = mb.token_values([s.rollout_logprobs for s in rows]).to(dev)
                tis = algo.tis
                weights, tm = rollout_correction(old, rollout, mask, seq_ids, level=tis.level, mode=tis.mode,
                                                 low=tis.low, high=tis.high)
                per_token = per_token * weights
                sums.update({k: float(v) * n_local for k, v in tm.items()})
            pg_loss = aggregate_loss(per_token, mask, seq_ids, **agg)
            loss = pg_loss
            if algo.entropy_coef:
                loss = loss - algo.entropy_coef * aggregate_loss(entropy, mask, seq_ids, **agg)
            if rows[0].ref_logprobs is not None:
                ref = mb.token_values([s.ref_logprobs for s in rows]).to(dev)
                kl = kl_estimate(logp, ref, kind=algo.kl_estimator)
                if algo.use_kl_loss:
                    loss = loss + algo.kl_coef * aggregate_loss(kl, mask, seq_ids, **agg)
                sums["kl_ref"] = float((kl.detach() * mask).sum())
            sums.update(loss=loss.item(), pg_loss=pg_loss.item(), entropy=float((entropy.detach() * mask).sum()),
                        loss_tokens=n_local)
            return loss, sums

        return accumulate_gradients(self.engine, samples, self.dims, layout=train_layout(self.cfg), loss_fn=loss_fn)

    def optimizer_step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def train(self, samples: Sequence[Sample]) -> dict:
        """One rollout batch: num_mini_batches optimizer steps. Returns global metrics."""
        n_mini = self.cfg.train.num_mini_batches
        totals: dict[str, float] = {}
        grad_norms = []
        for mini in mini_batches(samples, n_mini, self.dims.dp):
            sums = self.forward_backward(mini)
            grad_norms.append(self.optimizer_step())
            for key, value in sums.items():
                totals[key] = totals.get(key, 0.0) + value
        keys = sorted(totals)
        g = dict(zip(keys, self.dims.all_reduce_sum([totals[k] for k in keys])))
        ntok = max(g.pop("loss_tokens"), 1.0)
        n_mb = max(g.pop("micro_batches"), 1.0)
        out = {
            "train/loss": g.pop("loss") / n_mini,
            "train/grad_norm": sum(grad_norms) / len(grad_norms),
            "train/lr": self.engine.get_lr()[0],
            "train/tokens": g.pop("train_tokens"),
            "train/real_tokens": g.pop("real_tokens"),
            "train/micro_batches_per_rank": n_mb / self.dims.dp / n_mini,
            "train/real_token_fraction": g.pop("real_token_fraction") / n_mini,
            "train/dp_imbalance": g.pop("dp_imbalance") / n_mini,
        }
        if "pg_loss" in g:
            out["train/pg_loss"] = g.pop("pg_loss") / n_mini
        out.update({f"train/{k}": v / ntok for k, v in g.items()})  # the rest are token sums
        return out

    # -- colocation -------------------------------------------------------------------------------

    def offload(self, *, params: bool = True) -> None:
        """Move DeepSpeed states to host while a colocated engine uses the GPU (no-op on CPU).

        params=False keeps the parameter partitions, which the weight gather for the engine needs.
        """
        if self.device.type != "cuda":
            return
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        include = [t for t in OffloadStateTypeEnum if params or t != OffloadStateTypeEnum.lp_params]
        self.engine.offload_states(include=include)
        torch.cuda.empty_cache()

    def reload(self) -> None:
        if self.device.type == "cuda":
            self.engine.reload_states()

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
            self.engine.module.hf.save_pretrained(out_dir, state_dict=state)
            tokenizer.save_pretrained(out_dir)
        self.dims.barrier()


class Reference:
    """A frozen copy of the initial policy as a ZeRO-3 inference engine, for KL."""

    def __init__(self, cfg: Config, dims: ParallelDims):
        self.cfg, self.dims = cfg, dims
        self.engine = load_policy_engine(cfg, dims, trainable=False)
        self._forward = policy_forward(self.engine, cfg, dims.device)

    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        return per_sample_pass(lambda mb: self._forward(mb)[0], samples, self.dims, layout=nograd_layout(self.cfg))
