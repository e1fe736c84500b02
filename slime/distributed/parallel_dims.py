"""ParallelDims: the single owner of process groups.

world = dp * sp. Expert parallelism (DeepSpeed AutoEP) groups blocks of `ep` consecutive ranks, so `ep` divides the
world (with sp > 1 an ep group holds sp peers first); its groups are built by DeepSpeed when the first engine
starts, and handed out here (`expert_group`). Nothing else in the project creates or reads a global group: code that
needs a collective calls a method of this object or receives a group from it, the weight-update
group shared with rollout engines included (`new_external_group`).
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import itertools
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from slime.utils.net import free_port

logger = logging.getLogger(__name__)
ON_MAIN_READ_S = 30.0  # how long rank 0 gives the others to read its error before it raises it (they poll
# every half second: the margin is for a loaded machine)
_ON_MAIN_CALLS = itertools.count(1)  # ParallelDims.on_main's keys: every rank calls it as often, in one order


@dataclasses.dataclass
class ParallelDims:
    world_size: int
    rank: int
    local_rank: int
    dp: int
    sp: int = 1
    ep: int = 1
    dp_group: dist.ProcessGroup | None = None
    sp_group: dist.ProcessGroup | None = None

    @classmethod
    def build(cls, *, sp: int = 1, ep: int = 1, backend: str | None = None,
              timeout: datetime.timedelta = datetime.timedelta(minutes=30),
              agree: Callable[[], None] | None = None) -> "ParallelDims":
        """Initialise torch.distributed from the launcher's env (deepspeed/torchrun) and build groups. `agree`: a
        check every rank runs on the world before the groups (ranks that disagree on sp would wait out the timeout
        in new_group)."""
        import deepspeed

        if "RANK" not in os.environ:  # plain `python run.py`: a world of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():  # before the first collective: NCCL runs each on the current device
            torch.cuda.set_device(local_rank)
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            warn_build_locks()  # DeepSpeed builds its shared-memory all-reduce op here at a first run
            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
            _unlink_shm_buffer()
        if agree is not None:
            agree()
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % sp:
            raise ValueError(f"parallel.sp={sp} must divide the world size {world}")
        dp = world // sp
        if world % ep:  # DeepSpeed's ep groups: blocks of ep consecutive ranks (sp peers included)
            raise ValueError(f"parallel.ep={ep} must divide the world size {world} (ranks)")
        dims = cls(world_size=world, rank=rank, local_rank=local_rank, dp=dp, sp=sp, ep=ep)
        # Ranks r*sp .. r*sp+sp-1 form one sp group; ranks with equal sp-rank form a dp group.
        # new_group is collective: every rank creates every group in the same order.
        # Groups get the same timeout as the world (new_group would otherwise wait torch's default 30 min).
        for i in range(dp):
            group = dist.new_group(list(range(i * sp, (i + 1) * sp)), timeout=timeout)
            if rank // sp == i:
                dims.sp_group = group
        for j in range(sp):
            group = dist.new_group(list(range(j, world, sp)), timeout=timeout)
            if rank % sp == j:
                dims.dp_group = group
        return dims

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def world_group(self) -> dist.ProcessGroup:
        """Every rank (engines are shared across dp and sp alike)."""
        return dist.group.WORLD

    def expert_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel group of this rank: DeepSpeed's AutoEP builds it when the first engine starts
        (ranks r*ep .. r*ep+ep-1); None while ep = 1."""
        if self.ep == 1:
            return None
        from deepspeed.utils import groups

        return groups._get_expert_parallel_group(f"ep_size_{self.ep}")

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    @property
    def comm_device(self) -> torch.device:
        """Where tensors must live for a collective of the default backend (nccl: GPU, gloo: CPU)."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- collectives ------------------------------------------------------------------------------

    def all_gather_objects(self, obj, group=None) -> list:
        """Gather a picklable object from every rank of `group` (default: dp)."""
        group = group or self.dp_group
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def all_reduce_sum(self, values: list[float], group=None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, group=group or self.dp_group)
        return t.tolist()

    def all_reduce_tensors(self, values: dict[str, torch.Tensor], group=None, op=dist.ReduceOp.SUM) -> dict[str, float]:
        """Reduce a dict of scalar tensors (the same keys on every rank) in ONE collective; floats out."""
        keys = sorted(values)
        if not keys:
            return {}
        t = torch.stack([values[k].detach().to(self.comm_device, torch.float64).reshape(()) for k in keys])
        dist.all_reduce(t, op=op, group=group or self.dp_group)
        return dict(zip(keys, t.tolist()))

    def all_reduce_max(self, value: int, group=None) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group or self.dp_group)
        return int(t.item())

    def exchange_objects(self, outgoing: dict[int, Any], group=None) -> dict[int, Any]:
        """Send `outgoing[r]` to dp rank r (any picklable object) and return what each rank sent here.

        Point-to-point in effect: one all-to-all of pickled bytes, so each object travels once, to its
        destination only (unlike an all-gather, which hands every rank everything).
        """
        group = group or self.dp_group
        n = dist.get_world_size(group)
        blobs = [pickle.dumps(outgoing[r]) if r in outgoing else b"" for r in range(n)]
        send_sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64, device=self.comm_device)
        recv_sizes = torch.empty_like(send_sizes)
        dist.all_to_all_single(recv_sizes, send_sizes, group=group)
        send = torch.frombuffer(bytearray(b"".join(blobs)) or bytearray(1), dtype=torch.uint8)[:int(send_sizes.sum())]
        recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8, device=self.comm_device)
        dist.all_to_all_single(recv, send.to(self.comm_device), output_split_sizes=recv_sizes.tolist(),
                               input_split_sizes=send_sizes.tolist(), group=group)
        data, out, offset = recv.cpu().numpy().tobytes(), {}, 0
        for r, size in enumerate(recv_sizes.tolist()):
            if size:
                out[r] = pickle.loads(data[offset:offset + size])
            offset += size
        return out

    def barrier(self) -> None:
        dist.barrier()

    def on_main(self, what: str, fn: Callable[[], Any], *, poll_s: float = 0.5, say_every_s: float = 300.0) -> None:
        """Collective: `fn` runs on the main rank while the others wait for it outside the collectives' timeout
        (train.dist_timeout_minutes), which rank 0 writing a large model's files alone (an HF export of 60 GB)
        outlasts: they poll the launcher's store, saying every `say_every_s` what they wait for. An exception `fn`
        raises is raised on every rank, its message included (not a collective timeout on the others)."""
        if self.world_size == 1:
            fn()
            return
        store = dist.distributed_c10d._get_default_store()
        # per process, not per object: a process may build its dims again (run() called twice) on the same store,
        # whose keys of the earlier calls would answer at once
        key = f"slime/on_main/{next(_ON_MAIN_CALLS)}"
        if self.is_main:
            try:
                fn()
            except BaseException as e:
                store.set(key, f"{type(e).__name__}: {e}")
                # the store lives in this process: the others read the message before it ends with the error
                deadline = time.monotonic() + ON_MAIN_READ_S
                while store.add(f"{key}/read", 0) < self.world_size - 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise
            store.set(key, "")
            return
        start = said = time.monotonic()
        try:
            while not store.check([key]):
                time.sleep(poll_s)
                if time.monotonic() - said >= say_every_s:
                    said = time.monotonic()
                    logger.info("rank %d: waiting for rank 0 %s (%.0f min so far)", self.rank, what,
                                (said - start) / 60)
            error = store.get(key).decode()
            if error:
                store.add(f"{key}/read", 1)
        except (dist.DistError, RuntimeError) as e:  # its store went with it (killed, out of memory)
            raise RuntimeError(f"rank 0 ended while {what} (its store stopped answering: {type(e).__name__}); rank "
                               "0's log has the cause") from e
        if error:
            raise RuntimeError(f"rank 0 failed {what}: {error}")

    # -- groups shared with processes outside the world --------------------------------------

    def new_external_group(self, *, host: str, port: int, world_size: int, group_name: str, backend: str,
                           timeout_s: float) -> dist.ProcessGroup:
        """Become rank 0 of a group with processes outside our world (rollout engines join from their side).

        Mirrors SGLang's `init_custom_process_group` (a PrefixStore named after the group, identity rank
        mapping) but hosts the TCPStore itself: under torchrun, `rendezvous("tcp://...")` would connect
        to the launcher's store (TORCHELASTIC_USE_AGENT_STORE) instead of serving the engines. torch has
        no public call for a group outside the default world, hence the c10d internals, kept here only.
        """
        from torch.distributed.distributed_c10d import (Backend, PrefixStore, _get_default_group,
                                                        _new_process_group_helper, _world)

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        # DeepSpeed binds the trainer world to this rank's GPU; torch then makes a new NCCL group by splitting the
        # world's communicator (ncclCommSplit), which every trainer rank must enter: this rank alone would wait
        # there forever. Unbound while the group is made, it gets a communicator of its own.
        default = _get_default_group()
        bound, default.bound_device_id = default.bound_device_id, None
        try:
            pg, _ = _new_process_group_helper(world_size, 0, [], Backend(backend), PrefixStore(group_name, store),
                                              group_name=group_name, backend_options=None, timeout=timeout)
        finally:
            default.bound_device_id = bound
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        return pg

    def destroy_group(self, group: dist.ProcessGroup) -> None:
        dist.destroy_process_group(group)


def shm_buffer_path(rank: int) -> Path:
    """The file DeepSpeed's CPU all-reduce maps for `rank` (when every rank is on this node), named after the
    rendezvous address and port."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def warn_build_locks() -> None:
    """DeepSpeed compiles some ops at their first use (its CPU all-reduce, CPU Adam for an offloaded optimizer,
    fused Adam on a GPU) under a lock file in torch's extensions folder; a build killed midway leaves the lock, and
    every later run then waits on it forever, saying nothing. Say where, before a wait may start."""
    from torch.utils.cpp_extension import _get_build_directory  # the folder torch builds each op in

    try:
        root = Path(_get_build_directory("", verbose=False))
    except Exception:  # noqa: BLE001  (a private function: no word beats a failed run)
        return
    for lock in sorted(root.glob("*/lock")):
        logger.warning("%s exists: another process is building DeepSpeed's op %s, or a killed build left it; with "
                       "no build running, this run waits on it forever: delete the file", lock, lock.parent.name)


def _unlink_shm_buffer() -> None:
    """DeepSpeed maps a 66 MB file per rank in /dev/shm and never deletes it: every run on a new port left
    132 MB of RAM behind for good (the test suite's jobs 4 GB). Once every rank has opened its peers' files (the
    barrier: each does so inside init_distributed), the names go; the mappings stay until the process ends."""
    dist.barrier()
    shm_buffer_path(dist.get_rank()).unlink(missing_ok=True)


def leave() -> None:
    """Leave torch.distributed cleanly at the end of a program: every rank waits for the others, then the
    groups are destroyed. A rank that exits while the others still talk to it, or with gloo's threads
    still running, can abort in their destructors ("terminate called without an active exception").

    Then the objects alive now are frozen out of the garbage collector: the interpreter's teardown otherwise
    walks the half million that torch, transformers and DeepSpeed hold, 1.2 s of every exit on the CI machine
    (atexit callbacks still run; a process that ends frees its memory whole)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.freeze()
