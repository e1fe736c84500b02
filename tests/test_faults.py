"""Faults end in a clear message or a recovery: non-finite losses and rewards, torn or corrupt checkpoints,
signals, hung reward functions and ranks, and bad data files."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_ranks
from slime.algorithms.policy_loss import aggregate_loss, cispo_policy_loss, gspo_policy_loss, ppo_policy_loss
from slime.config import DataConfig, load_config
from slime.rollout.rewards import make_reward_fn
from slime.utils.net import reserved_port


# -- non-finite values ----------------------------------------------------------------------------------

@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
def test_extreme_log_ratios_give_a_finite_loss_and_gradient(loss):
    """The issue's reproduction: a masked token 99 nats off and zero advantages."""
    lp = torch.tensor([-1.0, -1.2, -0.5], requires_grad=True)
    old = torch.tensor([-100.0, -1.0, 120.0])
    mask = torch.tensor([0.0, 1.0, 1.0])
    seq = torch.tensor([0, 0, 1])
    for adv in (torch.tensor([0.5, 0.5, 0.0]), torch.zeros(3)):
        lp.grad = None
        if loss == "ppo":
            per_token, _ = ppo_policy_loss(lp, old, adv, mask)
        elif loss == "gspo":
            per_token, _ = gspo_policy_loss(lp, old, adv, mask, seq, clip_low=3e-4, clip_high=4e-4)
        else:
            per_token, _ = cispo_policy_loss(lp, old, adv, mask, clip_high=4.0)
        total = aggregate_loss(per_token, mask, seq, mode="token_mean", num_tokens=2, num_seqs=2)
        total.backward()
        assert torch.isfinite(total) and torch.isfinite(lp.grad).all(), (loss, adv, total, lp.grad)


def test_rewards_not_finite_in_float32_name_the_function_and_sample():
    from slime.data.sample import Sample

    with pytest.raises(ValueError, match=r"e2e_rewards:huge returned 1e\+39 for sample index=3 .* not a finite"):
        make_reward_fn("e2e_rewards:huge").score([Sample(prompt_ids=[1], prompt_text="2+2=", index=3)])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from data_tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("fault_model") / "m", arch="qwen2", seed=0)


def test_a_nan_loss_on_one_rank_skips_the_step_everywhere_and_repeated_skips_stop(model, tmp_path):
    run_ranks([str(REPO / "tests/dist/fault_checks.py"), str(model), str(tmp_path)])
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["skipped"] == 1.0 and r["unchanged"]  # rank 1's NaN: no rank stepped
    assert r["good_skipped"] == 0.0 and r["moved"]  # a finite step still trains
    assert r["nan_input_skipped"] == 1.0 and r["nan_input_unchanged"]  # NaN pi_old: a NaN loss with zero gradients
    assert "2 consecutive optimizer steps of the actor had a non-finite loss or gradient" in r["error"]
    assert "outside the actor's vocabulary" in r["vocab_error"], r["vocab_error"]


def test_work_of_rank_0_alone_may_outlast_the_collective_timeout_and_its_error_reaches_every_rank(tmp_path):
    """Rank 0 writes an HF export (or publishes a checkpoint) alone: a 60 GB model's can outlast the default 10
    minutes of train.dist_timeout_minutes, where the other ranks' barrier failed a finished run. They wait outside
    it now, saying so; rank 0's error (a full disk) is raised on them too, not a timeout."""
    proc = run_ranks([str(REPO / "tests/dist/on_main_checks.py"), str(tmp_path)], check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["waited"] and r1["waited"] and r1["waited_again"]  # dims built again: its keys are new
    assert "rank 1: waiting for rank 0 writing a slow file (0 min so far)" in proc.stdout
    assert r0["error"] == "OSError: [Errno 28] No space left on device"
    assert r1["error"] == "RuntimeError: rank 0 failed writing the HF export to /x: OSError: [Errno 28] No space " \
                          "left on device"
    assert r1["barrier"] != "passed"  # the barrier it replaces: rank 1 timed out
    last = json.loads((tmp_path / "rank1_last.json").read_text())  # rank 0 ended right after its error
    assert last["error"] == "RuntimeError: rank 0 failed publishing checkpoint step_2: OSError: [Errno 28] No " \
                            "space left on device"


def job_overrides(model, task_dir, run_dir) -> list[str]:
    """The tiny GRPO job of these tests, over examples/cpu_tiny_grpo.yaml (no plot: ~1 s of each launch)."""
    return [f"model.path={model}", f"data.path={task_dir / 'train.jsonl'}", f"log.run_dir={run_dir}", "eval.path=null",
            "rollout.reward.fn=e2e_rewards:digit_fraction", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
            "rollout.max_response_len=6", "train.lr=5e-3", "train.max_tokens_per_gpu=64", "log.plot=false"]


def launch(model, task_dir, run_dir, *overrides, nproc=2, check=True, timeout=600, env=None):
    args = [str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_grpo.yaml"),
            *job_overrides(model, task_dir, run_dir), *overrides]
    return run_ranks(args, nproc=nproc, timeout=timeout, env=env, check=check)


def test_a_step_without_a_token_to_learn_from_is_said_and_leaves_the_weights(model, task_dir, tmp_path):
    """A generate function that masks every response token trained on nothing, exit 0, loss 0, not a word; and
    after a step that trained, Adam's momentum still moved the weights at such a step."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    launch(model, task_dir, run_dir, "train.num_steps=1")
    before = load_file(next((run_dir / "hf").glob("*.safetensors")))
    proc = launch(model, task_dir, run_dir, "rollout.generate_fn=custom_rollouts:masks_everything",
                  "train.num_steps=2")
    out = proc.stdout + proc.stderr
    assert "actor: this step has no token to learn from (every response token has loss mask 0" in out
    after = load_file(next((run_dir / "hf").glob("*.safetensors")))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # means over no token are null, not 0 (an entropy of 0 in the plot); sums and the loss stay numbers
    row = read_metrics(run_dir)[-1]
    assert row["step"] == 2 and row["train/entropy"] is None and row["train/pg_clipfrac"] is None and \
        row["rollout/train_logprob_abs_diff"] is None and row["adv/adv_abs_mean"] is None, row
    assert row["train/loss"] == 0.0 and row["train/grad_norm"] == 0.0 and row["rollout/gen_tokens"] == 0, row


def test_sft_without_packing_keeps_rows_past_the_packing_budget(model, tmp_path):
    """train.max_tokens_per_gpu is packing's budget: with train.packing=false (padded micro-batches of
    train.micro_batch_size samples) SFT still skipped the rows past it as label_too_long."""
    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(8)] + [{"prompt": "9+1=", "label": "1" * 80}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = launch(model, tmp_path, tmp_path / "run", f"data.path={data}", "algo.policy_loss=sft",
                  "train.packing=false", "train.micro_batch_size=2", "train.num_steps=1", "data.max_skipped_frac=0.0")
    assert "label_too_long" not in proc.stdout + proc.stderr
    assert not [k for k in read_metrics(tmp_path / "run")[0] if k.startswith("data/skipped")]


def test_a_model_whose_packed_samples_would_not_compute_alone_is_said_before_the_models_load(model, task_dir,
                                                                                            tmp_path):
    """The loop's check_packing: dynamic rope, whose frequencies follow a packed row's largest position once a
    sample can pass the original context (here 64 < the job's longest sample), is refused at start, naming the
    settings that avoid it; a padded run of one sample per micro-batch starts."""
    import shutil

    dynamic = tmp_path / "dynamic"
    shutil.copytree(model, dynamic)
    config = json.loads((dynamic / "config.json").read_text())
    config.update(max_position_embeddings=64, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                               "rope_theta": 10000.0})
    (dynamic / "config.json").write_text(json.dumps(config))
    long = ("data.max_prompt_len=60", "rollout.max_response_len=8", "train.num_steps=1", "eval.path=null")
    proc = launch(dynamic, task_dir, tmp_path / "run", *long, nproc=1, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert f"model.path={dynamic} uses dynamic rope" in out
    assert "set train.packing=false and train.micro_batch_size=1" in out
    assert "RL for 1 steps" not in out
    launch(dynamic, task_dir, tmp_path / "padded", *long, "train.packing=false", "train.micro_batch_size=1", nproc=1)


def test_a_misspelled_generate_fn_is_said_before_the_models_load(model, task_dir, tmp_path):
    """It was loaded at the first rollout: after the actor, reference and engine (an SGLang server on a GPU) had
    loaded, and with a traceback from every rank."""
    proc = launch(model, task_dir, tmp_path / "run", "rollout.generate_fn=custom_rollouts:masks_everythin",
                  "train.num_steps=1", nproc=1, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert "start-up error: ValueError: rollout.generate_fn='custom_rollouts:masks_everythin'" in out
    assert "RL for 1 steps" not in out  # said before the models load


def test_a_reward_function_missing_from_its_module_is_said_before_the_models_load(model, task_dir, tmp_path):
    """The module exists, the function does not (a typo): said when the reward function loaded, after the actor,
    reference and engine (minutes on a GPU)."""
    proc = launch(model, task_dir, tmp_path / "run", "rollout.reward.fn=e2e_rewards:digit_fractio",
                  "train.num_steps=1", nproc=1, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert ("start-up error: ValueError: reward spec 'e2e_rewards:digit_fractio': module 'e2e_rewards' has no "
            "callable 'digit_fractio'") in out
    assert "Loading weights" not in out  # said before the models load


def test_zero1_in_bf16_under_a_colocated_engine_is_refused_before_the_models_load(model, task_dir, tmp_path):
    """DeepSpeed's BF16_Optimizer (ZeRO-1, bf16, fp32 accumulation) cannot offload: a colocated run on a GPU failed at
    its first rollout. Refused at start, before any model or engine loads (on CPU too, where offload is a no-op)."""
    ds = json.loads((REPO / "ds_configs/zero2.json").read_text())
    ds["zero_optimization"]["stage"] = 1
    (tmp_path / "zero1.json").write_text(json.dumps(ds))
    proc = launch(model, task_dir, tmp_path / "run", f"train.ds_config={tmp_path / 'zero1.json'}",
                  "model.dtype=bfloat16", "rollout.engine=sglang", "train.num_steps=1", nproc=1, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Loading weights" not in out, out[-3000:]
    assert "ZeRO-1 in bf16 with data_types.grad_accum_dtype=fp32 runs DeepSpeed's BF16_Optimizer" in out


def test_an_eval_budget_past_the_context_length_is_warned(model, task_dir, tmp_path):
    """The training prompts and rollout.max_response_len were checked against the model's context (512 here);
    the eval file and eval.max_response_len were not, and evaluation generated past it without a word."""
    proc = launch(model, task_dir, tmp_path / "run", f"eval.path={task_dir / 'eval.jsonl'}", "eval.max_prompts=2",
                  "eval.max_response_len=600", "train.num_steps=1", "checkpoint.export_hf=false", nproc=1)
    out = proc.stdout + proc.stderr
    assert "the longest eval prompt (" in out and "plus up to 600 new tokens passes the model's context length" in out
    assert "Lower data.max_prompt_len or eval.max_response_len" in out


def test_dynamic_sampling_that_would_draw_more_prompts_than_the_file_has_is_refused_at_start(model, tmp_path):
    """10 prompts, a batch of 4 x over_sample_factor 3: the first attempt draws 12; this failed after the models
    loaded, with "cannot draw 12 prompts over 2 ranks from 10"."""
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(10)))
    proc = launch(model, tmp_path, tmp_path / "run", f"data.path={data}", "rollout.batch_size=4",
                  "rollout.dynamic_sampling=true", "rollout.over_sample_factor=3", "train.num_steps=1", nproc=1,
                  check=False)
    assert proc.returncode != 0
    assert ("small.jsonl has 10 usable prompts, but dynamic sampling draws up to 12 at once (rollout.batch_size=4 x "
            "rollout.over_sample_factor=3" in proc.stdout + proc.stderr)
    # A start-up error is its message, one line per rank; each rank printed its traceback before
    assert "[rank0] start-up error: ValueError: " in proc.stderr and "Traceback" not in proc.stderr
    assert "SLIME_TRACEBACK=1 shows where it was raised" in proc.stderr
    proc = launch(model, tmp_path, tmp_path / "run2", f"data.path={data}", "rollout.batch_size=4",
                  "rollout.dynamic_sampling=true", "rollout.over_sample_factor=3", "train.num_steps=1", nproc=1,
                  check=False, env={"SLIME_TRACEBACK": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "start-up error" not in proc.stderr


def test_an_eval_prompt_past_the_vocabulary_in_one_ranks_slice_stops_every_rank_with_its_message(task_dir, tmp_path):
    """Each rank holds its slice of the eval file: the row with a token past the tiny arithmetic model's 261
    embeddings (<|endoftext|>, id 261) is rank 1's alone. Every rank raises its message, rank 0 included (not only
    rank 1, with rank 0 left waiting in the next collective)."""
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n" +
                     json.dumps({"prompt": "2+2=<|endoftext|>", "label": "4"}) + "\n")
    proc = launch(REPO / "assets/tiny-arith", task_dir, tmp_path / "run", f"eval.path={evals}", "train.num_steps=1",
                  check=False)
    assert proc.returncode != 0
    message = f"the prompt at {evals}:2 (eval.path) holds token ids [261]"
    assert f"[rank0] start-up error: ValueError: {message}" in proc.stderr, proc.stderr[-3000:]
    assert "RL for 1 steps" not in proc.stdout + proc.stderr


def test_a_prompt_longer_than_a_micro_batch_is_refused_at_start(model, tmp_path):
    """A prompt past parallel.sp x train.max_tokens_per_gpu can never train: this failed only at the step that drew
    it, after its rollout, suggesting a budget sized to that one sample."""
    data = tmp_path / "long.jsonl"
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(8)] + [{"prompt": "9+1=" * 40, "label": "x"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = launch(model, tmp_path, tmp_path / "run", f"data.path={data}", "rollout.batch_size=4",
                  "train.max_tokens_per_gpu=100", "rollout.max_response_len=8", "data.max_prompt_len=512",
                  "train.num_steps=1", nproc=1,
                  check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "1 prompt(s) are longer than a training micro-batch holds" in out, out[-3000:]
    assert f"(the prompt at {data}:9); a step that draws one would stop. Raise train.max_tokens_per_gpu to 1" in out
    assert "rollout:" not in out  # before any rollout


def test_a_second_run_in_a_run_dir_in_use_is_refused(model, task_dir, tmp_path):
    """Two runs started in one log.run_dir both exited 0: the second resumed from the first one's checkpoint
    while it still trained, and both wrote metrics.jsonl (step 100 twice). The first holds run_dir/.lock."""
    import fcntl

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / ".lock", "a+") as held:  # as the first run's rank 0 holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242 on node-a\n")
        held.flush()
        proc = launch(model, task_dir, run_dir, "train.num_steps=1", nproc=1, check=False)
    assert proc.returncode != 0
    assert f"log.run_dir={run_dir} is in use by another run (pid 4242 on node-a)" in proc.stdout + proc.stderr
    launch(model, task_dir, run_dir, "train.num_steps=1", nproc=1)  # released: the next run goes ahead
    assert (run_dir / ".lock").read_text().startswith("pid ")


def test_an_evaluation_with_no_prompt_left_says_so():
    """Every eval prompt skipped (images that failed when drawn, say): a ZeroDivisionError, before."""
    from slime.config import load_config
    from slime.trainer.evaluate import EvalSet, evaluate
    from one_rank import OneRank

    class Engine:
        def wake(self):
            pass

    cfg = load_config(None, ["model.path=m", "data.path=d.jsonl", "eval.path=eval.jsonl"])
    with pytest.raises(RuntimeError, match=r"evaluation on eval.jsonl: no prompt left to evaluate \(skipped: "
                                           r"\{'image_unreadable': 3\}\)"):
        evaluate(Engine(), EvalSet([], {"image_unreadable": 3}), cfg, None, None, OneRank())


def test_an_evaluation_counts_the_answers_cut_at_the_length_limit():
    """A truncated answer can still score (a number cut after its first digits): eval/accuracy alone hid how many
    answers ran into eval.max_response_len. eval/truncated_frac says it, as rollout/truncated_frac does."""
    from one_rank import OneRank

    from slime.config import load_config
    from slime.data.prompts import Prompt
    from slime.rollout.engine import Generation
    from slime.rollout.rewards import make_reward_fn
    from slime.trainer.evaluate import EvalSet, evaluate

    class Engine:  # rows 0 and 2 end at the limit, row 1 at EOS
        def wake(self):
            pass

        def generate(self, prompts, params, mm=None):
            return [[Generation([5, 6], [-0.1, -0.1], "stop" if i == 1 else "length")] for i in range(len(prompts))]

    class Tok:
        def decode(self, ids, **_):
            return "".join(map(str, ids))

    prompts = [Prompt(prompt_ids=[1, 2], prompt_text="q", label="56", metadata={}, index=i, source=f"e:{i + 1}")
               for i in range(3)]
    cfg = load_config(None, ["model.path=m", "data.path=d.jsonl", "eval.path=e.jsonl", "eval.max_response_len=2"])
    out = evaluate(Engine(), EvalSet(prompts, {}), cfg, Tok(), make_reward_fn("exact_match"), OneRank())
    assert out["eval/truncated_frac"] == pytest.approx(2 / 3) and out["eval/accuracy"] == 1.0


def test_a_run_whose_rewards_overflow_stops_with_the_message(model, task_dir, tmp_path):
    proc = launch(model, task_dir, tmp_path / "run", "rollout.reward.fn=e2e_rewards:huge", "train.num_steps=2",
                  check=False)
    assert proc.returncode != 0
    assert "e2e_rewards:huge returned 1e+39 for sample index=" in proc.stderr + proc.stdout


def test_a_learning_rate_that_overflows_never_reaches_a_checkpoint(model, task_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(model, task_dir, run_dir, "train.lr=1e30", "train.num_steps=3", "checkpoint.interval=1",
                  check=False)
    log = proc.stderr + proc.stdout
    assert proc.returncode != 0
    assert "not finite" in log and "blown" in log  # said as such, not as a bare sampling error
    for path in (run_dir / "checkpoints").rglob("*.pt"):  # whatever was saved is finite
        state = torch.load(path, weights_only=False, map_location="cpu")
        assert all(torch.isfinite(t).all() for t in tensors_in(state)), path


def tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj.float() if obj.is_floating_point() else obj.double()
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


# -- checkpoints -------------------------------------------------------------------------------------------

def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def exported(run_dir):
    return load_file(run_dir / "hf" / "model.safetensors")


@pytest.fixture(scope="module")
def straight(model, task_dir, tmp_path_factory):
    """The uninterrupted reference: 6 steps, a checkpoint after every step."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    launch(model, task_dir, run_dir, "train.num_steps=6", "checkpoint.interval=1")
    return run_dir


def assert_same_run(run_dir, straight):
    """Every step once, the metrics of every step and the final weights bitwise those of the straight run."""
    got, want = read_metrics(run_dir), read_metrics(straight)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, len(want) + 1))
    for a, b in zip(got, want):
        for key, value in b.items():
            if not key.startswith(("time/", "perf/")):
                assert a[key] == value, (a["step"], key)
    for name, t in exported(straight).items():
        assert torch.equal(exported(run_dir)[name], t), name


def test_corrupt_latest_checkpoint_is_reported_and_the_previous_one_resumes(model, task_dir, straight, tmp_path):
    run_dir = tmp_path / "run"
    launch(model, task_dir, run_dir, "train.num_steps=4", "checkpoint.interval=1", "checkpoint.keep=3")
    ckpt = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_2", "step_3", "step_4"]  # keep=3
    victim = max((ckpt / "step_4").rglob("*model_states.pt"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the size is right, the content is not
    victim.write_bytes(bytes(data))
    (ckpt / "step_3" / "rng_rank1.pt").write_bytes(b"torn")  # and step_3 truncated
    proc = launch(model, task_dir, run_dir, "train.num_steps=6", "checkpoint.interval=1", "checkpoint.keep=3")
    log = proc.stdout + proc.stderr
    assert "step_4: " in log and "does not match its checksum" in log
    assert "step_3: rng_rank1.pt has 4 bytes" in log and "resuming from the older checkpoint" in log
    assert_same_run(run_dir, straight)  # resumed at step 2, and every later step reproduced exactly


def test_the_checkpoint_a_resume_skipped_is_not_kept_in_place_of_a_good_one(model, task_dir, tmp_path):
    """Resumed from step_3 past a corrupt step_4, the first save (step 5, keep=2) kept step_4 and step_5 and
    removed step_3: a second fault would have left no checkpoint that verifies."""
    run_dir = tmp_path / "run"
    launch(model, task_dir, run_dir, "train.num_steps=4", "checkpoint.interval=1", "checkpoint.keep=3",
           "eval.path=null")
    ckpt = run_dir / "checkpoints"
    victim = max((ckpt / "step_4").rglob("*model_states.pt"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    proc = launch(model, task_dir, run_dir, "train.num_steps=5", "checkpoint.interval=5", "checkpoint.keep=2",
                  "eval.path=null")
    assert "removing checkpoints a run skipped as unusable when it resumed from an older one: step_4" in \
        proc.stdout + proc.stderr
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_3", "step_5"]


def test_a_zero2_run_resumes_exactly(model, task_dir, tmp_path):
    """ZeRO-2 lays its states out unlike ZeRO-3 (full parameters, flat optimizer partitions): a resume is exact too."""
    zero2 = ("train.ds_config=ds_configs/zero2.json", "checkpoint.interval=1")
    straight = tmp_path / "straight"
    launch(model, task_dir, straight, "train.num_steps=4", *zero2)
    run_dir = tmp_path / "run"
    launch(model, task_dir, run_dir, "train.num_steps=2", *zero2)
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_2"
    launch(model, task_dir, run_dir, "train.num_steps=4", *zero2)
    assert_same_run(run_dir, straight)


def cut_back_to(run_dir, source, step):
    """A copy of the run in `source` as a crash right after its checkpoint of `step` leaves it (later checkpoints,
    the export and metrics.jsonl's later records are what the resume replaces or truncates)."""
    shutil.copytree(source, run_dir)
    for later in (run_dir / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (run_dir / "checkpoints" / "latest").write_text(f"step_{step}")
    shutil.rmtree(run_dir / "hf")


def test_a_one_step_off_run_resumes_exactly_on_the_batch_it_had_in_flight(model, task_dir, tmp_path):
    """A one-step-off checkpoint holds the batch generated ahead (by the weights before its step's update): the
    resumed run trains on it, as the uninterrupted run did, not on one generated again with the saved weights.
    A resume with another rollout setting cannot use it: said, and that batch is generated again."""
    common = ("rollout.one_step_off=true", "algo.tis.level=token", "checkpoint.interval=1", "checkpoint.keep=4",
              "train.num_steps=4")
    straight = tmp_path / "straight"
    proc = launch(model, task_dir, straight, *common)
    assert "saving the checkpoint of step 2 and the batch generated ahead" in proc.stdout + proc.stderr
    assert "saving the checkpoint of step 4 and" not in proc.stdout + proc.stderr  # nothing is in flight at the end
    assert {p.name for p in (straight / "checkpoints/step_2").glob("ahead_rank*.pt")} == {"ahead_rank0.pt",
                                                                                          "ahead_rank1.pt"}
    lags = [r["rollout/policy_lag"] for r in read_metrics(straight)]
    assert lags == [0.0, 1.0, 1.0, 1.0]
    run_dir = tmp_path / "run"
    cut_back_to(run_dir, straight, 2)
    launch(model, task_dir, run_dir, *common)
    assert_same_run(run_dir, straight)  # step 3 trained on the batch the weights of step 1 generated (lag 1)

    changed = tmp_path / "changed"
    cut_back_to(changed, straight, 2)
    proc = launch(model, task_dir, changed, *common, "rollout.temperature=0.9")
    assert "holds the batch generated ahead for step 3, not used: this run's settings differ (rollout.temperature " \
           "1.0 -> 0.9)" in proc.stdout + proc.stderr
    rows = read_metrics(changed)
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 0.0, 1.0]  # step 3's batch made again, on-policy


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_resumable(model, task_dir, straight, tmp_path):
    """What a kill between DeepSpeed's files and the loop state leaves behind: a staging folder without a
    manifest; `latest` still names the previous, whole checkpoint."""
    run_dir = tmp_path / "run"
    launch(model, task_dir, run_dir, "train.num_steps=2", "checkpoint.interval=1")
    staging = run_dir / "checkpoints" / ".partial" / "step_3"
    staging.mkdir(parents=True)
    (staging / "actor").mkdir()
    (staging / "actor" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"half written")
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_2"
    launch(model, task_dir, run_dir, "train.num_steps=6", "checkpoint.interval=1")
    assert_same_run(run_dir, straight)


def test_kill_9_of_run_sh_alone_ends_the_ranks(model, task_dir, tmp_path):
    """SIGKILL to run.sh's process group (not its session) misses the launcher, which runs in a group of its own:
    the ranks trained on as orphans, writing to the run dir a rerun would use. They exit when run.sh is gone."""
    run_dir = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        proc = start_run_sh(model, task_dir, run_dir, steps=1000, stdout=log)
    wait_for_steps(run_dir, 2)
    assert rank_processes(run_dir)
    os.killpg(os.getpgid(proc.pid), signal.SIGKILL)  # run.sh's group only
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while rank_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rank_processes(run_dir)


def test_kill_9_of_the_whole_job_then_rerun_is_exact(model, task_dir, straight, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run_sh(model, task_dir, run_dir)
    wait_for_steps(run_dir, 3)
    # run.sh leads its own session (the launcher has a process group of its own inside it): SIGKILL to the
    # whole session is the whole job, as an OOM killer or a scheduler's hard kill would do it
    subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)])
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while rank_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rank_processes(run_dir)
    launch(model, task_dir, run_dir, "train.num_steps=6", "checkpoint.interval=1")
    assert_same_run(run_dir, straight)  # metrics.jsonl holds each step once


def test_a_run_of_skipped_steps_counts_on_across_a_resume(model, task_dir, tmp_path):
    """train.max_skipped_steps counts skips in a row across a resume, as in a run never stopped: a skip at step 2,
    checkpointed, then one at step 3 of the resumed run are 2 in a row (tests/dist/nan_norm_run.py makes them)."""
    run_dir = tmp_path / "run"
    args = [str(REPO / "tests/dist/nan_norm_run.py"), "--config", str(REPO / "examples/cpu_tiny_grpo.yaml"),
            *job_overrides(model, task_dir, run_dir), "train.max_skipped_steps=2", "checkpoint.interval=1"]
    run_ranks([*args, "train.num_steps=2"], nproc=1, env={"SLIME_TEST_NAN_NORM_AT": "2"})
    assert [r["train/skipped_steps"] for r in read_metrics(run_dir)] == [0.0, 1.0]
    proc = run_ranks([*args, "train.num_steps=4"], nproc=1, env={"SLIME_TEST_NAN_NORM_AT": "1"}, check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]  # the resumed run's first step is the run's step 3
    assert "2 consecutive optimizer steps of the actor had a non-finite" in proc.stdout + proc.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]


def test_the_micro_batch_plan_fits_a_critic_that_cannot_share_prompts(model, task_dir, tmp_path):
    """A MoE critic under a dense actor keeps each sample's prompt (no shared prompts): the training plan counts
    them, so the critic's micro-batches stay within train.max_tokens_per_gpu (planned with the actor's shared
    prompts, they reached 204-240 tokens of a 128 budget)."""
    from data_tools.make_tiny_model import make_tiny_model

    critic = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=0)
    out = tmp_path / "tokens.json"
    run_ranks([str(REPO / "tests/dist/micro_batch_tokens_run.py"), "--config",
               str(REPO / "examples/cpu_tiny_grpo.yaml"), *job_overrides(model, task_dir, tmp_path / "run"), "train.num_steps=2", "algo.advantage_estimator=gae",
               f"algo.critic.path={critic}", "train.max_tokens_per_gpu=128", "rollout.max_response_len=8"],
              nproc=1, env={"SLIME_TEST_TOKENS_OUT": str(out)})
    largest = json.loads(out.read_text())
    assert set(largest) == {"actor", "critic"} and max(largest.values()) <= 128, largest
    assert largest["critic"] > 64, largest  # the budget is in play: micro-batches are not trivially small


def test_resume_refuses_another_model_or_zero_stage_or_no_resume_and_applies_a_changed_lr(model, task_dir, tmp_path):
    from data_tools.make_tiny_model import make_tiny_model

    run_dir = tmp_path / "run"
    constant = ("train.warmup_steps=0", "train.lr_schedule=constant")  # the step-2 lr is then train.lr itself
    launch(model, task_dir, run_dir, "train.num_steps=1", *constant)
    proc = launch(model, task_dir, run_dir, "train.num_steps=1", *constant, "checkpoint.resume=false", check=False)
    assert proc.returncode != 0 and "already holds a run" in proc.stdout + proc.stderr  # a used run dir
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    other = make_tiny_model(tmp_path / "other", arch="qwen2", seed=0, layers=3)
    proc = launch(other, task_dir, run_dir, "train.num_steps=2", *constant, check=False)
    assert proc.returncode != 0 and "resuming would load another model's weights" in proc.stderr + proc.stdout
    assert "shared prompts (train.share_prompts)" not in proc.stdout + proc.stderr  # before the actor was built
    proc = launch(model, task_dir, run_dir, "train.num_steps=2", *constant, "train.ds_config=ds_configs/zero2.json",
                  check=False)
    assert proc.returncode != 0 and "holds ZeRO-3 states but train.ds_config sets ZeRO stage 2" in proc.stderr + proc.stdout
    assert "shared prompts (train.share_prompts)" not in proc.stdout + proc.stderr
    proc = launch(model, task_dir, run_dir, "train.num_steps=2", *constant, nproc=1, check=False)
    assert proc.returncode != 0 and "was written by 2 ranks, this run has 1" in proc.stderr + proc.stdout
    assert "shared prompts (train.share_prompts)" not in proc.stdout + proc.stderr
    proc = launch(model, task_dir, run_dir, "train.num_steps=2", *constant, "train.lr=1e-3")
    assert "train.lr 0.005 -> 0.001" in proc.stdout + proc.stderr
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["train/lr"] == pytest.approx(1e-3)
    assert json.loads((run_dir / "config.json").read_text())["train"]["lr"] == 1e-3



def test_the_logged_lr_is_the_one_used_and_a_longer_resumed_run_follows_its_own_schedule(model, task_dir, tmp_path):
    """train/lr is the rate of the step's update; a run resumed with more steps continues on the schedule of its
    new length from the first resumed step (the restored optimizer held the old schedule's last rate: 0 here)."""
    from slime.config import TrainConfig
    from slime.trainer.policy_engine import lr_lambda

    run_dir = tmp_path / "run"
    schedule = ("train.warmup_steps=1", "train.lr_schedule=cosine", "train.min_lr=0", "checkpoint.interval=1")
    launch(model, task_dir, run_dir, "train.num_steps=2", *schedule, nproc=1)
    proc = launch(model, task_dir, run_dir, "train.num_steps=4", *schedule, nproc=1)
    assert "train.num_steps 2 -> 4" in proc.stdout + proc.stderr
    short, long = (lr_lambda(TrainConfig(num_steps=n, warmup_steps=1, lr_schedule="cosine", lr=5e-3), n) for n in (2, 4))
    expected = [5e-3 * short(0), 5e-3 * short(1), 5e-3 * long(2), 5e-3 * long(3)]  # 2.5e-3, 5e-3, 3.75e-3, 1.25e-3
    assert [r["train/lr"] for r in read_metrics(run_dir)] == pytest.approx(expected)


def test_after_a_critics_warmup_the_actors_schedule_spans_the_steps_that_train_it(model, task_dir, tmp_path):
    """algo.critic.warmup_steps: the actor trains from the step after the warmup, and its cosine spanned every step
    of the run, so it ended a warmup's share short of min_lr (verl's does the same)."""
    from slime.config import TrainConfig
    from slime.trainer.policy_engine import lr_lambda

    run_dir = tmp_path / "run"
    launch(model, task_dir, run_dir, "train.num_steps=3", "algo.advantage_estimator=gae", "algo.critic.warmup_steps=1",
           "train.lr_schedule=cosine", "train.warmup_steps=0", "train.min_lr=1e-3", "algo.critic.lr=2e-3",
           "checkpoint.interval=0", nproc=1)
    cosine = TrainConfig(num_steps=3, lr_schedule="cosine", lr=5e-3, min_lr=1e-3)
    actor = lr_lambda(cosine, 2)  # two updates: steps 2 and 3
    rows = read_metrics(run_dir)
    assert [r.get("train/lr") for r in rows] == pytest.approx([None, 5e-3, 5e-3 * actor(1)])
    assert actor(1) == pytest.approx(0.2 + 0.8 * 0.5)  # halfway down to min_lr at its second update
    # The critic trains at every step on the same schedule, scaled to its own rate (it kept 2e-3 throughout)
    critic = lr_lambda(cosine, 3)
    assert [r["critic/lr"] for r in rows] == pytest.approx([2e-3, 2e-3 * critic(1), 2e-3 * critic(2)])
    assert critic(1) < 1


def test_a_critic_saved_with_a_constant_rate_resumes_onto_the_schedule(model, task_dir, tmp_path):
    """Checkpoints from before the critic followed the lr schedule hold no scheduler state for it: DeepSpeed's
    load handed None to the scheduler (AttributeError). Such a checkpoint (made here by removing the state and
    the manifest's mark) resumes, and the critic's rate at step 2 is the straight run's."""
    import hashlib

    gae = ("algo.advantage_estimator=gae", "checkpoint.interval=1")
    launch(model, task_dir, tmp_path / "straight", "train.num_steps=2", *gae, nproc=1)
    run_dir = tmp_path / "run"
    launch(model, task_dir, run_dir, "train.num_steps=1", *gae, nproc=1)
    step = run_dir / "checkpoints" / "step_1"
    (states,) = (step / "critic").glob("*model_states.pt")
    saved = torch.load(states, weights_only=False)
    assert saved["lr_scheduler"] is not None
    saved["lr_scheduler"] = None
    torch.save(saved, states)
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["critic_schedule"]
    manifest["files"][str(states.relative_to(step))] = {"bytes": states.stat().st_size,
                                                         "sha256": hashlib.sha256(states.read_bytes()).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))
    proc = launch(model, task_dir, run_dir, "train.num_steps=2", *gae, nproc=1)
    assert "saved when the critic's learning rate was constant" in proc.stdout + proc.stderr
    want = [r["critic/lr"] for r in read_metrics(tmp_path / "straight")]
    assert [r["critic/lr"] for r in read_metrics(run_dir)][1] == pytest.approx(want[1]) and want[1] != want[0]


# -- signals ----------------------------------------------------------------------------------------------------

def run_sh(model, task_dir, run_dir, *overrides) -> tuple[list[str], dict]:
    """The command and environment that run the tiny job through run.sh (DeepSpeed's launcher), as a user would."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "MASTER_PORT": str(29400 + os.getpid() % 500)}
    return ["bash", str(REPO / "run.sh"), str(REPO / "examples/cpu_tiny_grpo.yaml"),
            *job_overrides(model, task_dir, run_dir), *overrides], env


def start_run_sh(model, task_dir, run_dir, steps=6, stdout=subprocess.PIPE):
    cmd, env = run_sh(model, task_dir, run_dir, f"train.num_steps={steps}", "checkpoint.interval=1",
                      "checkpoint.export_hf=true")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_steps(run_dir, n, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and sum('"train/loss"' in line for line in metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{run_dir} did not reach step {n}")


def rank_processes(run_dir):
    out = subprocess.run(["pgrep", "-f", f"log.run_dir={run_dir}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_sigterm_to_run_sh_saves_stops_every_rank_and_a_rerun_is_exact(model, task_dir, straight, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run_sh(model, task_dir, run_dir)
    wait_for_steps(run_dir, 2)
    os.kill(proc.pid, signal.SIGTERM)  # run.sh's PID only, as a scheduler or `kill PID` would
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    assert "stopped by signal after step" in out and "checkpoint" in out
    assert not rank_processes(run_dir)  # no rank ran on
    latest = (run_dir / "checkpoints" / "latest").read_text()
    done = len([r for r in read_metrics(run_dir) if "train/loss" in r])
    assert latest == f"step_{done}" and 2 <= done < 6  # saved after the step it was in
    launch(model, task_dir, run_dir, "train.num_steps=6", "checkpoint.interval=1")
    assert_same_run(run_dir, straight)


STOP_SCRIPT = """
import os, signal, sys, time
from slime.utils.signals import StopRequest
stop = StopRequest.install()
stop.stuck_after_s = 0.5
stop.in_loop = sys.argv[2] != "start-up"
def stuck_in_user_code():
    time.sleep(float(sys.argv[1]))
os.kill(os.getpid(), signal.SIGTERM)
if sys.argv[2] == "ends":
    stop.step_ended()
stuck_in_user_code()
print("left the step", stop.requested)
"""


def test_a_rank_stuck_after_a_stop_signal_prints_where_and_exits(tmp_path):
    """After SIGTERM a rank that does not reach the end of its step in time prints its threads' stacks (naming
    the function it hangs in) and exits; one that reached it (stop agreed, checkpoint under way) is left alone."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    stuck = subprocess.run([sys.executable, "-c", STOP_SCRIPT, "600", "hangs"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert stuck.returncode != 0 and "left the step" not in stuck.stdout
    assert "SIGTERM received" in stuck.stderr and "in stuck_in_user_code" in stuck.stderr, stuck.stderr
    ended = subprocess.run([sys.executable, "-c", STOP_SCRIPT, "1.5", "ends"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert ended.returncode == 0 and "left the step True" in ended.stdout, ended.stderr
    assert "stuck_in_user_code" not in ended.stderr
    # At start-up (models loading, servers starting) there is no step to finish: it exited only when the stack
    # dump's timer ran out, by os._exit, so no cleanup ran (SGLang servers still starting were left behind)
    early = subprocess.run([sys.executable, "-c", STOP_SCRIPT.replace("0.5", "600"), "600", "start-up"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert early.returncode == 143 and "SIGTERM received during start-up: stopping" in early.stderr, early.stderr


SECOND_SIGNAL = """
import os, signal, sys
from slime.utils.logging import setup_logging
from slime.utils.signals import StopRequest
setup_logging()
stop = StopRequest.install()
stop.in_loop = True
os.kill(os.getpid(), signal.SIGTERM)
stop.step_ended()
if sys.argv[1] == "saved":
    stop.saved = "runs/x/checkpoints/step_3"
os.kill(os.getpid(), signal.SIGTERM)  # a launcher passing on another rank's exit
"""


def test_a_second_signal_after_the_stop_saved_says_the_checkpoint_is_saved():
    """On a stop the first rank to exit (143) made the launcher signal the others again: one still stopping its
    SGLang server said "exiting now without saving" after the checkpoint was written."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for case, said in (("saved", "second signal (SIGTERM): exiting now; the checkpoint runs/x/checkpoints/step_3 is "
                                 "saved"), ("not", "second signal (SIGTERM): exiting now without saving")):
        done = subprocess.run([sys.executable, "-c", SECOND_SIGNAL, case], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 143 and said in done.stdout + done.stderr, done.stdout + done.stderr


# -- hangs -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["sleeps", "sleeps_async"])
def test_a_hung_reward_function_times_out_naming_itself_and_the_sample(fn):
    from slime.data.sample import Sample

    reward = make_reward_fn(f"reward_fns_for_test:{fn}", timeout=0.5)
    with pytest.raises(TimeoutError, match=rf"reward_fns_for_test:{fn} did not return within "
                                           r"rollout.reward.timeout=0.5s for sample index=7"):
        reward.score([Sample(prompt_ids=[1], prompt_text="q", index=7)])  # sleeps 60 s, then returns a reward


def test_a_rank_that_stops_answering_is_named_with_step_and_phase(model, task_dir, tmp_path):
    """Rank 1 hangs in its reward function; rank 0 waits in the next collective and gives up after the
    loop's timeout with the step and the phase; the launcher's SIGTERM finds rank 1 still hung, which then
    prints where (its reward function) and exits. The timeout (15 s) also holds for the start-up's collectives:
    it leaves room for one rank to load and compile that much later than the other on a loaded machine."""
    proc = launch(model, task_dir, tmp_path / "run", "rollout.reward.fn=e2e_rewards:sleep_on_rank1",
                  "rollout.reward.timeout=600", "train.dist_timeout_minutes=0.25", "train.num_steps=1", check=False,
                  env={"SLIME_STUCK_AFTER_S": "3"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "step 1, rollout: a collective waited more than train.dist_timeout_minutes=0.25" in out
    assert "in sleep_on_rank1" in out, out[-3000:]
    # what the start said of it, once (rank 0): a reward timeout past the collectives' names no function
    assert out.count("rollout.reward.timeout=600s not below train.dist_timeout_minutes=0.25 (15 s): on 2 ranks") == 1


@pytest.mark.parametrize("error, collective", [
    (RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation to "
                  "complete"), True),
    (RuntimeError("Application timeout caused pair closure"), True),
    (torch.distributed.DistBackendError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                                        "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out."), True),
    (torch.distributed.DistStoreError("wait timeout after 600000ms, keys: /default_pg/0//cuda//0"), True),
    # an NCCL error of this rank's own (its CUDA ran out of memory) is not another rank's silence
    (torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL "
                                        "version 2.21.5, Last error: Cuda failure 'out of memory'"), False),
    # this rank's own failures that mention a timeout keep their message
    (RuntimeError("reward server http://h/score failed for sample index=0 after 1 attempts: HTTP 500: 'boom'. "
                  "Check the server, or raise rollout.reward.timeout / max_retries"), False),
    (RuntimeError("SGLang server died: Read timed out. (read timeout=30)"), False),
])
def test_only_a_collective_timeout_is_reported_as_a_rank_that_stopped_answering(error, collective):
    from slime.trainer.loop import Phase

    phase = Phase()
    phase.now = "rollout"
    with pytest.raises(RuntimeError) as e:
        with phase.guard(step=3, minutes=10):
            raise error
    assert ("step 3, rollout: a collective waited more than" in str(e.value)) is collective
    assert (e.value is error) is not collective


def test_a_collective_timeout_in_rollout_or_weight_sync_names_the_engine_a_rank_may_wait_on():
    """With SGLang engines the rank that stopped answering may be waiting on its server: the other ranks' message
    says so in the phases that talk to it (the rank itself names the server only after request_timeout)."""
    from slime.trainer.loop import Phase

    timeout = RuntimeError("Application timeout caused pair closure")
    for now, named in (("rollout", True), ("weight sync", True), ("training", False), ("checkpoint", False)):
        phase = Phase("waited on an SGLang engine that does not answer")
        phase.now = now
        with pytest.raises(RuntimeError) as e:
            with phase.guard(step=3, minutes=10):
                raise timeout
        assert ("data loader, waited on an SGLang engine that does not answer, or ran out" in str(e.value)) is named
    phase = Phase()
    phase.now = "rollout"
    with pytest.raises(RuntimeError, match=r"a reward function or a data loader, or ran out of memory\)"):
        with phase.guard(step=3, minutes=10):
            raise timeout


@pytest.mark.parametrize("text", [
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:5524",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:61002: Connection reset by peer",
])
def test_a_rank_killed_mid_collective_is_named_with_step_and_phase(text):
    from slime.trainer.loop import Phase

    phase = Phase()
    phase.now = "training"
    with pytest.raises(RuntimeError, match="step 2, training: another rank's connection closed"):
        with phase.guard(step=2, minutes=10):
            raise RuntimeError(text)
    with pytest.raises(RuntimeError, match="^HTTP: Connection reset by peer$"):  # not gloo's: this rank's own
        with phase.guard(step=2, minutes=10):
            raise RuntimeError("HTTP: Connection reset by peer")


def test_the_loops_own_stop_exits_and_user_codes_sys_exit_is_an_error():
    from slime.trainer.loop import Phase, Stopped

    phase = Phase()
    phase.now = "rollout"
    with pytest.raises(Stopped):
        with phase.guard(step=2, minutes=10):
            raise Stopped(143)
    with pytest.raises(RuntimeError, match=r"step 2, rollout: user code called sys.exit\(0\)"):
        with phase.guard(step=2, minutes=10):
            raise SystemExit(0)


@pytest.mark.parametrize("fn, where", [
    ("e2e_rewards:exits", "step 1, rollout"),
    ("exits_on_import:reward", "step 0, importing rollout.reward.fn=exits_on_import:reward")])
def test_a_reward_function_that_calls_sys_exit_0_fails_the_run(model, task_dir, tmp_path, fn, where):
    """sys.exit(0) in a reward's thread reached the main thread as SystemExit(0): the run ended after one step with
    exit code 0 and no checkpoint, a success to any scheduler. Also at the reward module's import."""
    proc = launch(model, task_dir, tmp_path / "run", f"rollout.reward.fn={fn}", "train.num_steps=2",
                  nproc=1, check=False)
    assert proc.returncode != 0
    assert f"{where}: user code called sys.exit(0)" in proc.stdout + proc.stderr


def test_a_generate_function_module_that_calls_sys_exit_0_on_import_fails_the_run(model, task_dir, tmp_path):
    """Imported before the models load (a typo found in seconds), outside the loop's guard: the run ended there
    with exit code 0, no step trained."""
    proc = launch(model, task_dir, tmp_path / "run", "rollout.generate_fn=exits_on_import:generate",
                  "train.num_steps=1", nproc=1, check=False)
    assert proc.returncode != 0
    assert ("step 0, importing rollout.generate_fn=exits_on_import:generate: user code called sys.exit(0)"
            in proc.stdout + proc.stderr)


def test_a_run_whose_processes_end_early_with_exit_code_0_fails_under_run_sh(model, task_dir, tmp_path):
    """os._exit(0) in a reward function ends every rank with code 0 and no step: run.sh sees no completion mark."""
    common = ("train.num_steps=1", "checkpoint.export_hf=false")
    cmd, env = run_sh(model, task_dir, tmp_path / "early", *common, "rollout.reward.fn=e2e_rewards:os_exits")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "every rank exited with code 0, but the run did not finish" in proc.stderr
    cmd, env = run_sh(model, task_dir, tmp_path / "ok", *common)
    ok = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0 and "did not finish" not in ok.stderr, ok.stderr[-3000:]


def test_a_resume_keeps_the_evaluation_of_its_step_and_evaluates_where_due(model, task_dir, tmp_path):
    """The first run evaluated its last step (2); resumed with more steps, that record stays, once, and the step is
    not evaluated again (the evaluation was cut from the history and made only where due: raising num_steps lost
    it); the new last step is evaluated."""
    run_dir = tmp_path / "run"
    common = (f"eval.path={task_dir / 'eval.jsonl'}", "eval.max_prompts=4", "eval.interval=3",
              "checkpoint.interval=0", "checkpoint.export_hf=false")
    for steps in (2, 3):
        proc = launch(model, task_dir, run_dir, *common, f"train.num_steps={steps}", nproc=1)
    log = proc.stdout + proc.stderr
    assert "eval after step 2/3" not in log and "eval after step 3/3" in log  # the resumed run's evaluations
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [(r["step"], "train" if any(k.startswith("train/") for k in r) else "eval") for r in records]
    assert kinds == [(0, "eval"), (1, "train"), (2, "train"), (2, "eval"), (3, "train"), (3, "eval")]


# -- data --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_each_bad_data_file_names_file_line_and_reason(tmp_path, tok):
    from slime.data.prompts import load_prompts

    cases = {
        "malformed.jsonl": (b'{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": \n',
                            r"malformed.jsonl:2: not valid JSON \(Expecting value at column"),
        "empty.jsonl": (b"\n\n", r"empty.jsonl is empty"),
        "latin1.jsonl": ('{"prompt": "ok", "label": "1"}\n{"prompt": "caf\u00e9", "label": "2"}\n'.encode("latin-1"),
                         r"latin1.jsonl:2: byte 0xe9 at column 16 \(file offset 46\) is not UTF-8"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=message):
            load_prompts(DataConfig(path=str(tmp_path / name)), tok)


def test_rows_without_a_needed_label_or_with_an_empty_prompt_are_counted_at_load(tmp_path, tok, caplog):
    from slime.data.prompts import load_prompts

    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2="}, {"prompt": "  ", "label": "x"},
            {"messages": [{"role": "user", "content": ""}], "label": "y"}] + \
        [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, report = load_prompts(DataConfig(path=str(path)), tok, label_required=True)
    assert len(prompts) == 41 and dict(report.skipped) == {"missing_label": 1, "empty_prompt": 2}
    assert "d.jsonl:2: skipped (missing_label)" in caplog.text and "d.jsonl:3: skipped (empty_prompt)" in caplog.text
    prompts, report = load_prompts(DataConfig(path=str(path)), tok, label_required=False)
    assert len(prompts) == 42  # a user reward may not need labels


def test_a_role_the_chat_template_does_not_render_skips_its_row(tmp_path):
    """ShareGPT's "human" (or "User"): the template rendered nothing for the message, and the row was trained on as
    the bare generation prompt, with one warning. It is skipped and counted now, and a file of them stops the run."""
    from slime.data.prompts import load_prompts
    from slime.models.loading import load_tokenizer
    from slime.config import ModelConfig

    tok = load_tokenizer(ModelConfig(path=str(REPO / "assets/tiny-arith")))
    path = tmp_path / "d.jsonl"
    rows = [{"messages": [{"role": role, "content": f"{i}+1="}], "label": str(i + 1)}
            for i, role in enumerate(["human"] + ["user"] * 19)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, report = load_prompts(DataConfig(path=str(path)), tok, label_required=True)
    assert len(prompts) == 19 and dict(report.skipped) == {"unrendered_role": 1}
    assert all("+1=" in p.prompt_text for p in prompts)
    path.write_text("".join(json.dumps({**r, "messages": [{"role": "User", "content": "1+1="}]}) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"20 of 20 rows are bad \({'unrendered_role': 20}\)"):
        load_prompts(DataConfig(path=str(path)), tok, label_required=True)


def test_the_epoch_tail_is_carried_into_the_next_epoch(tmp_path, tok):
    from slime.data.prompts import PromptSource

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": "x"}) + "\n" for i in range(10)))
    src = PromptSource(DataConfig(path=str(path)), tok, batch_size=4, dp_rank=0, dp_size=1, seed=0)
    seen = [p.index for _ in range(5) for p in src.next_batch()]  # 20 draws = 2 epochs exactly
    assert sorted(seen) == sorted(list(range(10)) * 2)  # every row twice: no tail dropped
    assert src.epoch == 1 and src.offset == 10  # the second epoch is used up exactly


@pytest.mark.parametrize("override", ["train.num_steps=-3", "train.num_steps=0", "checkpoint.keep=0",
                                      "rollout.reward.timeout=0", "train.max_skipped_steps=0"])
def test_invalid_counts_are_config_errors(override):
    with pytest.raises(ValueError, match=override.split("=")[0]):
        load_config(None, ["model.path=m", "data.path=d.jsonl", override])


def test_an_export_the_finished_run_did_not_complete_is_made_by_the_rerun(model, task_dir, tmp_path):
    """The final checkpoint is saved before the HF export: a run killed (or out of disk) in the export used to be
    'finished' for good, a rerun exiting 0 with no export. The export is written beside hf/ and renamed into place
    with the step it holds; a rerun at the end makes a missing or older one, and leaves a complete one alone; a run
    that trained writes its own, also over an earlier run's export of the same step."""
    run_dir = tmp_path / "run"
    launch(model, task_dir, run_dir, "train.num_steps=1", "checkpoint.export_hf=true", nproc=1)
    first = load_file(run_dir / "hf" / "model.safetensors")
    assert json.loads((run_dir / "hf" / "slime_export.json").read_text()) == {"step": 1}
    shutil.rmtree(run_dir / "hf")  # the export never finished
    (run_dir / ".hf.partial").mkdir()  # what a kill mid-export leaves beside it
    proc = launch(model, task_dir, run_dir, "train.num_steps=1", "checkpoint.export_hf=true", nproc=1)
    assert "nothing to do" in proc.stdout + proc.stderr
    again = load_file(run_dir / "hf" / "model.safetensors")
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    assert not (run_dir / ".hf.partial").exists()
    stamp = (run_dir / "hf" / "model.safetensors").stat().st_mtime_ns
    launch(model, task_dir, run_dir, "train.num_steps=1", "checkpoint.export_hf=true", nproc=1)
    assert (run_dir / "hf" / "model.safetensors").stat().st_mtime_ns == stamp  # complete: left alone
    # A fresh start in the same run dir (its checkpoints gone) trains anew: its export replaces the earlier run's,
    # although both hold step 1
    shutil.rmtree(run_dir / "checkpoints")
    launch(model, task_dir, run_dir, "train.num_steps=1", "checkpoint.export_hf=true", "train.seed=7", nproc=1)
    fresh = load_file(run_dir / "hf" / "model.safetensors")
    assert any(not torch.equal(fresh[k], first[k]) for k in first)


def test_run_sh_launches_on_the_visible_gpus(tmp_path):
    """DeepSpeed's --num_gpus N takes GPUs 0..N-1 and drops CUDA_VISIBLE_DEVICES: a user who picked GPUs 4,5 got
    0,1 (another job's). run.sh names the visible GPUs with --include, and refuses more ranks than the node has
    GPUs (scripts/run-qwen3-30B-A3B.sh started its 16 on one node), or a MASTER_PORT another run listens on. A
    stub deepspeed records its arguments; a stub python says there are 4 GPUs."""
    import shutil

    real_python = shutil.which("python") or sys.executable
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "python").write_text(f'#!/bin/sh\nif [ "$1" = -c ] && echo "$2" | grep -q device_count; then '
                                  f'echo 4; exit 0; fi\ncase "$1" in data_tools/*) echo "$1" >> {tmp_path}/built; '
                                  f'exit 0;; esac\nexec {real_python} "$@"\n')  # an asset build: recorded only
    (stubs / "deepspeed").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\ntouch "$SLIME_DONE_FILE"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)

    with reserved_port() as port:  # held from others; run.sh checks that no one listens on it
        base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NPROC")}
        base["PATH"] = f"{stubs}:{base['PATH']}"
        base["MASTER_PORT"] = str(port)

        def launch(*overrides, **env):
            out = subprocess.run(["bash", str(REPO / "run.sh"), str(REPO / "examples/cpu_tiny_grpo.yaml"),
                                  *overrides], env={**base, **env}, capture_output=True, text=True, timeout=60)
            return out, (tmp_path / "args").read_text().split() if out.returncode == 0 else None

        out, args = launch()
        assert out.returncode == 0 and args[:2] == ["--num_gpus", "4"], out.stderr
        out, args = launch(CUDA_VISIBLE_DEVICES="4,5,6,7", NPROC="2")
        assert out.returncode == 0 and args[:2] == ["--include", "localhost:4,5"], out.stderr
        # UUIDs: DeepSpeed's launcher failed on them (int("GPU-...")); nvidia-smi gives their indices
        (stubs / "nvidia-smi").write_text("#!/bin/sh\necho '0, GPU-aaaa-0'\necho '1, GPU-bbbb-1'\n"
                                         "echo '2, GPU-cccc-2'\necho '3, GPU-dddd-3'\n")
        (stubs / "nvidia-smi").chmod(0o755)
        out, args = launch(CUDA_VISIBLE_DEVICES="GPU-dddd-3,GPU-bbbb,2", NPROC="3")  # a UUID's prefix, as CUDA takes
        assert out.returncode == 0 and args[:2] == ["--include", "localhost:3,1,2"], out.stderr
        for visible, words in (("MIG-1234,MIG-5678", "names 'MIG-1234', not a GPU index (a MIG instance has none)"),
                               ("GPU-ffff", "names 'GPU-ffff', a UUID nvidia-smi does not list")):
            out, _ = launch(CUDA_VISIBLE_DEVICES=visible, NPROC="1")
            assert out.returncode == 2 and words in out.stderr and "torchrun --nproc_per_node 1 run.py" in out.stderr
        out, _ = launch(NPROC="16")  # a two-node recipe started on one node: ranks 4-15 would have no GPU
        assert out.returncode == 2 and "NPROC=16 ranks, but this node shows 4 GPU(s)" in out.stderr
        assert "docs/multi_node.md" in out.stderr
        with socket.socket() as taken:  # another run's rank 0 listens on the port: torch's EADDRINUSE from every rank
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            busy = taken.getsockname()[1]
            out, _ = launch("data.path=data/arith-chat/none.jsonl", MASTER_PORT=str(busy))
        assert out.returncode == 2 and f"run.sh: MASTER_PORT={busy} is in use" in out.stderr
        assert not (tmp_path / "built").exists()  # said before an asset's build (minutes for some), not after
        assert "Give this run a free port of its own, e.g. MASTER_PORT=" in out.stderr
        assert launch(MASTER_PORT="29x")[0].returncode == 2


def test_a_lock_a_killed_op_build_left_is_named_before_the_run_waits_on_it(tmp_path, monkeypatch, caplog):
    """DeepSpeed compiles CPU Adam (an offloaded optimizer), fused Adam (a GPU) and its CPU all-reduce at their first
    use, under a lock file: a build killed midway (a CI job's timeout did) left it, and the next run waited on it
    forever with no word. The file is named before DeepSpeed is started."""
    from slime.distributed.parallel_dims import warn_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "deepspeed_shm_comm").mkdir()  # built: no lock
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").touch()
    with caplog.at_level(logging.WARNING):
        warn_build_locks()
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'cpu_adam' / 'lock'} exists: another process is building DeepSpeed's op cpu_adam, or a killed "
        "build left it; with no build running, this run waits on it forever: delete the file"]
