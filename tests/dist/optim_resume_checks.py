"""Run on 1 rank by tests/test_resume_faults.py: a ZeRO-2 checkpoint saved with one gradient clipping and Adam eps,
resumed with others. The restored optimizer held the checkpoint's (ZeRO-1/2 save the clipping with it) while the
log said the new ones were applied. Then weight decay on ZeRO-3: a step with zero gradients, where AdamW only
decays, shrinks the matrices by (1 - lr * weight_decay) and leaves norm gains and biases as they were.

    python tests/spawn_ranks.py 1 tests/dist/optim_resume_checks.py MODEL_DIR OUT_DIR
"""
import json
import sys
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    import torch

    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims, leave
    from slime.trainer.checkpoint import load_checkpoint, save_checkpoint
    from slime.trainer.loop import checkpoint_identity
    from slime.trainer.policy_engine import PROBE, PolicyEngine


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
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "train.lr=0.1",
                             "train.weight_decay=0.5", "train.warmup_steps=0"])
    actor = PolicyEngine.actor(cfg, dims)
    before = weights(actor)
    actor.engine.backward(actor.forward(actor.train_layout.build(PROBE, [0, 1]))[0].sum() * 0)
    actor.engine.step()
    after = weights(actor)
    result["decayed"] = all(torch.allclose(after[n], before[n] * 0.95, rtol=1e-6, atol=0)
                            for n in before if before[n].dim() > 1)
    result["flat_kept"] = all(torch.equal(after[n], before[n]) for n in before if before[n].dim() < 2)
    result["flat"] = sum(before[n].dim() < 2 for n in before)
    (out / "result.json").write_text(json.dumps(result))


def weights(actor) -> dict:
    return {n: t.clone() for bucket in actor.gathered_weight_buckets() for n, t in bucket}


if __name__ == "__main__":
    main()
    leave()
