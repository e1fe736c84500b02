"""Metrics go to metrics.jsonl and, offline, to wandb."""
import json

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
