"""A reward (or generate function) module that ends the process when imported, as a script's top level might."""
import sys

sys.exit(0)


def reward(sample) -> float:
    return 0.0


async def generate(ctx):
    return None
