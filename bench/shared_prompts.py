"""Shared prompts (train.share_prompts): a GRPO micro-batch's forward + backward with each sample carrying its own
copy of the prompt vs the prompt carried once per micro-batch.

    python bench/shared_prompts.py [--hidden 256] [--layers 6] [--prompts 2] [--samples 8] [--response 64] [--reps 3]

A random Qwen3 model (data_tools), fp32, 1 thread, packed_sdpa; for prompts of 8, 128 and 512 tokens, prints the
tokens of each layout, the median time of one forward + backward and the ratio, both measured in the same run, and
the largest logprob difference between the layouts (they compute the same thing).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--response", type=int, default=64, help="response tokens per sample")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from data_tools.make_tiny_model import make_tiny_model
    from slime.data.batch import build_micro_batch
    from slime.data.sample import Sample
    from slime.models.attention import PACKED_SDPA
    from slime.models.policy import PolicyModel

    torch.set_num_threads(1)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch="qwen3", hidden=args.hidden, layers=args.layers,
                                heads=4, kv_heads=2, seed=0)
    model = PolicyModel(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=PACKED_SDPA))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.1f}M parameters; {args.prompts} prompts x {args.samples} samples x {args.response} "
          f"response tokens; forward + backward of one packed micro-batch, median of {args.reps}")
    g = torch.Generator().manual_seed(0)
    for prompt_len in (8, 128, 512):
        prompts = [torch.randint(5, 250, (prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
        samples = [Sample(prompt_ids=p, response_ids=torch.randint(5, 250, (args.response,), generator=g).tolist())
                   for p in prompts for _ in range(args.samples)]
        times, tokens, logps = {}, {}, {}
        for share in (False, True, False, True):  # alternating, so machine load hits both alike
            mb = build_micro_batch(samples, range(len(samples)), share_prompts=share)
            extra = {"prompt_prefixes": mb.prompt_prefixes} if mb.prompt_prefixes is not None else {}
            for _ in range(args.reps):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                logp, _ = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
                                target_ids=mb.target_ids, **extra)
                logp.sum().backward()
                times.setdefault(share, []).append(time.perf_counter() - start)
            tokens[share], logps[share] = mb.input_ids.numel(), logp.detach()
        diff = (logps[True] - logps[False]).abs().max().item()
        plain, shared = statistics.median(times[False]), statistics.median(times[True])
        print(f"prompt {prompt_len:4d} tokens: separate copies {tokens[False]:6d} tokens {plain:6.2f} s | shared "
              f"{tokens[True]:6d} tokens {shared:6.2f} s | {shared / plain:.2f}x the time, "
              f"{tokens[True] / tokens[False]:.2f}x the tokens | max |logprob diff| {diff:.1e}")


if __name__ == "__main__":
    main()
