"""Run on 1 or 2 ranks by tests/test_zero3.py: gradients, weight sync and HF export of the ZeRO-3 actor.

    torchrun --standalone --nproc_per_node 2 tests/dist/actor_checks.py MODEL_DIR OUT_DIR [overrides]

Each rank starts with a contiguous share of one fixed global batch (as after rollout) and the
layout moves samples between ranks. For each loss aggregation mode: saves the full weights before
the step, the full gradients after forward_backward (gathered from the ZeRO-3 partitions) and the
global loss, then steps. Then pushes the weights into an hf engine and exports an HF directory.
"""
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch
from deepspeed.utils import safe_get_full_grad

from slime.config import load_config
from slime.data.sample import Sample, as_token_tensor
from slime.distributed.parallel_dims import ParallelDims, leave
from slime.models import fused, onednn
from slime.rollout.hf_engine import HFEngine
from slime.trainer.layout import distribute
from slime.trainer.losses import actor_loss
from slime.trainer.policy_engine import PolicyEngine, local_elements


def fixed_batch(n: int = 12, seed: int = 0) -> list[Sample]:
    """Groups of 4 samples; the first two groups' samples share their group's prompt (as GRPO's do), the
    rest have prompts of their own, so packed micro-batches hold shared and unshared prompts."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p, r = int(torch.randint(2, 12, (1,), generator=g)), int(torch.randint(1, 14, (1,), generator=g))
        mask = (torch.rand(r, generator=g) > 0.2).long().tolist()
        mask[0] = 1
        prompt = torch.randint(5, 250, (p,), generator=g).tolist()
        if i < 8 and i % 4:
            prompt = samples[i - i % 4].prompt_ids
        samples.append(Sample(prompt_ids=prompt, response_ids=torch.randint(5, 250, (r,), generator=g).tolist(),
                              response_mask=mask, advantages=as_token_tensor([float(torch.randn(1, generator=g))] * r),
                              group_id=i // 4))
    return samples


def local_share(samples: list[Sample], dims: ParallelDims) -> list[Sample]:
    """Rank r's contiguous share, so that global indices equal positions in `samples`."""
    n = len(samples)
    return samples[dims.dp_rank * n // dims.dp:(dims.dp_rank + 1) * n // dims.dp]


def gather_by_index(batch, values, dims) -> list:
    """Per-sample values of every rank, in global-index order."""
    parts = dims.all_gather_objects([(s.index, v) for s, v in zip(batch.samples, values)])
    return [v for _, v in sorted((pair for part in parts for pair in part), key=lambda p: p[0])]


def full_state(engine: PolicyEngine) -> dict:
    return {n: t.cpu() for bucket in engine.gathered_weight_buckets(0.05) for n, t in bucket}


def finite_check(critic: PolicyEngine, dims: ParallelDims) -> dict:
    """ZeRO-3 rounds partitions up to equal sizes with memory it never writes: NaN there must not count as a
    non-finite parameter, NaN in a real element must. The critic's value-head bias (1 element) is padding
    only on rank 1."""
    padded = 0
    with torch.no_grad():
        for p in critic.engine.module.parameters():
            real = local_elements(p).numel()
            if real < p.ds_tensor.numel():
                p.ds_tensor[real:] = float("nan")
                padded += 1
    out = {"padded": dims.all_reduce_sum([padded])[0], "nan_padding_counts": not critic.parameters_finite()}
    first = next(critic.engine.module.parameters()).ds_tensor
    saved = first[:2].clone()
    with torch.no_grad():
        if dims.dp_rank == 1:
            first[0] = float("nan")
        out["nan_element_counts"] = not critic.parameters_finite()
        if dims.dp_rank == 1:
            first[0] = float("inf")
        out["inf_element_counts"] = not critic.parameters_finite()
        first[:2] = saved
        if dims.dp_rank == 1:  # finite, but summing to inf in fp32
            first[:2] = 3e38
        out["huge_is_finite"] = critic.parameters_finite()
        first[:2] = saved
        out["restored_is_finite"] = critic.parameters_finite()
    return out


def count_calls(owner, name: str) -> list[int]:
    """Counts the calls of owner.<name> from now on (its replacement counts, then calls it)."""
    calls, original = [0], getattr(owner, name)

    def counted(*args):
        calls[0] += 1
        return original(*args)

    setattr(owner, name, counted)
    return calls


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    onednn_calls = count_calls(onednn._Linear, "apply")  # the linear calls that take oneDNN, forward passes only
    fused_calls = count_calls(fused, "rms_norm")  # the fused RMSNorm calls (train.fuse_elementwise)
    cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "train.lr=1e-2",
                             "train.max_tokens_per_gpu=48", "train.logprob_max_tokens_per_gpu=64",
                             "train.logits_chunk_size=16", *sys.argv[3:]])
    dims = ParallelDims.build()
    actor = PolicyEngine.actor(cfg, dims)
    ref = PolicyEngine.reference(cfg, dims)
    batch = distribute(local_share(fixed_batch(), dims), dims, actor.train_layout)
    ref_before = gather_by_index(batch, ref.score(batch), dims)
    result = {"world": dims.world_size, "modes": {}, "moved": batch.moved, "packing": cfg.train.packing}
    first_state = full_state(actor)
    for mode in ("token_mean", "seq_mean_token_mean"):
        before = full_state(actor)
        old = actor.score(batch)
        for s, lp in zip(batch.samples, old):
            s.old_logprobs = lp
        loss_fn = functools.partial(actor_loss, dataclasses.replace(cfg.algo, loss_agg=mode))
        layer = actor.engine.module.hf.model.layers[0]
        runs = [0]  # the first decoder layer's forward passes: twice per micro-batch where it is checkpointed
        hook = layer.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
        sums = actor.forward_backward(batch, batch.mini_batches[0], loss_fn)
        hook.remove()
        grads = {n: safe_get_full_grad(p).clone() for n, p in actor.engine.module.hf.named_parameters()}
        g = dims.all_reduce_tensors({k: sums[k] for k in ("loss", "ppo_kl")})
        micro = dims.all_reduce_sum([len(batch.mini_batches[0].micro)])[0]
        shared = dims.all_reduce_sum([sum(actor.train_layout.build(batch.samples, idx).prompt_prefixes is not None
                                          for idx in batch.mini_batches[0].micro)])[0]
        actor.optimizer_step()
        old_all = gather_by_index(batch, old, dims)
        if dims.is_main:
            torch.save({"before": before, "grads": grads, "old_logprobs": old_all}, out / f"{mode}.pt")
        result["modes"][mode] = {"loss": g["loss"], "ppo_kl_sum": g["ppo_kl"], "micro_batches": micro,
                               "shared_prompt_micro_batches": shared,
                               "layer_runs": dims.all_reduce_sum([runs[0]])[0]}

    ref_after = gather_by_index(batch, ref.score(batch), dims)
    ref_state = full_state(ref)
    result["ref_logprobs_unchanged"] = all(torch.equal(a, b) for a, b in zip(ref_before, ref_after))
    result["ref_equals_initial"] = all(torch.equal(ref_state[n], t) for n, t in first_state.items())
    result["actor_moved"] = any(not torch.equal(ref_state[n], t) for n, t in full_state(actor).items())
    engine = HFEngine(cfg.model, tokenizer=type("T", (), {"pad_token_id": 0, "eos_token_id": 1})(),
                      device=dims.device)
    initial = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.update_weights(actor.gathered_weight_buckets(0.05), version=7)
    trainer = full_state(actor)
    eng = dict(engine.model.named_parameters())
    result["sync_max_diff"] = max((eng[n].detach() - t).abs().max().item() for n, t in trainer.items())
    result["sync_changed"] = max((eng[n].detach() - initial[n]).abs().max().item() for n in trainer)
    result["sync_names_equal"] = sorted(trainer) == sorted(eng)
    result["engine_version"] = engine.weight_version
    actor.export_hf(str(out / "hf"))
    result["zero_stage"] = actor.engine.zero_optimization_stage()
    result["onednn_calls"] = onednn_calls[0]
    result["fused_calls"] = fused_calls[0]
    if dims.world_size == 2 and result["zero_stage"] == 3:
        result["finite_check"] = finite_check(PolicyEngine.critic(cfg, dims), dims)
    if dims.is_main:
        torch.save(trainer, out / "final_state.pt")
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    leave()
