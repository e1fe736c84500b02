"""Run on 2 ranks by tests/test_vl.py: a ZeRO-3 step on an image-text model where rank 1 holds only
text samples (it still runs the vision tower on every micro-batch, or the ranks' gathers fall out of
step and the job hangs).

    torchrun --standalone --nproc_per_node 2 tests/dist/vl_checks.py MODEL_DIR OUT_DIR

Rank 0 trains two micro-batches of image-text samples, rank 1 two micro-batches of text-only samples
(placed by hand, no balancing). Rank 0 saves the SFT loss and the full gradients for tests/test_vl.py
to compare with one process running every sample through the plain HF model.
"""
import functools
import json
import sys
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    import torch
    from deepspeed.utils import safe_get_full_grad

    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims, leave
    from dist.actor_checks import gather_by_index
    from slime.trainer.layout import MiniBatch, RankBatch, distribute
    from slime.trainer.losses import actor_loss
    from slime.trainer.policy_engine import PolicyEngine
    from test_vl import vl_samples


def sequence_parallel(model_dir: str, out: Path) -> None:
    """parallel.sp=2: both ranks score the same image-text batch, each on its shard of every row."""
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "parallel.sp=2",
                             "train.max_tokens_per_gpu=24", "train.logprob_max_tokens_per_gpu=24"])
    dims = ParallelDims.build(sp=2)
    actor = PolicyEngine.actor(cfg, dims)
    batch = distribute(vl_samples(model_dir, text_only=1), dims, actor.train_layout)
    logprobs = gather_by_index(batch, actor.score(batch), dims)
    rows = [actor.nograd_layout.build(batch.samples, idx) for idx in
            actor.nograd_layout.pack_in_place(batch.lengths_by_rank)[0]]
    if dims.is_main:
        torch.save({"logprobs": logprobs, "rows": [(mb.cu_seqlens.tolist(), int(mb.extra["image_mask"].sum()))
                                                   for mb in rows if mb.extra]}, out / "sp.pt")


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    if sys.argv[3:] == ["sp"]:
        return sequence_parallel(model_dir, out)
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "algo.policy_loss=sft",
                             "train.logits_chunk_size=4"])
    dims = ParallelDims.build()
    actor = PolicyEngine.actor(cfg, dims)
    samples = vl_samples(model_dir, text_only=3)  # 3 image-text samples, then 3 text-only ones
    local = samples[:3] if dims.rank == 0 else samples[3:]
    calls = []
    actor.engine.module.hf.model.visual.register_forward_hook(lambda *a: calls.append(1))
    mini = MiniBatch(micro=[[0, 1], [2]], num_loss_tokens=sum(len(s.response_ids) for s in samples),
                     num_seqs=len(samples), num_processed=sum(s.row_len for s in samples), stats={})
    batch = RankBatch(samples=local, num_samples=len(samples), lengths_by_rank=[], mini_batches=[mini], moved=0)
    sums = actor.forward_backward(batch, mini, functools.partial(actor_loss, cfg.algo))
    loss = dims.all_reduce_tensors({"loss": sums["loss"]})["loss"]
    grads = {n: safe_get_full_grad(p).clone() for n, p in actor.engine.module.hf.named_parameters()}
    tower_calls = dims.all_gather_objects(len(calls))
    if dims.is_main:
        torch.save(grads, out / "grads.pt")
        (out / "result.json").write_text(json.dumps({"loss": loss, "tower_calls": tower_calls}))


if __name__ == "__main__":
    main()
    leave()
