"""Checkpoints: the DeepSpeed engine state plus loop state (step, data position) and per-rank RNG."""
from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(engine, ckpt_dir: Path, *, step: int, loop_state: dict, rank: int) -> None:
    """Collective. `step` is the number of completed steps; resuming starts there."""
    tag = f"step_{step}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step, **loop_state})
    torch.save(_rng_state(), ckpt_dir / tag / f"rng_rank{rank}.pt")
    logger.info("saved checkpoint %s", ckpt_dir / tag)


def load_checkpoint(engine, ckpt_dir: Path, *, rank: int) -> dict | None:
    """Load the latest checkpoint if one exists; returns its loop state (with 'step') or None."""
    if not (ckpt_dir / "latest").is_file():
        return None
    path, client_state = engine.load_checkpoint(str(ckpt_dir))
    if path is None:
        raise RuntimeError(f"{ckpt_dir}: 'latest' exists but the checkpoint could not be loaded")
    tag = (ckpt_dir / "latest").read_text().strip()
    _set_rng_state(torch.load(ckpt_dir / tag / f"rng_rank{rank}.pt", weights_only=False))
    logger.info("resumed from %s at step %d", ckpt_dir / tag, client_state["step"])
    return client_state
