"""`run.py --dry-run`: what a config would launch, and whether it fits, before any GPU is taken.

Reads only the run config and the model's config.json (no weights): the model is built on the meta
device to count its parameters exactly. Prints the world layout for `--num-gpus` ranks (dp x sp x ep,
the rollout engines and their GPUs) and a memory estimate per GPU, in two phases because a colocated
engine and the trainer take turns on the GPU:

- training: ZeRO-3 model states (DeepSpeed's own estimate: 18 bytes per parameter over the ranks plus
  the largest layer gathered; ZeRO-1/2: 2 bytes per parameter plus 18 over the ranks; 2 more over the ranks where
  the gradients accumulate in fp32, `data_types.grad_accum_dtype`, as the shipped configs do), a frozen
  reference's bf16 partitions (whole under ZeRO-1/2), a critic's states, activations at
  `train.max_tokens_per_gpu` tokens (with and without gradient checkpointing), and one logits chunk;
- rollout: the colocated SGLang engine at its static memory fraction (weights + KV cache), with the
  actor's states offloaded (a reference's and a critic's stay on the GPU and are counted);
- both: a `model:PATH` reward model, whole on every rank in bf16.

Activations: per token and layer, the tensors autograd keeps for an HF decoder layer (attention without a T^2
term), as measured with saved-tensor hooks (`tests/test_dry_run.py` holds the formula to the measurement):
e x (6 H + 3 q + 2 kv + 4 I) bytes at e bytes per element (two RMSNorms keep three H-wide tensors each; rope's
rotated q and k, v, attention's output and its copy for the output projection; SwiGLU four I-wide tensors), 4
bytes per head (attention's log-sum-exp), and 4 H bytes more in bf16 (the norms' fp32 upcasts); q/k norms
(Qwen3) add e x 2 (q + kv), and 2 (q + kv) more in bf16. I is the MLP width (top-k x
expert width, plus a shared expert's, for a mixture of experts). With gradient checkpointing: each layer's input
plus one layer's worth. The plan is for GPUs: bf16 unless model.dtype=float32 (a CPU run of model.dtype=auto
trains in fp32, twice the activations). Real runs add the CUDA context and fragmentation: the warning leaves a
margin.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from slime.config import Config
from slime.distributed.ds_config import (build_ds_config, check_offloadable, check_stage, grad_accum_dtype,
                                         zero_stage)

GIB = 2**30
SGLANG_DEFAULT_MEM_FRACTION = 0.88  # roughly what SGLang picks on an 80 GB GPU when none is given
CONTEXT_GIB = 1.5  # CUDA context, NCCL buffers, allocator slack per process
MARGIN = 0.9  # warn when an estimate passes 90% of the GPU


@dataclasses.dataclass
class ModelShape:
    params: int
    largest_layer: int
    largest_dense_layer: int  # the largest module that is not experts (expert parallelism does not split it)
    expert_params: int
    hidden: int
    layers: int
    q_dim: int
    kv_dim: int
    mlp_width: int  # per token: dense MLP width, or top-k x expert width
    vocab: int
    model_type: str
    num_heads: int = 0
    num_kv_heads: int = 0
    num_experts: int | None = None
    qk_norm: bool = False  # RMSNorms on q and k per head (Qwen3, OLMo 2, Gemma 3)


def model_shape(path: str, trust_remote_code: bool = False) -> ModelShape:
    """Parameter counts from a model built on the meta device from config.json alone."""
    import transformers
    from transformers import AutoConfig

    from slime.distributed.expert_parallel import num_experts
    from slime.models.adapters import get_adapter

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    adapter = get_adapter(config.model_type)
    with torch.device("meta"):
        model = getattr(transformers, adapter.auto_class).from_config(config, trust_remote_code=trust_remote_code)
    params = sum(p.numel() for p in model.parameters())  # shared (tied) weights once
    sizes = {name: sum(p.numel() for p in m.parameters(recurse=False)) for name, m in model.named_modules()}
    largest = max(sizes.values())
    dense = max(n for name, n in sizes.items() if ".experts" not in f"{name}.")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    top_k = getattr(text, "num_experts_per_tok", None)
    mlp = text.intermediate_size
    if top_k and experts:  # per token: top-k experts (Mixtral's width is intermediate_size), plus a shared expert
        mlp = top_k * (getattr(text, "moe_intermediate_size", None) or text.intermediate_size) + \
            (getattr(text, "shared_expert_intermediate_size", None) or 0)
    return ModelShape(params=params, largest_layer=largest, largest_dense_layer=dense, expert_params=experts,
                      hidden=text.hidden_size,
                      layers=text.num_hidden_layers, q_dim=text.num_attention_heads * head_dim,
                      kv_dim=text.num_key_value_heads * head_dim, mlp_width=mlp, vocab=text.vocab_size,
                      model_type=config.model_type, num_heads=text.num_attention_heads,
                      num_kv_heads=text.num_key_value_heads, num_experts=num_experts(config),
                      qk_norm=any(name.endswith((".q_norm", ".k_norm")) for name in sizes))


def reward_model_params(cfg: Config) -> int:
    """Parameters of the `model:PATH` reward models of rollout.reward.fn (every rank holds each whole, in bf16 on a
    GPU, for the whole run), from their config.json on the meta device."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from slime.rollout.reward_models import MODEL_PREFIX, is_reward_model
    from slime.rollout.rewards import spec_weights

    total = 0
    for name in spec_weights(cfg.rollout.reward.fn, cfg.rollout.reward.granularity):
        if is_reward_model(name):
            config = AutoConfig.from_pretrained(Path(name[len(MODEL_PREFIX):]).expanduser())
            with torch.device("meta"):
                total += sum(p.numel() for p in AutoModelForSequenceClassification.from_config(config).parameters())
    return total


def model_states_bytes(stage: int, params: int, largest_layer: int, gpus: int) -> int:
    """DeepSpeed's estimate of the model states per GPU without offload. ZeRO-3: bf16 params and grads, fp32
    master weights and two Adam moments, 18 bytes per parameter over the ranks, plus the largest layer.
    ZeRO-1/2 (DeepSpeed's ZeRO-2 estimate): the bf16 parameters whole on every rank (2 bytes per parameter) plus
    the same 18 over the ranks; ZeRO-1 keeps its gradients whole, which this does not count."""
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest_layer, num_gpus_per_node=gpus, num_nodes=1,
                                                          cpu_offload=False, cpu_offload_params=False)
        return gpu
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=gpus, num_nodes=1, cpu_offload=False)
    return gpu


def activation_bytes(shape: ModelShape, tokens: int, checkpointing: bool, element_bytes: int = 2) -> int:
    """What autograd keeps for `tokens` tokens of training forward (the module docstring's formula)."""
    e, h, qkv = element_bytes, shape.hidden, shape.q_dim + shape.kv_dim
    per_token_layer = e * (6 * h + 3 * shape.q_dim + 2 * shape.kv_dim + 4 * shape.mlp_width) + 4 * shape.num_heads \
        + (4 * h if e == 2 else 0)
    if shape.qk_norm:
        per_token_layer += e * 2 * qkv + (2 * qkv if e == 2 else 0)
    if checkpointing:
        return tokens * (shape.layers * e * h + per_token_layer)
    return tokens * shape.layers * per_token_layer


def plan(cfg: Config, num_gpus: int, gpu_gib: float = 80.0) -> dict:
    """The layout and memory figures for `num_gpus` trainer ranks; raises ValueError for layouts that cannot run."""
    sp, ep = cfg.parallel.sp, cfg.parallel.ep
    if num_gpus % sp:
        raise ValueError(f"parallel.sp={sp} must divide --num-gpus={num_gpus}")
    dp = num_gpus // sp
    if num_gpus % ep:  # DeepSpeed's ep groups: blocks of ep consecutive ranks (sp peers included)
        raise ValueError(f"parallel.ep={ep} must divide --num-gpus={num_gpus}")
    if cfg.rollout.batch_size % dp:
        raise ValueError(f"rollout.batch_size={cfg.rollout.batch_size} must be divisible by dp={dp}")
    shape = model_shape(cfg.model.path, cfg.model.trust_remote_code)
    if sp > 1:  # the head check, as at launch
        from slime.distributed.ulysses import check_heads

        check_heads(shape.num_heads, shape.num_kv_heads, sp, cfg.model.path)
    if ep > 1:
        from slime.distributed.expert_parallel import expert_parallel_settings

        expert_parallel_settings(ep, shape.model_type, shape.num_experts)  # as at launch
    out: dict = {"world": num_gpus, "dp": dp, "sp": sp, "ep": ep, "params": shape.params,
                 "largest_layer": shape.largest_layer}
    # engines
    s = cfg.rollout.sglang
    sft = cfg.algo.policy_loss == "sft"
    if sft and not cfg.eval.path:  # SFT generates nothing unless it evaluates
        out["engines"] = "none (SFT without eval.path generates nothing)"
        engine_gpus, num_engines = 0, 0
    elif cfg.rollout.engine == "hf":
        out["engines"] = f"hf engine in every trainer process ({num_gpus} copies of the weights)"
        engine_gpus, num_engines = 0, num_gpus
    elif s.mode == "colocated":
        k = s.ranks_per_engine or s.tp_size
        if num_gpus % k:
            raise ValueError(f"rollout.sglang.ranks_per_engine (or tp_size) = {k} must divide --num-gpus={num_gpus}")
        out["engines"] = (f"{num_gpus // k} SGLang server(s) colocated, tp={s.tp_size}, each on the GPUs of "
                          f"{k} trainer rank(s)")
        engine_gpus, num_engines = 0, num_gpus // k
    else:
        engine_gpus, num_engines = s.num_engines * s.tp_size, s.num_engines
        out["engines"] = (f"{s.num_engines} SGLang server(s) disaggregated, tp={s.tp_size}, on GPUs "
                          f"{num_gpus}..{num_gpus + engine_gpus - 1} (launch {num_gpus} trainer ranks on "
                          f"{num_gpus + engine_gpus} GPUs)")
    out["total_gpus"] = num_gpus + engine_gpus
    # training phase
    ds = build_ds_config(cfg.train, bf16=cfg.model.dtype != "float32")  # as on GPUs ("auto": bf16)
    stage = zero_stage(ds)
    colocated = bool(num_engines) and cfg.rollout.engine == "sglang" and s.mode == "colocated"
    if colocated:  # as at launch
        check_offloadable(ds, cfg.train.ds_config)
    needs_ref = cfg.algo.needs_reference and not sft
    check_stage(stage, cfg.train, sp=sp, ep=ep, offload_params=needs_ref and cfg.algo.ref_offload)
    gathered = max(shape.largest_dense_layer, shape.largest_layer // ep) if shape.expert_params else shape.largest_layer
    actor = model_states_bytes(stage, shape.params, gathered, num_gpus)  # under ep, a rank gathers its experts only
    if cfg.model.dtype != "float32" and grad_accum_dtype(ds) == "fp32":
        actor += 2 * shape.params // num_gpus  # the gradient partitions summed in fp32, not bf16
    ref = 0
    if needs_ref:
        if stage < 3:  # a replicated reference
            ref = 2 * shape.params
        else:
            ref = 0 if cfg.algo.ref_offload else 2 * shape.params // num_gpus + 2 * shape.largest_layer
    critic = actor if cfg.trains_critic else 0
    tokens = cfg.train.max_tokens_per_gpu
    element = 4 if cfg.model.dtype == "float32" else 2  # "auto" is bf16 on GPUs
    act_ckpt = activation_bytes(shape, tokens, True, element)
    act_full = activation_bytes(shape, tokens, False, element)
    acts = act_ckpt if cfg.model.gradient_checkpointing else act_full
    logits = 3 * 4 * min(cfg.train.logits_chunk_size, tokens) * shape.vocab
    reward_model = 2 * reward_model_params(cfg) if cfg.scores_generations else 0  # bf16, whole on every rank
    training = actor + ref + critic + reward_model + acts + logits + CONTEXT_GIB * GIB
    out.update(zero_stage=stage, actor_states=actor, reference=ref, critic_states=critic, reward_model=reward_model,
               activations=acts,
               activations_checkpointed=act_ckpt, activations_full=act_full, logits_chunk=logits,
               training_total=training)
    # rollout phase (colocated engine awake, trainer offloaded)
    if not num_engines:
        out["engine_weights"] = out["rollout_total"] = 0
    elif cfg.rollout.engine == "sglang":
        fraction = s.mem_fraction or SGLANG_DEFAULT_MEM_FRACTION
        weights = 2 * shape.params // s.tp_size
        pool = fraction * gpu_gib * GIB
        if weights >= pool:
            raise ValueError(f"SGLang's memory pool (rollout.sglang.mem_fraction={fraction} of {gpu_gib:g} GiB = "
                             f"{pool / GIB:.1f} GiB) does not hold the model's bf16 weights ({weights / GIB:.1f} GiB "
                             f"per GPU at tp_size={s.tp_size}), leaving no KV cache; raise mem_fraction or "
                             "rollout.sglang.tp_size")
        kv_per_token = 2 * shape.layers * shape.kv_dim * 2 // s.tp_size  # K and V, bf16
        out.update(engine_weights=weights, engine_pool=pool, kv_cache=max(pool - weights, 0),
                   kv_tokens=int(max(pool - weights, 0) // kv_per_token))
        # only the actor's states leave the GPU while a colocated engine is awake; a reference and a critic stay
        out["rollout_resident"] = ref + critic + reward_model if s.mode == "colocated" else 0
        out["rollout_total"] = pool + (CONTEXT_GIB * GIB + out["rollout_resident"] if s.mode == "colocated" else 0)
    else:
        out["engine_weights"] = 2 * shape.params if cfg.model.dtype != "float32" else 4 * shape.params
        out["rollout_total"] = out["engine_weights"] + reward_model + CONTEXT_GIB * GIB
        out["training_total"] += out["engine_weights"]  # the hf engine's copy stays resident
    seqs = -(-cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt // max(num_engines, 1))  # per engine
    out["kv_tokens_needed"] = seqs * (cfg.data.max_prompt_len + cfg.rollout.max_response_len)
    # every rank loads the bf16 model once, and a reward model
    out["cpu_load_bytes_per_node"] = min(num_gpus, 8) * (2 * shape.params + reward_model)
    # a colocated engine's turn: every rank's actor states in pinned host buffers, which DeepSpeed keeps for the run
    # (PolicyEngine.states_on_device: not what a ZeRO offload config keeps on the host already)
    zero = ds.get("zero_optimization", {})
    on_host = {k for k in ("offload_param", "offload_optimizer") if (zero.get(k) or {}).get("device", "none") != "none"}
    moved = 0 if "offload_param" in on_host else 2 * shape.params // num_gpus if on_host else actor
    out["cpu_offload_bytes_per_node"] = min(num_gpus, 8) * moved if colocated else 0
    out["gpu_bytes"] = gpu_gib * GIB
    out["warnings"] = [f"{phase} needs about {out[key] / GIB:.1f} GiB per GPU, over {MARGIN:.0%} of {gpu_gib:g} GiB"
                       for phase, key in (("training", "training_total"), ("rollout", "rollout_total"))
                       if out[key] > MARGIN * gpu_gib * GIB]
    if (longest := cfg.longest_sample_warning()) is not None:
        out["warnings"].append(longest)
    out["notes"] = []
    if num_engines and cfg.rollout.engine == "sglang" and out["kv_tokens"] < out["kv_tokens_needed"]:
        out["notes"].append(f"the KV cache holds about {out['kv_tokens']} tokens per engine and a rollout may ask up "
                            f"to {out['kv_tokens_needed']} at full length: SGLang queues what does not fit (slower, "
                            "still correct)")
    return out


def report(cfg: Config, num_gpus: int, gpu_gib: float = 80.0) -> str:
    from slime.models.loading import check_model_path, check_packing, critic_model
    from slime.rollout.rewards import check_reward_spec

    check_model_path(cfg.model)  # config.json is all a dry run reads: a missing folder is said as such
    check_packing(cfg)  # a model whose packed samples would not compute as each alone, refused as at launch
    if cfg.trains_critic and cfg.algo.critic.path and Path(cfg.algo.critic.path).is_dir():
        check_packing(cfg, critic_model(cfg), "algo.critic.path")
    check_reward_spec(cfg.rollout.reward.fn, granularity=cfg.rollout.reward.granularity)
    p = plan(cfg, num_gpus, gpu_gib)
    def g(b: float) -> str:  # MiB below a GiB: the CPU examples' figures read 0.0 GiB
        return f"{b / GIB:.1f} GiB" if b >= GIB else f"{b / 2**20:.1f} MiB"

    def count(n: int) -> str:
        return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"

    lines = [
        f"model {cfg.model.path}: {count(p['params'])} parameters (largest layer {count(p['largest_layer'])}); "
        f"planned for GPUs in {'fp32' if cfg.model.dtype == 'float32' else 'bf16'} (model.dtype={cfg.model.dtype}"
        + ("; a CPU run trains in fp32: twice the activations)" if cfg.model.dtype == "auto" else ")"),
        f"layout: {p['world']} trainer ranks = dp {p['dp']} x sp {p['sp']}; "
        f"ep {p['ep']} (blocks of consecutive ranks); "
        f"{p['total_gpus']} GPUs in all",
        f"engines: {p['engines']}",
        f"per GPU, training: ZeRO-{p['zero_stage']} actor states {g(p['actor_states'])}"
        + (f" + reference {g(p['reference'])}" if p["reference"] else "")
        + (f" + critic {g(p['critic_states'])}" if p["critic_states"] else "")
        + (f" + reward model {g(p['reward_model'])}" if p["reward_model"] else "")
        + f" + activations {g(p['activations'])} at {cfg.train.max_tokens_per_gpu} tokens "
          f"({'with' if cfg.model.gradient_checkpointing else 'without'} gradient checkpointing; "
          f"{g(p['activations_checkpointed'])} with, {g(p['activations_full'])} without)"
        + f" + logits chunk {g(p['logits_chunk'])} + context = {g(p['training_total'])}",
    ]
    if p["engine_weights"] and cfg.rollout.engine == "sglang":
        resident = f" + reference/critic/reward model kept on the GPU {g(p['rollout_resident'])}" \
            if p["rollout_resident"] else ""
        lines.append(f"per GPU, rollout: SGLang weights {g(p['engine_weights'])} + KV cache {g(p['kv_cache'])} "
                     f"(~{p['kv_tokens']} tokens){resident} = {g(p['rollout_total'])}; the actor's states are "
                     "offloaded")
    elif p["engine_weights"]:
        lines.append(f"per GPU, rollout: hf engine weights {g(p['engine_weights'])}"
                     + (f" + reward model {g(p['reward_model'])}" if p["reward_model"] else ""))
    lines.append(f"CPU memory at load: about {g(p['cpu_load_bytes_per_node'])} per node (each rank reads the model)")
    if p["cpu_offload_bytes_per_node"]:
        lines.append(f"CPU memory from the first rollout on: about {g(p['cpu_offload_bytes_per_node'])} per node, "
                     "pinned (the actor's states offloaded while the colocated engine generates)")
    lines += [f"note: {n}" for n in p["notes"]]
    for key, path in (("data.path", cfg.data.path), ("eval.path", cfg.eval.path)):  # a dry run may come before the data
        if path and not Path(path).is_file():
            lines.append(f"note: {key}={path} is not a file here yet: the run needs it")
    lines += [f"WARNING: {w}" for w in p["warnings"]] or [f"fits in {g(p['gpu_bytes'])} per GPU"]
    return "\n".join(lines)
