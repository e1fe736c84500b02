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
import contextlib
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
    """Tensors of one dtype laid back to back in a uint8 tensor, with SGLang's slice metadata. `out`: the uint8
    tensor of exactly their size to lay them into (a view of a kept buffer); None makes a fresh one."""

    def __init__(self, named: NamedTensors, out: torch.Tensor | None = None):
        assert named and len({t.dtype for _, t in named}) == 1, "one non-empty dtype group per flat bucket"
        self.names = [n for n, _ in named]
        self.dtype = named[0][1].dtype
        self.shapes = [list(t.shape) for _, t in named]
        parts = [t.detach().contiguous().view(-1).view(torch.uint8) for _, t in named]
        self.flat = torch.cat(parts) if out is None else torch.cat(parts, out=out)  # (bytes,)
        self.metadata, offset = [], 0
        for name, t in named:
            size = t.numel() * t.element_size()
            self.metadata.append(types.SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                                                       end_idx=offset + size, numel=size))
            offset += size

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


class SharedBuffers:
    """Shared-memory uint8 buffers kept from one flat bucket to the next, one per dtype, grown to the largest
    bucket (rollout.sync_bucket_mb): a CPU server reads a flat bucket from shared memory, and a fresh one per
    bucket costs two copies plus page faults (torch.cat into new memory, then share_memory_ moving it into a
    new shared file) where refilling a kept one costs one copy. Refilling is safe because pushes are
    synchronous: a bucket's call returns once the server has loaded it, before the next bucket is laid in."""

    def __init__(self):
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def get(self, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the dtype's buffer (a view; the server rebuilds the view, not the whole file)."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[dtype] = _shared_empty(nbytes)
        return buf[:nbytes]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())


def split_by_dtype(bucket: NamedTensors, buffers: SharedBuffers | None = None) -> list[FlatBucket]:
    """One FlatBucket per dtype of `bucket`. With `buffers` (CPU tensors only), each is laid into the kept
    buffer of its dtype."""
    groups: dict[torch.dtype, NamedTensors] = {}
    for name, t in bucket:
        groups.setdefault(t.dtype, []).append((name, t))
    flats = []
    for dtype, named in groups.items():
        out = None
        if buffers is not None and all(t.device.type == "cpu" for _, t in named):
            out = buffers.get(dtype, sum(t.numel() * t.element_size() for _, t in named))
        flats.append(FlatBucket(named, out))
    return flats


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
    with _file_system_sharing(start_manager=not bucket.flat.is_cuda):
        buf = io.BytesIO()
        _HandlePickler(buf).dump({"flattened_tensor": bucket.flat, "metadata": bucket.metadata})
    return base64.b64encode(buf.getvalue()).decode()


@contextlib.contextmanager
def _file_system_sharing(start_manager: bool):
    """CPU tensors shared meanwhile go to a named file in shared memory: the default file-descriptor strategy
    only reaches our own children; a file name can be opened by the unrelated server process."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        if start_manager:
            _start_shm_manager_detached()
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def _shared_empty(nbytes: int) -> torch.Tensor:
    with _file_system_sharing(start_manager=True):
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


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
