"""Run on 2 ranks by tests/test_multi_node.py: on a GPU node each rank takes its own device (LOCAL_RANK) before
the first collective. NCCL runs a collective on the current device: the config-agreement check ran before
set_device, so every rank ran it on cuda:0 and a multi-GPU launch failed at start. Here gloo stands in for NCCL
and torch.cuda's availability and set_device are stand-ins that record the calls.

    python tests/spawn_ranks.py 2 tests/dist/device_order_checks.py OUT_DIR
"""
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from slime.distributed.parallel_dims import ParallelDims

device, events = ["cuda:0 (the default, never set)"], []


def set_device(i: int) -> None:
    device[0] = f"cuda:{i}"
    events.append(f"set_device({i})")


def record(what: str, fn):
    def call(*args, **kwargs):
        events.append(f"{what} on {device[0]}")
        return fn(*args, **kwargs)
    return call


torch.cuda.is_available, torch.cuda.set_device = (lambda: True), set_device
deepspeed.init_distributed = record("init_distributed", deepspeed.init_distributed)
dims = ParallelDims.build(backend="gloo", agree=record("agree", lambda: dist.all_gather_object([None] * 2, 0)))
# a file per rank: two ranks printing to one pipe may interleave their lines
(Path(sys.argv[1]) / f"rank{dims.rank}.json").write_text(json.dumps(events))
dist.barrier()
