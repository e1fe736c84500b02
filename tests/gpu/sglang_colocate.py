"""GPU check of the colocated sglang engine (not part of CI; run on a machine with one GPU and SGLang).

    python tests/gpu/sglang_colocate.py [--python PYTHON_WITH_SGLANG] [--hidden 1024] [--layers 8]

Writes a random Qwen2 model (bf16), starts one server with the memory saver on GPU 0, then prints
the GPU's free memory (torch.cuda.mem_get_info, whole device) after start, after `sleep()`, after
the weight push (which resumes `weights` first) and after `wake()` (which resumes `kv_cache`), and
checks that:
  - sleep frees at least 80% of what the server took, and wake takes it back (within 20%);
  - a push of perturbed weights as CUDA-IPC tensor buckets makes the server's greedy tokens those of
    an HF model holding the same weights (bf16: compared on the first 8 tokens of each prompt), and
    different from before the push; the served weight version is the pushed one.
Exit code 0 when every check passes; the numbers are printed either way.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from data_tools.make_tiny_model import make_tiny_model  # noqa: E402
from slime.config import ModelConfig, SGLangConfig  # noqa: E402
from slime.models.loading import load_tokenizer  # noqa: E402
from slime.rollout.engine import SamplingParams  # noqa: E402
from slime.rollout.sglang_engine import SGLangEngine, server_args  # noqa: E402
from slime.rollout.sglang_server import SGLangServer, free_port  # noqa: E402
from tests.one_rank import OneRank  # noqa: E402


def chat_ids(tokenizer, question: str) -> list[int]:
    """Prompt ids as the data path makes them: chat template as text, then tokenized."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def free_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0] / 2**30


def hf_greedy(model, prompts, n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0, top_k=None, top_p=None, temperature=None)
        out.append(g[0, len(p):].tolist())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=sys.executable, help="python with sglang (default: this one)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mem-fraction", type=float, default=0.3)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="sglang-gpu-check-"))
    model_dir = make_tiny_model(work / "model", arch="qwen2", seed=0, hidden=args.hidden, layers=args.layers,
                                heads=16, kv_heads=8)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    hf.save_pretrained(model_dir)  # serve the bf16 weights the reference holds
    model_cfg = ModelConfig(path=str(model_dir), dtype="bfloat16")
    tokenizer = load_tokenizer(model_cfg)
    prompts = [chat_ids(tokenizer, q)
               for q in ("12+7=", "name a colour", "write a haiku", "abc")]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    checks: dict[str, bool] = {}

    cfg = SGLangConfig(mem_fraction=args.mem_fraction)
    base = free_gib()
    server = SGLangServer(args.python, str(model_dir), port=free_port(), env={}, log_path=work / "server.log",
                          args=server_args(cfg, dtype=torch.bfloat16, gpu_id=0, colocated=True))
    server.start()
    try:
        t = time.time()
        server.wait_ready(900)
        print(f"server ready in {time.time() - t:.0f}s, log {server.log_path}")
        engine = SGLangEngine(SGLangConfig(urls=[server.url]), model_cfg, tokenizer, OneRank())
        engine.clients[0].server = server
        started = free_gib()
        before = [g[0].response_ids for g in engine.generate(prompts, greedy)]

        engine.sleep()
        asleep = free_gib()
        torch.manual_seed(1)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.02 * torch.randn_like(p))
        named = [(n, p.detach()) for n, p in hf.named_parameters()]
        buckets = [named[i:i + 16] for i in range(0, len(named), 16)]
        t = time.time()
        engine.update_weights(buckets, version=5)
        push_s = time.time() - t
        after_push = free_gib()
        engine.wake()
        awake = free_gib()
        after = [g[0].response_ids for g in engine.generate(prompts, greedy)]
        want = hf_greedy(hf, prompts, 8)
        served = engine.clients[0].get("/model_info")["weight_version"]
        metrics = engine.metrics()
        engine.shutdown()
    finally:
        server.kill()

    taken = base - started
    print(f"GPU free GiB: before server {base:.2f} | server up {started:.2f} (takes {taken:.2f}) | "
          f"asleep {asleep:.2f} (freed {asleep - started:.2f}) | after push, weights resumed {after_push:.2f} | "
          f"awake {awake:.2f}")
    print(f"push of {sum(t.numel() * t.element_size() for _, t in named) / 2**30:.3f} GiB in {push_s:.2f}s; "
          f"metrics {metrics}")
    print(f"greedy before push {before}\nafter push  {after}\nHF (pushed) {want}")
    checks["sleep frees >= 80% of the server's memory"] = asleep - started >= 0.8 * taken
    checks["wake restores it (within 20%)"] = abs((base - awake) - taken) <= 0.2 * taken
    checks["push gives the pushed model's greedy tokens"] = after == want
    checks["push changed the output"] = after != before
    checks["served version is the pushed one"] = served == "5"
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
