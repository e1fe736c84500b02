"""Ulysses sequence parallelism: the same global batch with sp=2 as with sp=1 (logprobs, loss, gradients,
parameters after one step), GQA with a single kv head, GSPO and sequence-level TIS, the loop, 4 ranks."""
import json

import pytest
import torch

from conftest import REPO, assert_params_close, run_ranks, stable_adam_ds_config
from data_tools.make_tiny_model import make_tiny_model

# 3 micro-batches under 32 tokens per GPU and sp=2: the 41-token sample needs both ranks' budget.
BASE = ["train.max_tokens_per_gpu=32"]
VARIANTS = {
    "ppo": [],
    "gspo_tis_seq": ["algo.policy_loss=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4",
                     "algo.loss_agg=seq_mean_token_mean", "algo.tis.level=sequence", "algo.tis.mode=mask",
                     "algo.tis.low=0.5", "algo.tis.high=2.0"],
    "router_aux": ["algo.router_aux_loss_coef=0.1"],  # balanced over the whole row, not per shard
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp_models")
    # seed 1 and a larger init make attention position- and neighbour-sensitive (leaks would show)
    return {"qwen2": make_tiny_model(root / "qwen2", arch="qwen2", seed=1, init_std=0.1),
            "gqa1": make_tiny_model(root / "gqa1", arch="qwen3", seed=1, kv_heads=1, init_std=0.1),
            "moe": make_tiny_model(root / "moe", arch="qwen3_moe", seed=1)}


def run(model, out, nproc, *overrides):
    out.mkdir(parents=True)
    run_ranks([str(REPO / "tests/dist/sp_checks.py"), str(model), str(out), *BASE,
               f"train.ds_config={stable_adam_ds_config(out)}", *overrides], nproc=nproc)
    return torch.load(out / "result.pt", weights_only=False)


@pytest.mark.parametrize("model_name, variant", [("qwen2", "ppo"), ("gqa1", "gspo_tis_seq"), ("moe", "router_aux")])
def test_sp2_equals_sp1(models, tmp_path, model_name, variant):
    # sp=1 reference: one rank whose budget holds what two sp ranks hold together
    ref = run(models[model_name], tmp_path / "sp1", 1, "train.max_tokens_per_gpu=64", *VARIANTS[variant])
    sp = run(models[model_name], tmp_path / "sp2", 2, "parallel.sp=2", *VARIANTS[variant])
    assert sp["micro_batches"] >= 2  # the budget really split the batch
    # the shard cut falls inside a sample somewhere (not only on borders), and a row has an odd real length
    assert any(cu[-1] // 2 not in cu for cu in sp["rows"])
    assert any(cu[-1] - cu[-2] == 1 for cu in sp["rows"])  # an odd row: one pad token (its own segment) evens it
    for a, b in zip(ref["logprobs"], sp["logprobs"]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert sp["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-5, abs=1e-7)
    assert sp["metrics"]["loss_tokens"] == ref["metrics"]["loss_tokens"]
    if "router_aux" in ref["metrics"]:
        assert sp["metrics"]["router_aux"] == pytest.approx(ref["metrics"]["router_aux"], rel=1e-6)
    assert sp["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(sp["grads"][name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert_params_close(sp["state"], ref["state"])


def test_sp_splits_heads_that_divide(tmp_path):
    from slime.distributed.ulysses import check_heads

    check_heads(4, 2, 2, "m")
    check_heads(4, 1, 4, "m")  # one kv head, repeated on every rank
    with pytest.raises(ValueError, match="parallel.sp=3 must divide the number of attention heads"):
        check_heads(4, 2, 3, "m")
    with pytest.raises(ValueError, match="key/value heads"):
        check_heads(12, 3, 2, "m")


def test_a_sample_too_long_even_for_sp_names_the_settings():
    from slime.trainer.layout import Layout

    layout = Layout(packing=True, max_tokens=32, micro_batch_size=1, sp=2, budget_key="train.max_tokens_per_gpu")
    layout.plan([10, 64], dp=1)  # 64 = 2 x 32 fits when cut over 2 ranks
    with pytest.raises(ValueError, match=r"70 tokens .* parallel.sp=2 x train.max_tokens_per_gpu=32 = 64 .* "
                                         r"train.max_tokens_per_gpu to 35, or parallel.sp to 3 or more \(.*sp must "
                                         r"divide the model's attention heads and the number of GPUs\)"):
        layout.plan([10, 70], dp=1)


def run_loop(tiny_model, task_dir, run_dir, *overrides):
    run_ranks([str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_grpo.yaml"), f"model.path={tiny_model}",
               f"data.path={task_dir / 'train.jsonl'}", f"log.run_dir={run_dir}", "eval.path=null",
               "rollout.reward.fn=e2e_rewards:digit_fraction", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
               "rollout.max_response_len=6", "train.lr=5e-3", "train.max_tokens_per_gpu=32", "train.num_steps=3",
               "checkpoint.save_final=false", "checkpoint.export_hf=false", "log.plot=false", *overrides])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_loop_with_sp2_runs_exact_at_step_one(tiny_model, task_dir, tmp_path):
    sp = run_loop(tiny_model, task_dir, tmp_path / "sp2", "parallel.sp=2")
    ref = run_loop(tiny_model, task_dir, tmp_path / "sp1")
    assert [r["step"] for r in sp] == [1, 2, 3]
    assert sp[0]["train/ppo_kl"] == 0.0 and sp[0]["train/pg_clipfrac"] == 0.0  # pi_old is exact at step 1
    assert all(r["train/grad_norm"] > 0 for r in sp)
    # the trainer's logprobs agree with the engine's as closely as without sp
    assert sp[0]["rollout/train_logprob_abs_diff"] <= 2 * ref[0]["rollout/train_logprob_abs_diff"] + 1e-7
    # one dp rank: its 4 prompts x 4 samples, generated half by each sp peer, trained on together
    assert sp[0]["rollout/kept_samples"] == 16 and ref[0]["rollout/kept_samples"] == 16


@pytest.mark.four_ranks
def test_dp2_sp2_equals_dp2_sp1(models, tmp_path):
    ref = run(models["qwen2"], tmp_path / "dp2sp1", 2, "train.max_tokens_per_gpu=64")
    sp = run(models["qwen2"], tmp_path / "dp2sp2", 4, "parallel.sp=2")
    for a, b in zip(ref["logprobs"], sp["logprobs"]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert sp["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-5, abs=1e-7)
    assert sp["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(sp["grads"][name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert_params_close(sp["state"], ref["state"])


def test_the_sp_wrapper_of_flash_attention_loads_and_hands_flash_its_own_name(monkeypatch):
    """transformers takes any attention name with "flash" in it for a flash kernel to import by that name (a
    wrapper named ulysses_sp2_flash_attention_2 failed at load), and flash's forward passes
    module.config._attn_implementation on to choose its kernels: the wrapper's name has no "flash", and the
    function it wraps sees the module with a config naming that function (the model's own config unchanged)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, Qwen3Config

    import slime.distributed.ulysses as ulysses

    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8)
    name = ulysses.register_ulysses_attention("flash_attention_2", ulysses.SequenceShard(None, 0, 2))
    assert "flash" not in name
    AutoModelForCausalLM.from_config(Qwen3Config(**cfg), attn_implementation=name)  # loads without flash-attn

    seen = []

    def fake_flash(module, query, key, value, attention_mask, **kwargs):
        seen.append((module.config._attn_implementation, module.layer_idx, module.is_causal, attention_mask))
        return torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(2, 1),
                                                                value.repeat_interleave(2, 1),
                                                                is_causal=True).transpose(1, 2), None

    AttentionInterface.register("test_flash_attention", fake_flash)
    # one rank's view: the all-to-all of an sp group of one is the identity
    monkeypatch.setattr(ulysses, "_seq_to_heads", lambda x, group, sp: x)
    monkeypatch.setattr(ulysses, "_heads_to_seq", lambda x, group, sp: x)
    wrapped = ulysses.register_ulysses_attention("test_flash_attention", ulysses.SequenceShard(None, 0, 1))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**cfg), attn_implementation=wrapped)
    ids = torch.randint(0, 64, (1, 7))
    out = model(input_ids=ids).logits
    assert [s[:3] for s in seen] == [("test_flash_attention", 0, True), ("test_flash_attention", 1, True)]
    assert all(s[3] is None for s in seen)  # a custom name gets no mask: cu_seqlens mark the samples
    assert model.config._attn_implementation == wrapped
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(out, model(input_ids=ids).logits)
