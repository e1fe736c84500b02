"""The parallelize step (torchtitan's idea): (model, ParallelDims, run config) -> DeepSpeed engine.

Everything that depends on the parallel layout is derived here, once: the DeepSpeed config fields
(from `parallel.*`, never from the JSON), the process groups DeepSpeed uses (from ParallelDims),
parameter offload for frozen models, and the optimizer/scheduler of trainable ones.
"""
from __future__ import annotations

from typing import Callable

import deepspeed
import torch

from slime.config import TrainConfig
from slime.distributed.ds_config import build_ds_config, check_stage, zero_stage
from slime.distributed.expert_parallel import expert_parallel_settings, num_experts
from slime.distributed.parallel_dims import ParallelDims, warn_build_locks


def layout_settings(dims: ParallelDims, config) -> dict:
    """DeepSpeed config fields implied by the parallel sizes.

    Sequence parallelism needs none: ZeRO-3 shards over every rank and averages gradients over the whole
    world (no mpu), and PolicyEngine scales each rank's loss share by the world size, so the sp peers'
    shard gradients add up (tested against sp=1, not assumed). Expert parallelism is DeepSpeed's AutoEP.
    """
    if dims.ep > 1:
        return {"expert_parallel": expert_parallel_settings(dims.ep, config.model_type, num_experts(config))}
    return {}


def parallelize(model: torch.nn.Module, dims: ParallelDims, train: TrainConfig, *, lr: float | None,
                lr_lambda: Callable[[int], float] | None = None, offload_params: bool = False,
                decay_groups: bool = False):
    """A ZeRO engine over dp (stage 3 by default; 1 or 2 from train.ds_config); with lr None an inference-only
    engine (no optimizer; under ZeRO-3 the parameters are still sharded). `offload_params` keeps the parameter
    partitions in CPU memory (a frozen reference); `decay_groups`: see param_groups."""
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    ds_config = build_ds_config(train, bf16=bf16)
    stage = zero_stage(ds_config)
    check_stage(stage, train, sp=dims.sp, ep=dims.ep, offload_params=offload_params)
    ds_config.update(layout_settings(dims, model.config))
    if offload_params:
        ds_config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if lr is None:
        ds_config.pop("optimizer", None)
        ds_config.pop("gradient_clipping", None)
        if stage < 3:  # DeepSpeed's ZeRO-1/2 need an optimizer; replicated parameters need no ZeRO
            ds_config["zero_optimization"] = {"stage": 0}
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        engine.eval()
        return engine
    ds_config["optimizer"]["params"]["lr"] = lr
    warn_build_locks()  # DeepSpeed builds CPU Adam (offloaded optimizer) or fused Adam (GPU) at a first run
    sched = (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)) if lr_lambda else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, decay_groups),
                                      config=ds_config, lr_scheduler=sched)
    return engine


def param_groups(model: torch.nn.Module, decay_groups: bool) -> list:
    """The trained parameters; `decay_groups`: norm gains and biases (1-D) in a group of their own without weight
    decay, as Megatron and HF's Trainer do (else one group: checkpoints without decay, or written before)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    flat = [p for p in trained if p.dim() < 2]
    if not decay_groups or not flat:
        return trained
    return [{"name": "decay", "params": [p for p in trained if p.dim() >= 2]},
            {"name": "no_decay", "params": flat, "weight_decay": 0.0, "no_decay": True}]
