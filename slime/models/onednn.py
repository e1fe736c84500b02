"""fp32 linear layers on CPU through oneDNN (torch's mkldnn backend) instead of MKL.

torch runs an fp32 `F.linear` on CPU through MKL's sgemm. On AMD CPUs MKL takes its AVX2 code path even where
the core has AVX-512: on this project's 2-core EPYC (Zen 5) a 1-thread sgemm reaches ~110 GFLOP/s while
oneDNN, which torch also ships, reaches 200-265 GFLOP/s on the same fp32 shapes (`python bench/cpu_matmul.py`).
Both are IEEE fp32 with fp32 accumulation; only the summation order differs (errors ~1e-6 relative).

`model.cpu_linear=auto` (the default) uses it on AMD CPUs only (`resolve_cpu_linear`): on Intel MKL takes its
AVX-512 path and is the faster of the two.

`use_onednn_linears(model)` points every nn.Linear of a model at `linear` below: forward and both backward
matmuls go through `torch.ops.mkldnn._linear_pointwise` (the op torch's own CPU inference passes use) for fp32
CPU inputs of at least MIN_MACS multiply-adds; anything else (fp64, bf16, GPU, a one-token decode of a few rows)
takes `fallback`, torch's own linear.
"""
from __future__ import annotations

import os
import types
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

# Below ~1M multiply-adds per call oneDNN's fixed cost (20-40 us) outweighs its faster kernel: for a 512x512
# weight that is under 4 rows, for 256x256 under 16. bench/cpu_matmul.py prints the crossover of a machine;
# SLIME_ONEDNN_MIN_MACS moves it (0 sends every fp32 CPU call to oneDNN, as some tests do).
MIN_MACS = int(os.environ.get("SLIME_ONEDNN_MIN_MACS", 1 << 20))
MIN_TRANSPOSE = 1 << 16  # elements: below it a compiled transpose's call (~20 us) costs more than it saves


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's vendor id ("AuthenticAMD", "GenuineIntel", ...) from /proc/cpuinfo; None where there is none."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def resolve_cpu_linear(requested: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """model.cpu_linear -> "onednn" or "torch". auto picks oneDNN on AMD CPUs, where torch's MKL takes its AVX2
    path (a 1-thread sgemm at ~110 GFLOP/s on Zen 5 against oneDNN's 200-265), and torch's F.linear elsewhere:
    on an AVX-512 Intel Xeon MKL's sgemm is 5-20% faster than oneDNN's on the trainer's shapes (the weight
    gradients most), and off x86 MKL is not there to be avoided. A property of the machine, not a timing, so
    every run on one machine makes the same choice (the two differ in summation order: fp32 rounding)."""
    if requested != "auto":
        return requested
    return "onednn" if cpu_vendor(cpuinfo) == "AuthenticAMD" and available() else "torch"


@torch.library.custom_op("slime::onednn_mm_nt", mutates_args=())
def _mm_nt_op(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


@_mm_nt_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[0])


def _mm_nt(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b.T (+ bias) on oneDNN; a (M, K), b (N, K), either may be a strided view. Under torch.compile the
    call goes through an opaque custom op: inductor's own lowering of the oneDNN op assumes frozen weights."""
    if torch.compiler.is_compiling():
        return _mm_nt_op(a, b, bias)
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


def _gathered(weight: torch.Tensor) -> torch.Tensor:
    """Under ZeRO-3 a saved weight that DeepSpeed has released again (a frozen one, saved as the parameter
    itself, across a checkpointed recompute) is gathered back, as DeepSpeed's own linear does."""
    status = getattr(weight, "ds_status", None)
    if status is not None and status.name == "NOT_AVAILABLE":
        weight.all_gather()
    return weight


class _Linear(torch.autograd.Function):
    """y = x @ weight.T + bias for 2-D x; the output is a fresh tensor (not a view), so callers may add to it
    in place as they would to F.linear's. `transpose(t)`, where given, is `t.t().contiguous()` by a faster copy
    (slime/models/fused.py's `transpose`) for the weight gradient's big operand."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                transpose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.transpose = bias is not None, transpose
        return _mm_nt(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        gx = _mm_nt(grad, _gathered(weight).t()) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:  # oneDNN copies a transposed first operand: transpose the narrower of the two
            transpose = ctx.transpose if ctx.transpose is not None and not torch.compiler.is_compiling() else None
            if grad.shape[1] <= x.shape[1]:
                gw = _mm_nt(_t(grad, transpose), x.t())
            else:
                gw = _t(_mm_nt(_t(x, transpose), grad.t()), transpose, copy=True)
        gb = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def _t(t: torch.Tensor, transpose: Callable[[torch.Tensor], torch.Tensor] | None, copy: bool = False) -> torch.Tensor:
    """t.T: through `transpose` where given, for a big t; else as a view (`copy`: torch's contiguous copy of it). A
    transposed first operand is copied by oneDNN itself, by torch's strided copy, 2-3x slower than inductor's tiled
    one at (4192, 512)."""
    if transpose is not None and t.numel() >= MIN_TRANSPOSE:
        return transpose(t)
    return t.t().contiguous() if copy else t.t()


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.numel() > 0 and x.numel() * weight.shape[0] >= MIN_MACS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fallback: Callable = F.linear, packed: torch.Tensor | None = None,
           transpose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """x @ weight.T + bias; `packed`: `pack(weight)`, used where oneDNN takes the call without grad; `transpose`:
    see _Linear."""
    if usable(x, weight):
        flat = x.reshape(-1, x.shape[-1])
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            out = _Linear.apply(flat, weight, bias, transpose)
        else:  # no graph to record (generation, no-grad scoring): the Function's bookkeeping is ~10 us a call
            out = _mm_nt(flat, weight if packed is None else packed, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    return fallback(x, weight, bias)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A copy of `weight` (out, in) in oneDNN's own blocked layout, for `linear(..., packed=)`. Only oneDNN's linear
    reads it (its shape is the weight's, its memory is not laid out as the shape says), and it is a copy: a write
    into the weight reaches it only when packed again. Where a weight streams from memory at every call (a decode
    step's 64-row matmuls) oneDNN then reads it in the layout its kernel wants: the hf engine's rollout of
    bench/vs_trl.py's 23.7M model 3.38 -> 3.08 s on a 2-core EPYC, bitwise the same tokens and logprobs (the row
    count is a hint; any count runs)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 64)


def use_onednn_linears(model: nn.Module, fallback: Callable | None = None,
                       transpose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
    """Point each plain nn.Linear's forward at `linear` (per module: nothing process-wide changes). `fallback` is
    the linear for the calls oneDNN does not take; None looks up F.linear at call time (which ZeRO-3 wraps).
    `transpose`: the backward's transposes (see _Linear). Returns the number of layers changed; 0 where oneDNN is
    missing from this torch build."""
    if not available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = types.MethodType(
                lambda self, x: linear(x, self.weight, self.bias, fallback or F.linear, transpose=transpose), module)
            count += 1
    return count
