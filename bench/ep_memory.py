"""Expert parallelism: expert parameter bytes per rank and step time, ep=2 vs ep=1, on 2 CPU ranks.

    python bench/ep_memory.py [--hidden 256] [--experts 8] [--layers 4] [--samples 32] [--steps 3]

(launches itself twice under torchrun with 2 ranks: parallel.ep=1 and parallel.ep=2.)

A random Qwen3-MoE (top-2) trains on one fixed batch. Per rank it reports the expert parameters
- materialised in a forward: ZeRO-3 gathers a layer's whole tensors before using them, so at ep=1 every
  rank holds all E experts of a layer while it runs it; with ep=2 a rank holds only its E/2;
- kept between steps (the ZeRO-3 partitions): 1/2 of all experts in both cases on 2 ranks, since ZeRO-3
  already splits them over data parallelism;
and the median step time (forward, backward, optimizer) of --steps steps after one warm-up.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_rank(args) -> None:
    import torch

    from slime.config import load_config
    from slime.data.sample import Sample, as_token_tensor
    from slime.distributed.parallel_dims import ParallelDims
    from slime.trainer.layout import distribute
    from slime.trainer.losses import actor_loss
    from slime.trainer.policy_engine import PolicyEngine

    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={args.model}", "data.path=unused.jsonl", f"parallel.ep={args.ep}",
                             "train.max_tokens_per_gpu=4096", "train.lr=1e-5"])
    dims = ParallelDims.build(ep=args.ep)
    actor = PolicyEngine.actor(cfg, dims)
    expert = [p for n, p in actor.engine.module.named_parameters() if ".experts." in n]
    materialised = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in expert)
    kept = sum((p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()) * p.element_size() for p in expert)
    g = torch.Generator().manual_seed(dims.rank)
    local = [Sample(prompt_ids=torch.randint(5, 250, (64,), generator=g).tolist(),
                    response_ids=torch.randint(5, 250, (192,), generator=g).tolist(),
                    advantages=as_token_tensor(torch.randn(192, generator=g))) for _ in range(args.samples // 2)]
    batch = distribute(local, dims, actor.train_layout)
    for s, lp in zip(batch.samples, actor.score(batch)):
        s.old_logprobs = lp
    times = []
    for i in range(args.steps + 1):
        dims.barrier()
        t0 = time.perf_counter()
        actor.train_step(batch, functools.partial(actor_loss, cfg.algo))
        if i:
            times.append(time.perf_counter() - t0)
    result = dims.all_gather_objects({"materialised": materialised, "kept": kept,
                                      "step_s": sorted(times)[len(times) // 2]}, group=dims.world_group)
    if dims.is_main:
        Path(args.out).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=32, help="samples of 256 tokens per step (both ranks)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ep", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return
    from data_tools.make_tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="ep-bench-"))
    model = make_tiny_model(work / "m", arch="qwen3_moe", hidden=args.hidden, layers=args.layers, heads=4,
                            kv_heads=2, experts=args.experts)
    out = {}
    for ep in (1, 2):
        path = work / f"ep{ep}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               f"--ep={ep}", f"--model={model}", f"--out={path}", f"--samples={args.samples}", f"--steps={args.steps}"]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"ep={ep} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        out[ep] = json.loads(path.read_text())
    print(f"Qwen3-MoE hidden={args.hidden} layers={args.layers} experts={args.experts} top-2, 2 ranks, "
          f"{args.samples} x 256 tokens per step")
    print(f"{'':6}{'rank':>5} {'experts materialised':>22} {'experts kept':>14} {'step':>8}")
    for ep, ranks in out.items():
        for r, x in enumerate(ranks):
            base = out[1][r]
            print(f"ep={ep}:{r:>5} {x['materialised'] / 2**20:>10.2f} MiB ({x['materialised'] / base['materialised']:.3f}x)"
                  f" {x['kept'] / 2**20:>7.2f} MiB {x['step_s']:>7.2f} s ({x['step_s'] / base['step_s']:.2f}x)")


if __name__ == "__main__":
    main()
