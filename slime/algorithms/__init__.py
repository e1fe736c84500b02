"""RL math as pure tensor functions: advantages, policy/value losses, KL, rollout correction.

See docs/algorithms.md for which config keys select which published recipe.
"""

from slime.algorithms.advantages import (
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_returns,
    rloo_advantages,
)
from slime.algorithms.importance import rollout_correction
from slime.algorithms.kl import kl_estimate
from slime.algorithms.policy_loss import (
    aggregate_loss,
    cispo_policy_loss,
    gspo_policy_loss,
    masked_mean,
    ppo_policy_loss,
    segment_sum,
)
from slime.algorithms.value_loss import clipped_value_loss

__all__ = [
    "aggregate_loss",
    "cispo_policy_loss",
    "clipped_value_loss",
    "gae_advantages",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_estimate",
    "masked_mean",
    "masked_whiten",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_returns",
    "rloo_advantages",
    "rollout_correction",
    "segment_sum",
]
