"""Build a DeepSpeed config dict from a JSON file in ds_configs/, filling "auto" fields from the run config.

Settings that depend on the parallel layout (expert parallel, sequence parallel) are not read from
the JSON: `parallelize` derives them from `parallel.*`, so each is set in one place only.
"""
from __future__ import annotations

import copy
import difflib
import json
import logging
from pathlib import Path

import torch

from slime.config import TrainConfig
from slime.utils import jsonfiles

FUSED = object()  # "fused": "auto" -> true where the resolved torch_adam is true, else the key is removed
# Keys owned by the parallelize step; a DeepSpeed JSON that sets them would be a second place to set one thing.
LAYOUT_KEYS = {"expert_parallel": "parallel.ep", "sequence_parallel_size": "parallel.sp"}


def read_ds_json(train: TrainConfig, path: str | Path | None = None) -> tuple[dict, Path]:
    """The DeepSpeed JSON as written (train.ds_config, relative to the repo when not found here), and its path."""
    path = Path(path or train.ds_config)
    if not path.is_absolute() and not path.exists():
        path = Path(__file__).resolve().parents[2] / path  # relative to the repo when run elsewhere
    if not path.is_file():
        raise FileNotFoundError(f"train.ds_config: {path} does not exist")
    try:
        ds = jsonfiles.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, jsonfiles.DuplicateKeyError) as e:
        raise ValueError(f"train.ds_config: {path} is not valid JSON ({e})") from None
    if not isinstance(ds, dict):
        raise ValueError(f"train.ds_config: {path} must hold a JSON object, got {type(ds).__name__}")
    return ds, path


def build_ds_config(train: TrainConfig, path: str | Path | None = None, *, bf16: bool) -> dict:
    ds, path = read_ds_json(train, path)
    _check_top_level_keys(ds, path)
    _refuse_batch_settings(ds, path)
    for key, setting in LAYOUT_KEYS.items():
        if key in ds:
            raise ValueError(f"{path}: remove '{key}'; it is derived from the run config's {setting}")
    torch_adam = not torch.cuda.is_available()  # DeepSpeed's fused Adam needs CUDA; on CPU, torch's AdamW
    auto = {
        "gradient_clipping": train.grad_clip,
        "bf16.enabled": bf16,
        "optimizer.params.lr": train.lr,
        "optimizer.params.betas": list(train.betas),
        "optimizer.params.weight_decay": train.weight_decay,
        "optimizer.params.torch_adam": torch_adam,
        "optimizer.params.fused": FUSED,
    }
    _refuse_second_settings(ds, auto, str(path))
    _check_optimizer_and_precision(ds, path)
    _own_missing(ds)
    _fill(ds, auto, str(path))
    params = ds.get("optimizer", {}).get("params", {})
    if params.get("fused") is FUSED:
        # torch's one-pass AdamW kernel (CPU too): 12 ms instead of 123 ms per step for 24M parameters, 1 thread.
        # DeepSpeed's own Adams (CUDA, CPU offload) are fused already and take no such argument.
        if params.get("torch_adam") is True:
            params["fused"] = True
        else:
            del params["fused"]
    stage = zero_stage(ds)
    if stage not in (1, 2, 3):
        raise ValueError(f"{path}: zero_optimization.stage is {stage}; use 1, 2 or 3 (a stage-0 engine has no "
                         "offload_states for colocated rollout, and in fp32 reports no gradient norm for the "
                         "skipped-step guard). ds_configs/zero2.json is the fast choice when a full copy of the "
                         "model fits on every rank")
    _check_zero_section(ds, path)
    _check_data_types(ds, path)
    # We set accumulation boundaries by hand (micro-batch counts vary per step), so DeepSpeed
    # must neither scale the loss by 1/gas nor step on its own schedule.
    ds["gradient_accumulation_steps"] = 1
    ds["train_micro_batch_size_per_gpu"] = 1
    _check_with_deepspeed(ds, path)
    return ds


def zero_stage(ds: dict) -> int:
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise ValueError(f"zero_optimization.stage={stage!r} in the DeepSpeed config must be the integer 1, 2 or 3")
    return stage


SECTIONS = ("zero_optimization", "activation_checkpointing", "flops_profiler", "comms_logger", "tensorboard", "wandb",
            "csv_monitor", "aio", "data_efficiency", "compression_training", "autotuning", "elasticity", "pipeline",
            "amp", "checkpoint", "timers")


def _check_top_level_keys(ds: dict, path: Path) -> None:
    """DeepSpeed ignores top-level keys it does not know, so a misspelt one ("gradient_clippng") would be dropped
    without a word: one close to a known key is an error naming both."""
    import deepspeed.runtime.constants as constants

    known = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)} | set(SECTIONS)
    for key in ds:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
            if near:
                raise ValueError(f"train.ds_config: {path}: unknown key '{key}' (DeepSpeed would ignore it); "
                                 f"did you mean '{near[0]}'?")


def check_stage(stage: int, train: TrainConfig, *, sp: int, ep: int, offload_params: bool) -> None:
    """ZeRO-1/2 keep a full copy of the parameters on every rank; what needs partitioned parameters is refused, and
    so is compiling layers whose parameters ZeRO-3 gathers."""
    needs = [what for what, on in (("parallel.sp > 1 (Ulysses)", sp > 1),
                                   ("parallel.ep > 1 (AutoEP)", ep > 1),
                                   ("algo.ref_offload=true (parameter offload)", offload_params)) if on]
    if train.compile and needs:  # each stage refused one of them: the other stage's advice never ended anywhere
        raise ValueError(f"train.compile=true cannot be combined with {' and '.join(needs)}: compiling needs ZeRO-2's "
                         "whole parameters, and they need ZeRO-3; set train.compile=false")
    if stage == 3:
        if train.compile:
            raise ValueError(f"train.compile=true needs whole parameters: train.ds_config={train.ds_config} sets ZeRO "
                             "stage 3, whose per-layer parameter gathers and partitioned linear layers torch.compile "
                             "traces into (recompiling, for little gain). Use ds_configs/zero2.json, or "
                             "train.compile=false")
        return
    if needs:
        raise ValueError(f"train.ds_config={train.ds_config} sets ZeRO stage {stage}, but {' and '.join(needs)} "
                         f"{'is' if len(needs) == 1 else 'are'} built and tested on ZeRO-3 only; use "
                         "ds_configs/zero3.json")


# DeepSpeed keys the run config owns: an explicit value in the JSON would be overridden (lr) or would override
# the run config's without a word (gradient_clipping, the dtype).
OWNED = {"gradient_clipping": "train.grad_clip", "bf16.enabled": "model.dtype", "optimizer.params.lr": "train.lr",
         "optimizer.params.betas": "train.betas", "optimizer.params.weight_decay": "train.weight_decay"}


def _refuse_second_settings(ds: dict, auto: dict, source: str) -> None:
    for full, setting in OWNED.items():
        *parents, leaf = full.split(".")
        node = ds
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or node.get(leaf, "auto") in ("auto", auto[full]):
            continue
        raise ValueError(f"{source}: '{full}' is {node[leaf]!r} but the run config's {setting} gives {auto[full]!r}; "
                         f"set {setting} and leave '{full}' as \"auto\" (one setting, one place)")


ADAM_TYPES = ("adam", "adamw")  # what train.betas, train.weight_decay and torch_adam are settings of
# optimizer.params DeepSpeed takes for them: its own (torch_adam, adam_w_mode), and those of the optimizer it builds
# (torch's AdamW on CPU, FusedAdam on GPUs, DeepSpeedCPUAdam with an offloaded optimizer)
ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam", "adam_w_mode", "bias_correction",
               "set_grad_none", "fp32_optimizer_states", "foreach", "maximize", "capturable", "differentiable", "fused"}


def _check_optimizer_and_precision(ds: dict, path: Path) -> None:
    optimizer = ds.get("optimizer")
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("type"), str):
        raise ValueError(f"train.ds_config: {path} has no 'optimizer' section with a 'type': copy the one of "
                         "ds_configs/zero3.json ({\"type\": \"AdamW\", \"params\": {...\"auto\"...}})")
    if optimizer["type"].lower() not in ADAM_TYPES:
        raise ValueError(f"train.ds_config: {path}: optimizer type {optimizer['type']!r} is not supported: the run "
                         "config's train.betas and train.weight_decay are Adam's; use \"Adam\" or \"AdamW\"")
    params = optimizer.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"train.ds_config: {path}: optimizer.params must be an object, got {type(params).__name__}")
    unknown = sorted(set(params) - ADAM_PARAMS)
    if unknown:  # AdamW's own "unexpected keyword argument", after every model loaded
        near = difflib.get_close_matches(unknown[0], ADAM_PARAMS, n=1)
        raise ValueError(f"train.ds_config: {path}: optimizer.params.{unknown[0]} is not a setting of DeepSpeed's "
                         f"Adam{f' (did you mean {near[0]!r}?)' if near else ''}; its settings: "
                         f"{', '.join(sorted(ADAM_PARAMS))}")
    for key in ("lr", "eps", "weight_decay"):
        value = params.get(key, "auto")
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"train.ds_config: {path}: optimizer.params.{key}={value!r} must be a number (JSON "
                             "without quotes: 1e-8) or \"auto\"")
    fp16 = ds.get("fp16")
    if (fp16.get("enabled") if isinstance(fp16, dict) else fp16) not in (None, False, "auto"):
        raise ValueError(f"train.ds_config: {path} enables fp16: model.dtype sets the precision (bfloat16 or "
                         "float32), and the rollout engines would run another dtype than the trainer; remove the "
                         "'fp16' section")


def _check_zero_section(ds: dict, path: Path) -> None:
    """DeepSpeed's own check of zero_optimization (pydantic's: a misspelt key, a negative size, an unknown offload
    device), which named the key, not the file, after every model loaded."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        DeepSpeedZeroConfig(**ds.get("zero_optimization", {}))
    except Exception as e:  # noqa: BLE001 -- pydantic's ValidationError, or a TypeError of a value
        raise ValueError(f"train.ds_config: {path}: its zero_optimization section is refused by DeepSpeed: {e}") \
            from None


GRAD_ACCUM_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
                     "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
                     "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}


def grad_accum_dtype(ds: dict) -> str | None:
    """data_types.grad_accum_dtype as fp32, bf16 or fp16 (None: unset, DeepSpeed sums in the model's dtype)."""
    value = (ds.get("data_types") or {}).get("grad_accum_dtype")
    return None if value is None else GRAD_ACCUM_DTYPES[value]


def _check_data_types(ds: dict, path: Path) -> None:
    """DeepSpeed's parse takes any text there and fails on it after the models load."""
    data_types = ds.get("data_types")
    if data_types is None:
        return
    if not isinstance(data_types, dict) or set(data_types) - {"grad_accum_dtype"}:
        raise ValueError(f"train.ds_config: {path}: data_types={data_types!r}: DeepSpeed takes one key there, "
                         '"grad_accum_dtype" (e.g. {"grad_accum_dtype": "fp32"})')
    value = data_types.get("grad_accum_dtype")
    if value is not None and value not in GRAD_ACCUM_DTYPES:
        raise ValueError(f"train.ds_config: {path}: data_types.grad_accum_dtype={value!r} is not a dtype DeepSpeed "
                         'sums gradients in: "fp32" (what ds_configs/*.json set), "bf16" or "fp16"')


def check_offloadable(ds: dict, path: str) -> None:
    """A colocated engine's turn moves the actor's states off the GPU (DeepSpeed's offload_states): ZeRO-1 in bf16
    with fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer instead of ZeRO's, which cannot."""
    if zero_stage(ds) == 1 and (ds.get("bf16") or {}).get("enabled") is True and grad_accum_dtype(ds) == "fp32":
        raise ValueError(f"train.ds_config={path}: ZeRO-1 in bf16 with data_types.grad_accum_dtype=fp32 runs "
                         "DeepSpeed's BF16_Optimizer, which cannot move its states off the GPU while a colocated "
                         "SGLang engine generates: use ds_configs/zero2.json (ZeRO-2 sums gradients in fp32 and "
                         "offloads), or rollout.sglang.mode=disaggregated")


def _check_with_deepspeed(ds: dict, path: Path) -> None:
    """DeepSpeed's own parse of every section (bf16, data_types, activation_checkpointing, ...), whose errors came
    after every model had loaded, naming the key but not the file. Without torch.distributed up it plans for one
    rank: the per-rank batch keys are the trainer's anyway."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger as ds_logger

    level = ds_logger.level
    ds_logger.setLevel(logging.WARNING)  # its INFO line of the world size it planned for
    try:
        DeepSpeedConfig(copy.deepcopy(ds))
    except Exception as e:  # noqa: BLE001 -- pydantic's ValidationError, DeepSpeed's asserts and ValueErrors
        raise ValueError(f"train.ds_config: {path}: refused by DeepSpeed: {type(e).__name__}: {e}") from None
    finally:
        ds_logger.setLevel(level)


def _own_missing(ds: dict) -> None:
    """An owned key the JSON leaves out is filled like "auto": without it DeepSpeed used its own default (no
    clipping, AdamW's betas and weight decay, fp32) and the run config's value was dropped without a word."""
    ds.setdefault("gradient_clipping", "auto")
    bf16 = ds.setdefault("bf16", {})
    if isinstance(bf16, dict):
        bf16.setdefault("enabled", "auto")
    params = ds["optimizer"].setdefault("params", {})  # the section is there (_check_optimizer_and_precision)
    if isinstance(params, dict):
        for full in OWNED:
            if full.startswith("optimizer.params."):
                params.setdefault(full.rsplit(".", 1)[1], "auto")


# DeepSpeed keys for what the trainer decides itself: a value in the JSON was overridden (accumulation, micro-batch
# size), refused by DeepSpeed with an arithmetic error (train_batch_size), or applied to the critic only (scheduler).
BATCH_KEYS = {"train_batch_size": "rollout.batch_size, rollout.n_samples_per_prompt and train.num_mini_batches",
              "gradient_accumulation_steps": "train.max_tokens_per_gpu (micro-batches are packed to a token budget)",
              "train_micro_batch_size_per_gpu": "train.max_tokens_per_gpu (micro-batches are packed to a token "
                                                "budget)",
              "scheduler": "train.lr_schedule, train.warmup_steps and train.min_lr"}


def _refuse_batch_settings(ds: dict, path: Path) -> None:
    for key, setting in BATCH_KEYS.items():
        if key not in ds or (key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu")
                             and ds[key] in (1, "auto")):
            continue
        raise ValueError(f"train.ds_config: {path}: remove '{key}' ({ds[key]!r:.60}); the trainer sets it from the "
                         f"run config's {setting}")


def _fill(node: dict, auto: dict, source: str, prefix: str = "") -> None:
    for key, value in node.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            _fill(value, auto, source, full + ".")
        elif value == "auto":
            if full not in auto:
                raise ValueError(f"{source}: '{full}' is 'auto' but the run config has nothing to fill it with; "
                                 f"give it a value (auto is supported for: {', '.join(sorted(auto))})")
            node[key] = auto[full]
