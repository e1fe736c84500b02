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


def test_trl_runs_on_our_settings(tmp_path):
    """What costs time is the same on both sides. TRL's GRPOConfig turns gradient checkpointing on by default,
    which the bench left on: TRL recomputed its activations in every update and ours did not."""
    cfg = load_config(str(vs_trl.OUR_CONFIG), vs_trl.our_overrides(tmp_path / "m", tmp_path / "d.jsonl",
                                                                   tmp_path / "run", 5, []))
    trl = vs_trl.trl_settings(tmp_path, 5)
    assert trl["gradient_checkpointing"] is cfg.model.gradient_checkpointing is False
    assert (trl["temperature"], trl["max_completion_length"], trl["num_generations"], trl["learning_rate"]) == \
        (cfg.rollout.temperature, cfg.rollout.max_response_len, cfg.rollout.n_samples_per_prompt, cfg.train.lr)
    assert trl["generation_kwargs"]["min_new_tokens"] == trl["max_completion_length"] and cfg.rollout.ignore_eos
    assert trl["per_device_train_batch_size"] == cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    assert trl["beta"] == cfg.algo.kl_coef == 0 and trl["num_iterations"] == cfg.train.num_mini_batches == 1
    assert trl["bf16"] is False and cfg.model.dtype in ("auto", "float32")  # auto: fp32 on CPU
    try:
        from trl import GRPOConfig
    except ImportError:  # the bench extra: TRL's own defaults are checked where it is installed
        return
    built = GRPOConfig(**trl)
    assert built.gradient_checkpointing is False and built.temperature == cfg.rollout.temperature


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
    # --top's list: every op but the matmuls, slowest first, their times those of the groups
    names = [name for name, _, _ in ops]
    assert "aten::exp" in names and "aten::clone" in names and not any(step_profile.group_of(n) == "matmuls"
                                                                         for n in names)
    assert [t for _, _, t in ops] == sorted((t for _, _, t in ops), reverse=True)
    assert sum(t for _, _, t in ops) == pytest.approx(sum(groups.values()) - groups["matmuls"] - groups["outside ops"])


def test_the_floor_counts_the_positions_our_step_trains(tmp_path):
    """The floor counted every sample's own prompt and every response token (64 x 70 = 4480 a step), where the
    step needs each prompt once and no response's last token (16 x 6 + 64 x 63 = 4128): efficiencies read 6.2%
    high. The positions it counts are those the trainer logs as train/tokens."""
    import json

    from data_tools.make_tiny_model import make_tiny_model
    from transformers import AutoTokenizer

    model = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0, heads=4, kv_heads=2, hidden=64, layers=1)
    data = vs_trl.write_prompts(tmp_path, count=vs_trl.PROMPTS)
    out = vs_trl.run_ours(model, data, tmp_path, 1, ["rollout.max_response_len=8"])
    tok = AutoTokenizer.from_pretrained(model)
    mean = sum(len(tok(json.loads(line)["prompt"], add_special_tokens=False).input_ids)
               for line in data.read_text().splitlines()) / vs_trl.PROMPTS
    assert out["train_tokens"] == [vs_trl.needed_positions(mean, 8)]
    assert vs_trl.needed_positions(6, 64) == 16 * 6 + 64 * 63 == 4128
