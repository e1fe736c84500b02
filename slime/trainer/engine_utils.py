"""What every DeepSpeed-wrapped model here shares: engine creation, no-grad passes over a global
batch, and gradient accumulation over this rank's packed micro-batches."""
from __future__ import annotations

import copy
from typing import Callable, Sequence

import deepspeed
import torch

from slime.config import Config
from slime.data.batch import MicroBatch, build_micro_batch, build_padded_micro_batch
from slime.data.packing import packing_stats, padded_fixed_batches, plan_micro_batches
from slime.data.sample import Sample
from slime.distributed.parallel_dims import ParallelDims


def init_engine(module: torch.nn.Module, ds_config: dict, *, lr: float | None = None, lr_lambda=None):
    """A ZeRO-3 engine; with lr None, an inference-only engine (no optimizer, parameters still sharded)."""
    ds_config = copy.deepcopy(ds_config)
    if lr is None:
        ds_config.pop("optimizer", None)
        ds_config.pop("gradient_clipping", None)
        module.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=module, config=ds_config)
        engine.eval()
        return engine
    ds_config["optimizer"]["params"]["lr"] = lr
    sched = (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)) if lr_lambda else None
    engine, *_ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
                                      config=ds_config, lr_scheduler=sched)
    return engine


class Layout:
    """How a global batch becomes micro-batches: packed under a token budget, or padded fixed-size."""

    def __init__(self, cfg: Config, *, max_tokens: int):
        self.packing, self.max_tokens, self.micro_batch_size = cfg.train.packing, max_tokens, cfg.train.micro_batch_size

    def plan(self, samples: Sequence[Sample], dp: int) -> list[list[list[int]]]:
        lengths = [s.total_len for s in samples]
        if self.packing:
            return plan_micro_batches(lengths, max_tokens=self.max_tokens, dp_size=dp)
        return padded_fixed_batches(lengths, micro_batch_size=self.micro_batch_size, dp_size=dp)

    def build(self, samples: Sequence[Sample], idx: list[int]) -> MicroBatch:
        return build_micro_batch(samples, idx) if self.packing else build_padded_micro_batch(samples, idx)

    def stats(self, samples: Sequence[Sample], plan) -> dict:
        st = packing_stats([s.total_len for s in samples], plan, max_tokens=self.max_tokens if self.packing else None,
                           padded=not self.packing)
        return {"real_token_fraction": st["real_token_fraction"], "dp_imbalance": st["compute_imbalance"]}


@torch.no_grad()
def per_sample_pass(forward: Callable[[MicroBatch], torch.Tensor], samples: Sequence[Sample], dims: ParallelDims,
                    *, layout: Layout) -> list[list[float]]:
    """Run `forward` (micro-batch -> (N,) per response token) over the global batch, split over dp
    ranks; the results are all-gathered, so every rank returns one list per sample, in order."""
    plan = layout.plan(samples, dims.dp)
    mine: dict[int, list[float]] = {}
    for idx in plan[dims.dp_rank]:
        mb = layout.build(samples, idx)
        mine.update(zip(mb.indices, mb.split(forward(mb))))
    merged: dict[int, list[float]] = {}
    for part in dims.all_gather_objects(mine):
        merged.update(part)
    return [merged[i] for i in range(len(samples))]


def accumulate_gradients(engine, samples: Sequence[Sample], dims: ParallelDims, *, layout: Layout,
                         loss_fn: Callable[[MicroBatch], tuple[torch.Tensor, dict[str, float]]]) -> dict[str, float]:
    """Backward every micro-batch of this rank's share of `samples` (the step's GLOBAL batch).

    `loss_fn` returns the micro-batch's additive share of the global loss (global normalisers) and
    metric sums. DeepSpeed averages gradients over dp, so the share is scaled by dp here. The
    caller calls engine.step() afterwards; the last backward is the accumulation boundary.
    """
    full_plan = layout.plan(samples, dims.dp)
    plan = full_plan[dims.dp_rank]
    # Every rank holds the same plan, so its stats are global already: only rank 0 adds them to the sums
    # that the caller all-reduces (every rank must still hold the same keys).
    sums = {k: v if dims.is_main else 0.0 for k, v in layout.stats(samples, full_plan).items()}
    sums.update({"micro_batches": float(len(plan)), "train_tokens": 0.0, "real_tokens": 0.0})
    for k, idx in enumerate(plan):
        mb = layout.build(samples, idx)
        engine.set_gradient_accumulation_boundary(k == len(plan) - 1)
        loss, metrics = loss_fn(mb)
        engine.backward(loss * dims.dp)
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value
        sums["train_tokens"] += mb.num_tokens
        sums["real_tokens"] += sum(samples[i].total_len for i in idx)
    return sums


def mini_batches(samples: Sequence[Sample], n: int, dp: int) -> list[Sequence[Sample]]:
    """Split the rollout batch into n contiguous mini-batches (one optimizer step each)."""
    if len(samples) < n * dp:
        raise ValueError(f"{len(samples)} samples cannot fill train.num_mini_batches={n} x dp={dp}")
    bounds = [round(i * len(samples) / n) for i in range(n + 1)]
    return [samples[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def train_layout(cfg: Config) -> Layout:
    return Layout(cfg, max_tokens=cfg.train.max_tokens_per_gpu)


def nograd_layout(cfg: Config) -> Layout:
    """No-grad passes keep no activations for backward, so they get a larger budget."""
    return Layout(cfg, max_tokens=cfg.train.logprob_max_tokens_per_gpu or 2 * cfg.train.max_tokens_per_gpu)
