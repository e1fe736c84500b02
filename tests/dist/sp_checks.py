"""Run by tests/test_sp.py on 1 rank (sp=1, the reference) or 2 ranks (sp=2, dp=1), or on 4 ranks:
logprobs and parameters after one optimizer step of the ZeRO-3 actor on one fixed global batch.

    torchrun --standalone --nproc_per_node N tests/dist/sp_checks.py MODEL_DIR OUT_DIR [overrides]

The batch: samples of different lengths whose borders fall inside the sp shard cuts, an odd total
length, and one sample longer than one GPU's token budget (it fits only when cut over sp ranks).
Rank 0 writes OUT_DIR/result.pt: per-sample logprobs (in batch order) and the full parameters after the step.
"""
import functools
import sys
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    import torch
    from deepspeed.utils import safe_get_full_grad

    from dist.actor_checks import gather_by_index, local_share
    from slime.config import load_config
    from slime.data.sample import Sample, as_token_tensor
    from slime.distributed.parallel_dims import ParallelDims, leave
    from slime.trainer.layout import distribute
    from slime.trainer.losses import actor_loss
    from slime.trainer.policy_engine import PolicyEngine

LENGTHS = [(7, 10), (3, 9), (12, 17), (5, 4), (9, 12), (4, 37), (6, 9)]  # (prompt, response); 41 > the budget of 32


def batch() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate(LENGTHS):
        out.append(Sample(prompt_ids=torch.randint(5, 250, (p,), generator=g).tolist(),
                          response_ids=torch.randint(5, 250, (r,), generator=g).tolist(),
                          advantages=as_token_tensor(torch.randn(r, generator=g)), group_id=i // 2))
    return out


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "train.lr=1e-4",
                             "train.logits_chunk_size=8", *sys.argv[3:]])
    dims = ParallelDims.build(sp=cfg.parallel.sp)
    actor = PolicyEngine.actor(cfg, dims)
    samples = local_share(batch(), dims)
    rb = distribute(samples, dims, actor.train_layout)
    old = actor.score(rb)
    for s, lp in zip(rb.samples, old):
        s.old_logprobs = lp
        if s.rollout_logprobs is None:  # a rollout/trainer mismatch for the TIS variants
            s.rollout_logprobs = lp + 0.05 * torch.sin(torch.arange(len(lp), dtype=torch.float32) + s.index)
    sums = actor.forward_backward(rb, rb.mini_batches[0], functools.partial(actor_loss, cfg.algo))
    grads = {n: safe_get_full_grad(p).clone() for n, p in actor.engine.module.hf.named_parameters()}
    grad_norm = actor.optimizer_step()
    metrics = dims.all_reduce_tensors({k: sums[k] for k in ("loss", "ppo_kl", "entropy", "loss_tokens")})
    if "router_aux" in sums:  # each sp peer routes its own shard: over the whole world, as the trainer's metric
        metrics.update(dims.all_reduce_tensors({"router_aux": sums["router_aux"]}, group=dims.world_group))
    logprobs = gather_by_index(rb, old, dims)
    state = {n: t.cpu() for bucket in actor.gathered_weight_buckets(1.0) for n, t in bucket}
    rows = [actor.train_layout.build(rb.samples, idx).cu_seqlens.tolist() for idx in rb.mini_batches[0].micro]
    if dims.is_main:
        torch.save({"rows": rows, "logprobs": logprobs, "state": state, "grads": grads, "grad_norm": grad_norm, "metrics": metrics,
                    "micro_batches": len(rb.mini_batches[0].micro)}, out / "result.pt")


if __name__ == "__main__":
    main()
    leave()
