"""Gather ZeRO-3 partitioned parameters in size-bounded buckets, named as in the HF model.

Every rank must iterate the same buckets (the gather is a collective). Each yielded bucket is a
list of (hf_name, full tensor) copies, safe to keep after the gather context exits.
"""
from __future__ import annotations

from typing import Iterator

import deepspeed
import torch.nn as nn

from slime.rollout.engine import NamedTensors


def iter_gathered_buckets(module: nn.Module, *, bucket_bytes: int, prefix: str = "hf.") -> Iterator[NamedTensors]:
    bucket, size = [], 0
    for name, p in module.named_parameters():
        bucket.append((name.removeprefix(prefix), p))
        size += getattr(p, "ds_numel", p.numel()) * p.element_size()
        if size >= bucket_bytes:
            yield _gather(bucket)
            bucket, size = [], 0
    if bucket:
        yield _gather(bucket)


def _gather(bucket: list) -> NamedTensors:
    params = [p for _, p in bucket]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return [(name, p.data.detach().clone()) for name, p in bucket]
