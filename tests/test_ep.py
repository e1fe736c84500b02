"""Expert parallelism (DeepSpeed AutoEP) on ZeRO-3: ep=2 against ep=1 at the same data-parallel layout,
names out equal to the checkpoint's, the export reloads with the trainer's logprobs, the loop, sp x ep."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import REPO, assert_params_close, run_ranks, stable_adam_ds_config
from data_tools.make_tiny_model import make_tiny_model
from dist.actor_checks import fixed_batch
from one_rank import OneRank
from slime.data.batch import build_micro_batch, build_padded_micro_batch
from slime.models.adapters import read_checkpoint_shapes
from slime.models.attention import PACKED_SDPA
from slime.models.policy import PolicyModel
from slime.trainer.layout import Layout, distribute
from slime.trainer.losses import router_terms


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=1) for arch in ("qwen3_moe", "mixtral", "qwen2_moe")}


def run(model, out, nproc, *overrides):
    out.mkdir(parents=True)
    run_ranks([str(REPO / "tests/dist/ep_checks.py"), str(model), str(out),
               f"train.ds_config={stable_adam_ds_config(out)}", *overrides], nproc=nproc)
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def qwen3_runs(moe_models, tmp_path_factory):
    """ep=2 and ep=1, both on 2 ranks (the same dp layout, so the per-micro-batch aux loss matches too)."""
    root = tmp_path_factory.mktemp("qwen3_moe_runs")
    extra = ["algo.router_aux_loss_coef=0.1"]
    return run(moe_models["qwen3_moe"], root / "ep1", 2, "parallel.ep=1", *extra), \
        run(moe_models["qwen3_moe"], root / "ep2", 2, "parallel.ep=2", *extra), root


def assert_same_step(ref, ep):
    for a, b in zip(ref["logprobs"], ep["logprobs"]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert_params_close(ep["before"], ref["before"], rel=0, floor=0)  # the same weights went in
    assert_params_close(ep["after"], ref["after"])  # in checkpoint names: every expert of every rank
    assert ep["metrics"]["train/grad_norm"] == pytest.approx(ref["metrics"]["train/grad_norm"], rel=1e-5)
    assert ep["metrics"]["train/loss"] == pytest.approx(ref["metrics"]["train/loss"], rel=1e-5, abs=1e-7)


def test_router_terms_count_only_real_tokens(moe_models):
    """The aux loss and balance metrics of a micro-batch with padding (sequence parallel's pad segment, the padded
    layout's row ends) are those of the same samples packed without any; a dummy batch adds nothing."""
    torch.manual_seed(0)
    model = PolicyModel(AutoModelForCausalLM.from_pretrained(moe_models["qwen3_moe"], attn_implementation=PACKED_SDPA))
    samples, idx = fixed_batch(), [0, 1, 2]

    def router(mb, mask=True):
        with torch.no_grad():
            *_, stats = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
                              target_ids=mb.target_ids, token_mask=mb.token_mask if mask else None)
        return stats

    plain = router(build_micro_batch(samples, idx))
    assert plain["tokens"] == sum(samples[i].total_len - 1 for i in idx) == sum(samples[i].row_len for i in idx)
    # The step's aux loss is each micro-batch's aux weighted by its share of the rows' tokens: one micro-batch
    # that holds the whole step has all of it.
    mini = distribute([samples[i] for i in idx], OneRank(), Layout(packing=True, max_tokens=4096,
                                                                   micro_batch_size=1)).mini_batches[0]
    assert mini.micro == [[0, 1, 2]] and mini.num_processed == plain["tokens"]
    torch.testing.assert_close(router_terms(plain, num_processed=mini.num_processed)[0], plain["aux"], rtol=0, atol=0)
    padded = build_padded_micro_batch(samples, idx)
    sp_pad = build_micro_batch(samples, idx, pad_to=16)
    assert sp_pad.num_tokens % 16 == 0 and sp_pad.num_tokens > plain["tokens"]
    for mb in (sp_pad, padded):
        got = router(mb)
        assert got["tokens"] == plain["tokens"] and got["entropy_n"] == plain["entropy_n"]
        torch.testing.assert_close(got["expert_counts"], plain["expert_counts"], rtol=0, atol=0)
        for key in ("aux", "entropy_sum"):
            torch.testing.assert_close(got[key], plain[key], rtol=1e-5, atol=1e-6)
    unmasked = router(padded, mask=False)  # control: the padding does change the terms when it is counted
    assert unmasked["tokens"] > plain["tokens"] and not torch.allclose(unmasked["aux"], plain["aux"])

    dummy = build_micro_batch(samples, [])
    *_, stats = model(dummy.input_ids, dummy.position_ids, dummy.cu_seqlens, dummy.pred_index,
                      max_len=dummy.max_len, target_ids=dummy.target_ids, token_mask=dummy.token_mask)
    assert stats["tokens"] == 0 and stats["expert_counts"].sum() == 0 and stats["entropy_n"] == 0
    assert stats["aux"] == 0 and stats["aux"].requires_grad  # in the graph, as every rank's forward must be


def test_ep2_equals_ep1_with_the_router_aux_loss(qwen3_runs):
    ref, ep, _ = qwen3_runs
    assert_same_step(ref, ep)
    for key in ("train/router_aux_loss", "train/router_entropy", "train/expert_imbalance"):
        assert ep["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5), key
    assert ref["metrics"]["train/expert_imbalance"] >= 1.0 and ref["metrics"]["train/router_aux_loss"] > 0


def test_ep2_equals_ep1_with_weight_decay(moe_models, tmp_path):
    """Weight decay puts norm gains and biases in a group of their own: AutoEP's expert groups split each."""
    decay = ["train.weight_decay=0.1"]
    assert_same_step(run(moe_models["qwen3_moe"], tmp_path / "ep1", 2, "parallel.ep=1", *decay),
                     run(moe_models["qwen3_moe"], tmp_path / "ep2", 2, "parallel.ep=2", *decay))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_ep2_equals_ep1_other_families(moe_models, tmp_path, arch):
    assert_same_step(run(moe_models[arch], tmp_path / "ep1", 2, "parallel.ep=1"),
                     run(moe_models[arch], tmp_path / "ep2", 2, "parallel.ep=2"))


def test_names_and_export_with_ep2(moe_models, qwen3_runs, tmp_path):
    _, ep, root = qwen3_runs
    model = AutoModelForCausalLM.from_pretrained(moe_models["qwen3_moe"])
    model.save_pretrained(tmp_path / "ref")
    expected = read_checkpoint_shapes(tmp_path / "ref")
    assert {k: tuple(v.shape) for k, v in ep["before"].items()} == expected  # what weight sync yields
    assert read_checkpoint_shapes(root / "ep2" / "hf") == expected  # what export writes
    # the export holds the weights after the step, every expert of both ranks, bitwise
    saved = load_file(root / "ep2" / "hf" / "model.safetensors")
    assert set(saved) == set(ep["after"])
    for name, t in ep["after"].items():
        torch.testing.assert_close(saved[name], t, rtol=0, atol=0)
    AutoModelForCausalLM.from_pretrained(root / "ep2" / "hf")  # and loads


def test_export_reloads_with_the_trainer_logprobs(moe_models, tmp_path):
    """A run without a step: the export's logprobs, from from_pretrained, are the trainer's (ep=2)."""
    out = tmp_path / "score"
    out.mkdir()
    run_ranks([str(REPO / "tests/dist/ep_checks.py"), str(moe_models["qwen3_moe"]), str(out), "parallel.ep=2",
               "train.lr=0.0"])
    result = torch.load(out / "result.pt", weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(out / "hf", attn_implementation="sdpa")
    for s, got in zip(fixed_batch(), result["logprobs"]):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        p = len(s.prompt_ids)
        torch.testing.assert_close(got, torch.log_softmax(logits, -1)[p - 1:-1].gather(-1, ids[0, p:, None])
                                   .squeeze(-1), rtol=1e-5, atol=1e-5)


def test_ep_needs_a_supported_moe_family(tiny_model, tmp_path):
    from slime.distributed.expert_parallel import expert_parallel_settings

    assert expert_parallel_settings(2, "mixtral")["preset_model"] == "mixtral"
    with pytest.raises(ValueError, match="model type 'qwen2' is not one of mixtral, qwen2_moe, qwen3_moe"):
        expert_parallel_settings(2, "qwen2")


def test_grpo_loop_with_ep2_samples_as_ep1_does_and_a_resume_at_another_ep_is_refused(moe_models, task_dir, tmp_path):
    """A checkpoint of ep=2 resumed at ep=1 failed inside DeepSpeed (missing and unexpected expert keys; the other
    way, KeyError 'num_experts'), naming no setting: the manifest records parallel.ep."""
    run_dir = tmp_path / "run"
    args = [str(REPO / "run.py"), "--config", str(REPO / "examples/cpu_tiny_grpo.yaml"),
            f"model.path={moe_models['qwen3_moe']}", f"data.path={task_dir / 'train.jsonl'}",
            f"log.run_dir={run_dir}", "eval.path=null", "rollout.reward.fn=e2e_rewards:digit_fraction",
            "rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_response_len=6",
            "train.lr=5e-3", "train.max_tokens_per_gpu=64", "checkpoint.export_hf=false"]
    run_ranks(args + ["train.num_steps=3", "parallel.ep=2"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["train/ppo_kl"] == 0.0 and all(r["train/grad_norm"] > 0 for r in rows)
    assert rows[0]["rollout/train_logprob_abs_diff"] < 1e-5  # the hf engine got every expert
    assert all("train/expert_imbalance" in r for r in rows)
    proc = run_ranks(args + ["train.num_steps=4", "parallel.ep=1"], check=False)
    assert proc.returncode != 0 and ("was written with parallel.ep=2, this run has parallel.ep=1; resume with "
                                     "parallel.ep=2" in proc.stdout + proc.stderr), proc.stderr[-3000:]
    # ep=1 from the start samples what ep=2 sampled: building the ep=2 actor drew from the sampling stream
    ep1_dir = tmp_path / "ep1"
    run_ranks([a if not a.startswith("log.run_dir=") else f"log.run_dir={ep1_dir}" for a in args]
              + ["train.num_steps=1", "parallel.ep=1"])
    ep1 = json.loads((ep1_dir / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("rollout/reward_mean", "rollout/response_len", "adv/zero_adv_group_frac"):
        assert ep1[key] == rows[0][key], key
    assert ep1["train/loss"] == pytest.approx(rows[0]["train/loss"], rel=1e-4, abs=1e-6)


def test_sp2_times_ep2_on_two_ranks_equals_one_rank(moe_models, tmp_path):
    """DeepSpeed's ep groups are blocks of consecutive ranks, so on 2 ranks the ep group is the sp group: the layout
    was refused ("ep must divide the data-parallel size 1") though it trains as one rank does."""
    ref = run(moe_models["qwen3_moe"], tmp_path / "ref", 1, "train.max_tokens_per_gpu=96")
    both = run(moe_models["qwen3_moe"], tmp_path / "spep", 2, "parallel.sp=2", "parallel.ep=2")
    assert_same_step(ref, both)


@pytest.mark.four_ranks
def test_sp2_times_ep2_equals_sp1_ep1(moe_models, tmp_path):
    """4 ranks: dp=2 x sp=2 with ep=2 against dp=2 without sp or ep."""
    ref = run(moe_models["qwen3_moe"], tmp_path / "ref", 2, "train.max_tokens_per_gpu=96")
    both = run(moe_models["qwen3_moe"], tmp_path / "spep", 4, "parallel.sp=2", "parallel.ep=2")
    assert_same_step(ref, both)
