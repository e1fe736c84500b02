"""The test suite's launch of a 1-step tiny GRPO job on 2 ranks: forked from tests/fork_server.py's post-import
process against spawned as processes (tests/spawn_ranks.py), alternating, in one run.

    python bench/launch_forked.py [--reps 3]

Prints each run's wall time, the medians and their ratio. The first forked run also starts the server (its imports),
reported apart: the suite pays it once.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import conftest  # noqa: E402  (the suite's launcher: run_ranks, the fork server)
    from data_tools.make_tiny_model import make_tiny_model
    from test_faults import job_overrides

    tmp = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    model = make_tiny_model(tmp / "model", arch="qwen2", seed=0)
    task = conftest.make_task(tmp / "task")
    t = time.perf_counter()
    conftest.fork_server()
    print(f"fork server ready in {time.perf_counter() - t:.1f} s (once per session)", flush=True)
    times: dict[str, list[float]] = {"forked": [], "spawned": []}
    for rep in range(args.reps):
        for mode in times:
            conftest.FORK = mode == "forked"
            job = [str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_grpo.yaml"),
                   *job_overrides(model, task, tmp / f"run-{mode}-{rep}"), "train.num_steps=1"]
            t = time.perf_counter()
            conftest.run_ranks(job, nproc=2)
            times[mode].append(time.perf_counter() - t)
            print(f"rep {rep} {mode}: {times[mode][-1]:.2f} s", flush=True)
    forked, spawned = (statistics.median(times[m]) for m in ("forked", "spawned"))
    print(f"median: forked {forked:.2f} s, spawned {spawned:.2f} s, forked/spawned {forked / spawned:.2f}")


if __name__ == "__main__":
    main()
