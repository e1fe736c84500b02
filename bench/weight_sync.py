"""Weight sync: GiB/s of a push into the SGLang engine, against a memcpy of the same bytes, in the same run.

    export SLIME_SGLANG_PYTHON=... [SLIME_SGLANG_PYTHONPATH=...]   # see docs/sglang.md
    python bench/weight_sync.py [--hidden 512] [--layers 10] [--steps 4] [--modes colocated,disaggregated]

A random Qwen3 model (~25M parameters at the defaults, fp32) trains for a few GRPO steps on one rank with
an SGLang server on CPU; after each step the trainer gathers its weights and pushes them (colocated: the
tensors handed to the server; disaggregated: a broadcast over the weight-update group). Printed per mode:
bytes per push, the median push time (steps 2..N) and GiB/s, and the hf engine's in-process push for
reference; then a single-thread memcpy of the same bytes (dst.copy_(src)) and each push's share of it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CPU_ARGS = ["--max-total-tokens", "4096", "--skip-server-warmup", "--random-seed", "0"]


def memcpy_gib_per_s(nbytes: int, reps: int = 7) -> float:
    import torch

    torch.set_num_threads(1)
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / 2**30 / statistics.median(times)


CONFIG = REPO / "examples/cpu_tiny_grpo.yaml"


def overrides(model: Path, data: Path, run_dir: Path, steps: int, engine: list[str]) -> list[str]:
    """The bench's settings over CONFIG (tests/test_bench.py loads them: a config check must not break it)."""
    return [f"model.path={model}", f"data.path={data}", f"log.run_dir={run_dir}", "data.apply_chat_template=false",
            "rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.max_response_len=8",
            "rollout.reward.fn=exact_match", f"train.num_steps={steps}", "train.lr=1e-5", "train.min_lr=0",
            "eval.path=null", "checkpoint.export_hf=false", "checkpoint.save_final=false", "checkpoint.interval=0",
            "model.dtype=float32", *engine]  # fp32 on a GPU too (auto: bf16): the bytes counted are the fp32 file's


def run(model: Path, data: Path, run_dir: Path, steps: int, engine: list[str]) -> list[dict]:
    cmd = [sys.executable, str(REPO / "run.py"), "--config", str(CONFIG), *overrides(model, data, run_dir, steps, engine)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    log = run_dir.with_suffix(".log")
    with open(log, "w") as f:
        if subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"the run failed, see {log}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--modes", default="colocated,disaggregated")
    args = ap.parse_args()
    sglang_python = os.environ.get("SLIME_SGLANG_PYTHON")
    if not sglang_python:
        sys.exit("set SLIME_SGLANG_PYTHON to the Python of an SGLang environment (docs/sglang.md)")
    import torch

    from bench.vs_trl import write_prompts
    from data_tools.make_tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="weight-sync-"))
    model = make_tiny_model(work / "model", arch="qwen3", seed=0, hidden=args.hidden, layers=args.layers, heads=4,
                            kv_heads=2)
    nbytes = sum(t.numel() * t.element_size() for t in
                 __import__("safetensors.torch", fromlist=["load_file"]).load_file(model / "model.safetensors").values())
    data = write_prompts(work, 64)
    env = {"SGLANG_USE_CPU_ENGINE": "1"} if not torch.cuda.is_available() else {}
    if os.environ.get("SLIME_SGLANG_PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["SLIME_SGLANG_PYTHONPATH"]
    sglang = ["rollout.engine=sglang", f"rollout.sglang.python={sglang_python}",
              f"rollout.sglang.extra_args={json.dumps(CPU_ARGS)}", f"rollout.sglang.env={json.dumps(env)}"]
    print(f"model: {args.hidden}x{args.layers} qwen3, {nbytes / 2**20:.1f} MiB of fp32 weights per push")
    results = {}
    for mode in args.modes.split(","):
        rows = run(model, data, work / mode, args.steps, [*sglang, f"rollout.sglang.mode={mode}"])
        times = [r["sglang/sync_s"] for r in rows[1:] if "sglang/sync_s" in r]
        results[f"sglang {mode}"] = statistics.median(times)
    rows = run(model, data, work / "hf", args.steps, ["rollout.engine=hf"])
    results["hf engine (in-process copy)"] = statistics.median(r["time/sync"] for r in rows[1:])
    copy = memcpy_gib_per_s(nbytes)
    print(f"memcpy of the same bytes (1 thread): {copy:.2f} GiB/s ({nbytes / 2**30 / copy * 1e3:.1f} ms)")
    for name, t in results.items():
        rate = nbytes / 2**30 / t
        print(f"  {name:28s} {t * 1e3:8.1f} ms per push  {rate:6.2f} GiB/s  {rate / copy:.2f}x memcpy")


if __name__ == "__main__":
    main()
