"""hf engine decoding: our loop (stopped rows leave the batch) vs HF's generate, same model and prompts; our loop
with its decode step (slime/models/decode_step.py) vs the same loop over HF's forward; the step compiled whole
(rollout.hf_compile=step, auto's choice here) vs only its attention compiled (attention) vs eager (false); and
its decode step, compiled and eager, on packed weights (rollout.hf_packed_weights: oneDNN's layout where the engine
runs oneDNN, model.cpu_linear=auto on AMD; transposed copies on MKL) vs on the plain ones.

    python bench/hf_generation.py [--hidden 512] [--layers 10] [--prompts 16] [--n 4] [--max-new 64] [--reps 3]
                                  [--prompt-len 0]

1 thread, fp32, a random Qwen3 model, 16 prompts x 4 samples at temperature 1. Two settings: fixed
lengths (EOS ignored: both decode rows x max_new tokens) and ragged lengths (a set of stop tokens ends
responses early, as real responses do). Prints the median time of each, generated tokens per second and
the ratios, measured in the same run (our engines decode once before, untimed: the compiles); HF's generate
gets the same sampling settings (top_k=0). Prompts are 4-11 tokens, or --prompt-len tokens each: ours
prefills each prompt once for its n samples, HF's generate once per sample. Our engines sample from generators
of one seed, one each, drawn on from call to call: at a repetition they decode the same tokens as each other (up
to the compiled code's rounding), not the same tokens as at the last repetition.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=0, help="tokens per prompt (0: 4-11 at random)")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from data_tools.make_tiny_model import make_tiny_model
    from slime.config import ModelConfig
    from slime.rollout.engine import SamplingParams
    from slime.rollout.hf_engine import NO_TOKEN, HFEngine

    torch.set_num_threads(1)
    path = make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch="qwen3", hidden=args.hidden, layers=args.layers,
                           heads=4, kv_heads=2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    make = functools.partial(HFEngine, ModelConfig(path=str(path), dtype="float32"), tokenizer,
                             device=torch.device("cpu"), batch_size=args.prompts * args.n)
    engine = make()
    hf_forward = make(decode_step=False)
    attention, eager = make(compiled="attention"), make(compiled=False)
    unpacked = eager_unpacked = None
    if engine._step is not None and engine._step.pack is not None:  # the step on the plain weights
        unpacked, eager_unpacked = make(packed_weights=False), make(packed_weights=False, compiled=False)
        print(f"packed weights: {engine._step.pack}")
    else:
        print("the engine's decode step does not pack its weights here: no unpacked rows")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 250, (args.prompt_len or int(torch.randint(4, 12, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(args.prompts)]

    def hf_generate(params: SamplingParams) -> int:
        rows = [p for p in prompts for _ in range(params.n)]
        width = max(len(p) for p in rows)
        ids = torch.tensor([[engine.pad_id] * (width - len(p)) + p for p in rows])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in rows])[:, None]).long()
        stops = [NO_TOKEN] if params.ignore_eos else [engine.eos_id, *params.stop_token_ids]
        cfg = GenerationConfig(do_sample=True, temperature=params.temperature, top_k=0,
                               max_new_tokens=params.max_new_tokens, eos_token_id=stops, pad_token_id=engine.pad_id,
                               output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            out = engine.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        new = out.sequences[:, width:]
        ends = torch.isin(new, torch.tensor(stops)).int().argmax(1)
        return int(torch.where(torch.isin(new, torch.tensor(stops)).any(1), ends + 1, new.shape[1]).sum())

    def ours(params: SamplingParams, engine=engine) -> int:
        return sum(len(x.response_ids) for group in engine.generate(prompts, params) for x in group)

    runs = {"ours": ours, "ours, hf forward": lambda params: ours(params, hf_forward), "hf generate": hf_generate,
            "ours, attn compiled": lambda params: ours(params, attention),
            "ours, eager": lambda params: ours(params, eager)}
    if unpacked is not None:
        runs["ours, unpacked"] = lambda params: ours(params, unpacked)
        runs["ours, eager unpacked"] = lambda params: ours(params, eager_unpacked)

    # warm-up (compiles, page faults); same draws after
    for e in (engine, hf_forward, attention, eager, unpacked, eager_unpacked):
        if e is not None:
            ours(SamplingParams(max_new_tokens=40, n=args.n, ignore_eos=True, seed=0), e)
    settings = {"fixed lengths": SamplingParams(max_new_tokens=args.max_new, n=args.n, ignore_eos=True, seed=0),
                "ragged lengths": SamplingParams(max_new_tokens=args.max_new, n=args.n, seed=0,
                                                 stop_token_ids=tuple(range(5, 15)))}
    for name, params in settings.items():
        times, tokens = {label: [] for label in runs}, {}
        for _ in range(args.reps):
            for label, fn in runs.items():
                start = time.perf_counter()
                tokens[label] = fn(params)
                times[label].append(time.perf_counter() - start)
        t = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name}: {args.prompts}x{args.n} rows, <= {args.max_new} new tokens "
              f"(ours {tokens['ours']} tokens, HF {tokens['hf generate']})")
        for label in t:
            print(f"  {label:20s} {t[label]:6.2f} s  {tokens[label] / t[label]:7.0f} tokens/s")
        print(f"  ours / hf generate: {t['ours'] / t['hf generate']:.2f}x the time; "
              f"ours / ours over hf forward: {t['ours'] / t['ours, hf forward']:.2f}x"
              + (f"; packed / unpacked weights: {t['ours'] / t['ours, unpacked']:.2f}x, eager step "
                 f"{t['ours, eager'] / t['ours, eager unpacked']:.2f}x" if unpacked else ""))
        if engine._step is not None and engine._step.compiled:
            print(f"  step compiled / eager: {t['ours'] / t['ours, eager']:.2f}x the time; "
                  f"/ attention compiled: {t['ours'] / t['ours, attn compiled']:.2f}x")
        else:
            print("  (the decode step is not compiled for this model: rollout.hf_compile=auto needs a hidden size "
                  ">= 256 and a working compile)")


if __name__ == "__main__":
    main()
