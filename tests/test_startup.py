"""slime.utils.startup.long_lived_imports: no full collection while the trainer's modules import, and their objects
frozen after. Run in a fresh interpreter each (a freeze in pytest's own process would outlive the test)."""
import subprocess
import sys

import pytest

from conftest import REPO

CHECK = """
import gc, sys
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else None)
{wrap}
    import slime.trainer.loop
print(len(full), gc.get_freeze_count(), gc.isenabled())
"""


def imports(wrap: str) -> tuple[int, int, bool]:
    code = CHECK.format(wrap=wrap)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    full, frozen, enabled = out.split()[-3:]
    return int(full), int(frozen), enabled == "True"


def test_the_trainer_imports_without_a_full_collection_and_its_objects_are_frozen():
    full, frozen, enabled = imports("from slime.utils.startup import long_lived_imports\nwith long_lived_imports():")
    assert full == 0 and frozen > 100_000 and enabled
    full, frozen, enabled = imports("if True:")  # the same imports without it: what it saves
    assert full > 0 and frozen == 0 and enabled


def test_the_collector_is_back_on_when_an_import_fails():
    code = ("import gc\nfrom slime.utils.startup import long_lived_imports\ntry:\n    with long_lived_imports():\n"
            "        import no_such_module_here\nexcept ImportError:\n    print(gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "True"


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stop_signal_during_the_imports_exits_with_its_code_without_a_traceback(sig, code):
    """Ctrl-C while a rank imports torch, DeepSpeed and transformers (seconds): each rank printed a
    KeyboardInterrupt traceback from wherever its imports were; a SIGTERM killed it (exit code 241 under run.sh,
    not docs/faults.md's 143) without a word. The signal arrives, here, as the trainer's loop module starts
    importing."""
    probe = f"""
import importlib.abc, os, runpy, signal, sys
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "slime.trainer.loop":
            os.kill(os.getpid(), signal.{sig})
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = ["run.py", "--config", {str(REPO / "examples/cpu_tiny_grpo.yaml")!r}]
runpy.run_path({str(REPO / "run.py")!r}, run_name="__main__")
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == code and "Traceback" not in out.stderr and "KeyboardInterrupt" not in out.stderr, \
        (out.returncode, out.stderr[-3000:])
    assert f"[rank0] stopped by {sig} during start-up (exit code {code})" in out.stderr


def test_a_child_that_multiprocessing_spawns_keeps_the_default_signal_handlers():
    """A spawned child (the math reward's) imports run.py as __mp_main__: it took start-up's handlers, and a
    job-wide SIGTERM to it came back to its rank as Stopped(143) from the sample's result, not as the dead child
    the reward handles."""
    probe = f"""
import runpy, signal
runpy.run_path({str(REPO / "run.py")!r}, run_name="__mp_main__")
print([signal.getsignal(s) is signal.SIG_DFL or signal.getsignal(s) is signal.default_int_handler
       for s in (signal.SIGTERM, signal.SIGINT)])
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.stdout.split("\n")[-2] == "[True, True]", (out.stdout[-2000:], out.stderr[-2000:])
