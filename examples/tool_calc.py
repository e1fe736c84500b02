"""A calculator tool for the tiny arithmetic model: a generate function for `rollout.generate_fn`.

    bash run.sh examples/cpu_tiny_tool_grpo.yaml

The policy calls the calculator by writing an expression followed by "=" (generation stops there); the
tool's answer and a newline are appended as an observation (mask 0: no loss, no KL, no entropy), and the
policy takes the next turn, up to MAX_TURNS. The final answer is what the policy writes last, graded
against the label here (the sample's reward), so a copied tool result does not count unless the policy
writes it itself. See docs/custom_rollouts.md.
"""
from __future__ import annotations

import re

from slime.rollout.custom import RolloutContext

MAX_TURNS = 3
EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")


def calculate(expression: str) -> str | None:
    """The value of "a+b", "a-b" or "a*b" (integers), or None for anything else."""
    m = EXPRESSION.match(expression)
    if m is None:
        return None
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def calculator_rollout(ctx: RolloutContext):
    equals = ctx.tokenizer.convert_tokens_to_ids("=")
    samples = []
    for _ in range(ctx.n):
        traj = ctx.trajectory()
        last = ""
        for _turn in range(MAX_TURNS):
            gen = traj.generate(stop_token_ids=[equals])
            last = ctx.tokenizer.decode(gen.response_ids, skip_special_tokens=True)
            if not gen.response_ids or gen.response_ids[-1] != equals:
                break  # an answer (EOS), or out of tokens
            value = calculate(last[:-1])
            if value is None:
                break  # not a call the tool understands: the turn stands as the answer
            traj.observe(ctx.tokenizer(value + "\n", add_special_tokens=False).input_ids)
        answer = last.strip().removesuffix("=")
        samples.append(traj.sample(reward=float(answer == str(ctx.prompt.label).strip()),
                                   metadata={"tool_calls": traj.turns - 1}))
    return samples
