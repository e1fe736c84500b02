"""Prompt-length statistics of a converted data file, and the packing a token budget would reach on it.

    python data_tools/length_report.py --data data/gsm8k/train.jsonl --model models/Qwen3-4B \\
        --max-tokens-per-gpu 16384 --response-len 1024 --dp 8 --batch 64 --n 8
    python data_tools/length_report.py --config examples/qwen25vl_3b_geo3k.yaml --dp 8 [section.key=value ...]

Prompts are tokenised exactly as a run would: with --config, the run's data.* and model.* settings (keys, system
prompt, chat template, max_prompt_len, image pixels) and its defaults for the flags; without, the trainer's
defaults. The flags override the config. Responses do not exist
before a rollout, so each sample gets a response length drawn uniformly from [response-len / 4,
response-len] (seeded): the report shows how full the packed micro-batches would be, and how much of a
padded layout (`--micro-batch-size` samples per micro-batch) would be padding, for `--batch` prompts x `--n`
samples over `--dp` ranks. With algo.policy_loss=sft (in the config, or as an override) the data is read as SFT
reads it (chats ending in the assistant's reply, labels required) and each prompt is one sample whose response is
its label as the run learns it (--n and --response-len do not apply).
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(data, model, *, max_tokens: int, response_len: int, dp: int, batch: int, n: int,
           micro_batch_size: int = 8, max_prompt_len: int = 1 << 30, seed: int = 0, sft: bool = False,
           num_mini_batches: int = 1, share_prompts: bool = False) -> dict:
    """`data` and `model`: a run's DataConfig and ModelConfig, or the paths alone (the rest the defaults, with
    `max_prompt_len`). `sft`: the rows as SFT reads them, one sample per prompt with its label as the response
    (the run's micro-batch row: prompt + label + the turn's end, less the last token, a target only). As the run
    plans: each of `num_mini_batches` mini-batches on its own (the packing figures are means over them), and with
    `share_prompts` a prompt's samples in one micro-batch carry it once."""
    from slime.config import DataConfig, ModelConfig
    from slime.data.packing import packing_stats, padded_fixed_batches, plan_micro_batches
    from slime.data.prompts import load_prompts, sft_samples, turn_end_stops
    from slime.models.loading import load_processor, load_tokenizer

    model_cfg = model if isinstance(model, ModelConfig) else ModelConfig(path=model)
    data_cfg = data if isinstance(data, DataConfig) else DataConfig(path=data, max_prompt_len=max_prompt_len)
    tokenizer = load_tokenizer(model_cfg)
    limit = (max_tokens, "--max-tokens-per-gpu") if sft else None  # SFT skips a row past it, as the run does
    prompts, load = load_prompts(data_cfg, tokenizer, processor=load_processor(model_cfg, tokenizer),
                                 label_required=sft, label_is_text=sft, max_sample_len=limit)
    lengths = [len(p.prompt_ids) for p in prompts]
    rng = random.Random(seed)
    keys = None
    if sft:
        rows = [len(s.prompt_ids) + len(s.response_ids) - 1
                for s in sft_samples(prompts, tokenizer, turn_end_stops(tokenizer, data_cfg))]
        samples = [rng.choice(rows) for _ in range(batch)]
    else:
        drawn = [rng.choice(lengths) for _ in range(batch)]
        samples = [p + rng.randint(max(1, response_len // 4), response_len) for p in drawn for _ in range(n)]
        keys = [(j, p) for j, p in enumerate(drawn) for _ in range(n)] if share_prompts else None
    if len(samples) < num_mini_batches:
        raise ValueError(f"train.num_mini_batches={num_mini_batches} is more than the {len(samples)} samples a step "
                         "has")
    bounds = [round(m * len(samples) / num_mini_batches) for m in range(num_mini_batches + 1)]  # as the run splits
    packed, padded = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        part, part_keys = samples[a:b], keys[a:b] if keys else None
        plan = plan_micro_batches(part, max_tokens=max_tokens, dp_size=dp, prompts=part_keys, allow_empty=True)
        packed.append(packing_stats(part, plan, max_tokens=max_tokens, prompts=part_keys))
        padded.append(packing_stats(part, padded_fixed_batches(part, micro_batch_size=micro_batch_size, dp_size=dp,
                                                               allow_empty=True), padded=True))

    def mean(stats: list[dict]) -> dict:  # over the mini-batches, as the run's train/ metrics
        return {k: sum(st[k] for st in stats) / len(stats) if all(st[k] is not None for st in stats) else None
                for k in stats[0] if isinstance(stats[0][k], (int, float)) or stats[0][k] is None}

    packed, padded = mean(packed), mean(padded)
    return {"prompts": len(lengths), "too_long": load.too_long, "skipped": dict(load.skipped),
            "min": min(lengths), "median": int(statistics.median(lengths)), "p90": percentile(lengths, 0.9),
            "p99": percentile(lengths, 0.99), "max": max(lengths), "packed": packed, "padded": padded}


FLAGS = {"model.path": "--model", "data.path": "--data", "train.max_tokens_per_gpu": "--max-tokens-per-gpu",
         "rollout.max_response_len": "--response-len", "rollout.batch_size": "--batch",
         "rollout.n_samples_per_prompt": "--n"}


def as_flags(message: str) -> str:
    """A message from the trainer's code, naming this tool's flags where it names the settings they stand for."""
    return re.sub("|".join(map(re.escape, FLAGS)), lambda m: FLAGS[m.group(0)], message)


def shares_no_prompts(cfg) -> str | None:
    """Why the run would not share prompts on this machine (the trainer's reasons), or None: it would."""
    from slime.models.adapters import adapter_for
    from slime.models.attention import resolve_attn_implementation
    from slime.models.loading import check_model_path, resolve_dtype
    from slime.trainer.layout import prompts_unshared

    check_model_path(cfg.model)
    adapter = adapter_for(cfg.model)  # as the trainer reads the model (a GGUF file too)
    return prompts_unshared(cfg.train, sp=cfg.parallel.sp, multimodal=adapter.multimodal, moe=adapter.moe,
                            attention=resolve_attn_implementation(cfg.model.attn_implementation,
                                                                  resolve_dtype(cfg.model.dtype)))


def main(argv: list[str] | None = None) -> None:
    from slime.config import load_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="a run's YAML: its data.* and model.* settings, and its values for the flags")
    ap.add_argument("--data", help="data.path (required without --config)")
    ap.add_argument("--model", help="model.path: the model directory, whose tokenizer (and processor) is used")
    ap.add_argument("--max-tokens-per-gpu", type=int, help="train.max_tokens_per_gpu")
    ap.add_argument("--response-len", type=int, help="rollout.max_response_len")
    ap.add_argument("--dp", type=int, default=8, help="data-parallel ranks (default 8)")
    ap.add_argument("--batch", type=int, help="rollout.batch_size")
    ap.add_argument("--n", type=int, help="rollout.n_samples_per_prompt")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="for the padded comparison (default 8)")
    ap.add_argument("overrides", nargs="*", help="section.key=value settings over --config, as run.py takes them")
    args = ap.parse_args(argv)
    flags = {"data.path": args.data, "model.path": args.model, "train.max_tokens_per_gpu": args.max_tokens_per_gpu,
             "rollout.max_response_len": args.response_len, "rollout.batch_size": args.batch,
             "rollout.n_samples_per_prompt": args.n}
    try:
        cfg = load_config(args.config, [*args.overrides, *(f"{k}={v}" for k, v in flags.items() if v is not None)])
        args.data, args.max_tokens_per_gpu = cfg.data.path, cfg.train.max_tokens_per_gpu
        sft = cfg.algo.policy_loss == "sft"
        unshared = shares_no_prompts(cfg)
        r = report(cfg.data, cfg.model, max_tokens=cfg.train.max_tokens_per_gpu,
                   response_len=cfg.rollout.max_response_len, dp=args.dp, batch=cfg.rollout.batch_size,
                   n=cfg.rollout.n_samples_per_prompt, micro_batch_size=args.micro_batch_size, sft=sft,
                   num_mini_batches=cfg.train.num_mini_batches, share_prompts=unshared is None and not sft)
    except (ValueError, TypeError, OSError) as e:  # the trainer's messages, with this tool's flags for its settings
        ap.error(as_flags(str(e)))
    print(f"{args.data}: {r['prompts']} prompts (dropped as too long: {r['too_long']}, skipped: {r['skipped'] or 0})")
    print(f"prompt tokens: min {r['min']}  median {r['median']}  p90 {r['p90']}  p99 {r['p99']}  max {r['max']}")
    if sft:
        print("algo.policy_loss=sft: one sample per prompt, its label as the response (as the run learns it)")
    else:
        print(f"shared prompts: {'off (' + unshared + ')' if unshared else 'on (a prompt once per micro-batch)'}")
    pk, pd = r["packed"], r["padded"]
    per = f" per mini-batch ({cfg.train.num_mini_batches})" if cfg.train.num_mini_batches > 1 else ""
    print(f"packed under {args.max_tokens_per_gpu} tokens over {args.dp} ranks: budget fill {pk['budget_fill']:.3f}, "
          f"real-token fraction {pk['real_token_fraction']:.3f}, {pk['num_micro_batches']:g} micro-batches per "
          f"rank{per}, dp imbalance {pk['compute_imbalance']:.3f}")
    print(f"padded, {args.micro_batch_size} per micro-batch: real-token fraction {pd['real_token_fraction']:.3f}")


if __name__ == "__main__":
    main()
