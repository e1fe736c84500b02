"""Run on 1 rank by tests/test_zero3.py: what PolicyEngine.offload() moves to host before a colocated engine's
rollout (on a GPU), under the offload configs, called here on CPU. DeepSpeed refuses to move the states of
offloaded parameters ("not supported for offloaded parameters"), and only FusedAdam's optimizer states (an
offloaded optimizer is DeepSpeedCPUAdam): ds_configs/zero3_offload.json failed at the first rollout.

    python tests/spawn_ranks.py 1 tests/dist/offload_checks.py MODEL_DIR OUT_DIR
"""
import json
import sys
from pathlib import Path

from slime.config import load_config
from slime.distributed.parallel_dims import ParallelDims, leave
from slime.trainer.policy_engine import PolicyEngine


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    ds = json.loads(Path("ds_configs/zero3.json").read_text())
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    (out / "optimizer_offload.json").write_text(json.dumps(ds))
    dims, result = ParallelDims.build(), {}
    for name, path in [("zero3_offload", "ds_configs/zero3_offload.json"),
                       ("optimizer_offload", str(out / "optimizer_offload.json"))]:
        cfg = load_config(None, [f"model.path={model}", "data.path=unused.jsonl", f"train.ds_config={path}"])
        actor = PolicyEngine.actor(cfg, dims)
        moved = {}
        for params in (True, False):
            states = actor.states_on_device(params=params)
            if states:  # what offload() runs on a GPU
                actor.engine.offload_states(include=states)
            actor.engine.reload_states()
            moved[str(params)] = [s.value for s in states]
        result[name] = moved
    (out / "offload.json").write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    main()
