"""Evaluation on a held-out prompt file (greedy, or n sampled answers per prompt for pass@k): accuracy, pass@k,
mean reward and the reward functions' extras over every rank's share."""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time

import torch

from slime.config import Config
from slime.data.prompts import SKIP_REASONS, Prompt, load_prompts, rows_on_every_rank, turn_end_stops, with_pixels
from slime.distributed.parallel_dims import ParallelDims
from slime.rollout.engine import SamplingParams
from slime.rollout.rewards import needs_label
from slime.rollout.rollout import generate_rollout, reward_info_metrics, sampling_params

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EvalSet:
    prompts: list[Prompt]
    """This rank's share: empty where the file has fewer prompts than ranks (the rank still takes part)."""
    skipped: dict[str, int]
    """Prompts of the file left out, by reason, over every rank: reported as eval/skipped_<reason>."""
    longest_prompt: int = 0
    """Tokens of the longest prompt evaluated, over every rank."""
    turn_end: tuple[int, ...] = ()
    """Stops besides EOS: the chat template's end of turn where it is not EOS (turn_end_stops)."""


def load_eval_prompts(cfg: Config, tokenizer, dims: ParallelDims, processor=None) -> EvalSet:
    """This rank's slice of the eval file (the first eval.max_prompts prompts, split over every rank), with
    pixels. Evaluation needs no trainer layout, so sp peers take different prompts too. A collective (the
    skip counts are summed over ranks): call on every rank."""
    prompts, report = load_prompts(cfg.data, tokenizer, path=cfg.eval.path, processor=processor,
                                   label_required=needs_label(cfg.rollout.reward.fn),
                                   reply_as_label=cfg.algo.policy_loss == "sft")
    not_everywhere = 0
    if dims.world_size > 1:  # as the training file: rows one rank failed to load would shift every slice after them
        common = rows_on_every_rank(prompts, dims)
        not_everywhere = len(prompts) - len(common)
        if not_everywhere:
            logger.warning("%s: %d eval prompt(s) another rank could not load are left out on this rank too",
                           cfg.eval.path, not_everywhere)
            prompts = [p for p in prompts if p.index in common]
    if cfg.eval.max_prompts:
        prompts = prompts[:cfg.eval.max_prompts]
    mine, drawn = with_pixels(prompts[dims.rank::dims.world_size], cfg.data, processor, cfg.eval.path)
    # Load-time counts are the same on every rank (each read the whole file); skips when drawn are per rank.
    skipped = collections.Counter({"too_long": report.too_long, "not_on_every_rank": not_everywhere,
                                   **report.skipped})
    reasons = sorted(set(SKIP_REASONS) | set(skipped))
    counts = [float(drawn[r]) for r in reasons]
    if dims.world_size > 1:
        counts = dims.all_reduce_sum(counts, group=dims.world_group)
    for reason, n in zip(reasons, counts):
        skipped[reason] += int(n)
    return EvalSet(mine, {r: n for r, n in sorted(skipped.items()) if n},
                   longest_prompt=max((len(p.prompt_ids) for p in prompts), default=0),
                   turn_end=turn_end_stops(tokenizer, cfg.data))


def evaluate(engine, evalset: EvalSet, cfg: Config, tokenizer, reward_fn, dims: ParallelDims) -> dict:
    start, prompts, ev = time.time(), evalset.prompts, cfg.eval
    stops = sampling_params(cfg.rollout, evalset.turn_end).stop_token_ids
    params = SamplingParams(max_new_tokens=ev.max_response_len or cfg.rollout.max_response_len,
                            temperature=ev.temperature, top_p=ev.top_p, stop_token_ids=stops,
                            n=ev.n_samples_per_prompt, trains=False)
    engine.wake()  # a colocated engine may still hold its KV cache released after the weight push
    # Sampling (eval.temperature > 0, or a generate_fn's ctx.generate(temperature=1.0)) draws from torch's global
    # generator, which the training rollout draws from too. With a stream of its own (the same at every
    # evaluation), evaluating leaves training as it would be without it, and two evaluations of one model agree.
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(cfg.train.seed + dims.rank)
        samples = generate_rollout(engine, prompts, params, tokenizer, reward_fn, first_group_id=0,
                                   generate_fn=cfg.rollout.generate_fn,
                                   generate_fn_timeout=cfg.rollout.generate_fn_timeout) if prompts else []
    correct = [s.reward >= ev.accuracy_threshold for s in samples]
    ks = pass_at_ks(ev.n_samples_per_prompt)
    groups: list[list[bool]] = [[] for _ in prompts]  # each prompt's answers (a generate_fn returns exactly n)
    for c, s in zip(correct, samples):
        groups[s.group_id].append(c)
    passed = pass_at_k_sums(groups, ks)
    n, n_correct, reward, length, cut, n_prompts, *pass_sums = dims.all_reduce_sum([
        len(samples), sum(correct), sum(s.reward for s in samples), sum(len(s.response_ids) for s in samples),
        sum(s.finish_reason == "length" for s in samples), len(prompts), *(x for pair in passed for x in pair)],
        group=dims.world_group)
    extras = {f"eval/{k}": v for k, v in reward_info_metrics(samples, dims).items()}  # a collective
    if not n:  # every prompt of the file left out (images that failed when drawn, ...)
        raise RuntimeError(f"evaluation on {cfg.eval.path}: no prompt left to evaluate (skipped: "
                           f"{evalset.skipped or 'none'}); fix the file or set eval.path=null")
    out = {"eval/accuracy": n_correct / n, "eval/reward_mean": reward / n, "eval/response_len": length / n,
           "eval/truncated_frac": cut / n, "eval/num_prompts": n_prompts}
    for k, total, count in zip(ks, pass_sums[::2], pass_sums[1::2]):
        if count:
            out[f"eval/pass@{k}"] = total / count
    if ev.n_samples_per_prompt > 1:
        out["eval/num_samples"] = n
    return {**out, **extras, **{f"eval/skipped_{r}": k for r, k in evalset.skipped.items()},
            "time/eval": time.time() - start}


def pass_at_ks(n: int) -> list[int]:
    """The k of eval/pass@k for n answers per prompt: 1, 2, 4, ... below n, and n; none for n = 1 (eval/accuracy)."""
    return [] if n == 1 else [k for k in (2 ** i for i in range(n.bit_length())) if k < n] + [n]


def pass_at_k_sums(groups: list[list[bool]], ks: list[int]) -> list[tuple[float, int]]:
    """Per k: (the sum over prompts of the chance that k of a prompt's answers drawn without replacement hold a
    correct one, the number of prompts summed). The unbiased estimator of pass@k from n >= k answers of which c are
    correct, 1 - C(n - c, k) / C(n, k) (Chen et al. 2021). Every prompt of an evaluation has n answers (a
    generate_fn must return exactly n); a group of fewer than k would be left out of that k, not counted as a pass."""
    out = []
    for k in ks:
        total, count = 0.0, 0
        for group in groups:
            n, c = len(group), sum(group)
            if n < k:
                continue
            total += 1.0 if n - c < k else 1.0 - math.prod(1 - k / i for i in range(n - c + 1, n + 1))
            count += 1
        out.append((total, count))
    return out
