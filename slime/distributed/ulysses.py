"""Ulysses sequence parallelism over packed rows, with samples kept apart.

A packed micro-batch is one row of T tokens (padded to a multiple of sp by a pad segment that is its
own document). Each of the sp ranks of a group runs the model on a contiguous shard of T/sp tokens;
only attention needs the whole row, so around it the shards trade places with heads:

    q, k, v  (1, H, T/sp, D)  --all-to-all-->  (1, H/sp, T, D)  --packed attention-->  (1, T, H/sp, D)
    --all-to-all-->  (1, T/sp, H, D)

The packed attention (packed_sdpa on CPU, flash-attn varlen on GPU) gets the cu_seqlens of the
WHOLE row, so a sample never attends across its border even when a border falls inside a shard.
DeepSpeed's ALST attention (UlyssesSPAttentionHF) drops masks and requires 1-row position ids in
the attention kwargs (mrope rows do not fit), so this wrapper is our own; the all-to-all is torch's
autograd-aware one. KV heads fewer than sp are repeated (each rank then holds one).

Logprobs are computed on each rank's shard and all-gathered (`gather_shards`); the backward of that
gather keeps each rank's own slice, so every sp peer computes the same full-row loss and gradients
flow only through the rank that produced each value.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from transformers import AttentionInterface


@dataclasses.dataclass(frozen=True)
class SequenceShard:
    """This rank's place in its sp group."""
    group: dist.ProcessGroup
    rank: int
    size: int

    def bounds(self, length: int) -> tuple[int, int]:
        """[start, end) of this rank's shard of a row of `length` tokens (a multiple of size)."""
        assert length % self.size == 0, f"row of {length} tokens is not padded to a multiple of sp={self.size}"
        local = length // self.size
        return self.rank * local, (self.rank + 1) * local


def check_heads(num_heads: int, num_kv_heads: int, sp: int, model_path: str) -> None:
    """Heads must split evenly over the sp ranks (KV heads may also be fewer than sp and repeated)."""
    if num_heads % sp:
        raise ValueError(f"parallel.sp={sp} must divide the number of attention heads ({num_heads}) of "
                         f"{model_path}; pick an sp that divides it")
    if num_kv_heads % sp and sp % num_kv_heads:
        raise ValueError(f"parallel.sp={sp} and the {num_kv_heads} key/value heads of {model_path} must divide "
                         "one another (kv heads are split over sp ranks, or repeated when fewer)")


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single in equal chunks, differentiable: the gradient goes back by the same exchange (chunk j
    of the output came from rank j, so chunk j of its gradient goes to rank j). torch's own
    (torch.distributed.nn.functional.all_to_all_single) is deprecated and warned on every call."""

    @staticmethod
    def forward(ctx, send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        send = send.contiguous()
        recv = torch.empty_like(send, memory_format=torch.contiguous_format)
        dist.all_to_all_single(recv, send, group=group)
        return recv

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()  # (autograd hands it in any layout; the exchange reads and writes flat chunks)
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, sp: int) -> torch.Tensor:
    """(1, H, T/sp, D) sequence shard of all heads -> (1, H/sp, T, D) all tokens of this rank's heads."""
    b, h, t, d = x.shape
    send = x.reshape(b, sp, h // sp, t, d).transpose(0, 1).contiguous()  # chunk i goes to rank i
    recv = _AllToAll.apply(send, group)  # chunk j: rank j's tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * t, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, sp: int) -> torch.Tensor:
    """(1, T, H/sp, D) all tokens of this rank's heads -> (1, T/sp, H, D) this rank's tokens, all heads."""
    b, t, h, d = x.shape
    send = x.reshape(b, sp, t // sp, h, d).transpose(0, 1).contiguous()  # token chunk i goes to rank i
    recv = _AllToAll.apply(send, group)  # chunk j: rank j's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, t // sp, sp * h, d)


class _InnerView:
    """An attention module as the wrapped function sees it: the same module, with a config that names that
    function. flash-attn's forward passes `module.config._attn_implementation` on to choose its kernels, and the
    wrapper's own name is not one it knows."""

    def __init__(self, module: torch.nn.Module, inner: str):
        config = copy.copy(module.config)
        config._attn_implementation = inner
        self.__dict__.update(_module=module, config=config)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def register_ulysses_attention(inner: str, shard: SequenceShard) -> str:
    """Register (once per name) an attention function that wraps the registered `inner` one; returns its name.
    The name never says "flash": transformers takes any such name for a flash kernel to import by that name (and
    fails at load). As a custom name it also gets no attention mask, as packed rows need (cu_seqlens say where
    samples end)."""
    name = f"ulysses_sp{shard.size}_{inner.replace('flash', 'fa')}"
    inner_fn = AttentionInterface()[inner]
    sp, group = shard.size, shard.group
    views: dict[int, _InnerView] = {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        if key.shape[1] < sp:  # fewer kv heads than ranks: each rank gets (a copy of) one
            key = key.repeat_interleave(sp // key.shape[1], dim=1)
            value = value.repeat_interleave(sp // value.shape[1], dim=1)
        q, k, v = (_seq_to_heads(t, group, sp) for t in (query, key, value))
        view = views.get(id(module))
        if view is None or view._module is not module:
            view = views[id(module)] = _InnerView(module, inner)
        out, _ = inner_fn(view, q, k, v, attention_mask, **kwargs)
        return _heads_to_seq(out, group, sp), None

    AttentionInterface.register(name, attention)
    return name


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.start, ctx.count = sum(counts[:rank]), counts[rank]
        width = max(counts)
        padded = torch.zeros(width, dtype=local.dtype, device=local.device)
        padded[:local.shape[0]] = local
        out = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(out, padded, group=group)
        return torch.cat([o[:n] for o, n in zip(out, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every peer computed the same loss from the gathered values: each rank's share of the gradient is
        # the slice it produced, and no other rank's copy must be added to it.
        return grad[ctx.start:ctx.start + ctx.count], None, None, None


class _SumShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = local.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None  # as _GatherShards: every peer's loss is the same; each keeps its own part's gradient


def sum_shards(local: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """The sum of the sp peers' `local` tensors, on each of them, differentiable in this rank's own term."""
    return _SumShards.apply(local, shard.group)


def gather_shards(local: torch.Tensor, counts: list[int], shard: SequenceShard) -> torch.Tensor:
    """(counts[rank],) per-rank pieces -> (sum(counts),) in rank order, on every rank of the sp group."""
    return _GatherShards.apply(local, counts, shard.rank, shard.group)
