"""The hf engine's decode step (slime/models/decode_step.py) against the model's own forward over whole sequences."""
import copy
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from data_tools.make_tiny_model import tiny_config
from slime.models import attention, onednn
from slime.models.attention import GQA_SDPA, _decode_attention, decode_attention_fused
from slime.models.decode_step import DecodeStep, cached_attention
from slime.rollout.hf_engine import PreallocatedLayer

VOCAB = 97


def tiny(arch: str, **overrides) -> torch.nn.Module:
    cfg = tiny_config(arch, VOCAB, hidden=64, layers=3, heads=4, kv_heads=2, init_std=0.1)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=GQA_SDPA).eval()
    for name, p in model.named_parameters():  # norms and biases start at 1 and 0: give them values of their own
        if "norm" in name or name.endswith("bias"):
            p.data.add_(0.3 * torch.randn_like(p))
    return model


def decode(stepped: torch.nn.Module, step: DecodeStep, prompts: list[list[int]], new: torch.Tensor,
           keep_after: dict[int, list[int]], capacity: int | None = None) -> list[torch.Tensor]:
    """Prefill the left-padded prompts with the model's forward, then one step per column of `new` (B, S);
    rows not in keep_after[s] leave the batch after step s. Returns each step's logits (rows still going, V).
    The cache holds `capacity` positions (default: the prompts' and two more, so that it grows)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=stepped.config)
    cache.layers = [PreallocatedLayer(capacity or width + 2) for _ in cache.layers]
    stepped(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    live, pos, out = torch.arange(len(prompts)), positions[:, -1] + 1, []
    for s in range(new.shape[1]):
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], 1)
        out.append(step(new[live, s], pos, mask.bool(), cache))
        pos = pos + 1
        if s in keep_after:
            keep = torch.tensor(keep_after[s])
            live, pos, mask = live[keep], pos[keep], mask[keep]
            cache.batch_select_indices(keep)
    return out


def reference(model, prompts, new, keep_after) -> list[torch.Tensor]:
    """Each step's logits from a forward over each row's whole prompt + tokens so far, row by row."""
    live, out = list(range(len(prompts))), []
    for s in range(new.shape[1]):
        rows = [model(input_ids=torch.tensor([prompts[r] + new[r, :s + 1].tolist()])).logits[0, -1] for r in live]
        out.append(torch.stack(rows))
        if s in keep_after:
            live = [live[k] for k in keep_after[s]]
    return out


def packed_step(model: torch.nn.Module, pack: str, monkeypatch, **kwargs) -> DecodeStep:
    """The hf engine's step with packed weights: on oneDNN (every call on oneDNN: the tiny model's matmuls are
    below MIN_MACS, where the packed weights would not be read), or transposed copies on torch's mm."""
    if pack == "transposed":
        return DecodeStep(model, pack=pack, **kwargs)
    if not onednn.available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(onednn, "MIN_MACS", 0)
    return DecodeStep(model, functools.partial(onednn.linear, fallback=torch._C._nn.linear), pack=pack, **kwargs)


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3", {}),  # per-head q and k norms
    ("qwen2", {}),  # q, k, v biases
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
])
@pytest.mark.parametrize("pack", [None, "onednn", "transposed"], ids=["plain", "onednn", "transposed"])
def test_decode_step_gives_the_models_logits(arch, overrides, pack, monkeypatch):
    """Plain, and with the weights packed for oneDNN (the hf engine on oneDNN) or transposed (on MKL): rows leaving
    the batch run the packed weights at any row count."""
    model = tiny(arch, **overrides)
    assert DecodeStep.unsupported(model) is None
    stepped = copy.deepcopy(model)
    step = packed_step(stepped, pack, monkeypatch) if pack else DecodeStep(stepped)
    assert len(step._packed) == (0 if pack is None else 1 + 4 * len(model.model.layers))
    prompts = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [9], [60, 7, 7, 12]]
    new = torch.randint(3, VOCAB, (len(prompts), 6), generator=torch.Generator().manual_seed(1))
    keep_after = {1: [0, 1, 3], 3: [2, 0]}  # rows leave, and the order of those left changes
    with torch.no_grad():
        got, want = decode(stepped, step, prompts, new, keep_after), reference(model, prompts, new, keep_after)
    for s, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {s}: {m}")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("keys,dv", [(1, 16), (7, 16), (40, 16), (7, 8)])
def test_fused_decode_attention_is_the_matmuls_and_sdpa(dtype, tol, keys, dv):
    """decode_attention_fused against the engine's batched matmuls and against sdpa, one query per row over a cache
    view (strided, as the engine's preallocated layers give), GQA, rows whose first keys are padding; values
    narrower than the keys (DeepSeek's attention) too: the output has their width."""
    g = torch.Generator().manual_seed(keys)
    b, heads, kv_heads, d = 3, 4, 2, 16
    cache_k = torch.randn(b, kv_heads, keys + 5, d, generator=g).to(dtype)
    cache_v = torch.randn(b, kv_heads, keys + 5, dv, generator=g).to(dtype)
    k, v = cache_k[:, :, :keys], cache_v[:, :, :keys]
    q = torch.randn(b, heads, 1, d, generator=g).to(dtype)
    mask = torch.ones(b, 1, 1, keys, dtype=torch.bool)
    mask[1, ..., :keys // 2] = False
    mask[2, ..., :keys - 1] = False  # only its newest key
    got = decode_attention_fused(q, k, v, mask, 0.3)
    assert got.shape == (b, 1, heads, dv) and got.dtype == dtype
    torch.testing.assert_close(got, _decode_attention(q, k, v, mask, 0.3), rtol=tol, atol=tol)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                            scale=0.3, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(decode_attention_fused(q, k, v, None, None),  # no mask, the default scale
                               _decode_attention(q, k, v, None, None), rtol=tol, atol=tol)


@pytest.mark.parametrize("keys", [1, 7, 40])
def test_cached_attention_is_sdpa_over_the_cache_and_the_new_key(keys):
    """The compiled step's attention, eagerly: this step's key and value kept apart from the cache's (a strided view
    of a larger buffer) give sdpa's output over the cache with them appended; GQA, rows whose first keys are
    padding, one row that sees only its new key."""
    g = torch.Generator().manual_seed(keys)
    b, heads, kv_heads, d = 3, 4, 2, 16
    cache_k, cache_v = (torch.randn(b, kv_heads, keys + 5, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, kv_heads, d, generator=g) for _ in range(2))
    q = torch.randn(b, heads, d, generator=g)
    mask = torch.ones(b, keys + 1, dtype=torch.bool)
    mask[1, :keys // 2] = False
    mask[2, :keys] = False
    got = cached_attention(q.view(b, kv_heads, heads // kv_heads, d), k, v, cache_k[:, :, :keys],
                           cache_v[:, :, :keys], mask, 0.3)
    all_k, all_v = (torch.cat([c[:, :, :keys], new[:, :, None]], 2) for c, new in ((cache_k, k), (cache_v, v)))
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], all_k, all_v, attn_mask=mask[:, None, None],
                                                            scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got.reshape(b, heads, d), want[:, :, 0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2].reshape(heads, d), v[2].repeat_interleave(heads // kv_heads, 0))


def test_decode_step_with_fused_attention_gives_the_models_logits(monkeypatch):
    """fused_attention=True, every step of 2 rows or more through decode_attention_fused (the (row, key) threshold
    set to 0): the same logits as the model's forward. The one-row steps take the matmuls (torch.compile would
    specialize a second graph for a size of 1)."""
    monkeypatch.setattr(attention, "FUSED_DECODE_MIN_PAIRS", 0)
    calls = []

    def counted(*args):
        calls.append(args[1].shape[0])
        return decode_attention_fused(*args)

    import slime.models.decode_step as decode_step
    monkeypatch.setattr(decode_step, "decode_attention_fused", counted)
    model = tiny("qwen3")
    stepped = copy.deepcopy(model)
    step = DecodeStep(stepped, fused_attention=True)
    prompts = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [9], [60, 7, 7, 12]]
    new = torch.randint(3, VOCAB, (len(prompts), 6), generator=torch.Generator().manual_seed(1))
    keep_after = {1: [0, 1, 3], 3: [2]}
    with torch.no_grad():
        got, want = decode(stepped, step, prompts, new, keep_after), reference(model, prompts, new, keep_after)
    for s, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {s}: {m}")
    assert calls == [4] * 3 * 2 + [3] * 3 * 2  # 3 layers; steps 0-1 of 4 rows, 2-3 of 3, then one row: none


def test_compile_setting_resolves_per_model_and_device():
    """rollout.hf_compile -> DecodeStep's (fused_attention, compiled). auto compiles the whole step (with the
    fallback) for hidden sizes from fused.MIN_HIDDEN on CPU, and only the attention for an MLP that is not SwiGLU;
    nothing below that size or off the CPU. step and attention are on at any size and refuse another device with
    the fix; step also refuses an MLP it does not compile; false is off."""
    from slime.models import fused
    from slime.rollout.hf_engine import _compile

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    small, large, gelu = tiny("qwen3"), tiny("qwen3"), tiny("qwen3")
    large.config.hidden_size = gelu.config.hidden_size = fused.MIN_HIDDEN
    gelu.config.hidden_act = "gelu"
    assert _compile("auto", large, cpu) == ("fallback", "fallback")
    assert _compile("auto", gelu, cpu) == ("fallback", False)
    assert _compile("auto", small, cpu) == (False, False)
    assert _compile("auto", large, cuda) == (False, False)
    assert _compile("step", small, cpu) == (False, True)
    assert _compile("attention", small, cpu) == (True, False)
    assert _compile(False, large, cpu) == (False, False)
    for setting in ("step", "attention"):
        with pytest.raises(ValueError, match="rollout.hf_compile=auto or false"):
            _compile(setting, large, cuda)
    with pytest.raises(ValueError, match="hidden_act is 'gelu'"):
        _compile("step", gelu, cpu)


def count_compiled_steps(monkeypatch) -> list[tuple[int, int]]:
    """Wrap the graphs decode_step._step_graph makes: each call appends (rows, cached keys)."""
    import slime.models.decode_step as decode_step

    calls, make = [], decode_step._step_graph

    def counted_graph(*spec):
        graph = make(*spec)

        def counted(x, cos, sin, mask, *args):
            calls.append((x.shape[0], mask.shape[1] - 1))
            return graph(x, cos, sin, mask, *args)
        return counted

    monkeypatch.setattr(decode_step, "_step_graph", counted_graph)
    return calls


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3", {}),  # per-head q and k norms
    ("qwen2", {}),  # q, k, v biases
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
])
@pytest.mark.parametrize("pack", [None, "onednn", "transposed"], ids=["plain", "onednn", "transposed"])
def test_compiled_decode_step_gives_the_models_logits(arch, overrides, pack, monkeypatch):
    """compiled=True: every step of 2 rows or more runs as one compiled graph (on oneDNN with the packed weights,
    on mm with the transposed ones, or on F.linear), the same logits as the model's forward, rows leaving the batch
    and the cache growing past its capacity (a new buffer: other strides) on the way; the one-row steps run
    eagerly."""
    calls = count_compiled_steps(monkeypatch)
    model = tiny(arch, **overrides)
    stepped = copy.deepcopy(model)
    step = packed_step(stepped, pack, monkeypatch, compiled=True) if pack else DecodeStep(stepped, compiled=True)
    weights, _, _, kernel = step._graph_inputs
    assert kernel == (pack or "linear")  # the graph's matmuls on the packed weights, or on F.linear
    packed = {id(t) for t in step._packed.values()}
    assert sum(id(w) in packed for w in weights) == (0 if pack is None else 1 + 4 * len(model.model.layers))
    prompts = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [9], [60, 7, 7, 12]]
    new = torch.randint(3, VOCAB, (len(prompts), 6), generator=torch.Generator().manual_seed(1))
    keep_after = {1: [0, 1, 3], 3: [2]}  # rows leave, and the order of those left changes
    with torch.no_grad():
        got, want = decode(stepped, step, prompts, new, keep_after), reference(model, prompts, new, keep_after)
    for s, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {s}: {m}")
    assert calls == [(4, 7), (4, 8), (3, 9), (3, 10)]  # then one row: eager


def test_compiled_decode_step_compiles_once_for_any_batch():
    """Rollouts of other row counts, prompt widths and cache capacities reuse the one graph: a second compile would
    cost a rollout seconds each time."""
    import torch._dynamo.utils

    model = tiny("qwen3")
    step = DecodeStep(model, compiled=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for rows, width, extra in ((4, 3, 2), (7, 5, 9), (3, 12, 1), (5, 2, 30)):
            prompts = [torch.randint(3, VOCAB, (width,), generator=g).tolist() for _ in range(rows)]
            new = torch.randint(3, VOCAB, (rows, 3), generator=g)
            decode(model, step, prompts, new, {}, capacity=width + extra)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_compiled_decode_step_crosses_4096_cached_keys():
    """Inductor's loops guard each float sum on its length (> 4096: summed in chunks); a softmax over L + 1 keys
    beside a sum over L pinned the length to 4097, against the dynamic size it was marked with: a batch reaching
    4096 cached keys raised ConstraintViolationError (hf_compile=step) or fell back to the eager step for good."""
    import torch._dynamo.utils

    model = tiny("qwen3", max_position_embeddings=8192)
    compiled, eager = DecodeStep(model, compiled=True), DecodeStep(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4093, 40)]
    new = torch.randint(3, VOCAB, (2, 5), generator=g)  # 4093 -> 4098 keys in the first row
    with torch.no_grad():
        got, want = decode(model, compiled, prompts, new, {}), decode(model, eager, prompts, new, {})
    for g_step, w_step in zip(got, want):
        torch.testing.assert_close(g_step, w_step, rtol=1e-4, atol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # once more past 4096 keys, not per length


def test_compiled_decode_step_runs_in_another_thread():
    """One-step-off rollout decodes in a thread while the trainer trains: the compiled step runs there too, the same
    logits as the model's forward."""
    import threading

    model = tiny("qwen3")
    step = DecodeStep(copy.deepcopy(model), compiled=True)
    prompts, new = [[5, 17, 33], [9], [40, 41]], torch.tensor([[4, 8, 3], [15, 16, 17], [60, 61, 62]])
    got = []

    def run():
        with torch.no_grad():
            got.extend(decode(step.model, step, prompts, new, {}))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    with torch.no_grad():
        torch.testing.assert_close(got, reference(model, prompts, new, {}), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("what", ["step", "attention"])
def test_a_failing_compile_falls_back_or_raises(what, monkeypatch, caplog):
    """A compile that fails (no C++ compiler for inductor, say), of the whole step or of the attention alone:
    "fallback" (rollout.hf_compile=auto) logs why once and decodes on eagerly, the same logits; True raises."""
    import slime.models.decode_step as decode_step

    def broken(*args):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    if what == "step":
        monkeypatch.setattr(decode_step, "_step_graph", lambda *spec: broken)
        setting, message = "compiled", "compiled decode step failed"
    else:
        monkeypatch.setattr(attention, "FUSED_DECODE_MIN_PAIRS", 0)
        monkeypatch.setattr(decode_step, "decode_attention_fused", broken)
        setting, message = "fused_attention", "compiled decode attention failed"
    model = tiny("qwen3")
    prompts, new = [[5, 17, 33], [9]], torch.tensor([[4, 8], [15, 16]])
    with torch.no_grad():
        want = reference(model, prompts, new, {})
        step = DecodeStep(copy.deepcopy(model), **{setting: "fallback"})
        with caplog.at_level("WARNING"):
            got = decode(step.model, step, prompts, new, {})
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        warnings = [r.getMessage() for r in caplog.records if message in r.getMessage()]
        assert len(warnings) == 1 and "InvalidCxxCompiler" in warnings[0] and getattr(step, setting) is False
        step = DecodeStep(copy.deepcopy(model), **{setting: True})
        with pytest.raises(RuntimeError, match="InvalidCxxCompiler"):
            decode(step.model, step, prompts, new, {})


def write_fresh(g: torch.Generator, names: list[str], *models: torch.nn.Module) -> None:
    """Copy the same random values into the named parameters of each model (in place, on the parameter)."""
    for name in names:
        fresh = torch.randn(models[0].get_parameter(name).shape, generator=g)
        for m in models:
            m.get_parameter(name).copy_(fresh)


def test_a_weight_written_into_the_parameters_reaches_the_stacked_matmuls():
    """The engine pushes weights by copying into the parameters; q/k/v and gate/up are views of the stacks the step
    multiplies with, so it sees the push. A parameter given new storage (a cast, a move) is stacked again."""
    model = tiny("qwen3")
    stepped = copy.deepcopy(model)
    step = DecodeStep(stepped)
    prompts, new = [[5, 17, 33], [9]], torch.tensor([[4, 8], [15, 16]])
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        write_fresh(g, ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                        "model.layers.2.self_attn.v_proj.weight"], model, stepped)
        torch.testing.assert_close(decode(stepped, step, prompts, new, {}), reference(model, prompts, new, {}),
                                   rtol=1e-5, atol=1e-5)
        fresh = torch.randn(model.model.layers[0].self_attn.q_proj.weight.shape, generator=g)
        model.model.layers[0].self_attn.q_proj.weight.data = fresh.clone()
        stepped.model.layers[0].self_attn.q_proj.weight.data = fresh.clone()  # no longer a view of the stack
        step.check()
        torch.testing.assert_close(decode(stepped, step, prompts, new, {}), reference(model, prompts, new, {}),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pack", ["onednn", "transposed"])
def test_packed_weights_follow_writes_into_the_parameters(pack, monkeypatch):
    """The packed weights are copies. check() packs again after an in-place write into a parameter (its version
    counter moved); a write through .data (as HFEngine.update_weights writes) is not seen until refresh(): the
    step runs the old weight until then, shown here so that the test can fail (and that the packs are read)."""
    model = tiny("qwen3")
    stepped = copy.deepcopy(model)
    step = packed_step(stepped, pack, monkeypatch)
    prompts, new = [[5, 17, 33], [9]], torch.tensor([[4, 8], [15, 16]])
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        write_fresh(g, ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                        "lm_head.weight"], model, stepped)
        step.check()
        torch.testing.assert_close(decode(stepped, step, prompts, new, {}), reference(model, prompts, new, {}),
                                   rtol=1e-5, atol=1e-5)
        name = "model.layers.2.mlp.down_proj.weight"
        fresh = torch.randn(model.get_parameter(name).shape, generator=g)
        model.get_parameter(name).copy_(fresh)
        stepped.get_parameter(name).data.copy_(fresh)
        step.check()
        want = reference(model, prompts, new, {})
        assert not torch.allclose(decode(stepped, step, prompts, new, {})[0], want[0], atol=1e-3)
        step.refresh()  # kernel rounding: the transposed pack on MKL's AMD path differs from HF's by up to 1.5e-5
        torch.testing.assert_close(decode(stepped, step, prompts, new, {}), want, rtol=1e-4, atol=1e-4)


def test_an_unknown_pack_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"pack='mkl'\): pack is one of \('onednn', 'transposed'\) or None"):
        DecodeStep(tiny("qwen3"), pack="mkl")


@pytest.mark.parametrize("arch,overrides,why", [
    ("qwen3_moe", {}, "is not one of"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention", "full_attention"], "sliding_window": 4,
               "use_sliding_window": True}, "sliding"),
])
def test_other_models_are_refused_with_the_reason(arch, overrides, why):
    model = tiny(arch, **overrides)
    assert why in DecodeStep.unsupported(model)
    with pytest.raises(ValueError, match=why):
        DecodeStep(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_steps_rms_norm_is_bitwise_hfs(dtype):
    """HF normalises in fp32, rounds to the input's dtype, then multiplies by the weight: in bf16 a weighted
    F.rms_norm (one rounding) is an ulp off a quarter of the time, which the engine's logprobs would carry."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from slime.models.decode_step import rms_norm

    norm = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g) * 0.5 + 1)
        x = (torch.randn(32, 64, generator=g) * 3).to(dtype)
        assert torch.equal(rms_norm(x, norm), norm(x))


def test_compiled_decode_steps_of_several_models_each_get_their_own_compile_budget():
    """Each model's step graph is its own code object to Dynamo, whose recompile limit counts per code object: with
    one shared, a process that decoded more model shapes than the limit (8) could not compile the later ones (here
    the second model, with the limit at 1: Dynamo's FailOnRecompileLimitHit, checked before the fix)."""
    import torch._dynamo.utils

    models = [tiny("qwen3"), tiny("llama")]
    steps = [DecodeStep(m, compiled=True) for m in models]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    prompts, new = [[5, 17, 33], [9, 4]], torch.tensor([[4, 8, 3], [15, 16, 17]])
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        for model, step in zip(models, steps):
            torch.testing.assert_close(decode(model, step, prompts, new, {}), reference(model, prompts, new, {}),
                                       rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
