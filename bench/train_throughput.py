"""Training throughput on CPU: packed micro-batches vs the padded fixed-batch baseline.

    python bench/train_throughput.py [--n 64] [--hidden 256] [--layers 4] [--iters 3]

Same model, same global batch (long-tailed response lengths), one process: times
forward + backward + optimizer step of the real ZeRO-3 actor for both layouts, and prints real
(non-padding) tokens per second and the ratio, measured in the same run.
"""
from __future__ import annotations

import argparse
import copy
import functools
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_batch(n: int, seed: int):
    import torch

    from slime.data.sample import Sample

    rng = random.Random(seed)
    samples = []
    for i in range(n):
        p = rng.randint(20, 60)
        r = min(400, max(4, int(rng.lognormvariate(4.0, 0.8))))  # median ~55 tokens, long tail
        samples.append(Sample(prompt_ids=[rng.randint(5, 250) for _ in range(p)],
                              response_ids=[rng.randint(5, 250) for _ in range(r)],
                              advantages=torch.full((r,), rng.gauss(0, 1)), group_id=i // 4))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64, help="samples in the global batch")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3, help="timed steps per layout (after one warm-up)")
    ap.add_argument("--max-tokens", type=int, default=2048, help="packed token budget per micro-batch")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="padded baseline samples per micro-batch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from data_tools.make_tiny_model import make_tiny_model
    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims
    from slime.trainer.layout import distribute
    from slime.trainer.losses import actor_loss
    from slime.trainer.policy_engine import PolicyEngine

    torch.manual_seed(args.seed)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "m", hidden=args.hidden, layers=args.layers,
                                heads=max(4, args.hidden // 64), kv_heads=2, max_pos=1024)
    samples = make_batch(args.n, args.seed)
    real = sum(s.total_len for s in samples)
    dims = ParallelDims.build()
    results = {}
    for name, layout in (("padded", ["train.packing=false", f"train.micro_batch_size={args.micro_batch_size}"]),
                         ("packed", [f"train.max_tokens_per_gpu={args.max_tokens}"])):
        cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "train.lr=1e-5", *layout])
        actor = PolicyEngine.actor(cfg, dims)
        batch = distribute([copy.copy(s) for s in samples], dims, actor.train_layout)
        for s, lp in zip(batch.samples, actor.score(batch)):
            s.old_logprobs = lp
        times = []
        for it in range(args.iters + 1):
            start = time.perf_counter()
            m = actor.train_step(batch, functools.partial(actor_loss, cfg.algo))
            if it:  # the first step warms up allocators and DeepSpeed's parameter trace
                times.append(time.perf_counter() - start)
        t = sorted(times)[len(times) // 2]
        results[name] = (t, m)
        print(f"{name:7s} step {t:6.2f}s  real tokens/s {real / t:8.0f}  processed tokens {m['train/tokens']:7.0f}  "
              f"real-token fraction {m['train/real_token_fraction']:.3f}  micro-batches {m['train/micro_batches_per_rank']:.0f}")
    speedup = results["padded"][0] / results["packed"][0]
    print(f"batch: {args.n} samples, {real} real tokens; model hidden={args.hidden} layers={args.layers}")
    print(f"packed vs padded: {speedup:.2f}x real tokens/s (median of {args.iters} steps each, same run)")


if __name__ == "__main__":
    main()
