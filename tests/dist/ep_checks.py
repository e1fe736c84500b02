"""Run by tests/test_ep.py on 1 rank (ep=1, the reference) or 2 ranks (ep=2): logprobs, the gathered
checkpoint-named weights and their shapes, and the weights after one optimizer step of a ZeRO-3 MoE actor
on one fixed global batch, plus an HF export.

    torchrun --standalone --nproc_per_node N tests/dist/ep_checks.py MODEL_DIR OUT_DIR [overrides]
"""
import functools
import sys
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    import torch

    from dist.actor_checks import fixed_batch, gather_by_index, local_share
    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims, leave
    from slime.trainer.layout import distribute
    from slime.trainer.losses import actor_loss
    from slime.trainer.policy_engine import PolicyEngine


def state(actor) -> dict:
    return {n: t.cpu() for bucket in actor.gathered_weight_buckets(0.02) for n, t in bucket}


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "train.lr=1e-4",
                             "train.max_tokens_per_gpu=48", "train.logits_chunk_size=16", *sys.argv[3:]])
    dims = ParallelDims.build(sp=cfg.parallel.sp, ep=cfg.parallel.ep)
    actor = PolicyEngine.actor(cfg, dims)
    before = state(actor)
    batch = distribute(local_share(fixed_batch(), dims), dims, actor.train_layout)
    old = actor.score(batch)
    for s, lp in zip(batch.samples, old):
        s.old_logprobs = lp
    metrics = actor.train_step(batch, functools.partial(actor_loss, cfg.algo))
    logprobs = gather_by_index(batch, old, dims)
    after = state(actor)
    actor.export_hf(str(out / "hf"))
    if dims.is_main:
        torch.save({"logprobs": logprobs, "before": before, "after": after, "metrics": metrics}, out / "result.pt")


if __name__ == "__main__":
    main()
    leave()
