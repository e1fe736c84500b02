"""Metrics go to metrics.jsonl and, offline, to wandb."""
import json
import os

from slime.config import LogConfig
from slime.utils.metrics import MetricsLogger


def test_jsonl_and_wandb_offline(tmp_path):
    cfg = LogConfig(run_dir=str(tmp_path / "run"), wandb=True, wandb_mode="offline")
    log = MetricsLogger(cfg, run_config={"a": 1}, enabled=True, total_steps=2)
    log.log(0, {"rollout/reward_mean": 0.5, "train/loss": 1.25})
    log.log(1, {"rollout/reward_mean": 0.75, "train/loss": 1.0})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "rollout/reward_mean": 0.5, "train/loss": 1.25},
                    {"step": 1, "rollout/reward_mean": 0.75, "train/loss": 1.0}]
    assert list((tmp_path / "run/wandb").glob("offline-run-*"))


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(LogConfig(run_dir=str(tmp_path / "r")), run_config={}, enabled=False, total_steps=1)
    log.log(0, {"x": 1.0})
    log.close()
    assert not (tmp_path / "r").exists()


def test_a_metric_that_is_not_finite_is_written_as_null_so_every_json_reader_takes_the_line(tmp_path):
    log = MetricsLogger(LogConfig(run_dir=str(tmp_path / "run")), run_config={}, enabled=True, total_steps=1)
    log.log(1, {"train/loss": float("nan"), "train/grad_norm": float("inf"), "rollout/reward_mean": 0.5})
    log.close()

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    line = (tmp_path / "run/metrics.jsonl").read_text().splitlines()[0]
    assert json.loads(line, parse_constant=refuse) == {"step": 1, "train/loss": None, "train/grad_norm": None,
                                                       "rollout/reward_mean": 0.5}


def test_a_resumed_run_goes_on_in_its_wandb_run_without_sending_a_step_twice(tmp_path, monkeypatch):
    """Each resume started a new W&B run, and the first one kept the steps the resumed run did again. The run id
    is kept in the run dir; W&B takes increasing steps only, so steps done again are not sent."""
    cfg = LogConfig(run_dir=str(tmp_path / "run"), wandb=True, wandb_mode="offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sent = []

    def logger(resume_step=0):
        log = MetricsLogger(cfg, run_config={}, enabled=True, total_steps=5, resume_step=resume_step)
        real = log._wandb.log
        log._wandb.log = lambda metrics, step: (sent.append(step), real(metrics, step=step))
        return log

    log = logger()
    for step in range(1, 5):
        log.log(step, {"train/loss": float(step)})
    log.close()
    log = logger(resume_step=2)  # the checkpoint of step 2: steps 3 and 4 are done again
    for step in range(3, 6):
        log.log(step, {"train/loss": float(step)})
    log.close()
    assert sent == [1, 2, 3, 4, 5]
    run_id = (tmp_path / "run/wandb_run_id").read_text().strip()
    runs = sorted((tmp_path / "run/wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs)  # offline-run-<time>-<id>[-1]
    logger().close()  # a fresh start (no checkpoint) is a new W&B run
    assert (tmp_path / "run/wandb_run_id").read_text().strip() != run_id
    (tmp_path / "run/wandb_run_id").unlink()  # a history logged without W&B: its new W&B run gets every step
    sent.clear()
    log = logger(resume_step=1)
    log.log(2, {"train/loss": 2.0})
    log.close()
    assert sent == [2]


def test_the_plot_leaves_out_a_torn_line_and_null_values(tmp_path):
    """`python -m slime.utils.plot` is how a killed run's plot is made, and a kill can tear the last line."""
    from slime.utils.plot import plot_metrics

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "train/loss": 1.5, "rollout/reward_mean": null}\n'
                       '{"step": 2, "train/loss": 1.25, "rollout/reward_mean": 0.5}\n{"step": 3, "train/lo')
    out = plot_metrics(metrics, tmp_path / "m.png")
    assert out is not None and out.read_bytes().startswith(b"\x89PNG")


def test_the_plot_breaks_its_line_at_a_null_step(tmp_path, monkeypatch):
    """A skipped step's null loss was left out, and the line drawn straight across it: the step could not be seen."""
    import math

    from matplotlib.axes import Axes

    from slime.utils.plot import plot_metrics

    drawn, plot = [], Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, xs, ys, **kw: (drawn.append(ys), plot(ax, xs, ys, **kw))[1])
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(f'{{"step": {s}, "train/loss": {v}}}\n' for s, v in ((1, 1.5), (2, "null"), (3, 1.0))) +
                       '{"step": 3, "eval/accuracy": 0.5}\n{"step": 4, "eval/accuracy": null}\n')
    assert plot_metrics(metrics, tmp_path / "m.png") is not None
    accuracy, loss = drawn  # in DEFAULT_KEYS' order
    assert loss[::2] == (1.5, 1.0) and math.isnan(loss[1])
    assert accuracy[0] == 0.5 and math.isnan(accuracy[1]) and len(accuracy) == 2  # no NaN of the train rows
    metrics.write_text('{"step": 1, "train/loss": null}\n')
    assert plot_metrics(metrics, tmp_path / "m.png") is None  # nothing finite: no panel


def test_a_run_killed_hard_has_its_steps_up_to_the_checkpoint_sent_to_wandb_again(tmp_path, monkeypatch):
    """W&B buffers the last steps it was given; a run killed hard (kill -9, os._exit) lost them, and the resume
    sent only the steps after the end of metrics.jsonl's history: W&B missed those up to it for good. Steps W&B
    holds for sure are the ones sent before a clean close; the others up to the checkpoint are sent again."""
    import subprocess
    import sys

    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", f"""
import os
from slime.config import LogConfig
from slime.utils.metrics import MetricsLogger
log = MetricsLogger(LogConfig(run_dir={str(run_dir)!r}, wandb=True), run_config={{}}, enabled=True, total_steps=9)
log.log(0, {{"eval/accuracy": 0.5}})  # the evaluation before training (it was not sent again)
for step in range(1, 6):
    log.log(step, {{"train/loss": float(step)}})
os._exit(1)
"""], capture_output=True, text=True, timeout=300,  # its own W&B service, as a run has (not this process's)
                            env={k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"})
    assert killed.returncode == 1, killed.stderr[-2000:]
    sent, real_init = [], wandb.init

    def init(**kwargs):
        run = real_init(**kwargs)
        real_log = run.log
        run.log = lambda metrics, step: (sent.append(step), real_log(metrics, step=step))
        return run

    monkeypatch.setattr(wandb, "init", init)
    cfg = LogConfig(run_dir=str(run_dir), wandb=True)
    log = MetricsLogger(cfg, run_config={}, enabled=True, total_steps=9, resume_step=4)  # the checkpoint of step 4
    for step in (5, 6):
        log.log(step, {"train/loss": float(step)})
    log.close()
    assert sent == [0, 1, 2, 3, 4, 5, 6]
    sent.clear()
    log = MetricsLogger(cfg, run_config={}, enabled=True, total_steps=9, resume_step=5)  # after a clean close
    for step in (6, 7):
        log.log(step, {"train/loss": float(step)})
    log.close()
    assert sent == [7]


def test_the_environments_wandb_mode_is_used_unless_the_config_names_one(tmp_path, monkeypatch):
    from slime.utils.metrics import wandb_mode

    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode(LogConfig()) == "disabled" and wandb_mode(LogConfig(wandb_mode="online")) == "online"
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_mode(LogConfig()) == "offline"


def test_sync_puts_the_rows_logged_so_far_on_disk(tmp_path, monkeypatch):
    """The loop syncs metrics.jsonl before each checkpoint: a resume keeps the rows up to the checkpoint's step, so
    a power loss after the save must not take them (flush alone leaves them in the page cache)."""
    import slime.utils.metrics as metrics

    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(metrics.os, "fsync", fsync)
    log = MetricsLogger(LogConfig(run_dir=str(tmp_path / "run")), run_config={}, enabled=True, total_steps=2)
    log.log(1, {"train/loss": 1.0})
    assert synced == []  # not every step: once per checkpoint
    log.sync()
    assert synced == [str(tmp_path / "run/metrics.jsonl")]
    log.close()
    MetricsLogger(LogConfig(run_dir=str(tmp_path / "off")), run_config={}, enabled=False, total_steps=1).sync()
