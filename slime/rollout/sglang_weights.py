"""Weights out to SGLang: flattened buckets passed by handle, or broadcast over an update group.

Colocated (`/update_weights_from_tensor`, load_format "flattened_bucket"): for each TP rank the
server takes a base64 string of what SGLang's `MultiprocessingSerializer.serialize` writes, a
`ForkingPickler` pickle in which tensors travel by handle (a shared-memory file on CPU, a CUDA IPC
handle on GPU), not by value. We write the same bytes without importing SGLang, whose Python may not
be the trainer's: the object is `{"flattened_tensor": uint8 tensor, "metadata": [...]}` with the
metadata as `types.SimpleNamespace` records, which the server's SafeUnpickler admits and reads by
attribute exactly as it reads its own `FlattenedTensorMetadata`. CUDA tensors name their device by
UUID, as SGLang's patched reduction does, so the server finds the GPU whatever its device order.
The sender must keep the flat tensor alive until the server has answered.

Disaggregated (`/update_weights_from_distributed`): trainer rank 0 is rank 0 of a process group it
shares with every engine rank; each bucket is one broadcast of a flat uint8 tensor that the server
receives with `FlattenedTensorBucket.empty(names, dtypes, shapes)`, so tensors are laid out back to
back in the order of `names`. Buckets are split by dtype so every slice stays aligned.
"""
from __future__ import annotations

import base64
import io
import os
import sys
import types
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler
from torch.multiprocessing import reductions

from slime.rollout.engine import NamedTensors

_DEVICE_ARG = 6  # position of the device index in reduce_tensor's CUDA rebuild arguments (SGLang uses the same)


class FlatBucket:
    """Tensors of one dtype laid back to back in a uint8 tensor, with SGLang's slice metadata."""

    def __init__(self, named: NamedTensors):
        assert named and len({t.dtype for _, t in named}) == 1, "one non-empty dtype group per flat bucket"
        self.names = [n for n, _ in named]
        self.dtype = named[0][1].dtype
        self.shapes = [list(t.shape) for _, t in named]
        self.flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in named])  # (bytes,)
        self.metadata, offset = [], 0
        for name, t in named:
            size = t.numel() * t.element_size()
            self.metadata.append(types.SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                                                       end_idx=offset + size, numel=size))
            offset += size

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


def split_by_dtype(bucket: NamedTensors) -> list[FlatBucket]:
    groups: dict[torch.dtype, NamedTensors] = {}
    for name, t in bucket:
        groups.setdefault(t.dtype, []).append((name, t))
    return [FlatBucket(named) for named in groups.values()]


def _reduce_tensor(t: torch.Tensor):
    rebuild, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        uuid = str(torch.cuda.get_device_properties(t.device).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1:])
    return rebuild, args


class _HandlePickler(ForkingPickler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dispatch_table[torch.Tensor] = _reduce_tensor


def serialize_flat_bucket(bucket: FlatBucket) -> str:
    """The base64 payload one SGLang TP rank loads with load_format='flattened_bucket'."""
    previous = torch.multiprocessing.get_sharing_strategy()
    # CPU tensors: the default file-descriptor strategy only reaches our own children; a file
    # name in shared memory can be opened by the unrelated server process.
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        if not bucket.flat.is_cuda:
            _start_shm_manager_detached()
        buf = io.BytesIO()
        _HandlePickler(buf).dump({"flattened_tensor": bucket.flat, "metadata": bucket.metadata})
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode()


_shm_manager_started = False


def _start_shm_manager_detached() -> None:
    """Start torch's shared-memory manager with its stdio on /dev/null.

    torch starts this daemon on the first file_system share and it inherits our stdout/stderr; it
    lives while any process holds a handle it served (the SGLang server does, until it exits), so
    whoever waits for our output to close (a launcher, a test harness) would wait for the server.
    """
    global _shm_manager_started
    if _shm_manager_started:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_RDWR)
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    try:
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        torch.zeros(1).share_memory_()  # the file_system strategy is active: this starts the manager
        _shm_manager_started = True
    finally:
        for fd, copy in zip((0, 1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
