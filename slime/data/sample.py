"""The unit of work that travels from rollout to training.

Token ids are the source of truth: engines are given ids and return ids, nothing is re-tokenised.
Per-token values (logprobs, advantages, values, returns) are 1-D float32 tensors aligned with
`response_ids`, never Python lists: a rank holds only the samples it trains on, and those fields
are its largest part.
"""
from __future__ import annotations

import dataclasses
import decimal
import math
from typing import Any

import torch

from slime.multimodal.processor import MultimodalInputs

TOKEN_FIELDS = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "advantages", "values", "returns")
"""Per-response-token tensor fields; a micro-batch concatenates the ones its samples carry."""


@dataclasses.dataclass
class Sample:
    prompt_ids: list[int]
    """Prompt token ids, chat template already applied."""
    response_ids: list[int] = dataclasses.field(default_factory=list)
    """Generated token ids, including the stop token when generation stopped on one."""
    response_mask: list[int] | None = None
    """1 for response tokens that carry loss; 0 for tool/observation tokens. None means all 1."""
    rollout_logprobs: torch.Tensor | None = None
    """Per-response-token logprobs reported by the rollout engine (after temperature)."""
    prompt_text: str = ""
    response_text: str = ""
    label: Any = None
    """Ground truth for rule-based rewards (answer string, list of answers, ...)."""
    metadata: dict = dataclasses.field(default_factory=dict)
    reward: float = 0.0
    given_reward: float | None = None
    """The reward a generate function gave the sample (`Trajectory.sample(reward=...)`); the reward function scores
    the samples without one."""
    task_reward: float | None = None
    """The reward before DAPO's overlong penalty (rollout.overlong_penalty), where one is added; dynamic sampling
    filters on it."""
    advantages: torch.Tensor | None = None
    """Per-response-token advantages (sequence-level estimators repeat one value)."""
    old_logprobs: torch.Tensor | None = None
    """Trainer-side logprobs under the weights that generated the batch (PPO's pi_old)."""
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    """Critic values at each response position (PPO/GAE)."""
    returns: torch.Tensor | None = None
    group_id: int = 0
    """Samples of the same prompt share a group id (GRPO/RLOO baselines are per group)."""
    index: int = 0
    """Position in the step's global rollout batch (rank-major); identifies the sample across ranks."""
    finish_reason: str = ""
    """'stop' (hit a stop token), 'length' (hit max_new_tokens) or 'abort'."""
    mm: MultimodalInputs | None = None
    """Image-text samples: pixel patches and grids of the prompt's images (their tokens are in prompt_ids)."""

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def row_len(self) -> int:
        """Tokens the sample puts in a micro-batch row on its own (slime/data/batch.py): its prompt and its response
        less the last token, which is only a target (no later token reads its hidden state)."""
        return len(self.prompt_ids) + max(len(self.response_ids) - 1, 0)

    @property
    def loss_mask(self) -> torch.Tensor:
        """(R,) float32: 1 where a response token carries loss."""
        if self.response_mask is None:
            return torch.ones(len(self.response_ids), dtype=torch.float32)
        return torch.as_tensor(self.response_mask, dtype=torch.float32)

    @property
    def num_patches(self) -> int:
        return 0 if self.mm is None else self.mm.num_patches

    @property
    def num_loss_tokens(self) -> int:
        return len(self.response_ids) if self.response_mask is None else int(sum(self.response_mask))


def as_token_tensor(values) -> torch.Tensor:
    """A per-token field as a detached 1-D float32 CPU tensor."""
    return torch.as_tensor(values, dtype=torch.float32).detach().reshape(-1).cpu()


def unscorable_answers(label) -> list:
    """The answers of `label` the built-in rewards cannot compare with a response (a dict, a nested list, a bool,
    None: str() of one would be compared as its Python repr, and never match; a NaN or an infinity: JSON's NaN would
    give a response "nan" the reward)."""
    answers = list(label) if isinstance(label, (list, tuple)) else [label]
    return [x for x in answers if isinstance(x, bool) or not isinstance(x, (str, int, float))
            or (isinstance(x, float) and not math.isfinite(x))]


def answer_kind(x) -> str:
    """What an answer is, for a message: "a dict", "NaN or an infinity"."""
    return "NaN or an infinity" if isinstance(x, float) and not math.isfinite(x) else f"a {type(x).__name__}"


def label_text(label) -> str:
    """A label as text, a float as its digits: str(0.00001) is '1e-05' (what SFT would teach, and what a reward
    would compare the answer "0.00001" with)."""
    if isinstance(label, float) and math.isfinite(label):
        return format(decimal.Decimal(repr(label)), "f")
    return str(label)
