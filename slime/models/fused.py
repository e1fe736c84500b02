"""Fused elementwise chains for training on CPU (train.fuse_elementwise).

In a decoder layer's forward and backward on CPU, the matmuls run near the machine's peak, and what is left is
HF's eager elementwise chains: RMSNorm is ~5 ops forward and ~10 backward, each a pass over the (tokens,
hidden) activations through fresh memory; rotary embedding slices, negates and concatenates q and k; SwiGLU
multiplies silu(gate) by up. On the 23.7M model of bench/vs_trl.py they take ~2 s of a 6.4 s forward + backward
(the matmuls 4.3 s). Here each chain is one small function compiled by torch.compile (inductor, dynamic shapes),
forward and backward, so each runs as one or two fused loops:

- `rms_norm`: HF's formula (normalised in fp32, rounded to the input's dtype, times the weight);
- `rotary`: HF's apply_rotary_pos_emb (q * cos + rotate_half(q) * sin, and k);
- `silu_mul`: silu(gate) * up.

`fuse_elementwise(model)` points the layers of Llama, Qwen2 and Qwen3 models at them, per module instance
(nothing process-wide changes): RMSNorm forwards, MLP forwards, and the attention forward, which is HF's own
function with `apply_rotary_pos_emb` looked up in a namespace where it is `rotary`. The submodules are still
called as modules, so ZeRO-3's parameter gathers and hooks see the same calls as before. The graphs are small
and shape-generic: one compile each (grad and no-grad; the norm two, for the layers' and Qwen3's per-head norms),
reused by every layer, micro-batch length, step and model width, and inductor caches them on disk for later runs.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half  # Qwen2's and Qwen3's are the same

FAMILIES = ("llama", "qwen2", "qwen3")
NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP")
ATTENTIONS = ("LlamaAttention", "Qwen2Attention", "Qwen3Attention")
MIN_HIDDEN = 256  # auto: below it, the compile (seconds) costs more than a short run's fused chains give back
SILUS = ("SiLU", "SiLUActivation")  # torch's, and transformers' ACT2FN["silu"]


@torch.compile(dynamic=True)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@torch.compile(dynamic=True)
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@torch.compile(dynamic=True)
def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@torch.compile(dynamic=True)
def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def transpose(t: torch.Tensor) -> torch.Tensor:
    """t.t().contiguous() for a 2-D t: inductor's copy goes tile by tile, torch's strided one row by row (a column
    of the source at a time: 2-3x slower at (4192, 512) on CPU). For the oneDNN linears' weight gradients: no
    gradient flows through it, so it gets a detached tensor without grad (its one graph then serves a gradient, a
    saved activation that requires grad and a view alike; each of those was a graph of its own)."""
    with torch.no_grad():
        return _transpose(t.detach())


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's apply_rotary_pos_emb, same signature. HF's q and k (B, H, T, D) are views of token-major (B, T, H, D)
    projections; computed in that layout, the compiled graphs read and write contiguous memory, and the gradients
    arriving from packed attention (token-major too) need no copy into another layout (two copies of q and two of
    k per layer in backward otherwise)."""
    if unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4:
        q, k = _rotary(q.transpose(1, 2), k.transpose(1, 2), cos.unsqueeze(2), sin.unsqueeze(2))
        return q.transpose(1, 2), k.transpose(1, 2)
    return _rotary(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Without grad, a trained weight and a frozen one (the reference model's) share one graph: torch.compile guards
    # on requires_grad, and each variant counts against its limit of graphs per function.
    # With grad, the weight goes in as a view: Dynamo takes a parameter's sizes as constants, so each model width
    # would compile (and count against the limit) a graph of its own.
    weight = self.weight.view(-1) if torch.is_grad_enabled() else self.weight.detach()
    return rms_norm(x, weight, self.variance_epsilon)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


@functools.lru_cache(maxsize=None)
def _attention_forward(hf_forward: types.FunctionType) -> types.FunctionType:
    """HF's attention forward with `apply_rotary_pos_emb` resolved to `rotary` (its own module's globals, but that
    one name)."""
    namespace = dict(hf_forward.__globals__, apply_rotary_pos_emb=rotary)
    fn = types.FunctionType(hf_forward.__code__, namespace, hf_forward.__name__, hf_forward.__defaults__,
                            hf_forward.__closure__)
    fn.__kwdefaults__ = hf_forward.__kwdefaults__
    return fn


def unsupported(model: nn.Module) -> str | None:
    """Why the fused chains cannot run in this model (None: they can)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model type {model_type!r} is not one of {', '.join(FAMILIES)}"
    for m in model.modules():
        name = type(m).__name__
        if name in MLPS and type(getattr(m, "act_fn", None)).__name__ not in SILUS:
            return f"the MLP's activation is {type(getattr(m, 'act_fn', None)).__name__}, not SiLU"
        if name in ATTENTIONS:
            forward = type(m).forward
            if not isinstance(forward, types.FunctionType) or "apply_rotary_pos_emb" not in forward.__code__.co_names:
                return f"{name}.forward does not call apply_rotary_pos_emb (a transformers version not built for)"
    return None


@torch.compile(dynamic=True)
def _probe(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * F.silu(x)


@functools.lru_cache(maxsize=None)
def compiler_works() -> str | None:
    """Compile and run a chain like the fused ones (a reduction and elementwise ops), forward and backward, on tiny
    tensors. Returns why not where that fails (no C++ compiler for inductor, say). The fused functions themselves
    compile at their first training call, so each graph has the sizes and layouts of real calls: compiled here on
    a probe's, Dynamo's guards (a parameter's constant sizes, size-1 dims, views' bases, inductor's size ranges)
    made the training step compile most of them again (tests/test_fused.py counts them)."""
    try:
        x, w = torch.randn(3, 8, requires_grad=True), torch.ones(8, requires_grad=True)
        _probe(x, w).sum().backward()
    except Exception as e:  # inductor raises many kinds (CppCompileError, InvalidCxxCompiler, BackendCompilerFailed)
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    return None


def fuse_elementwise(model: nn.Module) -> int:
    """Point the RMSNorm, MLP and attention modules of `model` (a model `unsupported` accepts) at the fused chains.
    Returns the number of modules changed."""
    why = unsupported(model)
    if why is not None:
        raise ValueError(f"train.fuse_elementwise: {why}")
    count = 0
    for m in model.modules():
        name = type(m).__name__
        if name in NORMS:
            m.forward = types.MethodType(_norm_forward, m)
        elif name in MLPS:
            m.forward = types.MethodType(_mlp_forward, m)
        elif name in ATTENTIONS:
            m.forward = types.MethodType(_attention_forward(type(m).forward), m)
        else:
            continue
        count += 1
    return count


def resolve(setting: bool | str, model: nn.Module, device: torch.device) -> str | None:
    """train.fuse_elementwise (True, False or "auto") for this model and device -> None where the fused chains are
    to run, else why not (True raises where they cannot)."""
    if setting is False:
        return "train.fuse_elementwise=false"
    hidden = model.config.get_text_config().hidden_size
    why = (f"built and tested on CPU; this run is on {device.type}" if device.type != "cpu" else unsupported(model))
    if why is None and setting == "auto" and hidden < MIN_HIDDEN:
        why = f"hidden size {hidden} < {MIN_HIDDEN}: activations this small gain less than the compile costs"
    if why is None:
        why = compiler_works()
        why = None if why is None else f"torch.compile failed on a probe ({why})"
    if why is not None and setting is True:
        raise ValueError(f"train.fuse_elementwise=true: {why}; use train.fuse_elementwise=auto or false")
    return why
