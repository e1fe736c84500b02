"""Packed attention on CPU: one sdpa call per sample vs `packed_sdpa`'s length groups (one call per group).

    python bench/packed_attention.py [--heads 4] [--kv-heads 2] [--head-dim 128] [--reps 5]

Forward + backward of one attention layer over a packed row of 64 samples, 1 thread, for a uniform batch
(64 x 71 tokens, a GRPO batch at fixed lengths) and a long-tailed one; prints the median time of each and
the ratio, measured in the same run, and checks that both give the same output.
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from slime.models.attention import attention_groups, packed_sdpa_forward

    torch.set_num_threads(1)

    class Module:
        training = True

    def per_sample(q, k, v, cu):
        bounds = cu.tolist()
        outs = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                               enable_gqa=True) for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs, 2).transpose(1, 2).contiguous()

    def grouped(q, k, v, cu):
        return packed_sdpa_forward(Module, q, k, v, None, cu_seq_lens_q=cu)[0]

    rng = random.Random(0)
    batches = {"uniform 64 x 71": [71] * 64,
               "long-tailed 64": [40 + min(400, max(4, int(rng.lognormvariate(4.0, 0.8)))) for _ in range(64)]}
    for name, lengths in batches.items():
        cu = torch.tensor([0, *itertools.accumulate(lengths)])
        t = int(cu[-1])
        q = torch.randn(1, args.heads, t, args.head_dim, requires_grad=True)
        k, v = (torch.randn(1, args.kv_heads, t, args.head_dim, requires_grad=True) for _ in range(2))
        grad = torch.randn(1, t, args.heads, args.head_dim)
        diff = (per_sample(q, k, v, cu) - grouped(q, k, v, cu)).abs().max().item()
        times = {}
        for fn in (per_sample, grouped):
            ts = []
            for _ in range(args.reps):
                start = time.perf_counter()
                fn(q, k, v, cu).backward(grad)
                ts.append(time.perf_counter() - start)
            times[fn.__name__] = statistics.median(ts)
        print(f"{name}: {t} tokens, {len(attention_groups(tuple(cu.tolist())))} length groups, max |diff| {diff:.1e}; "
              f"fwd+bwd per layer: per-sample {times['per_sample'] * 1e3:.1f} ms, grouped {times['grouped'] * 1e3:.1f} "
              f"ms ({times['grouped'] / times['per_sample']:.2f}x)")


if __name__ == "__main__":
    main()
