"""main_thread_only(): with OMP_NUM_THREADS=2, the main thread keeps its 2 OpenMP and MKL threads, and a parallel
op in another thread (as gloo's worker threads run inside collectives) runs on that thread alone instead of
starting an OpenMP team of its own, whose extra worker would make libgomp count more threads than CPUs and put
every barrier to sleep. The control (no call) shows the extra worker appearing."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import ctypes, json, os, sys, threading
from pathlib import Path
import torch
from slime.utils.cpu_threads import main_thread_only
said = main_thread_only() if sys.argv[1] == "main-only" else ""
lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
mkl = getattr(lib, "MKL_Get_Max_Threads", lambda: None)
tasks = lambda: len(os.listdir("/proc/self/task"))
torch.ones(1 << 20).mul_(2)  # the main thread's team exists before the count
before, seen, ready, leave = tasks(), {}, threading.Event(), threading.Event()
def other():
    torch.ones(1 << 20).mul_(2)  # above the grain size: parallel where the thread may use 2 threads
    seen.update(torch=torch.get_num_threads(), mkl=mkl(), added=tasks() - before - 1)  # - 1: this thread
    ready.set()
    leave.wait()
thread = threading.Thread(target=other)
thread.start()
ready.wait()
torch.ones(1 << 20).mul_(2)
print(json.dumps({"said": said, "main": {"torch": torch.get_num_threads(), "mkl": mkl()}, "other": seen}))
leave.set()
thread.join()
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task counts the threads")


def run(mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_other_threads_run_on_one_thread_and_start_no_team():
    got = run("main-only")
    assert got["said"].startswith("2 threads for the main thread"), got["said"]
    assert got["main"]["torch"] == 2 and got["main"]["mkl"] in (2, None), got
    assert got["other"] == {"torch": 1, "mkl": got["other"]["mkl"], "added": 0}, got
    assert got["other"]["mkl"] in (1, None), got
    control = run("as-is")
    assert control["other"]["torch"] == 2 and control["other"]["added"] == 1, control  # a second team's worker


def test_one_thread_is_left_alone():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", "from slime.utils.cpu_threads import main_thread_only; "
                          "import torch; print(main_thread_only(), torch.get_num_threads())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "1 thread: nothing to do 1"
