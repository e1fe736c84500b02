"""Image-text rollout on a real SGLang server: the shipped tiny Qwen2-VL (assets/tiny-vl) answers the
same greedy tokens from SGLang as from the hf engine, from our expanded input_ids plus image_data.

    python tests/gpu/sglang_vl.py [--python PYTHON_WITH_SGLANG]

On a GPU (not part of CI). tests/test_sglang.py runs the same check with the CPU SGLang build, which
cannot serve Qwen2-VL today (see `CPU_LIMIT`); the test then skips with that reason.
Checks: SGLang's prompt_tokens equal len(input_ids) for every image-text request (our processor and
SGLang's size the images alike; SGLangEngine raises otherwise), greedy tokens equal the hf engine's,
and their logprobs agree within 1e-2 (bf16) / 1e-3 (fp32). Exit code 0 when every check passes.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from slime.config import ModelConfig, SGLangConfig  # noqa: E402
from slime.models.loading import load_processor, load_tokenizer  # noqa: E402
from slime.rollout.engine import SamplingParams  # noqa: E402
from slime.rollout.hf_engine import HFEngine  # noqa: E402
from slime.rollout.sglang_engine import SGLangEngine, server_args  # noqa: E402
from slime.rollout.sglang_server import SGLangServer, free_port  # noqa: E402
from tests.one_rank import OneRank  # noqa: E402

CPU_LIMIT = ("SGLang's CPU build cannot serve Qwen2-VL: sglang.srt.multimodal.processors.qwen_vl fails to import "
             "because the placeholder sgl_kernel has no fused_sigmoid_mul_cpu op, so no multimodal processor is "
             "registered for Qwen2VLForConditionalGeneration; run tests/gpu/sglang_vl.py on a GPU")
CPU_LIMIT_MARK = "No processor registered for architecture"


def vl_prompts(tokenizer, processor) -> tuple[list[list[int]], list]:
    """Three images of different sizes and a text-only prompt, as the data path makes them."""
    from data_tools.make_vl_task import QUESTION, draw, make_split

    _, specs = make_split(0, 3, seed=5)
    prompts, mm = [], []
    for k, spec in enumerate(specs):
        img = draw(spec).resize((56 + 28 * k, 56))
        text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                           {"type": "text", "text": QUESTION}]}],
                                             add_generation_prompt=True, tokenize=False)
        prompts.append(processor.prompt_ids(text, [img.size]))
        mm.append(processor.pixels([img]))
    prompts.append(tokenizer("<user>red or blue?<assistant>", add_special_tokens=False).input_ids)
    mm.append(None)
    return prompts, mm


def run_check(python: str, *, env: dict, log_dir: Path, extra_args: list[str] = ()) -> dict:
    """Start a server on assets/tiny-vl, generate greedily from both engines; raises SGLangServerError if
    the server does not come up (its log tail is in the message)."""
    model_cfg = ModelConfig(path=str(REPO / "assets/tiny-vl"), dtype="float32" if not torch.cuda.is_available()
                            else "bfloat16")
    dtype = torch.float32 if model_cfg.dtype == "float32" else torch.bfloat16
    server = SGLangServer(python, model_cfg.path, port=free_port(), env=env, log_path=log_dir / "server.log",
                          args=server_args(SGLangConfig(extra_args=list(extra_args)), dtype=dtype,
                                           gpu_id=0 if torch.cuda.is_available() else None, colocated=False))
    server.start()
    try:
        server.wait_ready(timeout=900)
        tokenizer = load_tokenizer(model_cfg)
        processor = load_processor(model_cfg, tokenizer)
        prompts, mm = vl_prompts(tokenizer, processor)
        ours = SGLangEngine(SGLangConfig(urls=[server.url]), model_cfg, tokenizer, OneRank())
        ours.clients[0].server = server
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
        got = [g[0] for g in ours.generate(prompts, greedy, mm=mm)]  # raises on a prompt_tokens mismatch
        hf = HFEngine(model_cfg, tokenizer, device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        want = [g[0] for g in hf.generate(prompts, greedy, mm=mm)]
        ours.shutdown()
        diff = max((abs(a - b) for x, y in zip(got, want) if x.response_ids == y.response_ids
                    for a, b in zip(x.logprobs, y.logprobs)), default=None)
        return {"same_tokens": [x.response_ids == y.response_ids for x, y in zip(got, want)], "logprob_diff": diff,
                "sglang": [x.response_ids for x in got], "hf": [y.response_ids for y in want]}
    finally:
        server.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=os.environ.get("SLIME_SGLANG_PYTHON", sys.executable))
    args = ap.parse_args()
    result = run_check(args.python, env={}, log_dir=Path(tempfile.mkdtemp(prefix="sglang-vl-")))
    print(result)
    tol = 1e-2 if torch.cuda.is_available() else 1e-3
    ok = all(result["same_tokens"]) and result["logprob_diff"] is not None and result["logprob_diff"] < tol
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
