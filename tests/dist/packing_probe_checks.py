"""Run on 1 rank by tests/test_packed_logprobs.py: an actor of a family without an adapter checks at start that two
samples packed in one row score as each alone; the same family, its rows' borders dropped (as a family whose
attention ignored them would), is refused.

    python tests/spawn_ranks.py 1 tests/dist/packing_probe_checks.py MODEL_DIR OUT_DIR [overrides...]
"""
import json
import sys
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    import torch

    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims, leave
    from slime.models import policy
    from slime.trainer.policy_engine import PolicyEngine


def main() -> None:
    model_dir, out, *overrides = sys.argv[1:]
    out = Path(out)
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", *overrides])
    dims = ParallelDims.build()
    PolicyEngine.actor(cfg, dims)  # raises unless the packed row scores as its samples alone
    borders = policy.packed_attention_kwargs
    policy.packed_attention_kwargs = lambda cu, max_len, prefixes=None: borders(
        torch.stack([cu[0], cu[-1]]), int(cu[-1] - cu[0]), prefixes)  # the whole row as one sample
    try:
        PolicyEngine.actor(cfg, dims)
        refused = None
    except ValueError as e:
        refused = str(e)
    (out / "result.json").write_text(json.dumps({"refused": refused}))


if __name__ == "__main__":
    main()
    leave()
