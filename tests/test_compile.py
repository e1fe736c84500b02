"""train.compile: compiled decoder layers give the eager model's logprobs and gradients, and micro-batches of new
lengths reuse the compiled graphs."""
import copy

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

from data_tools.make_tiny_model import make_tiny_model
from slime.config import TrainConfig
from slime.data.batch import build_micro_batch
from slime.distributed.ds_config import check_stage
from slime.models.adapters import get_adapter
from slime.models.attention import PACKED_SDPA
from slime.models.policy import PolicyModel, compile_layers
from test_packed_logprobs import grouped_samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3") / "m", arch="qwen3", seed=1)


def forward_backward(model, samples):
    mb = build_micro_batch(samples, range(len(samples)), share_prompts=True)
    model.zero_grad()
    logp, ent = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len, chunk_size=7,
                      target_ids=mb.target_ids, prompt_prefixes=mb.prompt_prefixes)
    (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def compare_over_lengths(eager, other) -> list[int]:
    """Forward + backward of both models over micro-batches of three lengths, shared prompts included: the same
    logprobs, entropies and (nonzero) gradients to fp32 rounding. Returns the graphs compiled since the start, after
    each micro-batch."""
    before, graphs = counters["stats"]["unique_graphs"], []
    for seed in (1, 2, 3):
        samples = grouped_samples(seed=seed)
        lp_e, ent_e, g_e = forward_backward(eager, samples)
        lp_o, ent_o, g_o = forward_backward(other, samples)
        torch.testing.assert_close(lp_o, lp_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent_o, ent_e, rtol=1e-5, atol=1e-5)
        for name, grad in g_e.items():  # fused kernels round differently: fp32 agreement, not bitwise
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(g_o[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(),
                                       msg=lambda m: f"{name}: {m}")
        graphs.append(counters["stats"]["unique_graphs"] - before)
    return graphs


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_layers_match_eager_and_reuse_their_graphs(model_dir, checkpointing):
    torch._dynamo.reset()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=PACKED_SDPA)
    if checkpointing:  # the layers' compiled forward then also runs again in backward
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf.train()
    eager = PolicyModel(hf)
    compiled = copy.deepcopy(eager)
    assert compile_layers(compiled.hf) == compiled.hf.config.num_hidden_layers
    graphs = compare_over_lengths(eager, compiled)
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[2] == graphs[1] == graphs[0], f"new micro-batch lengths recompiled the layers: {graphs}"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_vl"])
def test_compile_refused_for_moe_and_image_text_models(arch, tmp_path):
    config = AutoConfig.from_pretrained(make_tiny_model(tmp_path / arch, arch=arch))
    with torch.device("meta"):
        model = getattr(transformers, get_adapter(arch).auto_class).from_config(config)
    with pytest.raises(ValueError, match=r"train.compile=true is built and tested for text-only dense models"):
        compile_layers(model)


def test_compile_refused_for_other_attention(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"tested with packed_sdpa attention.*this model runs sdpa"):
        compile_layers(model)
    model.config._attn_implementation = "ulysses_sp2_packed_sdpa"  # parallel.sp=2's wrapper: named as such
    with pytest.raises(ValueError, match=r"does not run with sequence parallelism \(parallel.sp > 1: this model runs "
                                         r"ulysses_sp2_packed_sdpa\): set parallel.sp=1 or train.compile=false"):
        compile_layers(model)


def test_compile_refused_under_zero3():
    with pytest.raises(ValueError, match=r"train.compile=true needs whole parameters.*zero2.json"):
        check_stage(3, TrainConfig(compile=True), sp=1, ep=1, offload_params=False)
    check_stage(2, TrainConfig(compile=True), sp=1, ep=1, offload_params=False)
    check_stage(3, TrainConfig(compile=False), sp=1, ep=1, offload_params=False)
    # With sp or ep, each stage refused one of the two, advising the other stage: say the combination can't run
    for stage in (2, 3):
        with pytest.raises(ValueError, match=r"train.compile=true cannot be combined with parallel.sp > 1 \(Ulysses\) "
                                             r"and parallel.ep > 1 \(AutoEP\).*set train.compile=false"):
            check_stage(stage, TrainConfig(compile=True), sp=2, ep=2, offload_params=False)
