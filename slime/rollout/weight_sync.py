"""Gather ZeRO-3 partitioned parameters (under ZeRO-1/2 they are whole already) in size-bounded buckets,
named as in the checkpoint.

Every rank must iterate the same buckets (the gather is a collective), so bucket boundaries depend
only on parameter sizes, never on the rank (AutoEP expert tensors have the same local size on every rank). Each yielded bucket is a list of (checkpoint name, full
tensor) copies, safe to keep after the gather context exits; `to_checkpoint` (the model adapter)
renames and reshapes them, e.g. a fused MoE expert tensor into one tensor per expert.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import deepspeed
import torch

from slime.rollout.engine import NamedTensors


def iter_gathered_buckets(units: Iterable[list[tuple[str, torch.Tensor]]], *, bucket_bytes: int,
                          to_checkpoint: Callable[[NamedTensors], NamedTensors] | None = None
                          ) -> Iterator[NamedTensors]:
    """Buckets of at least `bucket_bytes` (the last may be smaller). A unit (one parameter, or the tensors of
    one expert-parallel layer, which convert together) never straddles two buckets, and a bucket closes after
    the unit that makes it reach the size, so no bucket exceeds it by more than its last unit."""
    bucket, size = [], 0
    for unit in units:
        bucket += unit
        size += sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for _, p in unit)
        if size >= bucket_bytes:
            yield _gather(bucket, to_checkpoint)
            bucket, size = [], 0
    if bucket:
        yield _gather(bucket, to_checkpoint)


def _gather(bucket: list, to_checkpoint) -> NamedTensors:
    params = [p for _, p in bucket]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        named = [(name, p.data.detach().clone()) for name, p in bucket]
    return to_checkpoint(named) if to_checkpoint is not None else named
