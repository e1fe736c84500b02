"""The bench scripts' run settings load as configs: a new config check must not break a bench (one did:
train.min_lr of the example above a bench's lower train.lr)."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench import vs_trl, weight_sync
from slime.config import load_config


@pytest.mark.parametrize("extra", [[], ["algo.old_logprobs=recompute"], [vs_trl.ZERO2],
                                   [vs_trl.ZERO2, "train.compile=true"], ["model.cpu_linear=torch"],
                                   ["model.cpu_linear=onednn"], [vs_trl.ZERO2, vs_trl.UNFUSED]])
def test_vs_trl_settings_load(extra, tmp_path):
    cfg = load_config(str(vs_trl.OUR_CONFIG), vs_trl.our_overrides(tmp_path / "m", tmp_path / "d.jsonl",
                                                                   tmp_path / "run", 5, extra))
    assert cfg.train.lr == vs_trl.LR and cfg.rollout.max_response_len == vs_trl.NEW_TOKENS


def test_weight_sync_settings_load(tmp_path):
    cfg = load_config(str(weight_sync.CONFIG), weight_sync.overrides(tmp_path / "m", tmp_path / "d.jsonl",
                                                                     tmp_path / "run", 3, []))
    assert cfg.train.lr == 1e-5
