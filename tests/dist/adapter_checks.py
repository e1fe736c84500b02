"""Run on 2 ranks by tests/test_adapters.py: what leaves the ZeRO-3 trainer, per model family.

    torchrun --standalone --nproc_per_node 2 tests/dist/adapter_checks.py OUT_DIR NAME=MODEL_DIR[:score] ...

For each model: the names and shapes weight sync yields (gathered over ZeRO-3, through the adapter),
an hf engine loaded from those buckets, an HF export, and (`:score`) the trainer's logprobs of a fixed
batch. Rank 0 writes OUT_DIR/NAME/{sync.json, engine_state.pt, logprobs.pt, hf/}.
"""
import json
import sys
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    import torch

    from dist.actor_checks import fixed_batch, gather_by_index, local_share
    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims, leave
    from slime.rollout.hf_engine import HFEngine
    from slime.trainer.layout import distribute
    from slime.trainer.policy_engine import PolicyEngine


def main() -> None:
    out = Path(sys.argv[1])
    dims = ParallelDims.build()
    for spec in sys.argv[2:]:
        name, _, rest = spec.partition("=")
        model_dir, _, mode = rest.partition(":")
        cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "train.max_tokens_per_gpu=64",
                                 "train.logits_chunk_size=16"])
        actor = PolicyEngine.actor(cfg, dims)
        shapes = {n: list(t.shape) for bucket in actor.gathered_weight_buckets(0.02) for n, t in bucket}
        engine = HFEngine(cfg.model, tokenizer=type("T", (), {"pad_token_id": 0, "eos_token_id": 1})(),
                          device=dims.device)
        for p in engine.model.parameters():
            p.data.zero_()  # so a tensor the update misses cannot pass for a correct one
        engine.update_weights(actor.gathered_weight_buckets(0.02), version=1)
        actor.export_hf(str(out / name / "hf"))
        logprobs = None
        if mode == "score":
            batch = distribute(local_share(fixed_batch(), dims), dims, actor.train_layout)
            logprobs = gather_by_index(batch, actor.score(batch), dims)
        if dims.is_main:
            (out / name / "sync.json").write_text(json.dumps(shapes))
            torch.save({n: p.detach() for n, p in engine.model.named_parameters()}, out / name / "engine_state.pt")
            if logprobs is not None:
                torch.save(logprobs, out / name / "logprobs.pt")
        dims.barrier()


if __name__ == "__main__":
    main()
    leave()
