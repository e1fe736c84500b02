"""What algo.old_logprobs=train_forward saves: the scoring pass before the update.

    python bench/old_logprobs.py [--n 64] [--hidden 512] [--layers 6] [--iters 3]

One process, the real ZeRO-3 actor, one GRPO-style batch (long-tailed response lengths). Per mode, the
median over `iters` steps of what the loop runs between rollout and weight sync: `recompute` scores the
batch (pi_old) and then updates; `train_forward` updates with pi_old taken from the update's own forward.
The two modes alternate step by step, so machine load hits both alike. Prints both and the ratio.
"""
from __future__ import annotations

import argparse
import copy
import functools
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.train_throughput import make_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64, help="samples in the batch")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--iters", type=int, default=3, help="timed steps per mode (after one warm-up each)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="packed token budget per micro-batch")
    args = ap.parse_args()

    import torch

    from data_tools.make_tiny_model import make_tiny_model
    from slime.config import load_config
    from slime.distributed.parallel_dims import ParallelDims
    from slime.trainer.layout import distribute
    from slime.trainer.losses import actor_loss
    from slime.trainer.policy_engine import PolicyEngine

    torch.manual_seed(0)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "m", hidden=args.hidden, layers=args.layers,
                                heads=max(4, args.hidden // 64), kv_heads=2, max_pos=1024)
    samples = make_batch(args.n, 0)
    tokens = sum(s.total_len for s in samples)
    dims = ParallelDims.build()
    actors, times = {}, {"recompute": [], "train_forward": []}
    for mode in times:
        cfg = load_config(None, [f"model.path={model_dir}", "data.path=unused.jsonl", "train.lr=0",
                                 f"train.max_tokens_per_gpu={args.max_tokens}", f"algo.old_logprobs={mode}"])
        actors[mode] = (cfg, PolicyEngine.actor(cfg, dims))  # lr 0: both see the same weights at every step
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in actors["recompute"][1].engine.module.parameters())
    for it in range(args.iters + 1):
        for mode, (cfg, actor) in actors.items():
            batch = distribute([copy.copy(s) for s in samples], dims, actor.train_layout)
            start = time.perf_counter()
            if mode == "recompute":
                for s, lp in zip(batch.samples, actor.score(batch)):
                    s.old_logprobs = lp
            actor.train_step(batch, functools.partial(actor_loss, cfg.algo))
            if it:  # the first step warms up allocators and DeepSpeed's parameter trace
                times[mode].append(time.perf_counter() - start)
    med = {m: sorted(t)[len(t) // 2] for m, t in times.items()}
    print(f"model: {n_params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers); "
          f"batch: {args.n} samples, {tokens} tokens; {torch.get_num_threads()} thread(s)")
    for m, t in med.items():
        print(f"{m:14s} scoring + update {t:6.2f} s  (median of {args.iters}: {', '.join(f'{x:.2f}' for x in times[m])})")
    print(f"train_forward / recompute: {med['train_forward'] / med['recompute']:.2f}x the time")


if __name__ == "__main__":
    main()
