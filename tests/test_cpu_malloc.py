"""train.cpu_malloc=retain: after retain_freed_memory() a step's freed buffers are reused instead of being
page-faulted in again; glibc's defaults (the control) fault a large part of them in on every step."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MB_PER_STEP, CHUNK_MB = 256, 4

# Each "step" allocates and touches 64 tensors of 4 MB, then frees them all, as a training step does with its
# activations; the minor page faults of two steps after a warm-up one are counted.
SCRIPT = f"""
import resource, sys
import torch
from slime.utils.cpu_malloc import retain_freed_memory
if sys.argv[1] == "retain":
    print(retain_freed_memory())
def step():
    tensors = [torch.ones({CHUNK_MB} << 18) for _ in range({MB_PER_STEP // CHUNK_MB})]
    del tensors
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step(); step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = 2 * MB_PER_STEP * (1 << 20) // os.sysconf("SC_PAGE_SIZE")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")


def faults(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env={**clean, **env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return out[0] if mode == "retain" else "", int(out[-2])


def test_freed_memory_is_reused_where_glibc_defaults_fault_it_in_again():
    said, retained = faults("retain")
    assert "freed memory is reused (no mmap, no trimming, one arena for all threads)" in said
    _, default = faults("glibc")
    assert default > 0.3 * PAGES, (default, PAGES)  # the control: the defaults give pages back every step
    assert retained < 0.1 * PAGES, (retained, PAGES)


# A thread started after the settings allocates one tensor of 96 MB: above the 64 MB heap that a thread's own
# arena can have, so there glibc mmaps it whatever M_MMAP_MAX says (and unmaps it on free), as gloo's worker
# threads did with a ZeRO-3 step's flat gradient on 2 ranks. Printed: whether it lies in the main heap.
THREAD_SCRIPT = """
import sys, threading
import torch
from slime.utils.cpu_malloc import retain_freed_memory
if sys.argv[1] == "retain":
    print(retain_freed_memory())
def in_main_heap(address):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            return start <= address < end
    return False
found = []
def worker():
    found.append(in_main_heap(torch.ones(96 << 18).data_ptr()))
thread = threading.Thread(target=worker)
thread.start()
thread.join()
print(found[0])
"""


@pytest.mark.parametrize("mode", ["retain", "glibc"])
def test_a_threads_large_buffers_come_from_the_main_heap(mode):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", THREAD_SCRIPT, mode], env={**clean, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == str(mode == "retain")  # glibc's defaults (the control) mmap it


def test_the_users_malloc_environment_wins():
    said, retained = faults("retain", MALLOC_TRIM_THRESHOLD_="0")
    assert said == "left as is (MALLOC_TRIM_THRESHOLD_ set in the environment)"
    assert retained > 0.3 * PAGES  # trimming at 0 (the user's choice) still gives every freed page back
