"""glibc malloc settings for training on CPU: keep freed memory in the process between steps.

A CPU step allocates and frees the same activations, gradients and cache buffers every step, many of them
hundreds of kB to tens of MB. glibc's defaults hand such memory back to the kernel: a chunk above the mmap
threshold (128 kB at start, raised dynamically up to the size of the largest freed mmap chunk, 32 MB at most)
is unmapped on free, and free memory at the top of the heap beyond the trim threshold (twice the mmap
threshold) is trimmed. The next step then page-faults the same bytes back in, zeroed by the kernel, page by page
(~10 us of system time per fault in this project's VMs). With mmap off (M_MMAP_MAX 0: every allocation comes
from the heap) and trimming off, those buffers are reused instead: on the 23.7M model of bench/vs_trl.py a
ZeRO-3 training step went from 300,000 page faults and 2-3 s of system time to almost none (notes of issue 15). The
cost is that the process's resident memory stays at its peak rather than dropping between steps (the peak
itself did not change: 3.9-4.0 GB there).

Threads other than the main one allocate from arenas of their own, whose heaps glibc caps at 64 MB: a larger
request there is mmap'ed whatever M_MMAP_MAX says, and unmapped on free. On 2 ranks a ZeRO-3 step's collectives
(gloo's worker threads) allocate the whole flat gradient (95 MB on the 23.7M model) that way: 23,000 page faults
and 0.2-0.4 s of system time per step per rank. So every thread shares the main arena (M_ARENA_MAX 1), which
must be set before those threads first allocate: before the process group starts (slime/trainer/loop.py).

GPU runs are left alone: there the host allocations that matter are pinned buffers, which glibc does not serve.
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters (malloc.h)
NO_TRIM = -1  # M_TRIM_THRESHOLD -1: never trim the heap's top (man mallopt)
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "GLIBC_TUNABLES")


def retain_freed_memory() -> str:
    """Serve every allocation of this process, from every thread started after this call, from glibc's main heap
    (no mmap, one arena) and never trim it. Returns what was done, as one line for the log; nothing changes off
    Linux/glibc or where the user set malloc's environment variables (their choice wins)."""
    if not sys.platform.startswith("linux"):
        return "left as is (not Linux)"
    user = [k for k in USER_SETTINGS if k in os.environ]
    if user:
        return f"left as is ({', '.join(user)} set in the environment)"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "left as is (not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, NO_TRIM) and mallopt(M_ARENA_MAX, 1)):
        return f"left as is (glibc {version} refused mallopt)"
    return f"glibc {version}: freed memory is reused (no mmap, no trimming, one arena for all threads)"
