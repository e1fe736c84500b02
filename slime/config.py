"""Run configuration: nested dataclasses loaded from one YAML file plus `a.b=value` overrides.

Every field has a default and a one-line doc (`help` metadata). Loading checks names and types
recursively and `__post_init__` checks combinations, so a bad config fails at start-up with a
message naming the key and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal

import yaml

logger = logging.getLogger(__name__)


def field(default: Any, help: str) -> Any:
    """A dataclass field with a default and a one-line doc shown by `run.py --help`."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class ModelConfig:
    path: str = field("", "HF model directory (config + weights + tokenizer) to train.")
    gguf_file: str | None = field(None, "GGUF file inside `path` to load instead of safetensors.")
    dtype: Literal["auto", "float32", "bfloat16"] = field("auto", "Training dtype; auto = bf16 on GPU, fp32 on CPU.")
    attn_implementation: Literal["auto", "packed_sdpa", "flash_attention_2"] = field(
        "auto", "Attention kernel for packed micro-batches; auto = flash-attn varlen on GPU when installed and the "
                "model runs in bf16, else packed sdpa.")
    cpu_linear: Literal["auto", "onednn", "torch"] = field(
        "auto", "fp32 linear layers on CPU (trainer and hf engine): oneDNN's kernels or torch's own F.linear (MKL); "
                "auto = oneDNN on AMD CPUs (where MKL takes its AVX2 path: oneDNN 2-2.4x faster there) and torch's "
                "elsewhere (on Intel MKL is 5-20% faster). bench/cpu_matmul.py compares both on a machine.")
    gradient_checkpointing: bool = field(False, "Recompute activations in backward to save memory.")
    trust_remote_code: bool = field(False, "Allow model code from the model directory.")
    min_pixels: int | None = field(None, "Image-text models: images are resized to at least this many pixels "
                                         "(None = the model's image processor default).")
    max_pixels: int | None = field(None, "Image-text models: images are resized to at most this many pixels "
                                         "(None = the model's image processor default).")

    def __post_init__(self):
        for key in ("min_pixels", "max_pixels"):
            value = getattr(self, key)
            if value is not None and value < 1:  # 0: transformers' processor fails after the models load
                raise ValueError(f"model.{key}={value}: give a positive number of pixels, or null for the image "
                                 "processor's default")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"model.min_pixels={self.min_pixels} is above model.max_pixels={self.max_pixels}: every "
                             "image would be resized to the smallest size the processor makes; swap or fix them")


@dataclasses.dataclass
class DataConfig:
    path: str = field("", "Prompt file: .jsonl, .json (an array of objects or JSON lines) or .parquet "
                               "(through `datasets`).")
    prompt_key: str = field("prompt", "Field holding the prompt text.")
    messages_key: str = field("messages", "Field holding chat messages; used when the prompt field is absent.")
    label_key: str = field("label", "Field holding the ground truth passed to the reward function.")
    metadata_key: str = field("metadata", "Optional dict field copied into Sample.metadata.")
    apply_chat_template: bool = field(True, "Wrap prompts with the tokenizer's chat template when it has one.")
    system_prompt: str | None = field(None, "System message prepended when the chat template is applied (a row "
                                            "with a system message of its own keeps that one).")
    max_prompt_len: int = field(512, "Prompts longer than this (in tokens, image tokens included) are dropped "
                                     "and counted.")
    shuffle: bool = field(True, "Shuffle prompts every epoch (seeded by train.seed and the epoch).")
    images_key: str = field("images", "Image-text rows: field listing the images of a prompt with <image> "
                                      "placeholders (or of bare image parts in messages).")
    image_placeholder: str = field("<image>", "Image-text rows: the placeholder in the prompt field.")
    max_image_pixels: int = field(89_478_485, "Images with more pixels are skipped unread (Pillow's "
                                              "decompression-bomb limit by default).")
    image_fetch_timeout: float = field(10.0, "Seconds to fetch an http(s) image.")
    max_skipped_frac: float = field(0.1, "Stop with an error when more than this share of the rows is skipped "
                                         "as bad (missing or corrupt image, placeholder mismatch, ...).")

    def __post_init__(self):
        if not 0 <= self.max_skipped_frac <= 1:
            raise ValueError(f"data.max_skipped_frac={self.max_skipped_frac} must be in [0, 1]")
        if self.max_prompt_len < 1 or self.max_image_pixels < 1:
            raise ValueError(f"data.max_prompt_len={self.max_prompt_len} and data.max_image_pixels="
                             f"{self.max_image_pixels} must be >= 1")
        if not 0 < self.image_fetch_timeout < math.inf:
            raise ValueError(f"data.image_fetch_timeout={self.image_fetch_timeout} must be a finite number of seconds "
                             "> 0")
        if not self.image_placeholder:
            raise ValueError("data.image_placeholder is empty: it marks where each image goes in the prompt text "
                             "(default '<image>')")


@dataclasses.dataclass
class RewardConfig:
    fn: str | dict = field("exact_match", "Built-in name (math, exact_match, format), 'module:function', a reward "
                                          "server 'http://host:port/path', a reward model 'model:PATH', or "
                                          "{spec: weight}. docs/custom_rollouts.md.")
    granularity: Literal["sample", "group"] = field("sample", "User function gets one sample or one prompt's group.")
    timeout: float = field(60.0, "Seconds one call of a user reward function (or one attempt at a reward server) "
                                 "may take; past it the run stops with the function and the sample named (a hung "
                                 "function cannot hold the job); a server's attempt is retried (max_retries).")

    max_concurrency: int = field(32, "User reward calls (or reward-server requests) in flight per rank.")
    batch_size: int = field(16, "Reward server / reward model: samples per request or forward pass.")
    max_retries: int = field(3, "Reward server: retries of a failed request (connection error, timeout, 5xx, 408, 429, "
                                "malformed answer) before the run stops naming the endpoint and the samples.")
    retry_backoff: float = field(1.0, "Reward server: seconds before the first retry; doubles each retry, up to a "
                                      "minute (a server's Retry-After is waited for instead, within the minute).")

    def __post_init__(self):
        if not 0 < self.timeout < math.inf:  # NaN too; inf would turn off the guard against a hung function
            raise ValueError(f"rollout.reward.timeout={self.timeout} must be a finite number of seconds > 0")
        if self.max_concurrency < 1 or self.batch_size < 1:
            raise ValueError("rollout.reward.max_concurrency and rollout.reward.batch_size must be >= 1")
        if self.max_retries < 0 or not 0 <= self.retry_backoff < math.inf:
            raise ValueError("rollout.reward.max_retries and rollout.reward.retry_backoff must be >= 0 (and finite)")


@dataclasses.dataclass
class OverlongPenaltyConfig:
    max_len: int = field(0, "DAPO overlong penalty: responses longer than max_len - buffer_len lose reward (0 = off).")
    buffer_len: int = field(0, "Length of the linear penalty ramp before max_len.")
    factor: float = field(1.0, "Penalty at and beyond max_len.")

    def __post_init__(self):
        if self.max_len < 0 or not 0 <= self.buffer_len <= max(self.max_len, 0) or not self.factor >= 0:
            raise ValueError(f"rollout.overlong_penalty: max_len={self.max_len} must be >= 0, buffer_len="
                             f"{self.buffer_len} in [0, max_len] (responses longer than max_len - buffer_len "
                             f"are penalised) and factor={self.factor} >= 0")


@dataclasses.dataclass
class SGLangConfig:
    python: str = field("", "Python with SGLang for the servers; '' = $SLIME_SGLANG_PYTHON, else this interpreter.")
    extra_args: list = field([], "Extra `sglang.launch_server` arguments, e.g. ['--max-total-tokens', '8192'].")
    env: dict = field({}, "Extra environment variables for the server processes only.")
    mode: Literal["colocated", "disaggregated"] = field(
        "colocated", "colocated: engines share the trainer's GPUs (sleep/wake, tensor buckets); "
        "disaggregated: engines on their own GPUs, weights broadcast over a process group.")
    tp_size: int = field(1, "Tensor-parallel size of one engine (GPUs per server).")
    ranks_per_engine: int = field(0, "colocated: trainer ranks sharing one engine; 0 = tp_size (one per TP group).")
    release_memory: bool | None = field(
        None, "colocated: release the engines' weights and KV cache while the trainer trains (sleep/wake); "
        "null = on GPU only. On CPU SGLang releases nothing and each release costs the server a "
        "garbage-collection pass (~0.5 s).")
    num_engines: int = field(1, "disaggregated: servers rank 0 launches (on GPUs base_gpu_id, base_gpu_id + tp_size, ...).")
    base_gpu_id: int = field(-1, "disaggregated: first GPU of the engines; -1 = the GPU after the trainer's.")
    urls: list = field([], "Use these running servers (http://HOST:PORT, on this node or another) instead of "
                           "launching any.")
    mem_fraction: float = field(0.0, "--mem-fraction-static of each server; 0 = SGLang's default.")
    max_concurrency: int = field(64, "Requests in flight per rank.")
    startup_timeout: float = field(900.0, "Seconds to wait for a server to answer /health.")
    request_timeout: float = field(300.0, "Seconds one HTTP request (a whole generation, a weight push) may take. "
                                          "On several ranks keep it below train.dist_timeout_minutes: a rank whose "
                                          "server hangs reports it after this long, and the other ranks' collective "
                                          "timeout, whose message names no server, must not come first.")
    max_retries: int = field(2, "Retries of a failed request (refused, reset, 5xx) while the server is alive; a "
                                "timed-out one is not retried.")

    def __post_init__(self):
        for i, url in enumerate(self.urls):
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                hint = f": http://{url}" if isinstance(url, str) and url else ""
                raise ValueError(f"rollout.sglang.urls[{i}]={url!r} is not an http(s) address; give the scheme{hint}")
        if self.tp_size < 1 or self.ranks_per_engine < 0 or self.num_engines < 1:
            raise ValueError("rollout.sglang.tp_size and num_engines must be >= 1 and ranks_per_engine >= 0")
        if self.ranks_per_engine and self.ranks_per_engine % self.tp_size:
            raise ValueError(f"rollout.sglang.ranks_per_engine={self.ranks_per_engine} must be a multiple of "
                             f"tp_size={self.tp_size}")
        if self.max_concurrency < 1 or self.max_retries < 0 or not (0 < self.request_timeout < math.inf and
                                                                    0 < self.startup_timeout < math.inf):
            raise ValueError("rollout.sglang.max_concurrency must be >= 1, request_timeout and startup_timeout finite "
                             "numbers of seconds > 0, max_retries >= 0")


@dataclasses.dataclass
class RolloutConfig:
    engine: Literal["hf", "sglang"] = field("hf", "Generation engine: in-process HF transformers or SGLang servers.")
    batch_size: int = field(8, "Prompts per step over all data-parallel ranks.")
    n_samples_per_prompt: int = field(4, "Responses sampled per prompt (the GRPO group size).")
    temperature: float = field(1.0, "Sampling temperature (also applied to the trainer's logprobs).")
    top_p: float = field(1.0, "Nucleus sampling threshold. The rollout's logprobs (TIS, rollout/"
                              "train_logprob_abs_diff) are of the whole distribution at rollout.temperature, as the "
                              "trainer's, not of the nucleus the token was drawn from (as SGLang reports them).")
    max_response_len: int = field(64, "Maximum new tokens per response.")
    stop_token_ids: list = field([], "Extra token ids that end a response (EOS always does, and the chat "
                                     "template's end of turn where the prompts are templated).")
    ignore_eos: bool = field(False, "Generate exactly max_response_len tokens: no stop token ends a response "
                                    "(benchmarks at fixed lengths; SGLang's ignore_eos).")
    gen_batch_size: int = field(64, "hf engine: sequences generated per forward batch.")
    hf_packed_weights: bool = field(True, "hf engine on CPU: its decode steps read a copy of the matmul weights "
                                          "laid out for the kernel: on oneDNN (model.cpu_linear, auto on AMD CPUs) "
                                          "in its blocked layout, 4-20% faster rollouts there; on MKL (fp32) "
                                          "transposed, which MKL multiplies faster at a decode step's few rows "
                                          "(0.83x the rollout time of bench/vs_trl.py's 23.7M model on an Intel "
                                          "Xeon). false saves that copy's memory (the size of the model's matmul "
                                          "weights, logged at start).")
    hf_compile: Literal["auto", "step", "attention", False] = field(
        "auto", "hf engine on CPU: what of a decode step torch.compile (inductor) fuses. step: the whole step, every "
        "layer, as one compiled graph (slime/models/decode_step.py's _step_graph): no Python between the layers and "
        "a few C++ loops per layer between the matmuls; a 64-token rollout of the 23.7M model of bench/vs_trl.py in "
        "0.85x the eager step's time. attention: only the decode attention over 2048 (row, key) pairs or more (64 rows "
        "x 32 keys), which long responses need most (a 256-token rollout in 0.89x the time). Both need a C++ "
        "compiler; the first rollout pays the compile (step: ~25 s for that 10-layer model, ~6-9 s with inductor's "
        "disk cache warm, more for deeper models; attention: ~2-5 s). auto: step for fp32 Llama, Qwen2 and Qwen3 "
        "models with hidden size >= 256 and SwiGLU MLPs on CPU (in bf16 its fused chains round elsewhere than the "
        "model's forward: attention only), falling back with a warning to the eager step with the "
        "compiled decode attention (as attention) where the step's compile fails, and to plain eager decoding where "
        "that compile fails too; attention alone for such models without SwiGLU MLPs; false: neither.")
    generate_fn: str | None = field(None, "'package.module:function' building each prompt's samples (multi-turn, "
                                          "tools; see docs/custom_rollouts.md); None = one completion per sample.")
    generate_fn_timeout: float = field(300.0, "Seconds rollout.generate_fn may take for one prompt's samples, besides "
                                              "the time its requests queue for the engine (a tool that never answers "
                                              "ends the run naming the function and the prompt's file:line, not a "
                                              "hang); 0 = no limit. On several ranks keep it below "
                                              "train.dist_timeout_minutes (warned otherwise).")
    one_step_off: bool = field(False, "Asynchronous rollout: generate step k+1's batch while training on step k's "
                                      "(one-step-off-policy, as slime's train_async); the engine must not share the "
                                      "trainer's GPUs (hf engine, or SGLang disaggregated). Use algo.tis to correct "
                                      "the lag; rollout/policy_lag reports it.")
    sync_bucket_mb: float = field(64.0, "Size of the parameter buckets gathered and pushed to the engine.")
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    sglang: SGLangConfig = dataclasses.field(default_factory=SGLangConfig)
    dynamic_sampling: bool = field(False, "DAPO: drop groups whose rewards (before any overlong penalty) are all "
                                            "equal and sample more prompts.")
    max_sampling_attempts: int = field(4, "Dynamic sampling: rollouts per step at most before training on what is kept.")
    over_sample_factor: float = field(1.0, "Draw this many times the prompts still needed per sampling attempt.")
    overlong_penalty: OverlongPenaltyConfig = dataclasses.field(default_factory=OverlongPenaltyConfig)

    def __post_init__(self):
        if self.max_response_len < 1 or self.gen_batch_size < 1 or self.max_sampling_attempts < 1:
            raise ValueError(f"rollout.max_response_len={self.max_response_len}, rollout.gen_batch_size="
                             f"{self.gen_batch_size} and rollout.max_sampling_attempts={self.max_sampling_attempts} "
                             "must be >= 1")
        if self.over_sample_factor < 1:
            raise ValueError("rollout.over_sample_factor must be >= 1")
        if self.dynamic_sampling and self.n_samples_per_prompt == 1:
            raise ValueError("rollout.dynamic_sampling=true keeps groups whose rewards differ, and a group of "
                             "rollout.n_samples_per_prompt=1 never has two: raise n_samples_per_prompt or turn "
                             "dynamic sampling off")
        penalty = self.overlong_penalty
        if penalty.max_len and penalty.max_len - penalty.buffer_len >= self.max_response_len:
            raise ValueError(f"rollout.overlong_penalty: max_len={penalty.max_len} - buffer_len={penalty.buffer_len} >= "
                             f"rollout.max_response_len={self.max_response_len}: no response can be that long, so the "
                             "penalty never applies; DAPO sets max_len to the response limit (max_len <= "
                             "rollout.max_response_len), or 0 turns it off")
        if penalty.max_len > self.max_response_len:
            raise ValueError(f"rollout.overlong_penalty.max_len={penalty.max_len} > rollout.max_response_len="
                             f"{self.max_response_len}: responses stop at the limit, so one cut there would get only "
                             "part of the penalty (the ramp ends past it); set max_len <= rollout.max_response_len "
                             "(DAPO sets it to the limit)")
        if not self.sync_bucket_mb > 0:
            raise ValueError(f"rollout.sync_bucket_mb={self.sync_bucket_mb} must be > 0 (MB per bucket of the weight "
                             "push)")
        if self.batch_size < 1 or self.n_samples_per_prompt < 1:
            raise ValueError("rollout.batch_size and rollout.n_samples_per_prompt must be >= 1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if not 0 < self.temperature < math.inf:  # inf: every logit 0 or NaN (inf / inf), logprobs NaN
            raise ValueError(f"rollout.temperature={self.temperature} must be > 0 and finite (use a small value for "
                             "near-greedy)")
        if not 0 <= self.generate_fn_timeout < math.inf:
            raise ValueError(f"rollout.generate_fn_timeout={self.generate_fn_timeout} must be a finite number of "
                             "seconds >= 0 (0 = no limit)")
        bad = [t for t in self.stop_token_ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"rollout.stop_token_ids={self.stop_token_ids}: {bad} are not token ids; give the ids "
                             "as non-negative integers (tokenizer.convert_tokens_to_ids names a token's id)")


@dataclasses.dataclass
class TISConfig:
    level: Literal["off", "token", "sequence", "geometric"] = field(
        "off", "Rollout/training mismatch correction: importance weight exp(logp_old - logp_rollout) at this level.")
    mode: Literal["truncate", "mask"] = field("truncate", "Clamp weights into [low, high], or zero tokens outside it.")
    low: float = field(0.0, "Lower bound of the importance weight.")
    high: float = field(2.0, "Upper bound of the importance weight.")


@dataclasses.dataclass
class CriticConfig:
    path: str | None = field(None, "Critic initialisation (HF dir); None = the actor's model.path.")
    lr: float = field(1e-5, "Critic learning rate, on the actor's schedule (train.warmup_steps, lr_schedule, and "
                            "min_lr as the same fraction of it as of train.lr) over all of train.num_steps.")
    value_clip: float = field(0.2, "Clip range of the value update around the old values.")
    value_loss_coef: float = field(0.5, "Weight of the value loss.")
    warmup_steps: int = field(0, "Steps in which only the critic trains (the actor's lr schedule spans the steps "
                                 "after).")

    def __post_init__(self):
        if not 0 <= self.lr < float("inf"):
            raise ValueError(f"algo.critic.lr={self.lr} must be a finite number >= 0")
        if not 0 < self.value_clip < float("inf"):
            raise ValueError(f"algo.critic.value_clip={self.value_clip} must be > 0 (the clip range of the value "
                             "update around the old values) and finite")
        if not 0 <= self.value_loss_coef < float("inf") or self.warmup_steps < 0:
            raise ValueError(f"algo.critic.value_loss_coef={self.value_loss_coef} and algo.critic.warmup_steps="
                             f"{self.warmup_steps} must be >= 0 (and the coefficient finite)")


@dataclasses.dataclass
class AlgoConfig:
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = field(
        "grpo", "How rewards become advantages (gae trains a critic).")
    normalize_std: bool = field(True, "GRPO: divide by the group's reward std.")
    policy_loss: Literal["ppo", "gspo", "cispo", "sft"] = field(
        "ppo", "Policy loss; 'sft' trains on prompt + label (cross-entropy on response tokens at temperature 1, "
               "no rollout; a chat ending in the assistant's reply learns that reply from the messages before it; the "
               "target ends with the chat template's end of turn, EOS without a template).")
    clip_low: float | None = field(0.2, "Clip range below ratio 1 (null = no lower bound, CISPO).")
    clip_high: float = field(0.2, "Clip range above ratio 1 (clip-higher when > clip_low).")
    dual_clip: float | None = field(None, "Dual-clip constant c > 1 bounding the loss of negative advantages.")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = field(
        "token_mean", "How per-token losses are averaged over each mini-batch, all ranks together.")
    loss_agg_constant: float = field(1.0, "Divisor for seq_mean_token_sum_norm (Dr.GRPO uses max_response_len).")
    entropy_coef: float = field(0.0, "Entropy bonus coefficient (0 = only logged).")
    use_reference: bool = field(False, "Keep a frozen reference model (implied by kl_coef > 0); KL to it is logged.")
    ref_offload: bool = field(False, "Keep the reference model's parameters in CPU memory (ZeRO-3 offload_param).")
    kl_coef: float = field(0.0, "KL coefficient (loss term with use_kl_loss, else reward penalty with kl_in_reward).")
    use_kl_loss: bool = field(False, "Add kl_coef * KL(policy || reference) to the loss.")
    kl_in_reward: bool = field(False, "Subtract kl_coef * KL from the rewards instead.")
    kl_estimator: Literal["k1", "k2", "k3"] = field("k3", "KL estimator (k3: low-variance, clamped).")
    router_aux_loss_coef: float = field(0.0, "Mixture of experts: weight of the router's load-balancing loss "
                                             "(0 = only logged; RL runs usually keep the router as it is).")
    old_logprobs: Literal["auto", "recompute", "train_forward", "rollout"] = field(
        "auto", "pi_old: 'recompute' = a forward pass over the batch before the update; 'train_forward' = the "
        "update's own forward, detached (on-policy with train.num_mini_batches=1, where the two are the same "
        "weights: saves one forward pass; not with kl_in_reward, whose advantages need pi_old first); 'rollout' = "
        "the engine's logprobs of the sampled tokens (no scoring pass, any mini-batches; the ratio is then to the "
        "policy that sampled, engine/trainer mismatch included, so algo.tis has nothing to correct); 'auto' = "
        "train_forward where it is the same, else recompute.")
    gamma: float = field(1.0, "Discount for token-level estimators (REINFORCE++, GAE).")
    lam: float = field(0.95, "GAE lambda.")
    gae_whiten: bool = field(True, "GAE: whiten the advantages over the batch's response tokens (zero mean, unit "
                                   "variance, over every rank), as verl and OpenRLHF do; false keeps GAE's scale.")
    tis: TISConfig = dataclasses.field(default_factory=TISConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)

    def __post_init__(self):
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"algo.{key}={getattr(self, key)} must be in [0, 1]")
        if self.clip_low is not None and not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"algo.clip_low={self.clip_low} must be in [0, 1) so that 1 - clip_low > 0")
        if self.clip_high < 0:
            raise ValueError(f"algo.clip_high={self.clip_high} must be >= 0")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"algo.router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0")
        if self.use_kl_loss and self.kl_in_reward:
            raise ValueError("algo.use_kl_loss and algo.kl_in_reward are exclusive; pick where the KL goes")
        if self.kl_coef < 0:
            raise ValueError(f"algo.kl_coef={self.kl_coef} must be >= 0 (a negative coefficient would reward moving "
                             "away from the reference)")
        if (self.use_kl_loss or self.kl_in_reward) and self.kl_coef <= 0:
            raise ValueError("algo.use_kl_loss / algo.kl_in_reward need algo.kl_coef > 0")
        if self.use_kl_loss and self.kl_estimator == "k1":
            raise ValueError("algo.use_kl_loss=true with algo.kl_estimator=k1: the gradient of k1 (log pi - log ref) "
                             "on tokens sampled from pi is zero in expectation, so the term adds noise and never pulls "
                             "the policy toward the reference. Use k3 (GRPO's) or k2 (the exact gradient of "
                             "KL(pi || ref)); k1 is for algo.kl_in_reward=true")
        if self.kl_coef > 0 and not (self.use_kl_loss or self.kl_in_reward) and self.policy_loss != "sft":
            raise ValueError(f"algo.kl_coef={self.kl_coef} weighs a KL term, but none is on: set algo.use_kl_loss=true "
                             "(a loss term) or algo.kl_in_reward=true (a reward penalty); to only log the KL to a "
                             "reference model, set algo.kl_coef=0 and algo.use_reference=true")
        if self.kl_in_reward and self.advantage_estimator == "grpo" and self.normalize_std:
            raise ValueError("algo.kl_in_reward=true with algo.advantage_estimator=grpo and algo.normalize_std=true "
                             "divides the KL penalty by the group's reward std: a group whose rewards are all equal "
                             "gets advantages made of KL noise over a tiny std. Use algo.use_kl_loss=true instead "
                             "(GRPO's KL term, as in DeepSeekMath), or algo.normalize_std=false, or another "
                             "estimator (rloo, reinforce_pp)")
        if self.loss_agg_constant <= 0:
            raise ValueError(f"algo.loss_agg_constant={self.loss_agg_constant} must be > 0 (the divisor of "
                             "loss_agg=seq_mean_token_sum_norm; Dr.GRPO uses rollout.max_response_len)")
        if self.policy_loss == "sft" and (self.entropy_coef or self.use_kl_loss or self.kl_in_reward or self.kl_coef):
            raise ValueError("algo.policy_loss=sft trains on cross-entropy alone: algo.entropy_coef, algo.kl_coef, "
                             "algo.use_kl_loss and algo.kl_in_reward do not apply to it; leave them at 0 / false")
        if self.clip_low is None and self.policy_loss != "cispo":
            raise ValueError(f"algo.clip_low=null (no lower bound) is only meaningful for policy_loss=cispo, "
                             f"not {self.policy_loss}; give a number")
        if self.policy_loss == "gspo" and max(self.clip_low or 0.0, self.clip_high) >= 0.01:
            # GSPO's ratio is a geometric mean over the sequence's tokens: their deviations average out, so it stays
            # far closer to 1 than PPO's per-token ratios, and PPO's 0.2 almost never clips it.
            logger.warning("algo.policy_loss=gspo with algo.clip_low=%s, algo.clip_high=%s: GSPO's sequence ratio "
                           "(a geometric mean over the response's tokens) stays far closer to 1 than PPO's per-token "
                           "ratios, so a range this wide seldom clips; the GSPO paper uses clip_low=3e-4, "
                           "clip_high=4e-4", self.clip_low, self.clip_high)
        if self.loss_agg == "seq_mean_token_sum_norm" and self.loss_agg_constant == 1.0:
            logger.warning("algo.loss_agg=seq_mean_token_sum_norm divides each sequence's summed loss by "
                           "algo.loss_agg_constant=1.0: a gradient about rollout.max_response_len times Dr.GRPO's, "
                           "which divides by the generation budget (set algo.loss_agg_constant to it)")
        if self.policy_loss == "gspo" and self.loss_agg == "token_mean":
            logger.warning("algo.policy_loss=gspo with algo.loss_agg=token_mean weighs each sequence's loss by its "
                           "length; GSPO's objective averages over sequences: algo.loss_agg=seq_mean_token_mean")
        if self.dual_clip is not None and (self.dual_clip <= 1 or self.policy_loss != "ppo"):
            raise ValueError("algo.dual_clip must be > 1 and needs algo.policy_loss=ppo")
        if self.tis.level != "off" and not 0 <= self.tis.low < self.tis.high:
            raise ValueError("algo.tis needs 0 <= low < high")
        if self.tis.level != "off" and self.old_logprobs == "rollout":
            raise ValueError("algo.tis corrects pi_old for the engine's logprobs, which algo.old_logprobs=rollout "
                             "takes as pi_old (every weight would be 1): set algo.tis.level=off, or "
                             "algo.old_logprobs=recompute to keep the correction")

    @property
    def needs_reference(self) -> bool:
        return self.use_reference or self.kl_coef > 0


@dataclasses.dataclass
class EvalConfig:
    path: str | None = field(None, "Held-out prompt file (same schema as data.path); None = no evaluation.")
    interval: int = field(5, "Evaluate every this many steps (and before the first and after the last).")
    max_prompts: int = field(0, "Evaluate on at most this many prompts (0 = all): the first usable ones of the file; "
                                "eval/skipped_* still count the bad rows of the whole file.")
    max_response_len: int = field(0, "Max new tokens for eval (0 = rollout.max_response_len).")
    accuracy_threshold: float = field(1.0, "A response counts as correct when its reward is >= this.")
    n_samples_per_prompt: int = field(1, "Answers per eval prompt. Above 1 (with eval.temperature > 0) eval/pass@k "
                                         "is logged for k = 1, 2, 4, ... and n (unbiased estimator over the n "
                                         "answers) and eval/accuracy is the mean over all answers.")
    temperature: float = field(0.0, "Eval sampling temperature; 0 = greedy (one answer per prompt).")
    top_p: float = field(1.0, "Eval nucleus sampling threshold (with eval.temperature > 0).")

    def __post_init__(self):
        if self.interval < 1 or self.max_prompts < 0 or self.max_response_len < 0:
            raise ValueError(f"eval.interval={self.interval} must be >= 1, eval.max_prompts={self.max_prompts} "
                             f"and eval.max_response_len={self.max_response_len} >= 0 (0 = all / the rollout's)")
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"eval.n_samples_per_prompt={self.n_samples_per_prompt} must be >= 1")
        if not math.isfinite(self.accuracy_threshold):  # inf: nothing correct; -inf: everything
            raise ValueError(f"eval.accuracy_threshold={self.accuracy_threshold} must be a finite reward")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"eval.temperature={self.temperature} must be >= 0 and finite (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"eval.top_p={self.top_p} must be in (0, 1]")
        if self.n_samples_per_prompt > 1 and self.temperature == 0:
            raise ValueError(f"eval.n_samples_per_prompt={self.n_samples_per_prompt} with eval.temperature=0: greedy "
                             "answers to one prompt are all the same; set eval.temperature > 0 (e.g. 1.0, or 0.6 "
                             "with eval.top_p=0.95) for pass@k")
        if self.temperature == 0 and self.top_p != 1:
            raise ValueError(f"eval.top_p={self.top_p} with eval.temperature=0: greedy decoding takes no nucleus; "
                             "set eval.temperature > 0 or leave eval.top_p at 1")


@dataclasses.dataclass
class TrainConfig:
    num_steps: int = field(10, "RL steps (rollout + update) to run.")
    lr: float = field(1e-6, "Peak learning rate.")
    min_lr: float = field(0.0, "Floor of the cosine schedule: the rate one step after the last (the last step "
                               "runs just above it).")
    lr_schedule: Literal["constant", "cosine"] = field("constant", "Schedule after warmup.")
    warmup_steps: int = field(0, "Linear warmup optimizer steps.")
    weight_decay: float = field(0.0, "AdamW weight decay of the weight matrices (embeddings included); norm gains "
                                     "and biases get none, as in Megatron and HF's Trainer.")
    betas: list = field([0.9, 0.999], "AdamW betas.")
    grad_clip: float = field(1.0, "Clip the global gradient norm to this (0 = off).")
    num_mini_batches: int = field(1, "Optimizer steps per rollout batch (PPO-style mini-batches).")
    packing: bool = field(True, "Pack samples without padding under the token budget (off = padded fixed-size batches).")
    micro_batch_size: int = field(4, "Samples per micro-batch when packing is off (each padded to the longest).")
    max_tokens_per_gpu: int = field(4096, "Token budget of one training micro-batch (packed, no padding).")
    logprob_max_tokens_per_gpu: int = field(0, "Budget for no-grad logprob passes; 0 = 2 x max_tokens_per_gpu.")
    logits_chunk_size: int = field(1024, "Tokens per chunk when computing logprobs from hidden states.")
    share_prompts: bool = field(
        True, "The samples of one prompt in a packed micro-batch carry the prompt once: its forward and backward run "
        "once and the responses attend to it (logprobs and gradients are those of separate copies). Applies where "
        "the attention is packed_sdpa (CPU), parallel.sp=1 and the model is text-only and dense; false: every "
        "sample carries its own prompt.")
    compile: bool = field(
        False, "torch.compile each decoder layer (regional compilation, dynamic shapes: micro-batches of any length "
        "reuse the graphs; the packed_sdpa attention stays eager). The first step pays the compile (~10-20 s); "
        "text-only dense models with packed_sdpa attention (CPU) on ZeRO-1/2 (ds_configs/zero2.json) only.")
    fuse_elementwise: bool | Literal["auto"] = field(
        "auto", "On CPU, run the RMSNorm, rotary-embedding and SwiGLU chains of Llama, Qwen2 and Qwen3 layers as small "
        "functions torch.compile fuses, forward and backward (slime/models/fused.py): the 23.7M model's forward + "
        "backward 6.4 -> 5.6 s. Needs a C++ compiler (inductor's CPU backend); the first step pays ~2-3 s of compile "
        "(~15 s on a machine whose inductor cache is cold). auto: on where it applies (CPU, one of those families, "
        "hidden size >= 256, the compile works), else off with the reason logged; true: fail where it does not "
        "apply; false: HF's eager chains.")
    cpu_malloc: Literal["retain", "glibc"] = field(
        "retain", "On CPU: glibc's malloc without mmap or heap trimming, and one arena for all threads, so each step "
        "reuses the memory it freed instead of page-faulting it in again (2-3 s of system time per step on the 23.7M "
        "model of bench/vs_trl.py; on 2 ranks gloo's threads another 0.2-0.4 s); resident memory stays at its peak. "
        "glibc = malloc's defaults. MALLOC_* variables in the environment win.")
    ds_config: str = field("ds_configs/zero3.json", "DeepSpeed JSON config; its 'auto' fields are filled from the run "
                                                      "config (train.lr, betas, weight_decay, grad_clip; bf16 from "
                                                      "model.dtype).")
    seed: int = field(1234, "Seed for data order, sampling and initialisation.")
    max_skipped_steps: int = field(3, "Stop after this many consecutive optimizer steps skipped for a non-finite "
                                      "loss or gradient (each skip is logged and counted in train/skipped_steps).")
    dist_timeout_minutes: float = field(10.0, "A collective that waits longer fails with the step and phase where a "
                                              "rank stopped answering (torch's default is 30 min).")

    def __post_init__(self):
        if self.num_steps < 1:
            raise ValueError(f"train.num_steps={self.num_steps} must be >= 1")
        if self.max_skipped_steps < 1:
            raise ValueError(f"train.max_skipped_steps={self.max_skipped_steps} must be >= 1")
        if not 0 < self.dist_timeout_minutes < math.inf:
            raise ValueError(f"train.dist_timeout_minutes={self.dist_timeout_minutes} must be a finite number > 0")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"train.seed={self.seed} must be in [0, 2**32) (numpy's seed range)")
        if self.max_tokens_per_gpu < 1:
            raise ValueError("train.max_tokens_per_gpu must be >= 1")
        if self.micro_batch_size < 1:
            raise ValueError(f"train.micro_batch_size={self.micro_batch_size} must be >= 1 (samples per micro-batch "
                             "when train.packing is off)")
        if self.logprob_max_tokens_per_gpu < 0:
            raise ValueError(f"train.logprob_max_tokens_per_gpu={self.logprob_max_tokens_per_gpu} must be >= 0 "
                             "(0 = 2 x train.max_tokens_per_gpu)")
        if self.num_mini_batches < 1:
            raise ValueError("train.num_mini_batches must be >= 1")
        if self.logits_chunk_size < 1:
            raise ValueError(f"train.logits_chunk_size={self.logits_chunk_size} must be >= 1 (tokens per chunk)")
        if not all(0 <= x < float("inf") for x in (self.lr, self.min_lr, self.weight_decay, self.grad_clip)) \
                or self.warmup_steps < 0:
            raise ValueError(f"train.lr={self.lr}, train.min_lr={self.min_lr}, train.weight_decay={self.weight_decay}, "
                             f"train.grad_clip={self.grad_clip} and train.warmup_steps={self.warmup_steps} must be "
                             ">= 0 (and finite)")
        if self.lr > 0.1:  # Adam moves each weight by about lr per step: a typo (1e4 for 1e-4) ruins the model
            logger.warning("train.lr=%g: Adam moves every weight by about that much per step, which wrecks a trained "
                           "model in one step (typical: 1e-6 to 1e-4 for RL, up to 1e-3 for SFT); a typo of 1e-4?",
                           self.lr)
        if self.lr_schedule == "cosine" and self.min_lr > self.lr:  # a constant schedule never reads min_lr
            raise ValueError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}: the schedule would climb to it "
                             "instead of decaying; min_lr is the floor the cosine decays to (<= train.lr)")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                           for b in self.betas):
            raise ValueError(f"train.betas={self.betas} must be two numbers in [0, 1) (AdamW's beta1, beta2), "
                             "e.g. [0.9, 0.999]")


@dataclasses.dataclass
class ParallelConfig:
    sp: int = field(1, "Ulysses sequence-parallel size (1 = off).")
    ep: int = field(1, "Expert-parallel size for MoE models (DeepSpeed AutoEP; divides the data-parallel size; "
                       "1 = off).")

    def __post_init__(self):
        if self.sp < 1 or self.ep < 1:
            raise ValueError("parallel.sp and parallel.ep must be >= 1")


@dataclasses.dataclass
class CheckpointConfig:
    interval: int = field(0, "Save a checkpoint every this many steps (0 = only at the end when save_final).")
    save_final: bool = field(True, "Save a checkpoint after the last step.")
    resume: bool = field(True, "Continue from the latest checkpoint in the run directory if there is one.")
    export_hf: bool = field(True, "Write an HF-format model directory (run_dir/hf) at the end.")
    keep: int = field(2, "Keep the newest this many checkpoints (older ones are deleted after a save).")

    def __post_init__(self):
        if self.keep < 1 or self.interval < 0:
            raise ValueError("checkpoint.keep must be >= 1 and checkpoint.interval >= 0")


@dataclasses.dataclass
class LogConfig:
    run_dir: str = field("runs/default", "Directory for metrics, checkpoints and exports.")
    wandb: bool = field(False, "Log to Weights & Biases.")
    wandb_project: str = field("slime", "W&B project name.")
    wandb_mode: Literal["online", "offline", "disabled"] | None = field(
        None, "W&B's mode; None: the environment's WANDB_MODE, else offline (works without network; `wandb sync` "
              "uploads it later). online needs an API key (WANDB_API_KEY or `wandb login`), checked at start.")
    tensorboard: bool = field(False, "Also write TensorBoard event files.")
    plot: bool = field(True, "At the end, plot metrics.jsonl into metrics.png beside it (matplotlib, ~1 s on CPU); "
                       "false skips it (python -m slime.utils.plot makes it later).")

    def __post_init__(self):
        if not str(self.run_dir).strip():
            raise ValueError("log.run_dir is empty; give the directory for metrics, checkpoints and exports")


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)

    def __post_init__(self):
        if not self.model.path:
            raise ValueError("model.path is required: an HF model directory (e.g. model.path=assets/tiny-arith)")
        if not self.data.path:
            raise ValueError("data.path is required: a .jsonl, .json or .parquet prompt file")
        if self.parallel.sp > 1 and not self.train.packing:
            raise ValueError("parallel.sp > 1 cuts packed rows into shards: it needs train.packing=true")
        sft = self.algo.policy_loss == "sft"
        per_step = self.rollout.batch_size * (1 if sft else self.rollout.n_samples_per_prompt)
        if per_step < self.train.num_mini_batches:  # a step's batch is at most this (filters only take away)
            raise ValueError(f"train.num_mini_batches={self.train.num_mini_batches} optimizer steps per batch, but a "
                             f"step has {per_step} samples (rollout.batch_size"
                             + ("" if sft else " x rollout.n_samples_per_prompt") + "): lower train.num_mini_batches "
                             "or raise rollout.batch_size")
        if self.rollout.one_step_off:
            why = ("rollout.dynamic_sampling=true (its attempts agree over ranks)" if self.rollout.dynamic_sampling
                   else "parallel.sp > 1 (sp peers gather their generations)" if self.parallel.sp > 1
                   else "SGLang in colocated mode (the engine sleeps while the trainer trains)"
                   if self.rollout.engine == "sglang" and self.rollout.sglang.mode == "colocated" else None)
            if why:
                raise ValueError(f"rollout.one_step_off=true generates while the trainer trains, which does not work "
                                 f"with {why}; change that setting or set rollout.one_step_off=false")
        if self.trains_critic and self.algo.critic.lr > 0.1:  # without a critic: "ignored" (ignored_settings)
            logger.warning("algo.critic.lr=%g: Adam moves every weight by about that much per step (typical: 1e-6 "
                           "to 1e-4); a typo of 1e-4?", self.algo.critic.lr)
        if self.trains_critic and self.algo.critic.warmup_steps >= self.train.num_steps:
            raise ValueError(f"algo.critic.warmup_steps={self.algo.critic.warmup_steps} leaves no step of "
                             f"train.num_steps={self.train.num_steps} to train the actor: lower the warmup or raise "
                             "train.num_steps")
        one_update = self.train.num_mini_batches == 1 and not self.algo.kl_in_reward
        if self.algo.old_logprobs == "auto":  # the scoring pass is redundant when pi_old is the update's weights
            self.algo.old_logprobs = "train_forward" if one_update else "recompute"
        if self.algo.old_logprobs == "train_forward" and not one_update:
            raise ValueError("algo.old_logprobs=train_forward takes pi_old from the update's own forward, which is "
                             "pi_old only for the first optimizer step and after the advantages: it needs "
                             "train.num_mini_batches=1 and algo.kl_in_reward=false (use algo.old_logprobs=recompute)")
        if self.trains_critic and self.parallel.ep > 1:
            raise ValueError("algo.advantage_estimator=gae trains a critic, which parallel.ep > 1 does not support yet "
                             "(expert parallelism covers the policy's MoE blocks only); set parallel.ep=1 or choose a "
                             "critic-free estimator (grpo, rloo, reinforce_pp)")
        if self.algo.policy_loss != "sft" \
                and self.algo.advantage_estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline") \
                and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(f"algo.advantage_estimator={self.algo.advantage_estimator} needs "
                             "rollout.n_samples_per_prompt >= 2 (a group baseline of one sample is zero)")

        for line in self.ignored_settings():
            logger.warning(line)

    def settings(self) -> dict[str, str]:
        """Every setting, as dotted key -> repr of its value."""
        def flat(obj, prefix: str):
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if dataclasses.is_dataclass(value):
                    yield from flat(value, f"{prefix}{f.name}.")
                else:  # canonical: a mapping in another key order is the same setting
                    yield f"{prefix}{f.name}", json.dumps(value, sort_keys=True, default=repr)

        return dict(flat(self, ""))

    def ignored_settings(self) -> list[str]:
        """Settings given (not at their defaults) that this run never reads, each with why: warned at start, so
        that nothing a user set is dropped in silence."""
        def given(obj, prefix: str, names=None) -> list[str]:
            default = type(obj)()
            return [f"{prefix}.{f.name}={getattr(obj, f.name)!r}" for f in dataclasses.fields(obj)
                    if (names is None or f.name in names) and getattr(obj, f.name) != getattr(default, f.name)]

        out, sft = [], self.algo.policy_loss == "sft"
        if not self.trains_critic and (critic := given(self.algo.critic, "algo.critic")):
            out.append(f"{', '.join(critic)} ignored: only algo.advantage_estimator=gae trains a critic (and not "
                       "under algo.policy_loss=sft)")
        if sft:
            unused = given(self.algo.tis, "algo.tis", ("level",)) + given(
                self.rollout, "rollout", ("dynamic_sampling", "one_step_off", "n_samples_per_prompt")) + given(
                self.rollout.overlong_penalty, "rollout.overlong_penalty", ("max_len",))
            if unused:
                out.append(f"{', '.join(unused)} ignored: algo.policy_loss=sft trains on the labels, with no "
                           "rollout to sample, filter, shape or correct")
        if not self.scores_generations and (unused := given(self.rollout.reward, "rollout.reward") + given(
                self.rollout, "rollout", ("generate_fn", "generate_fn_timeout"))):
            out.append(f"{', '.join(unused)} ignored: algo.policy_loss=sft generates and scores only to evaluate, "
                       "and eval.path is not set")
        if not self.eval.path and (unused := given(self.eval, "eval")):
            out.append(f"{', '.join(unused)} ignored: eval.path is not set (no evaluation)")
        if not self.rollout.dynamic_sampling and \
                (unused := given(self.rollout, "rollout", ("over_sample_factor", "max_sampling_attempts"))):
            out.append(f"{', '.join(unused)} ignored: they set how rollout.dynamic_sampling=true draws again")
        return out

    @property
    def scores_generations(self) -> bool:
        """Whether the run generates and scores (the rollout, or evaluation): SFT does only to evaluate."""
        return self.algo.policy_loss != "sft" or bool(self.eval.path)

    @property
    def trains_critic(self) -> bool:
        """GAE's value model: built and trained unless the run is SFT."""
        return self.algo.advantage_estimator == "gae" and self.algo.policy_loss != "sft"

    def longest_sample_warning(self) -> str | None:
        """A sample of the longest prompt and response may not fit a training micro-batch: the step that draws one
        would stop (slime/trainer/layout.py says so, after its rollout). A warning: most prompts are shorter."""
        longest = self.data.max_prompt_len + self.rollout.max_response_len - 1  # the last token is a target only
        budget = self.parallel.sp * self.train.max_tokens_per_gpu
        if self.algo.policy_loss == "sft" or not self.train.packing or longest <= budget:
            return None
        return (f"a sample of the longest prompt and response is {longest} tokens (data.max_prompt_len + "
                f"rollout.max_response_len - 1), more than a micro-batch holds (parallel.sp x "
                f"train.max_tokens_per_gpu = {budget}): a step that draws one stops. Raise train.max_tokens_per_gpu "
                f"to {-(-longest // self.parallel.sp)}, or lower data.max_prompt_len / rollout.max_response_len")

    def warmup_warning(self) -> str | None:
        """A warmup as long as the actor's schedule: its lr never reaches train.lr (the schedule counts optimizer
        updates: steps past a critic's warmup, times train.num_mini_batches)."""
        if self.algo.policy_loss != "sft" and self.trains_critic:
            steps = self.train.num_steps - self.algo.critic.warmup_steps
        else:
            steps = self.train.num_steps
        updates = steps * self.train.num_mini_batches
        if self.train.warmup_steps < updates:
            return None
        less = ", less algo.critic.warmup_steps" if steps != self.train.num_steps else ""
        return (f"train.warmup_steps={self.train.warmup_steps} is not shorter than the {updates} optimizer updates "
                f"of the run (train.num_steps x train.num_mini_batches{less}): the learning rate never reaches "
                f"train.lr={self.train.lr:g} (at most {updates / (self.train.warmup_steps + 1):.0%} of it); lower "
                "train.warmup_steps")

    def accuracy_warning(self) -> str | None:
        """An eval.accuracy_threshold above the most the built-in rewards can give (each at most 1): eval/accuracy
        would be 0 whatever the model answers."""
        from slime.rollout.rewards import BUILTIN_REWARDS, spec_weights

        spec = self.rollout.reward.fn
        try:
            weights = spec_weights(spec)
        except ValueError:  # refused, saying why, by check_reward_spec
            return None
        if not self.eval.path or any(name not in BUILTIN_REWARDS for name in weights):
            return None
        most = sum(max(float(w), 0.0) for w in weights.values())
        if self.eval.accuracy_threshold <= most:
            return None
        return (f"eval.accuracy_threshold={self.eval.accuracy_threshold:g} is above the most rollout.reward.fn="
                f"{spec!r} gives ({most:g}): eval/accuracy is 0 whatever the model answers; lower the threshold")

    def off_policy_warning(self) -> str | None:
        """One-step-off batches come from the weights one update older than pi_old; nothing corrects for that
        unless algo.tis weighs it or the ratio is taken against the engine's own logprobs."""
        if not self.rollout.one_step_off or self.algo.policy_loss == "sft" or self.algo.tis.level != "off" \
                or self.algo.old_logprobs == "rollout":
            return None
        return ("rollout.one_step_off=true with algo.tis.level=off: each batch was sampled by the weights one update "
                "older than those its PPO ratio starts from, and nothing corrects for the lag (rollout/policy_lag); "
                "set algo.tis.level=token (or sequence / geometric), or algo.old_logprobs=rollout")

    def user_timeout_warning(self, world_size: int) -> str | None:
        """On several ranks, a user function's timeout at or past the collective's: a rank hung (or slow) in it
        stops the run by the other ranks' collective timeout first, whose message names no function."""
        if world_size < 2:
            return None
        limit = 60 * self.train.dist_timeout_minutes
        scores = self.scores_generations
        timeouts = {"rollout.reward.timeout": self.rollout.reward.timeout} if scores else {}
        if self.rollout.generate_fn and scores:
            timeouts["rollout.generate_fn_timeout"] = self.rollout.generate_fn_timeout or math.inf
        if self.rollout.engine == "sglang":  # a hung server is named once a request times out and /health fails
            timeouts["rollout.sglang.request_timeout"] = self.rollout.sglang.request_timeout
        margin = {"rollout.sglang.request_timeout": SGLANG_HEALTH_TIMEOUT}
        said = {"rollout.sglang.request_timeout": f" (+{SGLANG_HEALTH_TIMEOUT:g} s on /health)"}
        fn = self.rollout.reward.fn
        servers = sum(isinstance(n, str) and is_remote(n) for n in ([fn] if isinstance(fn, str) else fn))
        if servers and scores:  # a server's batch may time out on every attempt, with backoffs between; servers
            r = self.rollout.reward  # of one spec are called one after the other
            backoff = sum(min(REWARD_MAX_BACKOFF_S, r.retry_backoff * 2 ** a * 1.25) for a in range(r.max_retries))
            margin["rollout.reward.timeout"] = servers * (r.timeout * (r.max_retries + 1) + backoff) - r.timeout
            said["rollout.reward.timeout"] = (f" (x{r.max_retries + 1} attempts at a reward server, rollout.reward."
                                              f"max_retries={r.max_retries}, +{backoff:g} s of backoff"
                                              + (f"; {servers} servers, one after the other" if servers > 1 else "")
                                              + ")")
        late = {k: v for k, v in timeouts.items() if v + margin.get(k, 0.0) >= limit}
        if not late:
            return None
        named = ", ".join(f"{k}={v:g}s{said.get(k, '')}" for k, v in late.items())
        return (f"{named} not below train.dist_timeout_minutes={self.train.dist_timeout_minutes:g} ({limit:g} s): on "
                f"{world_size} ranks, one that waits that long in the function (a tool that never answers, a slow "
                "multi-turn rollout) or on its SGLang server stops the run by the others' collective timeout, whose "
                "message names no function; set train.dist_timeout_minutes above the longest rollout a rank may take "
                f"beyond another's, or lower {' / '.join(late)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Loading

def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting only lossless cases (int -> float)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and value not in choices:  # YAML reads off / on / no / yes as booleans
            words = [c for c in choices if isinstance(c, str) and c in (("off", "no", "false") if not value
                                                                       else ("on", "yes", "true"))]
            value = words[0] if len(words) == 1 else value
        # by type too: 0 == False and 1 == True, so 0 passed for a choice of False (and meant something else)
        if not any(value == c and type(value) is type(c) for c in choices):
            raise ValueError(f"{key}={value!r} is not allowed; choose one of {', '.join(map(repr, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise TypeError(f"{key} may not be null; expected {_type_name(tp)}")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise TypeError(f"{key}={value!r} has the wrong type; expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if value is None:  # a section whose keys are all commented out
            value = {}
        if not isinstance(value, dict):
            raise TypeError(f"{key} must be a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{key}={value!r} must be a number (float)")
        if value != value:  # NaN passes every range check (each comparison is false) and reaches the run
            raise ValueError(f"{key}={value!r} is not a number; give a finite value")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{key}={value!r} must be an integer")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{key}={value!r} must be true or false")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise TypeError(f"{key}={value!r} must be a string (quote it in YAML)")
        return value
    if tp in (list, dict):
        if not isinstance(value, tp):
            raise TypeError(f"{key}={value!r} must be a {tp.__name__}")
        return value
    raise AssertionError(f"unsupported annotation {tp} for {key}")


SGLANG_HEALTH_TIMEOUT = 10.0  # seconds a client waits on /health after a failed request (SGLangClient)
REWARD_MAX_BACKOFF_S = 60.0  # the longest wait between two attempts at a reward server (reward_models.py)


def is_remote(spec: str) -> bool:
    """Whether a reward spec names a reward server."""
    return spec.startswith(("http://", "https://"))
# Other names users know a setting by (`async` is a Python keyword, so not a field name).
ALIASES = {"rollout.async": "rollout.one_step_off"}
# Keys that were renamed: key -> what to write instead.
RENAMED = {"rollout.hf_fused_attention": "rollout.hf_compile (true -> attention, false -> false; auto now compiles "
                                         "the whole decode step)"}


def _build(cls: type, raw: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}.{key}" if prefix else key
        if full in ALIASES:
            alias, key, full = full, ALIASES[full].rsplit(".", 1)[-1], ALIASES[full]
            if key in raw:
                raise ValueError(f"{full} is set twice, also by its alias {alias}; keep one")
        if full in RENAMED:
            raise ValueError(f"config key '{full}' was renamed: use {RENAMED[full]}")
        if not isinstance(key, str):
            raise ValueError(f"{prefix or 'the config'}: the key {key!r} is not a name (YAML reads yes/no/on/off as "
                             f"booleans, ~ as null and digits as numbers; valid keys here: {', '.join(names)})")
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""
            raise ValueError(f"unknown config key '{full}'{hint} (valid keys here: {', '.join(names)})")
        kwargs[key] = _coerce(value, hints[key], full)
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"invalid config: {e}") from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        if node.get(part) is None:  # absent, or a section whose keys are all commented out
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ValueError(f"override '{dotted}': '{part}' is not a section")
    node[parts[-1]] = value


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, but a key twice in one mapping is an error: PyYAML keeps the last one without a
    word, so a config with two `rollout:` sections would drop every setting of the first."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: flattened by construct_mapping
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in lines:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"{key!r} is given twice in one mapping (first on line {lines[key]}); YAML "
                            "would keep only the last: merge them into one", key_node.start_mark)
                    lines[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: construct_mapping names it
                    continue
        return super().construct_mapping(node, deep)


# Numbers as YAML 1.2 reads them (PyYAML implements YAML 1.1): 1e-3 is a float (1.1: a string, as in a list of
# betas or a reward's weights, where no float field converts it), 010 is ten (1.1: octal 8), 1:30 is text (1.1:
# 90, base 60). Underscores between digits are kept (1_000_000).
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?[0-9][0-9_]*$|^0o[0-7]+$|^0x[0-9a-fA-F]+$"),
                                    list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    _FLOAT, re.compile(r"^[-+]?(\.[0-9][0-9_]*|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?$"
                       r"|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"), list("-+0123456789."))


def _yaml_int(loader, node) -> int:
    text = loader.construct_scalar(node)
    return int(text[2:], 8) if text.startswith("0o") else int(text, 16 if text.startswith("0x") else 10)


_StrictLoader.add_constructor(_INT, _yaml_int)


def _load_yaml(text):
    """A str, or an open file (whose name the errors then give)."""
    return yaml.load(text, Loader=_StrictLoader)


PATH_KEYS = ("model.path", "data.path", "eval.path", "algo.critic.path", "log.run_dir", "train.ds_config",
             "rollout.sglang.python")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read YAML `path` (may be None), apply `a.b=value` overrides (values parsed as YAML), validate."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"config file {path} is a directory; give the YAML file in it")
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            with path.open(encoding="utf-8") as f:
                raw = _load_yaml(f) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{path} is not valid YAML: {e}") from None
        except UnicodeDecodeError as e:  # its position is in the chunk the reader decoded: found in the whole file
            data, where = path.read_bytes(), e
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as whole:
                where = whole
            line = data.count(b"\n", 0, where.start) + 1
            raise ValueError(f"{path}:{line}: byte 0x{data[where.start]:02x} is not UTF-8 (file offset "
                             f"{where.start}); save the file as UTF-8") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the top level must be a mapping of sections (model:, data:, ...)")
        # A top-level `x-NAME:` holds YAML anchors for the sections to merge (`<<: *NAME`), as in docker compose
        # files: read through its aliases, so it is no setting of its own.
        raw = {k: v for k, v in raw.items() if not (isinstance(k, str) and k.startswith("x-"))}
        sections = [f.name for f in dataclasses.fields(Config)]
        for key in raw:
            if isinstance(key, str) and key not in sections:
                close = difflib.get_close_matches(key, sections, n=1)
                raise ValueError(f"{path}: unknown config section '{key}'"
                                 + (f"; did you mean '{close[0]}'?" if close else "")
                                 + f" (sections: {', '.join(sections)}; a top-level section that only holds YAML "
                                 "anchors is named x-SOMETHING)")
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override '{item}' must look like section.key=value")
        key, text = item.split("=", 1)
        try:
            value = _load_yaml(text) if text.strip() else ""
        except yaml.YAMLError as e:
            raise ValueError(f"override '{item}': the value is not valid YAML ({str(e).splitlines()[0]}); quote "
                             "it if it is a string") from None
        if (value is None or isinstance(value, str)) and "#" in text and text.strip()[:1] not in ("'", '"'):
            value = text.strip()  # a comment on a command line is text: "Be brief. #1 rule" lost its "#1 rule"
        elif value is not None and not isinstance(value, str) and _takes_text(tp := _field_type(key.strip())):
            try:
                _coerce(value, tp, key)
            except (TypeError, ValueError):  # text YAML reads as something else: data.system_prompt=Answer: 42
                value = text.strip()  # (a mapping), =no (false), =1.0 (a number)
        if dataclasses.is_dataclass(_field_type(key.strip())):  # a section: `train={seed: 3}` replaced the YAML's
            if not isinstance(value, dict):  # whole train section (lr, steps, ... back to their defaults, unsaid)
                raise ValueError(f"override '{item}': {key.strip()} is a section; set its keys ({key.strip()}.KEY="
                                 "VALUE), or give a mapping of them, which updates those keys only")
            try:
                items = list(_section_items(key.strip(), value))
            except ValueError as e:
                raise ValueError(f"override '{item}': {e}") from None
            for dotted, v in items:
                _set_dotted(raw, dotted, v)
            continue
        _set_dotted(raw, key.strip(), value)
    for dotted in PATH_KEYS:  # a shell leaves "~" in `log.run_dir=~/runs` (not a variable name) and YAML always does
        *sections, key = dotted.split(".")
        node = raw
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key].startswith("~"):
            node[key] = os.path.expanduser(node[key])
    return _build(Config, raw)


def _section_items(section: str, mapping: dict) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of each key a mapping given for `section` sets, through its subsections."""
    for key, value in mapping.items():
        dotted = f"{section}.{key}"
        if dataclasses.is_dataclass(_field_type(dotted)):
            if not isinstance(value, dict):  # `rollout={sglang: null}` would reset that section too
                raise ValueError(f"{dotted} is a section: give a mapping of its keys, not {value!r}")
            yield from _section_items(dotted, value)
        else:
            yield dotted, value


def _field_type(dotted: str) -> Any:
    """The annotation of config key `dotted` (section.key), None where there is no such key."""
    tp = Config
    for part in dotted.split("."):
        hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def _takes_text(tp: Any) -> bool:
    """Whether a field of annotation `tp` holds free text (str, or str among a union's members)."""
    return tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp))


def describe(cls: type = Config, prefix: str = "") -> str:
    """Every section and field with its default and doc, for `run.py --help`."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            lines.append(f"\n[{name}]")
            lines.append(describe(tp, name + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {name} = {default!r}  ({_type_name(tp)})\n      {f.metadata.get('help', '')}")
    return "\n".join(lines)
