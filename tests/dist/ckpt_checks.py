"""Run on 2 ranks by tests/test_resume_faults.py: a save where the ranks see one file system succeeds; a save where
each rank sees a folder of its own (as nodes with node-local disks would) stops on every rank with the reason.

    torchrun --standalone --nproc_per_node 2 tests/dist/ckpt_checks.py MODEL_DIR OUT_DIR
"""
import json
import sys
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims, leave
    from slime.trainer.checkpoint import save_checkpoint, verify
    from slime.trainer.loop import checkpoint_identity
    from slime.trainer.policy_engine import PolicyEngine


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl"])
    dims = ParallelDims.build()
    actor = PolicyEngine.actor(cfg, dims)
    save = dict(engines={"actor": actor}, step=1, loop_state={}, dims=dims, identity=checkpoint_identity(cfg))
    shared = save_checkpoint(ckpt_dir=out / "shared", **save)
    error = None
    try:  # each rank its own folder: two nodes that each checkpoint to a local disk
        save_checkpoint(ckpt_dir=out / f"node{dims.rank}", **save)
    except RuntimeError as e:
        error = str(e)
    (out / f"result{dims.rank}.json").write_text(json.dumps({
        "shared": verify(shared), "error": error, "published": (out / f"node{dims.rank}" / "latest").exists()}))


if __name__ == "__main__":
    main()
    leave()
