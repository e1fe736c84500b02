"""Short GRPO runs of run.py on 2 gloo ranks (exact resumes: tests/test_faults.py)."""
import json

import pytest

from conftest import REPO, run_ranks


def launch(tiny_model, task_dir, run_dir, *overrides):
    return run_ranks([str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_grpo.yaml"),
                      f"model.path={tiny_model}", f"data.path={task_dir / 'train.jsonl'}",
                      f"log.run_dir={run_dir}", "rollout.reward.fn=e2e_rewards:digit_fraction",
                      "rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_response_len=6",
                      "train.lr=5e-3", "train.max_tokens_per_gpu=64", "eval.path=null", "log.plot=false", *overrides])


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_rank_grpo_run_writes_metrics_checkpoint_and_export(tiny_model, task_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(tiny_model, task_dir, run_dir, "train.num_steps=2", "log.plot=true")
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("rollout/reward_mean", "rollout/reward_std", "rollout/response_len", "train/pg_clipfrac",
                "train/ppo_kl", "train/entropy", "train/grad_norm", "train/lr", "time/rollout", "time/train",
                "time/sync", "perf/train_tokens_per_s"):
        assert key in rows[0], key
    assert any(r["train/grad_norm"] > 0 for r in rows)  # the digit reward gave a learning signal
    assert "step 2/2" in proc.stdout
    assert "Warning" not in proc.stdout + proc.stderr  # e.g. torch's FutureWarning at each ZeRO-3 collective
    assert (run_dir / "checkpoints/step_2").is_dir()
    exported = json.loads((run_dir / "hf/config.json").read_text())
    assert exported["use_cache"] is json.loads((tiny_model / "config.json").read_text()).get("use_cache", True)
    assert (run_dir / "metrics.png").read_bytes().startswith(b"\x89PNG")


def test_old_logprobs_from_the_update_forward_match_the_recomputed_ones(tiny_model, task_dir, tmp_path):
    """algo.old_logprobs=train_forward skips the scoring pass; on-policy with one mini-batch pi_old is the same
    weights, so the step (loss, gradient norm, the next rollout) is the recomputed run's."""
    rows = {}
    for mode in ("recompute", "train_forward"):
        launch(tiny_model, task_dir, tmp_path / mode, "train.num_steps=2", "checkpoint.export_hf=false",
               f"algo.old_logprobs={mode}")
        rows[mode] = read_metrics(tmp_path / mode)
    assert not (tmp_path / mode / "metrics.png").exists()  # log.plot=false, as launch() sets it
    a, b = rows["recompute"], rows["train_forward"]
    # the mismatch metric: from the scoring pass, or from the update's forward (the same weights)
    assert b[0]["rollout/train_logprob_abs_diff"] == b[0]["train/train_rollout_logprob_abs_diff"]
    assert b[0]["rollout/train_logprob_abs_diff"] == pytest.approx(a[0]["rollout/train_logprob_abs_diff"], abs=1e-6)
    assert b[0]["train/ppo_kl"] == 0.0 and b[0]["train/train_rollout_logprob_abs_diff"] < 1e-5
    for step_a, step_b in zip(a, b):
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "rollout/reward_mean",
                    "rollout/response_len"):
            assert step_b[key] == pytest.approx(step_a[key], rel=1e-4, abs=1e-6), key


def test_compiled_layers_give_the_eager_step(tiny_model, task_dir, tmp_path):
    """train.compile=true on 2 ZeRO-2 ranks, actor and KL reference compiled: the first step (same weights, same
    rollout) has the eager run's loss, KL, gradient norm and mismatch metric."""
    rows = {}
    for compiled in ("false", "true"):
        proc = launch(tiny_model, task_dir, tmp_path / compiled, "train.num_steps=1", "checkpoint.export_hf=false",
                      "train.ds_config=ds_configs/zero2.json", "algo.kl_coef=0.1", "algo.use_kl_loss=true",
                      f"train.compile={compiled}")
        assert ("decoder layers compiled" in proc.stdout + proc.stderr) == (compiled == "true")
        rows[compiled] = read_metrics(tmp_path / compiled)[0]
    eager, compiled = rows["false"], rows["true"]
    assert compiled["rollout/reward_mean"] == eager["rollout/reward_mean"]  # the same batch
    for key in ("train/loss", "train/pg_loss", "train/kl_ref", "train/grad_norm", "train/entropy",
                "rollout/train_logprob_abs_diff"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-4, abs=1e-6), key


def test_one_step_off_rollout(tiny_model, task_dir, tmp_path):
    """rollout.one_step_off: step k+1's batch is generated (by the weights after k updates) while step k
    trains, so from step 2 on the samples lag the trainer by one update; evaluation and checkpoints still
    happen, and the weights reach the engine (step 3's samples come from weights after 2 updates)."""
    run_dir = tmp_path / "run"
    proc = launch(tiny_model, task_dir, run_dir, "train.num_steps=3", "rollout.one_step_off=true",
                  "algo.tis.level=token", f"eval.path={task_dir / 'eval.jsonl'}", "eval.max_prompts=8",
                  "eval.interval=2", "checkpoint.interval=2")
    warning = "rollout.one_step_off=true with algo.tis.level=off"  # nothing would correct the lag
    assert warning not in proc.stdout + proc.stderr
    uncorrected = launch(tiny_model, task_dir, tmp_path / "uncorrected", "train.num_steps=1",
                         "rollout.one_step_off=true")
    assert warning in uncorrected.stdout + uncorrected.stderr
    rows = read_metrics(run_dir)
    train = [r for r in rows if "rollout/policy_lag" in r]
    evals = [r["step"] for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in train] == [1, 2, 3] and [r["rollout/policy_lag"] for r in train] == [0.0, 1.0, 1.0]
    assert evals == [0, 2, 3]
    assert train[1]["rollout/train_logprob_abs_diff"] > 1e-4  # pi_old is one update past the generating weights
    assert train[0]["rollout/train_logprob_abs_diff"] < 1e-5 and train[1]["train/tis_mean_weight"] != 1.0
    for r in train:  # the rate of the generation itself, not of the wait for its batch (time/rollout)
        assert r["perf/gen_tokens_per_s"] == pytest.approx(r["rollout/gen_tokens"] / r["time/generate"])
    assert (run_dir / "checkpoints/step_2").is_dir() and (run_dir / "checkpoints/step_3").is_dir()
    state = json.loads((run_dir / "checkpoints/step_2/manifest.json").read_text())["loop_state"]["data"]
    assert state["offset"] == 8  # before step 3's batch, which was in flight when step 2 was saved


def test_one_step_off_refuses_layouts_it_cannot_overlap():
    from slime.config import load_config

    base = ["model.path=m", "data.path=d.jsonl", "rollout.one_step_off=true"]
    for bad, words in ((["rollout.dynamic_sampling=true"], "dynamic_sampling"), (["parallel.sp=2"], "parallel.sp"),
                       (["rollout.engine=sglang"], "colocated")):
        with pytest.raises(ValueError, match=words):
            load_config(None, base + bad)
    assert load_config(None, base + ["rollout.engine=sglang", "rollout.sglang.mode=disaggregated"]).rollout.one_step_off
