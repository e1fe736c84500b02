"""The unit of work that travels from rollout to training.

Token ids are the source of truth: engines are given ids and return ids, nothing is re-tokenised.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Sample:
    prompt_ids: list[int]
    """Prompt token ids, chat template already applied."""
    response_ids: list[int] = dataclasses.field(default_factory=list)
    """Generated token ids, including the stop token when generation stopped on one."""
    response_mask: list[int] | None = None
    """1 for response tokens that carry loss; 0 for tool/observation tokens. None means all 1."""
    rollout_logprobs: list[float] | None = None
    """Per-response-token logprobs reported by the rollout engine (after temperature)."""
    prompt_text: str = ""
    response_text: str = ""
    label: Any = None
    """Ground truth for rule-based rewards (answer string, list of answers, ...)."""
    metadata: dict = dataclasses.field(default_factory=dict)
    reward: float = 0.0
    advantages: list[float] | None = None
    """Per-response-token advantages (sequence-level estimators repeat one value)."""
    old_logprobs: list[float] | None = None
    """Trainer-side logprobs under the weights that generated the batch (PPO's pi_old)."""
    ref_logprobs: list[float] | None = None
    values: list[float] | None = None
    """Critic values at each response position (PPO/GAE)."""
    returns: list[float] | None = None
    group_id: int = 0
    """Samples of the same prompt share a group id (GRPO/RLOO baselines are per group)."""
    index: int = 0
    """Position in the global rollout batch; used to restore order after packing/balancing."""
    finish_reason: str = ""
    """'stop' (hit a stop token), 'length' (hit max_new_tokens) or 'abort'."""

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def loss_mask(self) -> list[int]:
        return self.response_mask if self.response_mask is not None else [1] * len(self.response_ids)
