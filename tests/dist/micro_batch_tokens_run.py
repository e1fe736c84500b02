"""run.py recording each trained model's largest training micro-batch (tokens in its rows) into the JSON file
SLIME_TEST_TOKENS_OUT names, for tests/test_faults.py's check that the plan fits every model's rows.

    python tests/spawn_ranks.py 1 tests/dist/micro_batch_tokens_run.py --config CONFIG [overrides]
"""
import json
import os
import sys

import torch

import run
from slime.trainer.policy_engine import PolicyEngine

largest: dict[str, int] = {}
real_forward = PolicyEngine.forward


def forward(self, mb):
    if torch.is_grad_enabled():  # a training micro-batch (the scoring passes run without grad, on their own plan)
        largest[self.role] = max(largest.get(self.role, 0), mb.input_ids.numel())
    return real_forward(self, mb)


PolicyEngine.forward = forward

if __name__ == "__main__":
    run.main(sys.argv[1:])
    with open(os.environ["SLIME_TEST_TOKENS_OUT"], "w") as f:
        json.dump(largest, f)
