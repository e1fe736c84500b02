"""Decode attention against the memory it must read: is the hf engine's decode attention at the bandwidth bound?

    python bench/decode_attention.py [--rows 64] [--layers 10] [--keys 8,40,71,256] [--threads 1] [--reps 15]

A decode step's attention reads every cached key and value of every row once per layer: rows x KV heads x keys x
head dim x 2 floats. At a rollout's sizes (the 23.7M model of bench/vs_trl.py: 64 rows, 2 KV heads of 128, 10
layers, 8 to 71 keys) that is 5 to 93 MB a step, more than stays in cache between steps. Per key count, over
--layers layers' caches in turn (each its own buffer, of capacity keys + 16 as the engine's cache grows), median
of --reps, caches evicted before each repetition:

- read: a sum over the same cached keys and values, the least any attention can take here;
- step: `cached_attention` (slime/models/decode_step.py), the attention of the compiled decode step
  (rollout.hf_compile=step, the CPU default), compiled as the step is: head sizes constant, rows and keys dynamic;
- fused: `decode_attention_fused` (slime/models/attention.py), the same sums compiled with every size dynamic, the
  eager step's attention under rollout.hf_compile=attention;
- matmuls: `_decode_attention`, two batched matmuls (the eager step's attention otherwise).

Printed: ms per step (all layers), GB/s of the cache bytes, and each / read: how far it is from the bound.
4 query heads over 2 KV heads of 128, fp32, as bench/vs_trl.py's models.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from slime.models.attention import _decode_attention, decode_attention_fused  # noqa: E402
from slime.models.decode_step import _distinct_sizes, _dynamic, cached_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--keys", default="8,40,71,256", help="key counts (cached positions), comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b, scale = args.rows, HEAD_DIM ** -0.5
    evict = torch.empty(64 * 2 ** 20 // 4)  # 64 MB written before each repetition
    query = torch.randn(b, HEADS, 1, HEAD_DIM)
    print(f"{args.threads} thread(s), fp32, {b} rows, {HEADS} heads over {KV_HEADS} KV heads of {HEAD_DIM}, "
          f"{args.layers} layers' caches in turn, median of {args.reps}")

    def all_layers(q, new, keys, values, mask):  # one compiled call a step, as in the decode step's graph
        return [cached_attention(q, new, new, k, v, mask, scale) for k, v in zip(keys, values)]

    step = torch.compile(all_layers, dynamic=False, fullgraph=True)
    q, new = query.view(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM), torch.randn(b, KV_HEADS, HEAD_DIM)

    for keys in map(int, args.keys.split(",")):
        caches = [(torch.randn(b, KV_HEADS, keys + 16, HEAD_DIM)[:, :, :keys],
                   torch.randn(b, KV_HEADS, keys + 16, HEAD_DIM)[:, :, :keys]) for _ in range(args.layers)]
        mask, step_mask = torch.ones(b, 1, 1, keys, dtype=torch.bool), torch.ones(b, keys + 1, dtype=torch.bool)
        keys_, values_ = [k for k, _ in caches], [v for _, v in caches]
        _dynamic(q, new, new, step_mask, keys_, values_)  # rows and keys dynamic, as the decode step marks them

        def step_attention():
            with _distinct_sizes():
                step(q, new, keys_, values_, step_mask)

        runs = {  # each: all layers' attention of a step
            "read": lambda: [(k.sum(), v.sum()) for k, v in caches],
            "step": step_attention,
            "fused": lambda: [decode_attention_fused(query, k, v, mask, scale) for k, v in caches],
            "matmuls": lambda: [_decode_attention(query, k, v, mask, scale) for k, v in caches],
        }
        for name in ("step", "fused"):  # compiles, once per process
            runs[name]()
        times = {name: [] for name in runs}
        for _ in range(args.reps):  # alternating, so a slower minute hits all alike
            for name, fn in runs.items():
                evict.fill_(1.0)
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        nbytes = 2 * args.layers * b * KV_HEADS * keys * HEAD_DIM * 4
        t = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"{keys:4d} keys ({nbytes / 1e6:5.1f} MB a step): " + ", ".join(
            f"{name} {1e3 * s:6.2f} ms ({nbytes / s / 1e9:4.1f} GB/s" + ("" if name == "read" else
                                                                        f", {s / t['read']:.2f}x read") + ")"
            for name, s in t.items()))


if __name__ == "__main__":
    main()
