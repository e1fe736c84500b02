"""train.fuse_elementwise: the fused RMSNorm, rotary and SwiGLU chains (slime/models/fused.py) give HF's eager
logprobs and gradients, reuse their graphs across micro-batch lengths, and apply only where they are built for."""
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from data_tools.make_tiny_model import make_tiny_model, tiny_config
from slime.models import fused, onednn
from slime.models.attention import PACKED_SDPA
from slime.models.policy import PolicyModel
from test_compile import compare_over_lengths, forward_backward
from test_packed_logprobs import grouped_samples


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3", {}),  # per-head q and k norms
    ("qwen2", {}),  # q, k, v biases
    ("llama", {"attention_bias": True, "mlp_bias": True}),
])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_fused_chains_match_eager_and_reuse_their_graphs(tmp_path, arch, overrides, checkpointing, monkeypatch):
    """The fused model's logprobs, entropies and gradients against eager, over micro-batches of three lengths, with
    oneDNN linears whose weight gradients take `fused.transpose`, as the trainer runs them. Each fused function
    compiles one graph for all of it, and a model of other widths reuses them (the norm two: the layers' and
    Qwen3's per-head ones). Before, 10-11: the probe compiled them on tiny tensors whose guards the training calls
    failed (a parameter's constant sizes, x's rank, size-1 dims), and the transpose compiled again for each grad
    mode, requires_grad and view-ness of its input."""
    torch._dynamo.reset()  # graphs compiled by an earlier test would leave nothing to count
    fused.compiler_works.cache_clear()
    assert fused.compiler_works() is None
    compiled = {f.__name__: f._torchdynamo_orig_callable.__code__
                for f in (fused.rms_norm, fused.silu_mul, fused._rotary, fused._transpose)}
    cfg = tiny_config(arch, 256, hidden=64, layers=2, heads=4, kv_heads=2, init_std=0.1)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation=PACKED_SDPA)
    if checkpointing:  # the fused forwards then run again in backward
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf.train()
    eager = PolicyModel(hf)
    with torch.no_grad():  # norms and biases away from 1 and 0, so a chain that dropped one would show
        for name, p in eager.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    fast = copy.deepcopy(eager)
    layers = hf.config.num_hidden_layers
    per_layer = 4 + 2 * (arch == "qwen3")  # 2 norms, the MLP, the attention (+ q and k norms)
    assert fused.fuse_elementwise(fast.hf) == layers * per_layer + 1  # + the final norm
    monkeypatch.setattr(onednn, "MIN_MACS", 0)  # the tiny model's calls are below oneDNN's threshold
    monkeypatch.setattr(onednn, "MIN_TRANSPOSE", 0)
    assert onednn.use_onednn_linears(fast.hf, transpose=fused.transpose) == layers * 7 + 1
    graphs = compare_over_lengths(eager, fast)  # micro-batches of three lengths, shared prompts included
    assert graphs[2] == graphs[1], f"a new micro-batch length compiled again: {graphs}"
    graphs = {name: len(_debug_get_cache_entry_list(code)) for name, code in compiled.items()}
    assert graphs == {"rms_norm": 1 + (arch == "qwen3"), "silu_mul": 1, "_rotary": 1, "_transpose": 1}, graphs
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 96, 160, 24  # another model: other widths, same graphs
    wider = AutoModelForCausalLM.from_config(cfg, attn_implementation=PACKED_SDPA)
    fused.fuse_elementwise(wider)
    onednn.use_onednn_linears(wider, transpose=fused.transpose)
    forward_backward(PolicyModel(wider), grouped_samples(seed=1))
    assert {name: len(_debug_get_cache_entry_list(code)) for name, code in compiled.items()} == graphs


def test_no_grad_passes_match_eager(tmp_path):
    """Scoring and the reference model run without grad: the same numbers, and one set of graphs for both."""
    hf = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", arch="qwen3", seed=2),
                                              attn_implementation=PACKED_SDPA)
    eager = PolicyModel(hf)
    fast = copy.deepcopy(eager)
    fused.fuse_elementwise(fast.hf)
    from slime.data.batch import build_micro_batch
    samples = grouped_samples(seed=4)
    mb = build_micro_batch(samples, range(len(samples)), share_prompts=True)
    with torch.no_grad():
        got, want = (m(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
                       target_ids=mb.target_ids, prompt_prefixes=mb.prompt_prefixes) for m in (fast, eager))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    graphs = counters["stats"]["unique_graphs"]
    frozen = copy.deepcopy(fast).requires_grad_(False)  # as the reference model is
    with torch.no_grad():
        again = frozen(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
                       target_ids=mb.target_ids, prompt_prefixes=mb.prompt_prefixes)
    torch.testing.assert_close(again[0], got[0], rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == graphs, "a frozen model's no-grad pass compiled graphs of its own"


def test_where_it_applies(tmp_path):
    cpu = torch.device("cpu")
    small = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "s", arch="qwen3", hidden=64))
    big = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "b", arch="qwen3", hidden=256, layers=1))
    moe = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "moe", arch="qwen3_moe"))
    assert fused.resolve("auto", big, cpu) is None
    assert "hidden size 64 < 256" in fused.resolve("auto", small, cpu)
    assert fused.resolve(True, small, cpu) is None  # asked for: the size does not matter
    assert "is not one of" in fused.resolve("auto", moe, cpu)
    assert fused.resolve(False, big, cpu) == "train.fuse_elementwise=false"
    assert "built and tested on CPU" in fused.resolve("auto", big, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"train.fuse_elementwise=true: .*is not one of"):
        fused.resolve(True, moe, cpu)
    with pytest.raises(ValueError, match=r"train.fuse_elementwise: .*is not one of"):
        fused.fuse_elementwise(moe)
    gelu = copy.deepcopy(big)
    gelu.model.layers[0].mlp.act_fn = torch.nn.GELU()
    assert "not SiLU" in fused.unsupported(gelu)


def test_a_failing_compiler_turns_auto_off_with_the_reason(tmp_path):
    """No working C++ compiler (inductor's CPU backend needs one): auto falls back to eager and says why; true fails.
    Run in a fresh process with an empty inductor cache (a cached kernel needs no compiler)."""
    script = textwrap.dedent("""
        import torch, torch._inductor.config as cfg
        from transformers import AutoModelForCausalLM
        from slime.models import fused
        cfg.cpp.cxx = ("/nonexistent/c++",)
        model = AutoModelForCausalLM.from_pretrained(%r)
        why = fused.resolve("auto", model, torch.device("cpu"))
        print("AUTO:", why)
        try:
            fused.resolve(True, model, torch.device("cpu"))
        except ValueError as e:
            print("ON:", e)
    """ % str(make_tiny_model(tmp_path / "m", arch="qwen3", hidden=256, layers=1)))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TORCHINDUCTOR_FX_GRAPH_CACHE="0")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    auto = next(line for line in out.stdout.splitlines() if line.startswith("AUTO:"))
    assert "torch.compile failed on a probe" in auto, out.stdout
    assert "ON: train.fuse_elementwise=true: torch.compile failed on a probe" in out.stdout
