"""ZeRO-3 over gloo ranks against a single-process reference written with plain torch and HF.

The reference computes the loss per sample on an unpacked HF model with hand-written PPO and
aggregation formulas; the trainer packs micro-batches under a small budget and splits them over
ranks. Same loss and gradients means packing, dp splitting and loss normalisation are all right.
"""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import REPO, assert_params_close, run_ranks, stable_adam_ds_config
from dist.actor_checks import fixed_batch


LAYOUTS = {"1rank-packed": (1, []), "2ranks-packed": (2, []),
           "2ranks-padded": (2, ["train.packing=false", "train.micro_batch_size=2"]),
           "2ranks-zero2": (2, ["train.ds_config=ds_configs/zero2.json"]),
           # every linear on oneDNN (the tiny model's calls are all under its size threshold), against the
           # reference's torch linears: the custom autograd Function under ZeRO-3's gathers and releases, with
           # checkpointed layers recomputed in backward
           "2ranks-onednn": (2, ["model.cpu_linear=onednn", "model.gradient_checkpointing=true"]),
           # the fused RMSNorm, rotary and SwiGLU chains (torch.compile'd functions) under ZeRO-3's gathers and
           # releases, recomputed in backward by checkpointing, against the reference's eager HF model
           "2ranks-fused": (2, ["train.fuse_elementwise=true", "model.gradient_checkpointing=true"])}
ENV = {"2ranks-onednn": {"SLIME_ONEDNN_MIN_MACS": "0"}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def checks(request, tiny_model, tmp_path_factory):
    """The same global batch under six layouts: 1 vs 2 dp ranks, packed vs padded micro-batches, ZeRO-3 vs
    ZeRO-2 (replicated parameters, sharded gradients and optimizer states), torch's vs oneDNN's linears, eager vs
    fused elementwise chains."""
    nproc, overrides = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    run_ranks([str(REPO / "tests/dist/actor_checks.py"), str(tiny_model), str(out), *overrides], nproc=nproc,
              env=ENV.get(request.param))
    return out, json.loads((out / "result.json").read_text())


def reference_loss(model, samples, old_logprobs, mode: str, clip: float = 0.2) -> torch.Tensor:
    """PPO clipped loss with token-mean or sequence-mean aggregation, one sample at a time."""
    per_seq, n_tokens = [], 0
    for s, old in zip(samples, old_logprobs):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(input_ids=ids).logits[0].float()
        p = len(s.prompt_ids)
        logp = torch.log_softmax(logits, -1)[p - 1:-1].gather(-1, ids[0, p:, None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        adv = s.advantages
        loss = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        mask = s.loss_mask
        per_seq.append((loss * mask).sum() / (mask.sum() if mode == "seq_mean_token_mean" else 1))
        n_tokens += int(mask.sum())
    total = torch.stack(per_seq).sum()
    return total / (len(samples) if mode == "seq_mean_token_mean" else n_tokens)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_loss_and_grads_match_single_process_reference(checks, tiny_model, mode):
    out, result = checks
    saved = torch.load(out / f"{mode}.pt", weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa", dtype=torch.float32)
    model.load_state_dict(saved["before"], strict=True)
    samples = fixed_batch()
    loss = reference_loss(model, samples, saved["old_logprobs"], mode)
    loss.backward()
    assert result["modes"][mode]["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    # old == current before the step, to fp32 rounding: the scoring pass packs micro-batches under another budget,
    # so its matmuls have other shapes (MKL's sgemm sums in another order: ~2e-6 here on an Intel CPU)
    assert result["modes"][mode]["ppo_kl_sum"] == pytest.approx(0.0, abs=2e-5)
    assert result["modes"][mode]["micro_batches"] >= 2 * result["world"]  # the budget really split the batch
    # Packed micro-batches carry a shared prompt once (train.share_prompts), padded ones never.
    assert (result["modes"][mode]["shared_prompt_micro_batches"] > 0) == result["packing"]
    for name, p in model.named_parameters():
        torch.testing.assert_close(saved["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_linears_take_onednn_where_told(checks, request):
    """Under the size threshold (every other layout, whichever kernel cpu_linear=auto picks on this CPU) torch's
    linear runs; with oneDNN asked for and the threshold at 0, oneDNN's."""
    _, result = checks
    assert (result["onednn_calls"] > 0) == ("onednn" in request.node.callspec.id), result["onednn_calls"]


def test_fused_chains_run_where_told(checks, request):
    """The tiny model is under train.fuse_elementwise=auto's size threshold: its chains run fused only where asked."""
    _, result = checks
    assert (result["fused_calls"] > 0) == ("fused" in request.node.callspec.id), result["fused_calls"]


def test_layers_are_recomputed_in_backward_where_checkpointing_is_on(checks, request):
    """model.gradient_checkpointing: HF checkpoints a layer only in training mode, which the trainer never set
    (the model stays in eval mode, dropout off): no layer was ever checkpointed."""
    _, result = checks
    checkpointed = request.node.callspec.id in ("2ranks-onednn", "2ranks-fused")
    for mode in result["modes"].values():
        assert mode["layer_runs"] == mode["micro_batches"] * (2 if checkpointed else 1), mode


def test_weight_sync_makes_engine_equal_trainer(checks):
    _, result = checks
    assert result["sync_names_equal"]
    assert result["sync_max_diff"] == 0.0
    assert result["sync_changed"] > 1e-4  # the trainer did move away from the initial weights
    assert result["engine_version"] == 7


def test_finite_check_reads_real_elements_only(checks):
    """The after-step check that parameters are finite: ZeRO-3's never-written partition padding (any bits,
    NaN included) made it fail at random; NaN in a real element on one rank still stops every rank."""
    _, result = checks
    if result["world"] == 2 and result["zero_stage"] == 3:
        check = result["finite_check"]
        assert check["padded"] >= 1 and not check["nan_padding_counts"] and check["nan_element_counts"]
        assert check["inf_element_counts"] and check["huge_is_finite"] and check["restored_is_finite"]
    else:
        assert "finite_check" not in result


def test_hf_export_loads_with_from_pretrained(checks):
    out, _ = checks
    final = torch.load(out / "final_state.pt", weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), final[name], rtol=0, atol=0)


def test_reference_never_changes(checks):
    _, result = checks
    assert result["actor_moved"]  # two optimizer steps moved the actor ...
    assert result["ref_logprobs_unchanged"] and result["ref_equals_initial"]  # ... and not the reference


def run_minibatch_checks(model, out, nproc, *overrides, env=None) -> dict:
    out.mkdir(parents=True)
    # Without shared prompts: the samples' prompt counted once, their long siblings would share micro-batches, and
    # no rank would be short of them (the case this checks).
    run_ranks([str(REPO / "tests/dist/minibatch_checks.py"), str(model), str(out), "train.num_mini_batches=2",
               "train.share_prompts=false", f"train.ds_config={stable_adam_ds_config(out)}", *overrides], nproc=nproc,
              env=env)
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def one_rank_minibatches(tiny_model, tmp_path_factory):
    return run_minibatch_checks(tiny_model, tmp_path_factory.mktemp("minibatch") / "1rank", 1)


@pytest.mark.parametrize("layout", [[], ["train.packing=false", "train.micro_batch_size=1"]], ids=["packed", "padded"])
def test_mini_batches_of_a_count_dp_does_not_divide_match_one_rank(tiny_model, tmp_path, one_rank_minibatches, layout):
    """7 samples in 2 mini-batches over 2 ranks: the second mini-batch's 3 long samples (one per micro-batch)
    cannot give both ranks the same number of samples; the rank short of them runs a dummy micro-batch (ZeRO-3
    lockstep) instead of the step failing, and the two optimizer steps equal one rank's."""
    ref, got = one_rank_minibatches, run_minibatch_checks(tiny_model, tmp_path / "2ranks", 2, *layout)
    assert ref["minis"] == got["minis"] == [[0, 1, 2, 3], [4, 5, 6]]  # dp does not change what a step sees
    assert ref["dummies"] == 0 and got["dummies"] >= 1
    for key in ("train/loss", "train/grad_norm", "train/ppo_kl"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key
    assert ref["metrics"]["train/ppo_kl"] != 0  # the second mini-batch ran on weights the first step changed
    assert_params_close(got["state"], ref["state"])


def test_a_rank_with_no_sample_runs_dummies_and_the_step_equals_one_rank(tiny_model, tmp_path):
    """One sample on 2 ranks (dynamic sampling can keep that few): the rank without any runs dummy micro-batches
    that carry the fields the other's samples do (advantages, pi_old), and the step is the one-rank step."""
    one = {"SLIME_TEST_MINIBATCH_N": "1"}
    ref = run_minibatch_checks(tiny_model, tmp_path / "1rank", 1, "train.num_mini_batches=1", env=one)
    got = run_minibatch_checks(tiny_model, tmp_path / "2ranks", 2, "train.num_mini_batches=1", env=one)
    assert ref["minis"] == got["minis"] == [[0]] and got["dummies"] == 1
    assert got["metrics"]["train/loss"] == pytest.approx(ref["metrics"]["train/loss"], rel=1e-5, abs=1e-7)
    assert_params_close(got["state"], ref["state"])


def test_offload_before_a_colocated_rollout_moves_only_what_the_zero_config_keeps_on_the_device(tmp_path):
    """ds_configs/zero3_offload.json under a colocated engine failed at the first rollout: DeepSpeed refuses to move
    the states of offloaded parameters, and moves only FusedAdam's optimizer states (an offloaded optimizer is
    DeepSpeedCPUAdam). The states offload() names are moved and reloaded by the real engines here (on CPU)."""
    run_ranks([str(REPO / "tests/dist/offload_checks.py"), str(REPO / "assets/tiny-arith"), str(tmp_path)], nproc=1)
    moved = json.loads((tmp_path / "offload.json").read_text())
    assert moved["zero3_offload"] == {"True": [], "False": []}  # parameters and optimizer live on host already
    assert moved["optimizer_offload"] == {"True": ["lp_params", "contiguous_grad_buffer"],
                                          "False": ["contiguous_grad_buffer"]}


def test_bf16_gradients_accumulate_over_micro_batches_in_fp32(tiny_model, tmp_path):
    """DeepSpeed sums a mini-batch's micro-batch gradients in the model's dtype unless the config's
    data_types.grad_accum_dtype says otherwise: in bf16 (a GPU's default) the shipped configs were off by ~5e-3 of
    the gradient over 20 micro-batches (the helper's measurement; 1e-2 here), so the update depended on how the
    samples were cut. With fp32 accumulation: float rounding."""
    out = tmp_path / "accum.json"
    run_ranks([str(REPO / "tests/dist/grad_accum_checks.py"), str(tiny_model), str(out)], nproc=1)
    for ds, r in json.loads(out.read_text()).items():
        assert r["micro_batches"] >= 10, (ds, r)
        assert r["relative_error"] < 1e-5, (ds, r)
