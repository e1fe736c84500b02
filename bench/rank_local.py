"""What a rank holds and how long balancing takes: the global batch on every rank vs rank-local batches.

    python bench/rank_local.py [--samples 1024] [--mean-len 4096] [--ranks 2]

(re-launches itself under torchrun with --ranks CPU ranks over gloo.)

Before (the old design, rebuilt here as the baseline): every rank all-gathers every sample with its
per-token fields as Python lists (`all_gather_object`), plans the packing, and then holds the whole
global batch, old logprobs and advantages included. After (`slime.trainer.layout.distribute`): ranks
all-gather only (length, loss-token) pairs, plan the same way, exchange only the samples that change
rank, and hold their own share with per-token fields as float32 tensors.

Bytes held are counted per rank after scoring (rollout logprobs, old logprobs and advantages set):
Python objects by sys.getsizeof over their contents, tensors by their storage. Times are the median
of --reps runs of gather + plan (+ exchange), measured in the same run for both designs.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIELDS = ("rollout_logprobs", "old_logprobs", "advantages")


def deep_bytes(obj, seen=None) -> int:
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return sys.getsizeof(obj) + obj.untyped_storage().nbytes()
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_bytes(k, seen) + deep_bytes(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set)):
        size += sum(deep_bytes(x, seen) for x in obj)
    elif hasattr(obj, "__dict__"):
        size += deep_bytes(vars(obj), seen)
    return size


def make_local(n_local: int, mean_len: int, rank: int, as_tensors: bool):
    import torch

    from slime.data.sample import Sample

    rng = random.Random(1000 + rank)
    out = []
    for _ in range(n_local):
        total = rng.randint(mean_len // 2, mean_len * 3 // 2)
        p = rng.randint(128, 512)
        r = total - p
        logprobs = [rng.uniform(-5, 0) for _ in range(r)]
        out.append(Sample(prompt_ids=[rng.randint(1000, 150000) for _ in range(p)],
                          response_ids=[rng.randint(1000, 150000) for _ in range(r)],
                          rollout_logprobs=torch.tensor(logprobs) if as_tensors else logprobs))
    return out


def score(samples, as_tensors: bool) -> None:
    """What scoring adds: old logprobs and advantages, one value per response token."""
    import torch

    for s in samples:
        r = len(s.response_ids)
        s.old_logprobs = torch.full((r,), -1.0) if as_tensors else [-1.0 + 1e-9 * i for i in range(r)]
        s.advantages = torch.full((r,), 0.5) if as_tensors else [0.5 + 1e-9 * i for i in range(r)]


def run_rank(args) -> None:
    import torch

    from slime.data.packing import plan_micro_batches
    from slime.distributed.parallel_dims import ParallelDims
    from slime.trainer.layout import Layout, distribute

    torch.set_num_threads(1)
    dims = ParallelDims.build()
    n_local = args.samples // dims.dp
    layout = Layout(packing=True, max_tokens=args.max_tokens, micro_batch_size=1)
    timings = {"before": [], "after": []}
    held = {}
    for rep in range(args.reps):
        local = make_local(n_local, args.mean_len, dims.rank, as_tensors=False)
        dims.barrier()
        t0 = time.perf_counter()
        everything = [s for part in dims.all_gather_objects(local) for s in part]
        plan_micro_batches([s.total_len for s in everything], max_tokens=args.max_tokens, dp_size=dims.dp)
        timings["before"].append(time.perf_counter() - t0)
        if rep == 0:
            score(everything, as_tensors=False)
            held["before"] = deep_bytes(everything)
        del everything, local

        local = make_local(n_local, args.mean_len, dims.rank, as_tensors=True)
        dims.barrier()
        t0 = time.perf_counter()
        batch = distribute(local, dims, layout)
        timings["after"].append(time.perf_counter() - t0)
        if rep == 0:
            score(batch.samples, as_tensors=True)
            held["after"] = deep_bytes(batch.samples)
            moved = batch.moved
        del batch, local

    med = {k: sorted(v)[len(v) // 2] for k, v in timings.items()}
    per_rank = dims.all_gather_objects((held["before"], held["after"], med["before"], med["after"]))
    if dims.is_main:
        print(f"{args.samples} samples, mean {args.mean_len} tokens, {dims.dp} ranks, budget {args.max_tokens} tokens; "
              f"median of {args.reps} reps; {moved} samples moved between ranks")
        print(f"{'rank':>4} {'held before':>14} {'held after':>14} {'ratio':>6} {'gather+plan before':>19} "
              f"{'after':>8} {'ratio':>6}")
        for r, (hb, ha, tb, ta) in enumerate(per_rank):
            print(f"{r:>4} {hb / 2**20:>11.1f} MiB {ha / 2**20:>11.1f} MiB {ha / hb:>6.3f} {tb:>17.2f} s "
                  f"{ta:>6.2f} s {ta / tb:>6.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1024, help="samples in the global batch")
    ap.add_argument("--mean-len", type=int, default=4096, help="mean prompt+response tokens per sample")
    ap.add_argument("--max-tokens", type=int, default=16384, help="packing budget per micro-batch")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           __file__, *sys.argv[1:]]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
