"""ParallelDims: the single owner of process groups.

world = dp * sp. Expert parallelism (AutoEP) folds over dp, so `ep` divides dp and needs no
group of its own here. Nothing else in the project creates or reads a global group: code that
needs a collective receives the group from this object.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


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
    def build(cls, *, sp: int = 1, ep: int = 1, backend: str | None = None) -> "ParallelDims":
        """Initialise torch.distributed from the launcher's env (deepspeed/torchrun) and build groups."""
        import deepspeed

        if "RANK" not in os.environ:  # plain `python run.py`: a world of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(minutes=30))
        world, rank = dist.get_world_size(), dist.get_rank()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if world % sp:
            raise ValueError(f"parallel.sp={sp} must divide the world size {world}")
        dp = world // sp
        if dp % ep:
            raise ValueError(f"parallel.ep={ep} must divide the data-parallel size {dp}")
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dims = cls(world_size=world, rank=rank, local_rank=local_rank, dp=dp, sp=sp, ep=ep)
        # Ranks r*sp .. r*sp+sp-1 form one sp group; ranks with equal sp-rank form a dp group.
        # new_group is collective: every rank creates every group in the same order.
        for i in range(dp):
            group = dist.new_group(list(range(i * sp, (i + 1) * sp)))
            if rank // sp == i:
                dims.sp_group = group
        for j in range(sp):
            group = dist.new_group(list(range(j, world, sp)))
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
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    def all_gather_objects(self, obj, group=None) -> list:
        """Gather a picklable object from every rank of `group` (default: dp)."""
        group = group or self.dp_group
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def all_reduce_sum(self, values: list[float], group=None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, group=group or self.dp_group)
        return t.tolist()

    def barrier(self) -> None:
        dist.barrier()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
