"""Rebuild the shipped tiny image-text model (assets/tiny-vl): a Qwen2-VL that half-knows colours.

    python data_tools/build_tiny_vl.py [--steps N] [--nproc 2] [section.key=value ...]

Three stages, all deterministic (fixed seeds):
  1. data: the shape-colour task (data_tools/make_vl_task.py) in data/tiny-vl, 3000 train and 300
     held-out images (the images are not shipped: run.sh draws them on first use, in about 10 s);
  2. a random-init Qwen2-VL (text hidden 64, 2 layers; vision tower depth 1, width 32; byte-level
     tokenizer with the vision tokens and an image-aware chat template; data_tools/make_tiny_model.py);
  3. supervised training from scratch through the real trainer (algo.policy_loss=sft,
     examples/tiny_vl_sft.yaml) on CPU ranks, stopped early so the model is only partly right; its
     HF export (run_dir/hf, image processor included) becomes assets/tiny-vl.
The measured time and accuracies are in docs/vlm.md ("The tiny task").
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_tools import check_replaceable  # noqa: E402
from data_tools.build_tiny_arith import last_eval, run_sft  # noqa: E402
from data_tools.make_tiny_model import make_tiny_model  # noqa: E402
from data_tools.make_vl_task import write  # noqa: E402

TASK = dict(n_train=3000, n_eval=300, seed=0)
MODEL = dict(arch="qwen2_vl", seed=0, hidden=64, layers=2, heads=4, kv_heads=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "assets/tiny-vl", help="where the model goes")
    ap.add_argument("--data-dir", type=Path, default=REPO / "data/tiny-vl", help="where the task goes")
    ap.add_argument("--work-dir", type=Path, default=REPO / "runs/tiny_vl_build",
                    help="random init and the SFT run directory (deleted first)")
    ap.add_argument("--steps", type=int, default=None, help="SFT steps (default: the config's train.num_steps)")
    ap.add_argument("--nproc", type=int, default=2, help="CPU ranks (or GPUs) for the SFT job")
    ap.add_argument("overrides", nargs="*", help="extra section.key=value overrides for the SFT job")
    args = ap.parse_args()

    start = time.time()
    check_replaceable(args.work_dir, "--work-dir", ours=("init", "sft"))
    check_replaceable(args.out, "--out")
    write(args.data_dir, **TASK)  # always (~10 s, deterministic): a folder of another task would train in silence
    shutil.rmtree(args.work_dir, ignore_errors=True)
    init = make_tiny_model(args.work_dir / "init", **MODEL)
    run_dir = args.work_dir / "sft"
    steps = [f"train.num_steps={args.steps}"] if args.steps else []
    run_sft(init=init, data_dir=args.data_dir, run_dir=run_dir, nproc=args.nproc, overrides=steps + args.overrides,
            config="examples/tiny_vl_sft.yaml")
    shutil.rmtree(args.out, ignore_errors=True)
    shutil.copytree(run_dir / "hf", args.out)
    final = last_eval(run_dir)
    print(f"wrote {args.out} in {time.time() - start:.0f}s; held-out greedy accuracy "
          f"{final['eval/accuracy']:.3f} on {final['eval/num_prompts']:.0f} prompts after step {final['step']}")


if __name__ == "__main__":
    main()
