"""run.py with the actor's gradient norm reported NaN at chosen optimizer steps of this process (SLIME_TEST_NAN_NORM_AT,
comma-separated, counted from 1), so that a job skips steps as a NaN loss would make it: tests/test_faults.py
checks that train.max_skipped_steps counts a run of skips on across a resume. (DeepSpeed still applies the update
of such a step: only the counting is under test.)

    python tests/spawn_ranks.py 2 tests/dist/nan_norm_run.py --config CONFIG [overrides]
"""
import os
import sys

import run
from slime.trainer.policy_engine import PolicyEngine

NAN_AT = {int(i) for i in os.environ["SLIME_TEST_NAN_NORM_AT"].split(",") if i}
calls = 0
real_step = PolicyEngine.optimizer_step


def optimizer_step(self) -> float:
    global calls
    calls += 1
    if calls not in NAN_AT:
        return real_step(self)
    self.engine.get_global_grad_norm = lambda: float("nan")
    try:
        return real_step(self)
    finally:
        del self.engine.get_global_grad_norm  # the engine's own method again


PolicyEngine.optimizer_step = optimizer_step

if __name__ == "__main__":
    run.main(sys.argv[1:])
