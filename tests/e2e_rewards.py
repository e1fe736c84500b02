"""Reward functions for end-to-end tests: they give a random tiny model a learning signal."""
from slime.data.sample import Sample


def digit_fraction(sample: Sample) -> float:
    """Share of response characters that are digits (a random model scores > 0 sometimes)."""
    text = sample.response_text
    return sum(c.isdigit() for c in text) / max(len(text), 1)
