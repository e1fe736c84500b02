"""model.cpu_linear=onednn: fp32 linear layers on oneDNN give torch's results (forward and both gradients, alone,
in the policy model, compiled, and in the hf engine), and the calls that should take oneDNN do."""
import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_tools.make_tiny_model import make_tiny_model
from slime.config import ModelConfig
from slime.models import onednn
from slime.models.attention import PACKED_SDPA
from slime.models.policy import PolicyModel, compile_layers
from slime.rollout.engine import SamplingParams
from slime.rollout.hf_engine import HFEngine
from test_packed_logprobs import grouped_samples
from test_compile import forward_backward

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN")


class Ops(TorchDispatchMode):
    """Counts the ops that reach the dispatcher, backward included."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.linear")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["2d", "3d", "strided"])
@pytest.mark.parametrize("out_features", [160, 64])  # wider and narrower than the input: both weight-gradient forms
def test_linear_matches_fp64_forward_and_backward(bias, layout, out_features):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 96, generator=g)
    if layout == "2d":
        x = x[0]
    elif layout == "strided":  # a view with a gap between rows: reshaped, not misread
        x = torch.randn(2, 300, 2, 96, generator=g)[:, :, 1]
    w, b = torch.randn(out_features, 96, generator=g) / 10, torch.randn(out_features, generator=g) if bias else None
    up = torch.randn(*x.shape[:-1], out_features, generator=g)
    got = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    ref = [t.double().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    with Ops() as ops:
        y = onednn.linear(*got[:2], got[2] if bias else None)
        (y * up).sum().backward()
    y_ref = F.linear(*ref[:2], ref[2] if bias else None)
    (y_ref * up.double()).sum().backward()
    assert ops.count["mkldnn._linear_pointwise"] == 3 and not any(ops.count[m] for m in MATMULS), ops.count
    for a, r in zip([y] + [t.grad for t in got], [y_ref] + [t.grad for t in ref]):
        assert a.shape == r.shape and a.dtype == torch.float32
        scale = r.abs().max().item()
        torch.testing.assert_close(a.double(), r.detach(), rtol=0, atol=2e-6 * scale)  # fp32 sums of 96-600 terms


@pytest.mark.parametrize("out_features", [160, 64])  # the two weight-gradient forms: 1 and 2 transposes
def test_weight_gradient_transposes_through_the_given_copy(out_features, monkeypatch):
    """`transpose` (the fused chains' compiled copy) makes the weight gradient's transposes; the operands oneDNN
    then reads hold the same numbers, so every gradient is bitwise the same as without it."""
    from slime.models import fused
    if fused.compiler_works() is not None:
        pytest.skip(f"torch.compile does not run here: {fused.compiler_works()}")
    g = torch.Generator().manual_seed(2)
    x, w, up = (torch.randn(*shape, generator=g) for shape in ((300, 96), (out_features, 96), (300, out_features)))
    calls = []

    def counted(t):
        calls.append(tuple(t.shape))
        return fused.transpose(t)

    grads = {}
    for label, transpose, threshold in (("plain", None, 0), ("given", counted, 0), ("small", counted, 10 ** 9)):
        monkeypatch.setattr(onednn, "MIN_TRANSPOSE", threshold)
        got = [t.clone().requires_grad_() for t in (x, w)]
        (onednn.linear(*got, transpose=transpose) * up).sum().backward()
        grads[label] = [t.grad for t in got]
        if label == "given":  # the narrower of grad and x, and for a wider grad the (in, out) result back
            assert calls == ([(300, 64)] if out_features == 64 else [(300, 96), (96, out_features)]), calls
    assert len(calls) == (1 if out_features == 64 else 2), "under MIN_TRANSPOSE the copy is torch's own"
    for label in ("given", "small"):
        for a, b in zip(grads[label], grads["plain"]):
            assert torch.equal(a, b), label


@pytest.mark.parametrize("trainable", ["input", "weight", "bias"])
def test_linear_with_frozen_parts_and_an_in_place_add_on_its_output(trainable):
    """Only one of input, weight and bias needs a gradient (a frozen layer, a frozen bias, a LoRA-style base
    weight); the output takes an in-place residual add, as some model families write it."""
    g = torch.Generator().manual_seed(1)
    x, w, b, res = (torch.randn(*s, generator=g) for s in ((3, 100, 96), (160, 96), (160,), (3, 100, 160)))
    got = {"input": x.clone(), "weight": w.clone(), "bias": b.clone()}
    ref = {k: v.double() for k, v in got.items()}
    for d in (got, ref):
        d[trainable].requires_grad_()
    with Ops() as ops:
        y = onednn.linear(got["input"], got["weight"], got["bias"])
        y += res
        y.square().sum().backward()
    y_ref = F.linear(ref["input"], ref["weight"], ref["bias"]) + res.double()
    y_ref.square().sum().backward()
    assert ops.count["mkldnn._linear_pointwise"] == (1 if trainable == "bias" else 2), ops.count
    torch.testing.assert_close(y.detach().double(), y_ref.detach(), rtol=0, atol=2e-6 * y_ref.abs().max().item())
    for name, t in got.items():
        assert (t.grad is None) == (name != trainable)
    grad = ref[trainable].grad
    torch.testing.assert_close(got[trainable].grad.double(), grad, rtol=0, atol=2e-6 * grad.abs().max().item())


def test_small_and_non_fp32_calls_take_torchs_linear(monkeypatch):
    w = torch.randn(64, 64, requires_grad=True)
    cases = {"a 4-row call (under MIN_MACS)": torch.randn(4, 64),
             "fp64": torch.randn(512, 64, dtype=torch.float64)}
    assert 4 * 64 * 64 < onednn.MIN_MACS <= 512 * 64 * 64
    for what, x in cases.items():
        weight = w if x.dtype == torch.float32 else w.double()
        with Ops() as ops:
            y = onednn.linear(x, weight)
        assert ops.count["mkldnn._linear_pointwise"] == 0 and ops.count["aten.mm"] == 1, (what, ops.count)
        torch.testing.assert_close(y, F.linear(x, weight))
    monkeypatch.setattr(onednn, "MIN_MACS", 0)  # even with no threshold, an empty input stays with torch
    assert not onednn.usable(torch.randn(0, 64), w) and onednn.usable(torch.randn(1, 64), w)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3") / "m", arch="qwen3", seed=1)


@pytest.fixture
def every_call(monkeypatch):  # the tiny model's calls are all under MIN_MACS: send them to oneDNN anyway
    monkeypatch.setattr(onednn, "MIN_MACS", 0)


@pytest.mark.parametrize("compiled", [False, True])
def test_policy_model_on_onednn_matches_torch_linears(model_dir, every_call, compiled):
    """Logprobs, entropies and every parameter's gradient on shared-prompt micro-batches; with train.compile the
    calls go through the custom op that inductor keeps opaque."""
    torch._dynamo.reset()
    reference = PolicyModel(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=PACKED_SDPA))
    model = copy.deepcopy(reference)
    layers = sum(type(m) is torch.nn.Linear for m in model.hf.modules())
    assert onednn.use_onednn_linears(model.hf) == layers > 0
    if compiled:
        compile_layers(model.hf)
    forward_backward(model, grouped_samples(seed=0))  # the compile, outside the profile
    for seed in (1, 2):
        samples = grouped_samples(seed=seed)
        lp_r, ent_r, g_r = forward_backward(reference, samples)
        with torch.profiler.profile() as prof:
            lp, ent, g = forward_backward(model, samples)
        names = collections.Counter(e.name for e in prof.events())
        # each decoder linear: forward + 2 backward calls (the LM head is the LogprobHead's own F.linear)
        assert names["mkldnn::_linear_pointwise"] == 3 * (layers - 1), names
        assert names["slime::onednn_mm_nt"] == (3 * (layers - 1) if compiled else 0), names
        torch.testing.assert_close(lp, lp_r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ent_r, rtol=1e-5, atol=1e-5)
        for name, grad in g_r.items():
            torch.testing.assert_close(g[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(),
                                       msg=lambda m: f"{name}: {m}")


def test_hf_engine_on_onednn_matches_torch_linears(model_dir, every_call):
    """Greedy tokens and their logprobs agree with cpu_linear=torch."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    engines = {k: HFEngine(ModelConfig(path=str(model_dir), dtype="float32", cpu_linear=k), tok,
                           device=torch.device("cpu")) for k in ("onednn", "torch")}
    prompts = [[5 + i, 17, 30 + 2 * i, 9] for i in range(8)]
    params = SamplingParams(max_new_tokens=12, n=4, temperature=0.0, ignore_eos=True)
    with Ops() as ops:
        fast = engines["onednn"].generate(prompts, params)
    assert ops.count["mkldnn._linear_pointwise"] > 0
    with Ops() as ops:
        plain = engines["torch"].generate(prompts, params)
    assert ops.count["mkldnn._linear_pointwise"] == 0
    for a, b in zip(sum(fast, []), sum(plain, [])):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("vendor,kernel", [("AuthenticAMD", "onednn"), ("GenuineIntel", "torch"), (None, "torch")])
def test_auto_cpu_linear_is_onednn_on_amd_cpus_only(tmp_path, vendor, kernel):
    """MKL takes its AVX2 path on AMD (oneDNN 2-2.4x faster there) and is the faster kernel on Intel."""
    info = tmp_path / "cpuinfo"
    cpu = f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 25\n" if vendor else "processor\t: 0\n"
    info.write_text(cpu * 2)
    assert onednn.cpu_vendor(str(info)) == vendor
    assert onednn.resolve_cpu_linear("auto", cpuinfo=str(info)) == kernel
    assert onednn.resolve_cpu_linear("auto", cpuinfo=str(tmp_path / "missing")) == "torch"
    for explicit in ("onednn", "torch"):  # a choice the user made stays
        assert onednn.resolve_cpu_linear(explicit, cpuinfo=str(info)) == explicit

