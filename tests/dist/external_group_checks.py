"""Run on 1 rank by tests/test_multi_node.py: the weight-update group with processes outside the world (SGLang
engines) is made without splitting the trainer world's communicator. On GPUs DeepSpeed binds the world to the
rank's device, and torch then builds a new NCCL group with ncclCommSplit over the whole trainer world, which only
rank 0 enters: a hang. Here gloo stands in, the world bound to a device as DeepSpeed binds it on a GPU, and
torch's choice of a split source is recorded.

    python tests/spawn_ranks.py 1 tests/dist/external_group_checks.py
"""
import json

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from slime.distributed.parallel_dims import ParallelDims
from slime.utils.net import free_port

dims = ParallelDims.build()
world = c10d._get_default_group()
world.bound_device_id = torch.device("cpu", 0)  # as init_process_group(device_id=cuda:LOCAL_RANK) leaves it
consulted = []
real = c10d._get_split_source
c10d._get_split_source = lambda pg: consulted.append(str(pg)) or real(pg)
group = dims.new_external_group(host="127.0.0.1", port=free_port(), world_size=1, group_name="weights_test",
                                backend="gloo", timeout_s=30)
t = torch.ones(3)
dist.broadcast(t, src=0, group=group)
print("RESULT " + json.dumps({"split_sources_consulted": len(consulted), "bound": str(world.bound_device_id),
                              "broadcast": t.tolist()}), flush=True)
