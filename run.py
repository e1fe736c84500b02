"""Entry point, the same on every rank:  deepspeed --num_gpus N run.py --config examples/X.yaml [a.b=value ...]"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from slime.utils.signals import exit_on_interrupt

if __name__ == "__main__":  # not in a child multiprocessing spawns, which imports this file as __mp_main__
    exit_on_interrupt()  # before the imports that take seconds: Ctrl-C during them is an exit, not a traceback per rank
from slime.config import describe, load_config  # noqa: E402
from slime.utils.startup import long_lived_imports  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="SPMD RL trainer on DeepSpeed ZeRO-3. Override any field with section.key=value.",
        epilog="Config fields (section.key = default):\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML run config (examples/*.yaml)")
    ap.add_argument("--dry-run", action="store_true",
                    help="validate the config, print the layout and a memory estimate per GPU, and exit "
                         "(reads only the model's config.json)")
    ap.add_argument("--check", action="store_true",
                    help="validate the config and its overrides and exit (run.sh does so before it launches the "
                         "ranks, so that a mistake is said once, not by every rank)")
    ap.add_argument("--num-gpus", type=int, default=8, help="with --dry-run: trainer ranks to plan for")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0, help="with --dry-run: memory of one GPU")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # set by deepspeed
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = ap.parse_intermixed_args(argv)  # overrides before and after an option: all of them
    if args.num_gpus < 1 or args.gpu_memory_gb <= 0:
        ap.error(f"--num-gpus ({args.num_gpus}) must be >= 1 and --gpu-memory-gb ({args.gpu_memory_gb}) > 0")
    if args.check:  # its warnings (settings ignored, ...) are the ranks' to log, once they have set up logging
        logging.disable(logging.WARNING)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, TypeError, FileNotFoundError) as e:
        sys.exit(f"config error: {e}")
    if args.check:
        return
    if args.dry_run:
        from slime.dry_run import report

        try:
            print(report(cfg, args.num_gpus, args.gpu_memory_gb))
        except (ValueError, OSError) as e:
            sys.exit(f"dry run: {e}")
        return

    with long_lived_imports():  # no full collections during the imports; their objects frozen after
        from slime.distributed.parallel_dims import leave
        from slime.trainer.loop import run, started
        from slime.utils.logging import setup_logging

    setup_logging()
    try:
        run(cfg)
    except (ValueError, TypeError, OSError) as e:
        # A start-up error (a path, a setting, the data) names what to fix: its message, without the traceback
        # every rank would print. Past start-up, or with SLIME_TRACEBACK=1, the traceback as usual.
        if started() or os.environ.get("SLIME_TRACEBACK") == "1":
            raise
        rank = os.environ.get("RANK", "0")
        hint = " (SLIME_TRACEBACK=1 shows where it was raised)" if rank == "0" else ""
        sys.exit(f"[rank{rank}] start-up error: {type(e).__name__}: {e}{hint}")
    mark = os.environ.get("SLIME_DONE_FILE")  # run.sh's: exit code 0 without it is a process that ended early
    if mark and os.environ.get("RANK", "0") == "0":
        Path(mark).write_text("finished\n")
    leave()  # every rank finished: part from the others before the interpreter tears the groups down


if __name__ == "__main__":
    main()
