"""Logging set-up: one format for every rank, library INFO shown on rank 0 only."""
from __future__ import annotations

import logging
import os
import sys
import warnings


class _RankZeroFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


def setup_logging(level: int = logging.INFO) -> None:
    rank = int(os.environ.get("RANK", "0"))
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[%(asctime)s r{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    handler.addFilter(_RankZeroFilter(rank))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*torch.utils.checkpoint.*")
    # DeepSpeed's ZeRO-3 calls torch's deprecated all_gather_into_tensor / reduce_scatter_tensor, and the
    # warning came back at every step on every rank (a third of a short run's lines)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
