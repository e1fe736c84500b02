"""Reward functions for end-to-end tests: they give a random tiny model a learning signal."""
from slime.data.sample import Sample


def digit_fraction(sample: Sample) -> float:
    """Share of response characters that are digits (a random model scores > 0 sometimes)."""
    text = sample.response_text
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def huge(sample: Sample) -> float:
    """Finite in float64, infinite in float32: what made losses NaN before rewards were checked."""
    return 1e39


def sleep_on_rank1(sample: Sample) -> float:
    """Rank 1 hangs in its reward function (long after the collective timeout of the test)."""
    import os
    import time

    if os.environ.get("RANK") == "1":
        time.sleep(120)
    return 0.0


def exits(sample: Sample) -> float:
    """A verifier that ends the process as a command-line tool would."""
    import sys

    sys.exit(0)


def os_exits(sample: Sample) -> float:
    """Ends the process at once, before any handler or atexit runs: nothing inside the process can see it."""
    import os

    os._exit(0)
