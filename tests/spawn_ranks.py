"""The test suite's launcher: `python tests/spawn_ranks.py NPROC SCRIPT [ARGS ...]` starts NPROC ranks of
`python SCRIPT ARGS` on this machine, as DeepSpeed's launcher does for run.sh: each rank gets RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a free port, held by this process for the job's
life, so nothing else takes it before rank 0's store listens on it), and rank 0 serves the store.

Why not torchrun: its agent imports torch before it starts any rank, ~2.7 s of every launch on the CI machine,
and the suite launches over a hundred jobs. torchrun itself stays tested (tests/test_multi_node.py).

As the launchers do: when a rank fails, the others get SIGTERM, then SIGKILL after a grace period; the exit
code is that of the first rank to fail (1 for one killed by a signal). A SIGTERM or SIGINT to this process
goes to every rank, and the ranks die with it if it is killed (PR_SET_PDEATHSIG), so a test's timeout
leaves no rank behind."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slime.utils.net import reserved_port  # noqa: E402  (stdlib only: no torch import in the launcher)

GRACE_S = 30  # torchrun's and DeepSpeed's launchers wait about as long before SIGKILL


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main() -> int:
    nproc, args = int(sys.argv[1]), sys.argv[2:]
    with reserved_port() as port:
        return launch(nproc, lambda rank: subprocess.Popen(
            [sys.executable, *args], env=dict(os.environ, **rank_env(rank, nproc, port)), preexec_fn=die_with_parent))


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def launch(nproc: int, start: Callable[[int], subprocess.Popen]) -> int:
    """Start ranks 0..nproc-1 with `start(rank)` (a Popen, or anything with its poll, send_signal, wait and kill:
    tests/fork_server.py's forked ranks) and wait for them; returns the job's exit code."""
    procs = [start(rank) for rank in range(nproc)]

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            break
        time.sleep(0.05)
    if not failed:
        return 0
    rank, code = failed[0]
    print(f"spawn_ranks: rank {rank} exited with code {code}; stopping the others", file=sys.stderr, flush=True)
    forward(signal.SIGTERM, None)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return code if code > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
