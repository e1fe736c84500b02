"""Every advantage estimator x policy loss, and the KL / TIS / DAPO options, through a 2-step,
2-rank CPU training job of the real loop."""
import json
import math

import pytest

from conftest import REPO, run_ranks

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
LOSSES = {"ppo": [], "gspo": ["algo.clip_low=3e-4", "algo.clip_high=4e-4", "algo.loss_agg=seq_mean_token_mean"],
          "cispo": ["algo.clip_low=null", "algo.clip_high=4.0"]}
JOBS = {f"{est}-{loss}": [f"algo.advantage_estimator={est}", f"algo.policy_loss={loss}", *extra]
        for est in ESTIMATORS for loss, extra in LOSSES.items()}
# The padded layout (no packing) for every estimator: the critic's forward takes the same path.
JOBS.update({f"{est}-padded": [f"algo.advantage_estimator={est}", "train.packing=false", "train.micro_batch_size=3"]
             for est in ESTIMATORS})
JOBS.update({
    "kl_loss_k3": ["algo.use_kl_loss=true", "algo.kl_coef=0.1", "algo.kl_estimator=k3"],
    "kl_loss_ref_offload": ["algo.use_kl_loss=true", "algo.kl_coef=0.1", "algo.ref_offload=true"],
    "kl_reward_k1_rpp": ["algo.advantage_estimator=reinforce_pp", "algo.kl_in_reward=true", "algo.kl_coef=0.1",
                         "algo.kl_estimator=k1"],
    "kl_reward_k2_grpo": ["algo.kl_in_reward=true", "algo.kl_coef=0.1", "algo.kl_estimator=k2",
                          "algo.normalize_std=false"],
    "dual_clip_entropy": ["algo.dual_clip=3.0", "algo.entropy_coef=0.01", "algo.loss_agg=seq_mean_token_sum_norm",
                          "algo.loss_agg_constant=6"],
    "tis_token": ["algo.tis.level=token", "algo.tis.mode=truncate"],
    "tis_seq_mask": ["algo.tis.level=sequence", "algo.tis.mode=mask", "algo.tis.low=0.5", "algo.tis.high=2.0"],
    "tis_geo": ["algo.tis.level=geometric"],
    # pi_old from the engine: no scoring pass, also with a KL penalty whose advantages need pi_old first (where
    # train_forward cannot serve)
    "old_logprobs_rollout": ["algo.old_logprobs=rollout", "algo.advantage_estimator=reinforce_pp",
                             "algo.kl_in_reward=true", "algo.kl_coef=0.05"],
    "dapo": ["rollout.dynamic_sampling=true", "rollout.over_sample_factor=1.5", "rollout.max_sampling_attempts=3",
             "algo.clip_high=0.28", "rollout.overlong_penalty.max_len=5", "rollout.overlong_penalty.buffer_len=2"],
    # sequence parallel (dp=1 x sp=2): the critic and the reference take the same sharded path
    "gae_sp2": ["algo.advantage_estimator=gae", "parallel.sp=2"],
    "kl_loss_sp2": ["algo.use_kl_loss=true", "algo.kl_coef=0.1", "parallel.sp=2"],
    "ppo_critic_warmup": ["algo.advantage_estimator=gae", "algo.critic.warmup_steps=1", "algo.kl_in_reward=true",
                          "algo.kl_coef=0.05", "algo.kl_estimator=k1", "train.num_mini_batches=2"],
})


@pytest.fixture(scope="module")
def results(tiny_model, task_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("combos") / "results.json"
    jobs = [f"{name}:{','.join(overrides)}" for name, overrides in JOBS.items()]
    run_ranks([str(REPO / "tests/dist/algo_combos.py"), str(tiny_model), str(task_dir / "train.jsonl"), str(out),
               *jobs], timeout=1500)
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(JOBS))
def test_two_steps_run_and_update(results, name):
    rows = results[name]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key, value in row.items():
            assert math.isfinite(value), (key, value)
    trained = [r for r in rows if "train/loss" in r]
    assert trained and all(r["train/grad_norm"] > 0 for r in trained)
    first = rows[0]
    if name == "old_logprobs_rollout":  # pi_old is the engine's: the ratio starts at the engine/trainer mismatch
        assert abs(first["train/ppo_kl"]) < 1e-4 and first["train/pg_clipfrac"] == 0.0
        assert first["train/train_rollout_logprob_abs_diff"] == 0.0
    elif "train/ppo_kl" in first and "critic/value_loss" not in first:
        # Before any update the trainer's logprobs are pi_old exactly: no ratio, no clipping.
        assert first["train/ppo_kl"] == 0.0 and first["train/pg_clipfrac"] == 0.0
    assert "train/train_rollout_logprob_abs_diff" in first or "critic/value_loss" in first
    if name.startswith("gae") or name == "ppo_critic_warmup":
        assert all("critic/value_loss" in r for r in rows)
    if name == "ppo_critic_warmup":
        assert "train/loss" not in rows[0] and "train/loss" in rows[1]  # actor waits for the critic
    for option, key in (("dual_clip", "train/pg_dual_clipfrac"), ("cispo", "train/is_weight_mean")):
        if option in name:  # logged with its option only; before any update, ratio 1: nothing bounded, weight 1
            assert first[key] == (0.0 if option == "dual_clip" else pytest.approx(1.0)), key
        assert all((key in r) == (option in name) for r in trained), key


def test_kl_to_reference_starts_at_zero_then_grows(results):
    first, second = results["kl_loss_k3"]
    assert first["rollout/kl_ref_k1"] == 0.0 and first["train/kl_ref"] == 0.0
    assert second["train/kl_ref"] > 0.0


def test_dynamic_sampling_keeps_only_groups_with_signal(results):
    for row in results["dapo"]:
        assert row["adv/zero_adv_group_frac"] == 0.0
        assert 1 <= row["rollout/sampling_attempts"] <= 3
