"""Run on 2 ranks by tests/test_faults.py: a loss that turns NaN or inf (or NaN pi_old in one sample) skips the
optimizer step on every rank together (weights unchanged, counted), and train.max_skipped_steps skips in a row
stop the run; a token id outside the vocabulary is refused, naming the samples, even where it is only a
scored target.

    torchrun --standalone --nproc_per_node 2 tests/dist/fault_checks.py MODEL_DIR OUT_DIR
"""
import functools
import json
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


def poisoned(algo, bad_rank, mb, *outputs, **norms):
    """The actor loss, times NaN on one rank only."""
    loss, sums = actor_loss(algo, mb, *outputs, **norms)
    if torch.distributed.get_rank() == bad_rank:
        loss = loss * float("nan")
    return loss, sums


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "train.lr=1e-2",
                             "train.max_skipped_steps=2"])
    dims = ParallelDims.build()
    actor = PolicyEngine.actor(cfg, dims)
    batch = distribute(local_share(fixed_batch(), dims), dims, actor.train_layout)
    for s, lp in zip(batch.samples, actor.score(batch)):
        s.old_logprobs = lp
    state = lambda: {n: t for b in actor.gathered_weight_buckets(1.0) for n, t in b}  # noqa: E731
    before = state()
    skipped = actor.train_step(batch, functools.partial(poisoned, cfg.algo, 1))
    unchanged = all(torch.equal(before[n], t) for n, t in state().items())
    good = actor.train_step(batch, functools.partial(actor_loss, cfg.algo))  # resets the run of skips
    moved = any(not torch.equal(before[n], t) for n, t in state().items())
    # NaN pi_old in one sample of rank 1: clipping passes no gradient through a NaN, yet the step must be skipped
    kept = batch.samples[0].old_logprobs
    if dims.dp_rank == 1:
        batch.samples[0].old_logprobs = kept * float("nan")
    before_nan = state()
    nan_input = actor.train_step(batch, functools.partial(actor_loss, cfg.algo))
    nan_input_unchanged = all(torch.equal(before_nan[n], t) for n, t in state().items())
    batch.samples[0].old_logprobs = kept
    actor.train_step(batch, functools.partial(actor_loss, cfg.algo))
    actor.train_step(batch, functools.partial(poisoned, cfg.algo, 0))
    error = None
    try:
        actor.train_step(batch, functools.partial(poisoned, cfg.algo, 0))
    except RuntimeError as e:
        error = str(e)
    # A response whose last token is outside the vocabulary: that token is only a target, in no input row
    sample = batch.samples[0]
    response = sample.response_ids
    sample.response_ids = [*response[:-1], actor.vocab_size]
    vocab_error = None
    try:
        actor.score(batch)
    except ValueError as e:
        vocab_error = str(e)
    sample.response_ids = response
    if dims.is_main:
        (out / "result.json").write_text(json.dumps({"vocab_error": vocab_error,
            "skipped": skipped["train/skipped_steps"], "grad_norm": skipped["train/grad_norm"],
            "unchanged": unchanged, "good_skipped": good["train/skipped_steps"], "moved": moved, "error": error,
            "nan_input_skipped": nan_input["train/skipped_steps"], "nan_input_unchanged": nan_input_unchanged}))


if __name__ == "__main__":
    main()
    leave()
