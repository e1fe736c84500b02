"""Packed, balanced micro-batches versus fixed-size padded micro-batches on RL-like lengths.

Lengths: prompt ~ uniform[50, 300] plus response ~ lognormal (median 400) capped at 4096.
Cost per sample is `default_cost` (12*h*L + L^2, h=4096); a padded micro-batch costs
size * cost(longest). "lockstep" is the sum over micro-batch steps of the slowest rank, which
is what a ZeRO-3 step waits for.

    python bench/packing.py [--n 1024] [--seed 0] [--max-tokens 16384] [--dp 2 8] [--samples-per-prompt 8]

Then shared prompts (train.share_prompts): the same sizes with each prompt (uniform[500, 2000] tokens here)
shared by --samples-per-prompt samples, planned with every copy counted (as before f1fb686) against each
prompt counted once per micro-batch (`prompts=`, what the trainer does): micro-batches per rank and the budget
filled by the tokens the micro-batches really hold (`micro_batch_tokens`), and the ranks' compute imbalance with
each prompt counted once. Last, 200 small random GRPO batches (2 or 4 ranks, 2 or 4 prompts a rank of 20, 100
or 400 tokens, 4 samples each, responses uniform[1, 300]; h=1024): the imbalance of ranks balanced by whole
lengths against ranks balanced with each shared prompt paid once (what the trainer does).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.data.packing import (default_cost, flatten_plan, micro_batch_tokens, packing_stats,  # noqa: E402
                                padded_fixed_batches, plan_micro_batches)

TARGET_REAL_TOKEN_FRACTION = 0.97
TARGET_IMBALANCE = 1.05


def rl_lengths(n: int, seed: int, max_response: int = 4096) -> list[int]:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(50, 301, size=n)
    response = np.minimum(max_response, np.ceil(rng.lognormal(math.log(400), 1.0, size=n)))
    return (prompt + response).astype(int).tolist()


def shared_prompt_batch(n: int, per_prompt: int, seed: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Lengths and `Prompts` of n samples, per_prompt of them per prompt of uniform[500, 2000] tokens."""
    rng = np.random.default_rng(seed)
    lengths, prompts = [], []
    for i in range(n):
        if i % per_prompt == 0:
            prompt = int(rng.integers(500, 2001))
        response = int(min(4096, math.ceil(rng.lognormal(math.log(400), 1.0))))
        lengths.append(prompt + response)
        prompts.append((i // per_prompt, prompt))
    return lengths, prompts


def shared_prompt_rows(args) -> None:
    lengths, prompts = shared_prompt_batch(args.n, args.samples_per_prompt, args.seed)
    shared_tokens = micro_batch_tokens(range(len(lengths)), lengths, prompts)
    print(f"\nshared prompts: {args.n} samples, {args.samples_per_prompt} per prompt of 500-2000 tokens; "
          f"{sum(lengths)} tokens with every copy, {shared_tokens} with each prompt once")
    print(f"{'dp':>3} {'planned by':<13} {'mbs/rank':>8} {'fill':>6} {'imbal':>6} {'plan_ms':>7}")
    for dp in args.dp:
        owners = [i * dp // len(lengths) for i in range(len(lengths))]  # rank-local rollout: siblings together
        for name, given in (("every copy", None), ("shared tokens", prompts)):
            t0 = time.perf_counter()
            plan = plan_micro_batches(lengths, max_tokens=args.max_tokens, dp_size=dp, owners=owners, prompts=given)
            ms = 1e3 * (time.perf_counter() - t0)
            mbs = [mb for rank in plan for mb in rank if mb]
            fill = sum(micro_batch_tokens(mb, lengths, prompts) for mb in mbs) / (len(mbs) * args.max_tokens)
            imbalance = packing_stats(lengths, plan, prompts=prompts)["compute_imbalance"]
            print(f"{dp:>3} {name:<13} {len(plan[0]):>8} {fill:>6.3f} {imbalance:>6.3f} {ms:>7.1f}")


def small_grpo_balance_rows(batches: int = 200) -> None:
    cost = functools.partial(default_cost, hidden_size=1024)
    imbalance = {"whole lengths": [], "shared prompts": []}
    moved = {"whole lengths": [], "shared prompts": []}
    for seed in range(batches):
        rng = random.Random(seed)
        dp = rng.choice([2, 4])
        n_prompts = dp * rng.choice([2, 4])
        lengths, prompts, owners = [], [], []
        for g in range(n_prompts):
            p = rng.choice([20, 100, 400])
            for _ in range(4):
                lengths.append(p + rng.randint(1, 300))
                prompts.append((g, p))
                owners.append(g * dp // n_prompts)
        for name, given in (("whole lengths", None), ("shared prompts", prompts)):
            plan = plan_micro_batches(lengths, max_tokens=4096, dp_size=dp, cost_fn=cost, owners=owners,
                                      prompts=given)
            imbalance[name].append(packing_stats(lengths, plan, cost_fn=cost, prompts=prompts)["compute_imbalance"])
            dest = {i: r for r, mbs in enumerate(plan) for mb in mbs for i in mb}
            moved[name].append(sum(dest[i] != owners[i] for i in range(len(lengths))) / len(lengths))
    old, new = imbalance["whole lengths"], imbalance["shared prompts"]
    print(f"\n{batches} random GRPO batches, max/mean rank cost with each prompt counted once:")
    for name, v in imbalance.items():
        print(f"  balanced by {name:<15} mean {statistics.mean(v):.3f}  p90 {sorted(v)[int(0.9 * len(v))]:.3f}  "
              f"max {max(v):.3f}  samples moved {statistics.mean(moved[name]):.1%}")
    print(f"  shared prompts better in {sum(a < b - 1e-3 for a, b in zip(new, old))}, "
          f"worse in {sum(a > b + 1e-3 for a, b in zip(new, old))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1024, help="samples in the global batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=16384,
                        help="token budget per GPU per packed micro-batch")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 8], help="data-parallel sizes")
    parser.add_argument("--micro-batch-size", type=int, default=8,
                        help="samples per micro-batch in the padded baseline")
    parser.add_argument("--samples-per-prompt", type=int, default=8, help="shared prompts: samples per prompt")
    args = parser.parse_args()

    lengths = rl_lengths(args.n, args.seed)
    q = np.percentile(lengths, [50, 90, 99, 100])
    print(f"N={args.n} seed={args.seed} tokens={sum(lengths)} length p50/p90/p99/max="
          f"{'/'.join(str(int(x)) for x in q)}; packed budget={args.max_tokens}, "
          f"padded micro_batch_size={args.micro_batch_size}\n")
    header = (f"{'dp':>3} {'layout':<7} {'real_frac':>9} {'fill':>6} {'mbs/rank':>8} "
              f"{'lower_bd':>8} {'imbal':>7} {'lockstep':>8} {'peak_tok':>8} {'plan_ms':>7}")
    print(header)
    print("-" * len(header))
    ok = True
    ratios = []
    for dp in args.dp:
        t0 = time.perf_counter()
        plan = plan_micro_batches(lengths, max_tokens=args.max_tokens, dp_size=dp)
        plan_ms = 1e3 * (time.perf_counter() - t0)
        packed = packing_stats(lengths, plan, max_tokens=args.max_tokens)
        n_even = len(lengths) - len(lengths) % dp  # the padded layout needs equal rank shares
        padded = packing_stats(
            lengths[:n_even], padded_fixed_batches(lengths[:n_even], dp_size=dp,
                                                   micro_batch_size=args.micro_batch_size),
            padded=True)
        # No plan can use fewer micro-batches than the busiest rank's tokens over the budget.
        lower = math.ceil(sum(lengths) / (dp * args.max_tokens))
        for name, s, bound, ms in (("packed", packed, str(lower), f"{plan_ms:.1f}"),
                                   ("padded", padded, "-", "-")):
            fill = "-" if s["budget_fill"] is None else f"{s['budget_fill']:.3f}"
            print(f"{dp:>3} {name:<7} {s['real_token_fraction']:>9.3f} {fill:>6} "
                  f"{s['num_micro_batches']:>8} {bound:>8} {s['compute_imbalance']:>7.4f} "
                  f"{s['lockstep_imbalance']:>8.4f} {s['max_micro_batch_tokens']:>8} {ms:>7}")
        step = {k: s["lockstep_imbalance"] * s["total_cost"] / dp for k, s in
                (("packed", packed), ("padded", padded))}
        ratios.append((dp, padded["total_cost"] / packed["total_cost"],
                       step["padded"] / step["packed"],
                       packed["real_token_fraction"] / padded["real_token_fraction"]))
        ok &= packed["real_token_fraction"] >= TARGET_REAL_TOKEN_FRACTION  # 1.0 where the plan holds only samples:
        covered = sorted(flatten_plan(plan)) == list(range(len(lengths)))  # and each sample once, none dropped
        if not covered:
            print(f"dp={dp}: the packed plan does not hold every sample exactly once")
        ok &= covered
        ok &= packed["compute_imbalance"] <= TARGET_IMBALANCE

    print("\npadded / packed:")
    for dp, compute, step, frac in ratios:
        print(f"  dp={dp}: compute {compute:.2f}x, lockstep step compute {step:.2f}x, "
              f"real-token fraction packed/padded {frac:.2f}x")
    print(f"\ntargets (packed): every sample planned once, real_token_fraction >= {TARGET_REAL_TOKEN_FRACTION}, "
          f"compute_imbalance <= {TARGET_IMBALANCE}: {'met' if ok else 'NOT met'}")
    print("real_frac: real tokens / tokens processed (packed kernels see no padding). "
          "fill: mean micro-batch tokens / budget. lower_bd: ceil(tokens / (dp * budget)).")
    shared_prompt_rows(args)
    small_grpo_balance_rows()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
