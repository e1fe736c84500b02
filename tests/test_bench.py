"""The bench scripts' run settings load as configs: a new config check must not break a bench (one did:
train.min_lr of the example above a bench's lower train.lr)."""
from __future__ import annotations

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


def test_step_profile_groups_ops_as_its_doc_says():
    """bench/step_profile.py's grouping: each kind of op lands in its group, on a real profile."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import profile

    from bench import step_profile

    assert step_profile.group_of("## Call CompiledFxGraph fabc ##") == "fused chains"
    assert step_profile.group_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert step_profile.group_of("mkldnn::_linear_pointwise") == "matmuls"
    assert step_profile.group_of("aten::_foreach_mul_") == "copies and optimizer"
    assert step_profile.group_of("aten::silu") == "other ops"
    x, q = torch.randn(256, 256), torch.randn(1, 2, 64, 32)
    with profile() as prof:
        F.linear(x, x)
        F.scaled_dot_product_attention(q, q, q)
        x.clone()
        x.exp()
    groups, ops = step_profile.grouped(prof, wall=10.0)
    assert all(groups[g] > 0 for g in ("matmuls", "attention", "copies and optimizer", "other ops"))
    assert groups["fused chains"] == 0
    assert sum(groups.values()) == pytest.approx(10.0)  # what no op accounts for is "outside ops"
    # --top's list: every op but the matmuls, slowest first, their times those of the groups
    names = [name for name, _, _ in ops]
    assert "aten::exp" in names and "aten::clone" in names and not any(step_profile.group_of(n) == "matmuls"
                                                                         for n in names)
    assert [t for _, _, t in ops] == sorted((t for _, _, t in ops), reverse=True)
    assert sum(t for _, _, t in ops) == pytest.approx(sum(groups.values()) - groups["matmuls"] - groups["outside ops"])
