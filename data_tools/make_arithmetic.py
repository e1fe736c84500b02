"""Synthetic integer arithmetic with exactly checkable answers, as prompt jsonl files.

    python data_tools/make_arithmetic.py --out-dir data/arith --n-train 5000 --n-eval 500 \
        --seed 0 --min-digits 1 --max-digits 2 --ops +- [--format plain|chat]

Each line is {"prompt": ..., "label": "<integer>", "metadata": {"a", "op", "b", "format"}}.
`plain` prompts ("12+7=") suit a tiny character-level model whose expected response is the answer
digits then end-of-sequence (reward "exact_match"); `chat` prompts ask for <answer></answer>
(reward "exact_match" or "math", optionally plus "format").

Invariants: every problem is distinct, within and across splits; the eval split depends only on
the seed and the problem settings (not on --n-train); subtraction never goes negative.
"""
from __future__ import annotations

import argparse
import json
import operator
import random
from pathlib import Path

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
FORMATS = ("plain", "chat")


def _operand_count(min_digits: int, max_digits: int) -> int:
    """How many integers have between min_digits and max_digits digits (0 counts as 1 digit)."""
    low = 0 if min_digits == 1 else 10 ** (min_digits - 1)
    return 10 ** max_digits - low


def _draw_operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    # Digit count first, so 1-digit operands are as common as 2-digit ones.
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def format_prompt(a: int, op: str, b: int, fmt: str) -> str:
    if fmt == "plain":
        return f"{a}{op}{b}="
    return f"What is {a}{op}{b}? Put the answer in <answer></answer>."


def make_split(*, n_train: int, n_eval: int, seed: int = 0, min_digits: int = 1,
               max_digits: int = 2, ops: str = "+-", fmt: str = "plain",
               ) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of distinct problems; raises ValueError when too few exist."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"ops {ops!r} must be a non-empty string of characters from {''.join(OPS)}")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
    if n_train < 1 or n_eval < 0:
        raise ValueError(f"need n_train >= 1 (a run reads the train file) and n_eval >= 0, got {n_train}, {n_eval}")
    ops = "".join(dict.fromkeys(ops))  # '++-' must not make '+' twice as likely
    n = _operand_count(min_digits, max_digits)
    space = sum(n * (n + 1) // 2 if op == "-" else n * n for op in ops)
    wanted = n_train + n_eval
    if wanted > space:
        raise ValueError(f"only {space} distinct problems exist for digits {min_digits}..{max_digits}"
                         f" and ops {ops!r}, but {wanted} were asked for; raise --max-digits, add "
                         "ops, or lower --n-train/--n-eval")

    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    rows: list[dict] = []
    # Rejection sampling; the cap only matters when nearly the whole space is asked for.
    for _ in range(50 * wanted + 10_000):
        if len(rows) == wanted:
            break
        a, b = (_draw_operand(rng, min_digits, max_digits) for _ in range(2))
        op = rng.choice(ops)
        if op == "-" and a < b:
            a, b = b, a
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        rows.append({"prompt": format_prompt(a, op, b, fmt), "label": str(OPS[op](a, b)),
                     "metadata": {"a": a, "op": op, "b": b, "format": fmt}})
    if len(rows) < wanted:
        raise ValueError(f"drew only {len(rows)} distinct problems of {wanted} asked for (space "
                         f"{space}); ask for fewer or widen --max-digits")
    # Eval first: it then stays the same when only n_train changes.
    return rows[n_eval:], rows[:n_eval]


def write_jsonl(rows: list[dict], path: Path) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--n-train", type=int, default=5000)
    p.add_argument("--n-eval", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-digits", type=int, default=1)
    p.add_argument("--max-digits", type=int, default=2)
    p.add_argument("--ops", default="+-", help=f"characters from {''.join(OPS)!r}")
    p.add_argument("--format", choices=FORMATS, default="plain", dest="fmt")
    args = p.parse_args(argv)
    try:
        train, eval_ = make_split(n_train=args.n_train, n_eval=args.n_eval, seed=args.seed,
                                  min_digits=args.min_digits, max_digits=args.max_digits,
                                  ops=args.ops, fmt=args.fmt)
    except ValueError as e:
        p.error(str(e))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", eval_)):
        if not rows:  # --n-eval 0: no eval file (an empty one is an error where a run reads it), and not an
            # earlier run's, whose problems this train split now holds (the eval's are drawn first)
            if (args.out_dir / f"{name}.jsonl").exists():
                (args.out_dir / f"{name}.jsonl").unlink()
                print(f"removed {args.out_dir / f'{name}.jsonl'} of an earlier run: its problems are in this "
                      "train split")
            continue
        write_jsonl(rows, args.out_dir / f"{name}.jsonl")
        print(f"wrote {len(rows)} rows to {args.out_dir / f'{name}.jsonl'}")
    print(f"example: {train[0]}")


if __name__ == "__main__":
    main()
