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
    assert "freed memory is reused (no mmap, no trimming)" in said
    _, default = faults("glibc")
    assert default > 0.3 * PAGES, (default, PAGES)  # the control: the defaults give pages back every step
    assert retained < 0.1 * PAGES, (retained, PAGES)


def test_the_users_malloc_environment_wins():
    said, retained = faults("retain", MALLOC_TRIM_THRESHOLD_="0")
    assert said == "left as is (MALLOC_TRIM_THRESHOLD_ set in the environment)"
    assert retained > 0.3 * PAGES  # trimming at 0 (the user's choice) still gives every freed page back
