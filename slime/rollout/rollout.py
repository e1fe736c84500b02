"""One rollout: prompts -> n responses each -> rewards -> advantages, all on this rank's share."""
from __future__ import annotations

import logging

import torch

from slime.algorithms.advantages import grpo_advantages, rloo_advantages
from slime.config import AlgoConfig, RolloutConfig
from slime.data.prompts import Prompt
from slime.data.sample import Sample
from slime.rollout.engine import RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)


def sampling_params(cfg: RolloutConfig) -> SamplingParams:
    return SamplingParams(max_new_tokens=cfg.max_response_len, temperature=cfg.temperature, top_p=cfg.top_p,
                          stop_token_ids=tuple(cfg.stop_token_ids), n=cfg.n_samples_per_prompt)


def generate_rollout(engine: RolloutEngine, prompts: list[Prompt], params: SamplingParams, tokenizer, reward_fn,
                     *, first_group_id: int) -> list[Sample]:
    """Generate `params.n` responses per prompt and score them. Group ids start at first_group_id."""
    outputs = engine.generate([p.prompt_ids for p in prompts], params)
    samples = []
    for g, (prompt, gens) in enumerate(zip(prompts, outputs)):
        for gen in gens:
            samples.append(Sample(
                prompt_ids=list(prompt.prompt_ids), response_ids=gen.response_ids, rollout_logprobs=gen.logprobs,
                prompt_text=prompt.prompt_text, response_text=tokenizer.decode(gen.response_ids, skip_special_tokens=True),
                label=prompt.label, metadata=dict(prompt.metadata), group_id=first_group_id + g,
                finish_reason=gen.finish_reason))
    for sample, reward in zip(samples, reward_fn.score(samples)):
        sample.reward = float(reward)
    return samples


def compute_advantages(samples: list[Sample], cfg: AlgoConfig) -> dict:
    """Set `sample.advantage` from rewards (sequence-level estimators); returns metrics."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups = torch.tensor([s.group_id for s in samples], dtype=torch.long)
    if cfg.advantage_estimator == "grpo":
        adv, metrics = grpo_advantages(rewards, groups, normalize_std=cfg.normalize_std)
    elif cfg.advantage_estimator == "dr_grpo":
        adv, metrics = grpo_advantages(rewards, groups, normalize_std=False)
    elif cfg.advantage_estimator == "rloo":
        adv, metrics = rloo_advantages(rewards, groups)
    else:
        raise ValueError(f"algo.advantage_estimator={cfg.advantage_estimator!r} is not supported")
    for sample, a in zip(samples, adv.tolist()):
        sample.advantage = a
    return {k: float(v) for k, v in metrics.items()}
