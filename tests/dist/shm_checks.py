"""Run on 2 ranks by tests/test_multi_node.py (with LOCAL_SIZE=2, as DeepSpeed's launcher sets it): DeepSpeed's
CPU all-reduce maps a 66 MB file per rank in /dev/shm, which it never deletes (every run on a new port left them
for good); ParallelDims.build removes the names once every rank has opened them. Writes whether the files are still
there, and an all-reduce through DeepSpeed's shared memory after the removal, to OUT_DIR/rank{r}.json.

    LOCAL_SIZE=2 python tests/spawn_ranks.py 2 tests/dist/shm_checks.py OUT_DIR
"""
import json
import os
import sys
from pathlib import Path

import deepspeed.comm as ds_comm
import torch

from slime.distributed.parallel_dims import ParallelDims, leave

dims = ParallelDims.build()
name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}"
left = [(Path("/dev/shm") / f"{name}_{r}").exists() for r in range(dims.world_size)]
t = torch.full((4,), float(dims.rank + 1))
ds_comm.inference_all_reduce(t)  # through the mapped files
(Path(sys.argv[1]) / f"rank{dims.rank}.json").write_text(json.dumps({"left": left, "sum": t.tolist()}))
leave()
for r in range(dims.world_size):  # not left behind by this test either, whatever it found
    (Path("/dev/shm") / f"{name}_{r}").unlink(missing_ok=True)
