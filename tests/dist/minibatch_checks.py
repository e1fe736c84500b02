"""Run by tests/test_zero3.py on 1 or 2 ranks: one rollout batch of 7 samples (a count no dp of 2 divides),
trained as train.num_mini_batches optimizer steps, under a budget that fits one long sample per micro-batch.
Ranks short of samples in a mini-batch run dummy micro-batches; the result must not depend on dp.

    torchrun --standalone --nproc_per_node N tests/dist/minibatch_checks.py MODEL_DIR OUT_DIR [overrides]

Rank 0 writes OUT_DIR/result.pt: the full parameters after the batch, the step's metrics, the mini-batches'
sample indices and the number of dummy micro-batches run (over every rank).
"""
import functools
import os
import sys
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    import torch

    from dist.actor_checks import fixed_batch, local_share
    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims, leave
    from slime.trainer.layout import distribute
    from slime.trainer.losses import actor_loss
    from slime.trainer.policy_engine import PolicyEngine

# 1: rank 0 holds no sample at all (rank 1 generated the one there is)
N = int(os.environ.get("SLIME_TEST_MINIBATCH_N", "7"))


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    longest = max(s.total_len for s in fixed_batch(N))
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "train.lr=1e-3",
                             f"train.max_tokens_per_gpu={longest}", "train.logits_chunk_size=16", *sys.argv[3:]])
    dims = ParallelDims.build()
    actor = PolicyEngine.actor(cfg, dims)
    batch = distribute(local_share(fixed_batch(N), dims), dims, actor.train_layout,
                       num_mini_batches=cfg.train.num_mini_batches)
    for s, lp in zip(batch.samples, actor.score(batch)):
        s.old_logprobs = lp
    metrics = actor.train_step(batch, functools.partial(actor_loss, cfg.algo))
    dummies = dims.all_reduce_sum([sum(not idx for mini in batch.mini_batches for idx in mini.micro)])[0]
    minis = dims.all_gather_objects([[batch.samples[i].index for idx in mini.micro for i in idx]
                                     for mini in batch.mini_batches])
    state = {n: t.cpu() for bucket in actor.gathered_weight_buckets(1.0) for n, t in bucket}
    if dims.is_main:
        torch.save({"state": state, "metrics": metrics, "dummies": dummies,
                    "minis": [sorted(i for part in minis for i in part[m]) for m in range(len(batch.mini_batches))]},
                   out / "result.pt")
    leave()


if __name__ == "__main__":
    main()
