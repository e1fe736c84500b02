"""Run on 2 ranks by tests/test_faults.py: work rank 0 does alone (an HF export, a checkpoint's publication) may
outlast the collectives' timeout while the other ranks wait (dims.on_main), where a barrier in its place times
out; an error rank 0 meets there is raised on every rank with its message.

    python tests/spawn_ranks.py 2 tests/dist/on_main_checks.py OUT_DIR
"""
import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    import torch

    from slime.distributed.parallel_dims import ParallelDims


def main() -> None:
    out = Path(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    dims = ParallelDims.build()
    short = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=1))
    result = {}
    dims.on_main("writing a slow file", lambda: time.sleep(2), say_every_s=0.5)  # not bound by any group's timeout
    dims.barrier()
    result["waited"] = True

    def full_disk():
        raise OSError(28, "No space left on device")

    try:
        dims.on_main("writing the HF export to /x", full_disk)
    except (OSError, RuntimeError) as e:
        result["error"] = f"{type(e).__name__}: {e}"
    dims.barrier()

    # dims built again in the same process (run() called twice): its calls must not meet the keys of the first
    again, marker = ParallelDims.build(), out / "written"

    def slow_write():
        time.sleep(1)
        marker.write_text("done")

    again.on_main("writing again", slow_write)
    result["waited_again"] = marker.is_file()
    again.barrier()

    if dims.is_main:  # such a wait in a barrier of a 1 s timeout: the other rank's gives up
        time.sleep(3)
    try:
        torch.distributed.barrier(group=short)
        result["barrier"] = "passed"
    except RuntimeError as e:
        result["barrier"] = str(e)[:300]
    (out / f"rank{dims.rank}.json").write_text(json.dumps(result))

    # Rank 0 fails and its process ends at once, as a run's does, its store with it: rank 1, polling slowly, read a
    # store that no longer answered and said a collective had timed out. It reads rank 0's message now.
    try:
        dims.on_main("publishing checkpoint step_2", full_disk, poll_s=2)
    except (OSError, RuntimeError) as e:
        if not dims.is_main:
            (out / "rank1_last.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    os._exit(0)  # no teardown: rank 0's end is the point


if __name__ == "__main__":
    main()
