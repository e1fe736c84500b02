"""Rebuild the shipped tiny arithmetic model (assets/tiny-arith) and its data (assets/tiny-arith-data).

    python data_tools/build_tiny_arith.py [--steps N] [--nproc 2] [section.key=value ...]

Three stages, all deterministic (fixed seeds):
  1. data: 2-digit addition in the plain format ("63+41=" -> "104"), 7000 train and 500
     held-out eval problems with no overlap (data_tools/make_arithmetic.py);
  2. a random-init Qwen2-style model (hidden 64, 2 layers, byte-level tokenizer with a chat
     template; data_tools/make_tiny_model.py);
  3. supervised training from scratch through the real trainer (algo.policy_loss=sft,
     examples/tiny_arith_sft.yaml) on CPU ranks, stopped early so the model is only partly right;
     its HF export (run_dir/hf) becomes assets/tiny-arith.
The measured time and accuracies are in docs/tiny_arith.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_tools import check_replaceable  # noqa: E402
from data_tools.make_arithmetic import make_split, write_jsonl  # noqa: E402
from data_tools.make_tiny_model import make_tiny_model  # noqa: E402

TASK = dict(n_train=7000, n_eval=500, seed=0, min_digits=2, max_digits=2, ops="+", fmt="plain")
"""Fixed-width operands keep every digit at a fixed position, which a 2-layer model learns in a few
hundred steps; with 1-2 digit operands or with subtraction it takes thousands (docs/tiny_arith.md)."""
MODEL = dict(arch="qwen2", seed=0, hidden=64, layers=2, heads=4, kv_heads=2)


def write_data(out_dir: Path) -> None:
    train, evals = make_split(**TASK)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(train, out_dir / "train.jsonl")
    write_jsonl(evals, out_dir / "eval.jsonl")


def run_sft(*, init: Path, data_dir: Path, run_dir: Path, nproc: int, overrides: list[str],
            config: str = "examples/tiny_arith_sft.yaml") -> None:
    """The SFT job through the real launcher and trainer, as `bash run.sh` would start it. It runs in the repository,
    so the paths go to it absolute (relative ones are the caller's, as the tools' options say)."""
    init, data_dir, run_dir = Path(init).resolve(), Path(data_dir).resolve(), Path(run_dir).resolve()
    cmd = ["deepspeed", "--num_gpus", str(nproc), "run.py", "--config", config,
           f"model.path={init}", f"data.path={data_dir / 'train.jsonl'}", f"eval.path={data_dir / 'eval.jsonl'}",
           f"log.run_dir={run_dir}", "checkpoint.resume=false", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, env=env, check=True)


def last_eval(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval/accuracy" in r][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "assets/tiny-arith", help="where the model goes")
    ap.add_argument("--data-dir", type=Path, default=REPO / "assets/tiny-arith-data", help="where the data goes")
    ap.add_argument("--work-dir", type=Path, default=REPO / "runs/tiny_arith_build",
                    help="random init and the SFT run directory (deleted first)")
    ap.add_argument("--steps", type=int, default=None, help="SFT steps (default: the config's train.num_steps)")
    ap.add_argument("--nproc", type=int, default=2, help="CPU ranks (or GPUs) for the SFT job")
    ap.add_argument("overrides", nargs="*", help="extra section.key=value overrides for the SFT job")
    args = ap.parse_args()

    start = time.time()
    check_replaceable(args.work_dir, "--work-dir", ours=("init", "sft"))
    check_replaceable(args.out, "--out")
    write_data(args.data_dir)
    shutil.rmtree(args.work_dir, ignore_errors=True)
    init = make_tiny_model(args.work_dir / "init", **MODEL)
    run_dir = args.work_dir / "sft"
    steps = [f"train.num_steps={args.steps}"] if args.steps else []
    run_sft(init=init, data_dir=args.data_dir, run_dir=run_dir, nproc=args.nproc, overrides=steps + args.overrides)
    shutil.rmtree(args.out, ignore_errors=True)
    shutil.copytree(run_dir / "hf", args.out)
    final = last_eval(run_dir)
    print(f"wrote {args.out} and {args.data_dir} in {time.time() - start:.0f}s; held-out greedy accuracy "
          f"{final['eval/accuracy']:.3f} on {final['eval/num_prompts']:.0f} prompts after step {final['step']}")


if __name__ == "__main__":
    main()
