"""User reward functions loaded by tests/test_rewards.py through 'module:function' specs."""
from __future__ import annotations

import asyncio
import threading

from slime.data.sample import Sample

CALL_THREADS: list[str] = []
"""Thread names that ran `length_reward`; lets a test check sync functions leave the loop thread."""

_in_flight = 0
MAX_IN_FLIGHT = 0
"""Peak number of concurrent `slow_async_reward` calls."""


def length_reward(sample: Sample) -> float:
    CALL_THREADS.append(threading.current_thread().name)
    return float(len(sample.response_text))


def reward_with_info(sample: Sample) -> dict:
    return {"reward": 2.0, "n_chars": len(sample.response_text)}


async def slow_async_reward(sample: Sample) -> float:
    global _in_flight, MAX_IN_FLIGHT
    _in_flight += 1
    MAX_IN_FLIGHT = max(MAX_IN_FLIGHT, _in_flight)
    await asyncio.sleep(0.01)
    _in_flight -= 1
    return 1.0 if sample.response_text == sample.label else 0.0


def rank_in_group(samples: list[Sample]) -> list[float]:
    """1.0 for the longest response of the group, 0.0 for the others."""
    longest = max(len(s.response_text) for s in samples)
    return [float(len(s.response_text) == longest) for s in samples]


async def async_group_size(samples: list[Sample]) -> list[float]:
    return [float(len(samples))] * len(samples)


def wrong_length_group(samples: list[Sample]) -> list[float]:
    return [1.0]


def returns_string(sample: Sample) -> str:
    return "1.0"


def dict_without_reward(sample: Sample) -> dict:
    return {"score": 1.0}


def dict_of_mixed_keys(sample: Sample) -> dict:
    return {"score": 1.0, 1: 2.0}


def returns_nan(sample: Sample) -> float:
    return float("nan")


NOT_CALLABLE = 3


def sleeps(sample: Sample) -> float:
    import time

    time.sleep(60)
    return 1.0


async def sleeps_async(sample: Sample) -> float:
    await asyncio.sleep(60)
    return 1.0


def scaled_group(samples: list[Sample]) -> list[float]:
    return [1e38] * len(samples)


def returns_huge_int(sample: Sample) -> int:
    return 10**400


def raises_key_error(sample: Sample) -> float:
    return {"right": 1.0}[sample.response_text]


def nan_extra(sample: Sample) -> dict:
    return {"reward": 1.0, "format": float("nan")}


async def blocks_the_loop(sample: Sample) -> float:
    """A blocking call made directly from async code (requests.get, say): it holds the event loop."""
    import time

    await asyncio.sleep(0)
    time.sleep(600)
    return 1.0


async def raises_its_own_timeout(sample: Sample) -> float:
    """A grader's HTTP call that timed out: the function's own error, not the trainer's timeout."""
    raise TimeoutError("the grader did not answer")


async def tool_never_answers(sample: Sample) -> float:
    """A blocking call made the usual way from async code (asyncio.to_thread) that never returns."""
    await asyncio.to_thread(threading.Event().wait)
    return 1.0


def numpy_values(sample: Sample):
    """What numpy code returns: np.bool_ for a comparison, a 0-d array for a reduction."""
    import numpy as np

    return np.bool_(sample.response_text == "a") if sample.index == 0 else np.array(0.25)


def first_token_is_one(sample: Sample) -> float:
    return float(sample.response_ids[0] == 1)
