"""On CPU, a rank's intra-op threads work for its main thread only.

torch's CPU build runs its parallel ops on OpenMP (GNU libgomp). libgomp counts the threads of every team in the
process, and once that count exceeds the CPUs it may use, every parallel region's barrier stops spinning and
sleeps in a futex instead: each small op then pays a sleep and a wake-up. A second team appears as soon as any
other thread runs a parallel op, and it lives as long as that thread does. gloo's worker threads run some
(the copies inside collectives: ZeRO-3's parameter gathers and broadcasts), and so do the one-step-off rollout
thread and reward threads. With OMP_NUM_THREADS=2 on 2 cores, after a ZeRO-3 engine was built a 64-row batched
matmul of the decode attention took 120 us instead of 28, and the rollout of bench/vs_trl.py's 3.6M model took
0.75 s instead of 0.45 s, for the rest of the run (notes of issue 15).

`main_thread_only()` keeps the threads where they help. torch's process-wide thread count goes to 1 (each other
thread adopts it the first time it runs a parallel op, so it never starts a team), and the calling thread's own
OpenMP and MKL counts go back to the full number. Other threads still run their ops, on one thread each.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch


def _loaded_library(prefixes: tuple[str, ...]) -> str | None:
    """The path of a shared library already mapped into this process whose file name starts with a prefix."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if Path(path).name.startswith(prefixes):
            return path
    return None


def main_thread_only() -> str:
    """Give this process's intra-op threads to the calling thread alone (call it from the main thread, before
    the process group starts). Returns what was done, as one line for the log."""
    n = torch.get_num_threads()  # also runs the calling thread's one-time thread setup before it is changed
    if n == 1:
        return "1 thread: nothing to do"
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return f"{n} threads, left as they are (torch's parallel backend is not OpenMP)"
    path = _loaded_library(("libgomp", "libiomp", "libomp"))
    if path is None:
        return f"{n} threads, left as they are (torch's OpenMP library was not found among the loaded ones)"
    openmp = ctypes.CDLL(path)
    # MKL keeps a count of its own: torch's set_num_threads sets the process-wide one, and libtorch_cpu exports the
    # C entry point of the per-thread one where MKL is linked in (elsewhere there is no MKL count to set).
    torch_cpu = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    mkl = getattr(ctypes.CDLL(str(torch_cpu)), "MKL_Set_Num_Threads_Local", None) if torch_cpu.exists() else None
    torch.set_num_threads(1)
    openmp.omp_set_num_threads(ctypes.c_int(n))
    if mkl is not None:
        mkl(ctypes.c_int(n))
    if torch.get_num_threads() != n:  # not the OpenMP torch uses after all: undo
        torch.set_num_threads(n)
        return f"{n} threads, left as they are (setting {Path(path).name}'s count did not reach torch)"
    return (f"{n} threads for the main thread; other threads (gloo's, rollout and reward threads) run their ops "
            "on 1, so that their OpenMP teams do not oversubscribe the CPUs")
