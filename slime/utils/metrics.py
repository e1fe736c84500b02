"""Metrics sinks: console line, metrics.jsonl in the run directory, wandb and TensorBoard when enabled."""
from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path

from slime.config import LogConfig

logger = logging.getLogger(__name__)

CONSOLE_KEYS = [("rollout/reward_mean", "reward"), ("rollout/response_len", "len"), ("train/loss", "loss"),
                ("train/entropy", "ent"), ("train/pg_clipfrac", "clip"), ("train/grad_norm", "gnorm"),
                ("eval/accuracy", "acc"), ("eval/reward_mean", "eval_reward")]


class MetricsLogger:
    """Only rank 0 writes; other ranks hold a no-op logger."""

    def __init__(self, cfg: LogConfig, *, run_config: dict, enabled: bool, total_steps: int, resume_step: int = 0):
        self.enabled, self.total_steps = enabled, total_steps
        self.start, self.steps_done, self.first_step = time.time(), 0, None
        self.evaluated_at_resume = False  # the history holds an evaluation of the resumed step (rank 0 knows)
        self._wandb = self._tb = None
        self._file, self.last_step, self._wandb_sent_to = None, None, None
        if not enabled:
            return
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        history = self._truncate(resume_step)
        kept = [r for r in history if r["step"] == resume_step]  # the resumed step's records
        self.evaluated_at_resume = any(not _is_train(r) for r in kept)
        self._file = self.path.open("a")
        (run_dir / "config.json").write_text(json.dumps(run_config, indent=2))
        if cfg.wandb:
            import wandb

            # A resumed run goes on in the W&B run it resumes: one history, not a new run per restart. W&B takes
            # steps in increasing order only, so the steps the resumed run does again (after its checkpoint, up
            # to what W&B holds) are not sent again: W&B keeps their first values (the same values: a resume is
            # exact, one-step-off rollout aside). What W&B holds: up to the last step sent before a clean close
            # (wandb_step), or what the server says (online). A run killed hard lost the steps W&B still
            # buffered: those up to the checkpoint are sent again from metrics.jsonl.
            id_file, held_file = run_dir / "wandb_run_id", run_dir / "wandb_step"
            resumed = id_file.read_text().strip() if resume_step and id_file.is_file() else None
            run_id = resumed or uuid.uuid4().hex[:8]  # as W&B draws its ids
            id_file.write_text(run_id + "\n")
            if not resumed:
                held_file.unlink(missing_ok=True)  # an earlier W&B run's
            held = int(held_file.read_text()) if resumed and held_file.is_file() else -1  # -1: not step 0 either
            self._wandb = wandb.init(project=cfg.wandb_project, dir=str(run_dir), config=run_config,
                                     name=run_dir.name, mode=wandb_mode(cfg), id=run_id, resume="allow")
            if resumed:
                held = max(held, (getattr(self._wandb, "step", 0) or 0) - 1)  # online: the server's next step
                for record in history:
                    if record["step"] > held:
                        self._wandb.log({k: v for k, v in record.items() if k != "step" and v is not None},
                                        step=record["step"])
            # a new W&B run (the history was logged without W&B) gets every step from here on
            self._wandb_sent_to = self.last_step = max(held, resume_step) if resumed else None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run drops the events from its checkpoint's step on, as metrics.jsonl is cut back (no step
            # twice), and writes back the records kept of that step.
            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step or None)
            for record in kept:
                for key, value in record.items():
                    if key != "step":
                        self._tb.add_scalar(key, float("nan") if value is None else value, resume_step)

    def _truncate(self, resume_step: int | None) -> list[dict]:
        """Keep only what the resumed run will not log again: the records up to `resume_step`, its evaluation
        included (the loop does not evaluate that step again where it was), so no step appears twice; returns the
        records kept. A fresh start (no `resume_step`) moves an earlier history aside instead of overwriting it."""
        if not self.path.is_file():
            return []
        if not resume_step:
            if self.path.stat().st_size:
                n = 1
                while (backup := self.path.with_name(f"{self.path.name}.{n}.bak")).exists():
                    n += 1
                os.replace(self.path, backup)
                for name in ("config.json", "tensorboard", "metrics.png"):  # what belongs to that history goes along
                    other = self.path.with_name(name)
                    if other.exists():
                        os.replace(other, other.with_name(f"{name}.{n}.bak"))
                logger.warning("%s holds metrics of an earlier run but no checkpoint was resumed: moved it to %s "
                               "(and its config.json, tensorboard/ and metrics.png beside it), this run starts a new "
                               "one", self.path,
                               backup)
            return []
        kept, last_step, records = [], None, []
        for lineno, line in enumerate(self.path.read_bytes().split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = record["step"]
                if not isinstance(step, (int, float)):
                    raise TypeError(f"step is {step!r}")
            except (ValueError, KeyError, TypeError) as e:  # a torn line (a kill or full disk mid-write), a bad byte
                # The file is in step order: after a record of resume_step or later, the line is dropped anyway.
                if last_step is not None and last_step >= resume_step:
                    logger.warning("%s:%d: dropped an unreadable line after step %d (%s: %s)", self.path, lineno,
                                   last_step, type(e).__name__, e)
                    continue
                raise ValueError(f"{self.path}:{lineno}: unreadable line ({type(e).__name__}: {e}) at or before the "
                                 f"resumed step {resume_step}, whose history must be kept; repair or delete that "
                                 "line and run again") from None
            last_step = step
            if step <= resume_step:
                kept.append(line)
                records.append(record)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in kept))
        os.replace(tmp, self.path)
        return records

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        # NaN and inf are not JSON (Python writes them, jq and most readers refuse the line): null, as pandas writes
        self._file.write(json.dumps({k: v if math.isfinite(v) else None for k, v in record.items()}) + "\n")
        self._file.flush()
        if self._wandb is not None and (self._wandb_sent_to is None or step > self._wandb_sent_to):
            self._wandb.log(metrics, step=step)
        self.last_step = max(step, self.last_step or 0)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()  # a hard exit (os._exit) keeps what was logged, as metrics.jsonl does
        shown = " ".join(f"{short}={metrics[key]:.4g}" for key, short in CONSOLE_KEYS if key in metrics)
        if not _is_train(metrics):  # an evaluation record
            logger.info("eval after step %d/%d: %s", step, self.total_steps, shown)
            return
        self.steps_done += 1
        if self.first_step is None:
            self.first_step, self.start = step - 1, time.time() - metrics.get("time/step", 0.0)
        rate = (time.time() - self.start) / (step - self.first_step)
        logger.info("step %d/%d %s | %.2fs/step eta %s", step, self.total_steps, shown, rate,
                    _fmt_time(rate * (self.total_steps - step)))

    def sync(self) -> None:
        """Make the rows logged so far durable (a checkpoint is about to claim their steps: a resume from it keeps
        metrics.jsonl's rows up to its step and continues after them, so a power loss must not lose them)."""
        if self._file:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            if self.last_step is not None:  # W&B holds every step sent: a resume need not send them again
                (self.path.parent / "wandb_step").write_text(f"{self.last_step}\n")
        if self._tb is not None:
            self._tb.close()


def wandb_mode(cfg: LogConfig) -> str:
    """log.wandb_mode, else the environment's WANDB_MODE, else offline."""
    return cfg.wandb_mode or os.environ.get("WANDB_MODE") or "offline"


def _is_train(record: dict) -> bool:
    return any(k.startswith("train/") for k in record)


def _fmt_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
