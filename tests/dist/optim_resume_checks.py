"""Run on 1 rank by tests/test_resume_faults.py: a ZeRO-2 checkpoint saved with one gradient clipping and Adam eps,
resumed with others. The restored optimizer held the checkpoint's (ZeRO-1/2 save the clipping with it) while the
log said the new ones were applied.

    python tests/spawn_ranks.py 1 tests/dist/optim_resume_checks.py MODEL_DIR OUT_DIR
"""
import json
import sys
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims, leave
    from slime.trainer.checkpoint import load_checkpoint, save_checkpoint
    from slime.trainer.loop import checkpoint_identity
    from slime.trainer.policy_engine import PolicyEngine


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    ds = json.loads(Path("ds_configs/zero2.json").read_text())
    ds["optimizer"]["params"]["eps"] = 1e-3
    (out / "eps.json").write_text(json.dumps(ds))
    dims = ParallelDims.build()
    settings = {"saved": ["train.ds_config=ds_configs/zero2.json", "train.grad_clip=1.0"],
                "resumed": [f"train.ds_config={out / 'eps.json'}", "train.grad_clip=0.0001"]}
    result = {}
    for run, overrides in settings.items():
        cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", *overrides])
        actor = PolicyEngine.actor(cfg, dims)
        identity = checkpoint_identity(cfg)
        if run == "saved":
            save_checkpoint({"actor": actor}, out / "ckpt", step=1, loop_state={}, dims=dims, identity=identity)
            continue
        state = load_checkpoint({"actor": actor.engine}, out / "ckpt", dims=dims, identity=identity)
        actor.apply_optim_settings(cfg, changed=state["changed_optim"])
        result = {"clip": actor.engine.optimizer.clip_grad,
                  "eps": [g["eps"] for g in actor.engine.optimizer.param_groups]}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    leave()
