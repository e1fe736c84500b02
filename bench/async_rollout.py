"""Step time with synchronous vs one-step-off rollout (rollout.one_step_off), same settings, same run.

    python bench/async_rollout.py [--hidden 384] [--layers 4] [--steps 6] [--nproc 1] [--equal-cores]

Runs run.py on the tiny arithmetic prompts with a random model of the given size and the in-process hf
engine, first synchronous, then one-step-off, and prints the median `time/step` of steps 2.. for each and
the ratio. The overlap only pays where generation and training do not compete for the same compute (an
engine on its own GPUs, or spare CPU cores: with one rank on a 2-core machine the generation thread
gets the second core). `--equal-cores` adds the synchronous run given those cores too (twice the threads per
rank): the comparison on equal compute.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(model: Path, run_dir: Path, nproc: int, steps: int, extra: list[str], threads: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_grpo.yaml"), f"model.path={model}",
           f"log.run_dir={run_dir}", f"train.num_steps={steps}", "eval.path=null", "checkpoint.export_hf=false",
           "checkpoint.save_final=false", "checkpoint.interval=0", "rollout.max_response_len=24", *extra]
    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=1, help="trainer ranks")
    ap.add_argument("--equal-cores", action="store_true",
                    help="also the synchronous run with twice the threads per rank (the cores the overlap uses)")
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    from data_tools.make_tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="async-bench-"))
    model = make_tiny_model(work / "m", hidden=args.hidden, layers=args.layers, heads=max(4, args.hidden // 64),
                            kv_heads=2)
    med = {}
    runs = [("sync", [], threads), ("one_step_off", ["rollout.one_step_off=true", "algo.tis.level=token"], threads)]
    if args.equal_cores:
        runs.append((f"sync_{2 * threads}_threads", [], 2 * threads))
    for name, extra, n_threads in runs:
        rows = run(model, work / name, args.nproc, args.steps, extra, n_threads)
        times = sorted(r["time/step"] for r in rows[1:])
        med[name] = times[len(times) // 2]
        gen = sorted(r["time/rollout"] for r in rows[1:])[len(times) // 2]
        print(f"{name:13s} time/step median {med[name]:6.2f} s   waiting for rollout {gen:6.2f} s   "
              f"policy lag {rows[-1].get('rollout/policy_lag', 0.0):.0f}")
    print(f"model hidden={args.hidden} layers={args.layers}, {args.nproc} rank(s) of {threads} thread(s), "
          f"{args.steps} steps (median of steps 2..); one_step_off / sync: {med['one_step_off'] / med['sync']:.2f}x "
          "the step time")
    if args.equal_cores:
        name = f"sync_{2 * threads}_threads"
        print(f"on equal cores: one_step_off / {name}: {med['one_step_off'] / med[name]:.2f}x the step time")


if __name__ == "__main__":
    main()
