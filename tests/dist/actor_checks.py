"""Run on 1 or 2 ranks by tests/test_zero3.py: gradients, weight sync and HF export of the ZeRO-3 actor.

    torchrun --standalone --nproc_per_node 2 tests/dist/actor_checks.py MODEL_DIR OUT_DIR [overrides]

For each loss aggregation mode: saves the full weights before the step, the full gradients after
forward_backward (gathered from the ZeRO-3 partitions) and the global loss, then steps. Then
pushes the weights into an hf engine and exports an HF directory.
"""
import json
import sys
from pathlib import Path

import torch
from deepspeed.utils import safe_get_full_grad

from slime.config import load_config
from slime.data.sample import Sample
from slime.distributed.parallel_dims import ParallelDims
from slime.rollout.hf_engine import HFEngine
from slime.rollout.weight_sync import iter_gathered_buckets
from slime.trainer.actor import Actor, Reference


def fixed_batch(n: int = 12, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p, r = int(torch.randint(2, 12, (1,), generator=g)), int(torch.randint(1, 14, (1,), generator=g))
        mask = (torch.rand(r, generator=g) > 0.2).long().tolist()
        mask[0] = 1
        samples.append(Sample(prompt_ids=torch.randint(5, 250, (p,), generator=g).tolist(),
                              response_ids=torch.randint(5, 250, (r,), generator=g).tolist(),
                              response_mask=mask, advantages=[float(torch.randn(1, generator=g))] * r, group_id=i // 4))
    return samples


def full_state(actor: Actor) -> dict:
    return {n: t.cpu() for bucket in actor.gathered_weight_buckets() for n, t in bucket}


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "train.lr=1e-2",
                             "train.max_tokens_per_gpu=48", "train.logprob_max_tokens_per_gpu=64",
                             "train.logits_chunk_size=16", "rollout.sync_bucket_mb=0.05", *sys.argv[3:]])
    dims = ParallelDims.build()
    actor = Actor(cfg, dims)
    ref = Reference(cfg, dims)
    samples = fixed_batch()
    ref_before = ref.compute_logprobs(samples)
    result = {"world": dims.world_size, "modes": {}}
    first_state = full_state(actor)
    for mode in ("token_mean", "seq_mean_token_mean"):
        actor.cfg.algo.loss_agg = mode
        before = full_state(actor)
        old = actor.compute_logprobs(samples)
        for s, lp in zip(samples, old):
            s.old_logprobs = lp
        sums = actor.forward_backward(samples)
        grads = {n.removeprefix("hf."): safe_get_full_grad(p).clone() for n, p in actor.engine.module.named_parameters()}
        loss, ppo_kl, micro = dims.all_reduce_sum([sums["loss"], sums["ppo_kl"], sums["micro_batches"]])
        actor.optimizer_step()
        if dims.is_main:
            torch.save({"before": before, "grads": grads, "old_logprobs": old}, out / f"{mode}.pt")
        result["modes"][mode] = {"loss": loss, "ppo_kl_sum": ppo_kl, "micro_batches": micro}

    ref_after = ref.compute_logprobs(samples)
    ref_state = {n: t for b in iter_gathered_buckets(ref.engine.module, bucket_bytes=2**20) for n, t in b}
    result["ref_logprobs_unchanged"] = ref_before == ref_after
    result["ref_equals_initial"] = all(torch.equal(ref_state[n], t) for n, t in first_state.items())
    result["actor_moved"] = any(not torch.equal(ref_state[n], t) for n, t in full_state(actor).items())
    engine = HFEngine(cfg.model, tokenizer=type("T", (), {"pad_token_id": 0, "eos_token_id": 1})(),
                      device=dims.device)
    initial = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.update_weights(actor.gathered_weight_buckets(), version=7)
    trainer = full_state(actor)
    eng = dict(engine.model.named_parameters())
    result["sync_max_diff"] = max((eng[n].detach() - t).abs().max().item() for n, t in trainer.items())
    result["sync_changed"] = max((eng[n].detach() - initial[n]).abs().max().item() for n in trainer)
    result["sync_names_equal"] = sorted(trainer) == sorted(eng)
    result["engine_version"] = engine.weight_version
    actor.export_hf(str(out / "hf"), tokenizer=_NoTokenizer())
    if dims.is_main:
        torch.save(trainer, out / "final_state.pt")
        (out / f"result.json").write_text(json.dumps(result))


class _NoTokenizer:
    def save_pretrained(self, path):
        pass


if __name__ == "__main__":
    main()
