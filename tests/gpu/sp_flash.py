"""GPU check of Ulysses sequence parallelism with flash-attn varlen (not part of CI; needs 2 GPUs and flash-attn).

    python tests/gpu/sp_flash.py [--hidden 1024] [--layers 8] [--length 16384]

Runs tests/dist/sp_checks.py (a fixed packed batch with borders inside the shard cuts) with
model.attn_implementation=flash_attention_2 in bf16 on 1 GPU (sp=1) and on 2 GPUs (sp=2), and compares
per-sample logprobs (bf16: within 2e-2) and the loss; then trains one sample of `--length` tokens at a
per-GPU budget of length/2 with sp=2 (refused with sp=1) and prints torch.cuda.max_memory_allocated per
rank for one sample of length/2 tokens, sp=2 vs sp=1 (expected about 1/2 for the activations).
Exit code 0 when the checks pass.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def launch(nproc: int, script: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    str(script), *args], check=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--length", type=int, default=16384)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("needs 2 GPUs")
    from data_tools.make_tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="sp-gpu-"))
    model = make_tiny_model(work / "m", hidden=args.hidden, layers=args.layers, heads=16, kv_heads=4,
                            max_pos=2 * args.length)
    common = ["model.attn_implementation=flash_attention_2", "model.dtype=bfloat16"]
    (work / "sp1").mkdir()
    (work / "sp2").mkdir()
    launch(1, REPO / "tests/dist/sp_checks.py", str(model), str(work / "sp1"), "train.max_tokens_per_gpu=64", *common)
    launch(2, REPO / "tests/dist/sp_checks.py", str(model), str(work / "sp2"), "train.max_tokens_per_gpu=32",
           "parallel.sp=2", *common)
    a = torch.load(work / "sp1/result.pt", weights_only=False)
    b = torch.load(work / "sp2/result.pt", weights_only=False)
    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(a["logprobs"], b["logprobs"]))
    loss_rel = abs(a["metrics"]["loss"] - b["metrics"]["loss"]) / max(abs(a["metrics"]["loss"]), 1e-8)
    print(f"flash-attn varlen, bf16: max logprob diff sp=2 vs sp=1 {diff:.2e}, loss relative diff {loss_rel:.2e}")
    ok = diff < 2e-2 and loss_rel < 1e-2
    # memory: bench/sp_memory.py measures saved activations; here the allocator's peak on each GPU
    launch(1, REPO / "bench/sp_memory.py", f"--budget={args.length // 2}", "--sp=1", f"--model={model}",
           f"--out={work / 'mem1.json'}")
    launch(2, REPO / "bench/sp_memory.py", f"--budget={args.length // 2}", "--sp=2", f"--model={model}",
           f"--out={work / 'mem2.json'}")
    print((work / "mem1.json").read_text())
    print((work / "mem2.json").read_text())
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
