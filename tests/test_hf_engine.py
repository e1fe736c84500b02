"""The hf engine's own decoding loop against HF's generate and against a full forward of what it generated."""
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from data_tools.make_tiny_model import make_tiny_model
from slime.config import ModelConfig, RolloutConfig
from slime.models import onednn
from slime.rollout.engine import SamplingParams, make_engine
from slime.rollout.hf_engine import HFEngine


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hf-engine") / "m", arch="qwen3", seed=1)


@pytest.fixture(scope="module")
def engine(model_path):
    engine = HFEngine(ModelConfig(path=str(model_path), dtype="float32"), AutoTokenizer.from_pretrained(model_path),
                      device=torch.device("cpu"))
    assert engine._step is not None  # decode steps of its own (slime/models/decode_step.py)
    return engine


@pytest.fixture(scope="module", params=["decode_step", "hf_forward"])
def engines(request, engine, model_path):
    """The engine, and one whose decode steps run the model's own forward (as other families' do)."""
    if request.param == "decode_step":
        return engine
    return HFEngine(ModelConfig(path=str(model_path), dtype="float32"), AutoTokenizer.from_pretrained(model_path),
                    device=torch.device("cpu"), decode_step=False)


NEVER = 10**9
PROMPTS = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [9], [100, 7, 7, 7, 12]]


def hf_generate(engine, prompts, params):
    """HF's generate on left-padded rows, its defaults kept out: top_k=0 (None would mean 50) and, for
    ignore_eos, a stop id no token has (None would mean the model's eos)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[engine.pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    greedy = params.temperature == 0
    stops = [NEVER] if params.ignore_eos else [engine.eos_id, *params.stop_token_ids]
    cfg = GenerationConfig(do_sample=not greedy, temperature=None if greedy else params.temperature,
                           top_p=None if greedy or params.top_p >= 1 else params.top_p, top_k=0,
                           max_new_tokens=params.max_new_tokens, num_return_sequences=params.n,
                           eos_token_id=stops, pad_token_id=engine.pad_id, output_logits=True,
                           return_dict_in_generate=True)
    res = engine.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    logps = torch.log_softmax(torch.stack(res.logits, 1).float() / (1.0 if greedy else params.temperature), -1)
    new = res.sequences[:, width:]
    return new, logps.gather(-1, new[..., None]).squeeze(-1)


def teacher_forced(engine, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_draws_what_hf_generate_draws(engines, temperature, top_p):
    """Without stops no row leaves the batch, so the random stream is consumed as HF's generate does:
    the same seed gives the same tokens, and the same logprobs."""
    engine = engines
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, n=3, ignore_eos=True)
    batch_rows = []
    hook = engine.model.model.embed_tokens.register_forward_pre_hook(lambda m, a: batch_rows.append(a[0].shape))
    torch.manual_seed(3)
    try:
        ours = engine.generate(PROMPTS, params)
    finally:
        hook.remove()
    # the prefill runs once per prompt (HF's generate: once per row); its cache rows serve the prompt's n samples
    assert batch_rows[0] == (len(PROMPTS), max(len(p) for p in PROMPTS))
    assert batch_rows[1][0] == len(PROMPTS) * params.n
    torch.manual_seed(3)
    tokens, logps = hf_generate(engine, PROMPTS, params)
    flat = [g for group in ours for g in group]
    assert [g.response_ids for g in flat] == tokens.tolist()
    torch.testing.assert_close(torch.tensor([g.logprobs for g in flat]), logps, rtol=1e-5, atol=1e-5)
    assert all(g.finish_reason == "length" for g in flat)


def test_greedy_with_stops_equals_hf_generate(engines):
    engine = engines
    stops = tuple(range(20, 60))  # common enough that rows stop at different steps
    params = SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=stops, n=1)
    ours = [g for group in engine.generate(PROMPTS, params) for g in group]
    tokens, _ = hf_generate(engine, PROMPTS, params)
    for g, row in zip(ours, tokens.tolist()):
        end = next((i + 1 for i, t in enumerate(row) if t in stops or t == engine.eos_id), len(row))
        assert g.response_ids == row[:end]


def test_rows_that_stop_leave_the_batch_and_the_others_continue_on_their_own_context(engines):
    """Stops make rows leave at different steps (their cache rows are dropped); every response's logprobs
    must still be those of a full forward over its own prompt + response, and stop exactly at a stop token."""
    engine = engines
    stops = tuple(range(20, 45))
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=stops, n=4)
    torch.manual_seed(0)
    groups = engine.generate(PROMPTS, params)
    lengths = {len(g.response_ids) for group in groups for g in group}
    assert len(lengths) >= 4, lengths  # rows really left at different steps
    for prompt, group in zip(PROMPTS, groups):
        for g in group:
            ended = g.response_ids[-1] in stops
            assert g.finish_reason == ("stop" if ended else "length")
            assert not any(t in stops for t in g.response_ids[:-1])
            assert ended or len(g.response_ids) == params.max_new_tokens
            torch.testing.assert_close(torch.tensor(g.logprobs), teacher_forced(engine, prompt, g.response_ids, 1.0),
                                       rtol=1e-4, atol=1e-4)


def test_an_abort_cuts_the_calls_running_and_not_the_next(engine, monkeypatch):
    """abort() (from the thread that stops a one-step-off batch) ends the generate() calls in flight, as SGLang's
    does: the rows decoding stop after their current step and the chunks not started return empty, all with
    finish_reason "abort"; a call that starts afterwards runs in full (an earlier abort left a flag that the next
    call cleared, and chunks after an abort still ran their prefill and a step)."""
    params = SamplingParams(max_new_tokens=6, n=2, ignore_eos=True)
    monkeypatch.setattr(engine, "batch_size", 2)  # one prompt (2 rows) per chunk: 3 chunks
    step, steps = engine._step, []

    def step_then_abort(*args):  # the second decode step of the first chunk is where another thread aborts
        steps.append(1)
        if len(steps) == 2:
            engine.abort()
        return step(*args)

    step_then_abort.check = step.check
    monkeypatch.setattr(engine, "_step", step_then_abort)
    gens = engine.generate(PROMPTS[:3], params)
    assert [[len(g.response_ids) for g in row] for row in gens] == [[3, 3], [0, 0], [0, 0]]
    assert {g.finish_reason for row in gens for g in row} == {"abort"}
    assert len(steps) == 2  # nothing ran after the abort
    monkeypatch.setattr(engine, "_step", step)
    gens = engine.generate(PROMPTS[:3], params)
    assert all(len(g.response_ids) == 6 and g.finish_reason == "length" for row in gens for g in row)


@pytest.mark.parametrize("prompts, params, words", [
    ([[5, 6], []], dict(), ["prompt 1", "empty"]),
    ([[5, 10**6]], dict(), ["prompt 0", "outside the model's vocabulary", "[1000000]", "tokenizer"]),
    ([[5]], dict(n=0), ["n=0", ">= 1"]),
    ([[5]], dict(max_new_tokens=0), ["max_new_tokens=0", ">= 1"]),
    ([[5]], dict(temperature=-1.0), ["temperature=-1.0", ">= 0"]),
    ([[5]], dict(top_p=0.0), ["top_p=0.0", "(0, 1]"]),
])
def test_bad_generate_inputs_are_named(engine, prompts, params, words):
    """Custom generate functions build their own calls: an empty context decoded silently from padding, a negative
    temperature sampled the inverted distribution, n=0 divided by zero."""
    with pytest.raises(ValueError) as e:
        engine.generate(prompts, SamplingParams(**{"max_new_tokens": 2, **params}))
    for word in words:
        assert word in str(e.value)


def test_engine_attention_keeps_grouped_kv_heads_and_equals_hf_sdpa(engine, monkeypatch):
    """The engine's attention (gqa_sdpa) gives HF sdpa's logits on a left-padded batch, without repeating the
    KV heads (HF's sdpa copies them whenever there is a mask: the whole cache, every layer, every step)."""
    import transformers.integrations.sdpa_attention as hf_sdpa
    from transformers import AutoModelForCausalLM

    assert engine.model.config.num_key_value_heads < engine.model.config.num_attention_heads
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[engine.pad_id] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    reference = AutoModelForCausalLM.from_pretrained(engine.model.name_or_path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: pytest.fail("the engine repeated the KV heads"))
        got = engine.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_generation_bypasses_a_process_wide_linear_patch(engine, monkeypatch):
    """A ZeRO-3 engine replaces torch.nn.functional.linear for the whole process (an autograd Function for
    partitioned weights); the hf engine's whole weights call torch's own linear, with the same result."""
    calls = []
    original = torch.nn.functional.linear

    def patched(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    params = SamplingParams(max_new_tokens=5, temperature=0, n=1, ignore_eos=True)
    before = [g.response_ids for group in engine.generate(PROMPTS, params) for g in group]
    monkeypatch.setattr(torch.nn.functional, "linear", patched)
    after = [g.response_ids for group in engine.generate(PROMPTS, params) for g in group]
    assert after == before and not calls
    layer = torch.nn.Linear(3, 2)  # a module of our own still sees the patch: it is the engine's alone
    layer(torch.randn(1, 3))
    assert calls == [1]


def test_preallocated_cache_layer_holds_what_dynamic_layer_holds():
    """The decode's cache layer writes in place into buffers (doubling past its capacity) and drops rows; at every
    step it must return exactly the keys and values that HF's concatenating DynamicLayer returns."""
    from transformers.cache_utils import DynamicLayer

    from slime.rollout.hf_engine import PreallocatedLayer

    ours, theirs = PreallocatedLayer(capacity=6), DynamicLayer()
    g = torch.Generator().manual_seed(0)
    for step, (rows, length, keep) in enumerate([(5, 4, None), (5, 1, None), (5, 1, [0, 2, 3]), (3, 1, None),
                                                 (3, 1, [2]), (1, 3, None), (1, 1, None)]):
        if keep is not None:
            for layer in (ours, theirs):
                layer.batch_select_indices(torch.tensor(keep))
            rows = len(keep)
        k, v = torch.randn(rows, 2, length, 8, generator=g), torch.randn(rows, 2, length, 8, generator=g)
        got, want = ours.update(k, v), theirs.update(k, v)
        for a, b in zip(got, want):
            assert torch.equal(a, b), step
        assert ours.get_seq_length() == theirs.get_seq_length()
    assert ours._keys.shape[2] == 12  # grew once, by doubling, past 6


def test_a_gpu_cache_starts_short_and_grows_to_the_same_generations(engines, monkeypatch):
    """On a GPU the decode's cache buffers are allocated whole, so they start at the prompt plus GPU_CACHE_STEP new
    tokens (not max_new_tokens: 64 rows of a 7B model at 8k tokens would be ~30 GB) and double as rows grow. Run
    here as a GPU would (a step of 3, so the buffers grow twice in 24 tokens): the same tokens and
    logprobs as with room for the whole decode."""
    from slime.rollout import hf_engine

    assert hf_engine.cache_capacity(10, 8192, torch.device("cpu")) == 8202
    assert hf_engine.cache_capacity(10, 8192, torch.device("cuda")) == 10 + hf_engine.GPU_CACHE_STEP
    assert hf_engine.cache_capacity(10, 100, torch.device("cuda")) == 110
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=4, ignore_eos=True)
    torch.manual_seed(0)
    whole = engines.generate(PROMPTS, params)
    grown: list[int] = []
    real = hf_engine.PreallocatedLayer._reserve

    def reserve(layer, length):
        real(layer, length)
        grown.append(layer._keys.shape[2])

    monkeypatch.setattr(hf_engine, "GPU_CACHE_STEP", 3)
    as_gpu = hf_engine.cache_capacity
    monkeypatch.setattr(hf_engine, "cache_capacity",
                        lambda width, new, device: as_gpu(width, new, torch.device("cuda")))
    monkeypatch.setattr(hf_engine.PreallocatedLayer, "_reserve", reserve)
    torch.manual_seed(0)
    short = engines.generate(PROMPTS, params)
    assert sorted(set(grown)) == [10, 20, 40]  # the widest prompt (7) and 3, doubled twice on the way to 31
    assert [[(g.response_ids, g.logprobs) for g in group] for group in short] == \
        [[(g.response_ids, g.logprobs) for g in group] for group in whole]


@pytest.mark.parametrize("setting", ["step", "attention"])
def test_a_compile_asked_for_a_model_without_the_decode_step_is_refused(model_path, setting):
    """rollout.hf_compile=step or attention compiles the engine's own decode step: where the model decodes through
    its own forward (here: turned off), the setting is refused with the fix, not dropped."""
    with pytest.raises(ValueError, match=f"rollout.hf_compile={setting} compiles the engine's own decode step.*"
                                         "turned off.*auto or false"):
        HFEngine(ModelConfig(path=str(model_path), dtype="float32"), AutoTokenizer.from_pretrained(model_path),
                 device=torch.device("cpu"), decode_step=False, compiled=setting)


def test_rows_leaving_copy_only_the_positions_written():
    """A row leaving (and the prefill's copy to a prompt's n samples) copies the cache's written positions, not the
    buffers sized for max_new_tokens: with a long max_new_tokens and short responses, copying the whole buffers made
    them resident and cost time in proportion to the cap."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from slime.rollout.hf_engine import PreallocatedLayer

    class Written(TorchDispatchMode):  # elements of every tensor an op returns
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func not in (torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default):
                Written.elements += sum(t.numel() for t in torch.utils._pytree.tree_leaves(out)
                                        if isinstance(t, torch.Tensor) and not t._is_view())
            return out

    layer = PreallocatedLayer(capacity=4096)
    k, v = torch.randn(6, 2, 10, 8), torch.randn(6, 2, 10, 8)
    layer.update(k, v)
    with Written():
        layer.batch_select_indices(torch.tensor([4, 1, 1]))
    written = 2 * (3 * 2 * 10 * 8)  # keys and values of 3 rows x 10 positions; the whole buffers are 400x that
    assert Written.elements <= 5 * written
    assert torch.equal(layer.keys, k[[4, 1, 1]]) and torch.equal(layer.values, v[[4, 1, 1]])
    assert layer._keys.shape[2] == 4096  # the capacity stays for the positions to come


@pytest.mark.parametrize("padded", [True, False])
def test_decode_attention_equals_sdpa(padded):
    """One query per row against a grouped-KV cache (a strided view, as the preallocated cache returns), with a
    left-padding mask or none."""
    import torch.nn.functional as F

    from slime.models.attention import _decode_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 6, 1, 16, generator=g)
    k, v = (torch.randn(5, 2, 20, 16, generator=g)[:, :, :13] for _ in range(2))
    mask = (torch.arange(13) >= torch.tensor([0, 3, 7, 12, 1])[:, None])[:, None, None] if padded else None
    got = _decode_attention(q, k, v, mask, scaling=0.3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cpu_linear,pack", [("onednn", "onednn"), ("torch", "transposed")])
def test_a_weight_push_reaches_the_packed_weights_of_the_decode_step(model_path, tmp_path, monkeypatch, cpu_linear,
                                                                     pack):
    """The decode step multiplies with packed copies of the weights (oneDNN's layout on oneDNN, transposed on MKL):
    after update_weights it generates what the model's own forward (on the weights themselves) generates from the
    pushed weights, not the old ones."""
    if cpu_linear == "onednn" and not onednn.available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(onednn, "MIN_MACS", 0)  # the tiny model's matmuls on oneDNN too
    engine = HFEngine(ModelConfig(path=str(model_path), dtype="float32", cpu_linear=cpu_linear),
                      AutoTokenizer.from_pretrained(model_path), device=torch.device("cpu"))
    assert engine._step is not None and engine._step.pack == pack
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    before = [g.response_ids for (g,) in engine.generate(PROMPTS, params)]
    other = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "other", arch="qwen3", seed=2))
    engine.update_weights([[(n, p.detach()) for n, p in other.named_parameters()]], version=1)
    got = [g.response_ids for (g,) in engine.generate(PROMPTS, params)]
    want, _ = hf_generate(engine, PROMPTS, params)
    assert got == want.tolist() and got != before


@pytest.mark.parametrize("cpu_linear,pack", [("onednn", "onednn"), ("torch", "transposed")])
def test_a_push_that_fails_part_way_leaves_the_decode_step_on_the_weights_it_wrote(model_path, tmp_path, monkeypatch,
                                                                                  cpu_linear, pack):
    """A push that raises after writing some parameters (a name the model lacks, at the end): the packed copies
    follow the weights written, so decoding stays the model's own forward on them (the error is the caller's)."""
    if cpu_linear == "onednn" and not onednn.available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(onednn, "MIN_MACS", 0)
    engine = HFEngine(ModelConfig(path=str(model_path), dtype="float32", cpu_linear=cpu_linear),
                      AutoTokenizer.from_pretrained(model_path), device=torch.device("cpu"))
    assert engine._step is not None and engine._step.pack == pack
    other = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "other", arch="qwen3", seed=2))
    bogus = ("model.no_such.weight", torch.zeros(1))
    with pytest.raises(KeyError, match="model.no_such.weight"):
        engine.update_weights([[(n, p.detach()) for n, p in other.named_parameters()], [bogus]], version=1)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    got = [g.response_ids for (g,) in engine.generate(PROMPTS, params)]
    want, _ = hf_generate(engine, PROMPTS, params)
    assert got == want.tolist() and engine.weight_version == 0


@pytest.mark.parametrize("decode_step", [True, False])
def test_a_bf16_engines_logprobs_are_as_close_to_a_teacher_forced_forward_as_hfs_own_decoding(tmp_path, decode_step):
    """The decode attention rounded its scores (and their scaling and softmax) to bf16, where sdpa keeps them in
    fp32: the engine's logprobs stood 2-3x further from a teacher-forced forward of the same weights than HF's own
    decoding with a cache (its noise floor in bf16), a larger rollout/training mismatch than bf16 makes. Now no
    further than HF's, on the eager step and on HF's forward (rollout.hf_compile=auto compiles no step in bf16)."""
    from transformers import DynamicCache

    path = make_tiny_model(tmp_path / "m", arch="llama", seed=0, init_std=0.5, hidden=256, heads=4, kv_heads=2,
                           layers=2)  # large scores: rounding shows; hidden 256: auto would compile the step in fp32
    engine = HFEngine(ModelConfig(path=str(path), dtype="bfloat16", cpu_linear="torch"),
                      AutoTokenizer.from_pretrained(path), device=torch.device("cpu"), decode_step=decode_step)
    compiled = engine._step is not None and engine._step.compiled
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    groups = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, n=3, ignore_eos=True, seed=1))
    ours, hf = [], []
    for prompt, group in zip(PROMPTS, groups):
        for g in group:
            forced = teacher_forced(types.SimpleNamespace(model=model), prompt, g.response_ids, 1.0)
            cache, logits = DynamicCache(config=model.config), []
            with torch.no_grad():
                for step in [prompt] + [[t] for t in g.response_ids[:-1]]:
                    logits.append(model(input_ids=torch.tensor([step]), past_key_values=cache,
                                        use_cache=True).logits[0, -1].float())
            decoded = torch.log_softmax(torch.stack(logits), -1).gather(-1, torch.tensor(g.response_ids)[:, None])
            ours.append((torch.tensor(g.logprobs) - forced).abs().mean())
            hf.append((decoded.squeeze(-1) - forced).abs().mean())
    assert not compiled
    assert torch.stack(ours).mean() <= 1.2 * torch.stack(hf).mean(), (torch.stack(ours).mean(), torch.stack(hf).mean())


@pytest.mark.parametrize("cpu_linear", ["onednn", "torch"])
def test_a_bf16_engine_keeps_no_packed_copies(model_path, cpu_linear):
    """The packed kernels are fp32's: a bf16 model decodes on its weights, so no copies are kept (they went unread)."""
    engine = HFEngine(ModelConfig(path=str(model_path), dtype="bfloat16", cpu_linear=cpu_linear),
                      AutoTokenizer.from_pretrained(model_path), device=torch.device("cpu"))
    assert engine._step is not None and engine._step.pack is None and engine._step.packed_bytes() == 0


@pytest.mark.parametrize("cpu_linear,pack", [("onednn", "onednn"), ("torch", "transposed")])
def test_rollout_hf_packed_weights_false_keeps_no_packed_copies(model_path, monkeypatch, cpu_linear, pack):
    """rollout.hf_packed_weights=false (through make_engine, as the trainer builds it): the decode step multiplies
    with the weights themselves, and generates what the packed one does. Packed: in oneDNN's layout where the
    engine runs oneDNN, transposed where it runs torch's linear (MKL)."""
    if cpu_linear == "onednn" and not onednn.available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(onednn, "MIN_MACS", 0)
    model = ModelConfig(path=str(model_path), dtype="float32", cpu_linear=cpu_linear)
    tok, dims = AutoTokenizer.from_pretrained(model_path), types.SimpleNamespace(device=torch.device("cpu"))
    engines = {flag: make_engine(RolloutConfig(hf_packed_weights=flag), model, tok, dims) for flag in (True, False)}
    assert engines[True]._step.pack == pack
    assert engines[True]._step._packed and engines[True]._step.packed_bytes() > 0
    assert engines[False]._step.pack is None and not engines[False]._step._packed
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    got = {flag: [g.response_ids for (g,) in e.generate(PROMPTS, params)] for flag, e in engines.items()}
    assert got[True] == got[False]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_weights_blown_up_are_said_so_when_sampling_and_when_greedy(tmp_path, temperature):
    """NaN logits: sampling fails in multinomial, greedy would pick token 0 with logprob NaN; both say why."""
    path = make_tiny_model(tmp_path / "m", arch="qwen3", seed=1)
    engine = HFEngine(ModelConfig(path=str(path), dtype="float32"), AutoTokenizer.from_pretrained(path),
                      device=torch.device("cpu"))
    with torch.no_grad():
        engine.model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="probabilities are not finite.*blown the weights up"):
        engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, temperature=temperature, n=2))


def test_a_seeded_generation_ignores_the_global_generator(engine):
    """One-step-off rollout samples in a thread while activation checkpointing saves and restores torch's
    global generator: a seed gives the batch its own, so what it draws does not depend on that."""
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=7)
    ids = lambda gens: [[g.response_ids for g in gs] for gs in gens]  # noqa: E731
    torch.manual_seed(0)
    first = ids(engine.generate(PROMPTS, params))
    # The next call with the seed draws on (a batch's chunks, a generate function's turns): not the same again.
    assert ids(engine.generate(PROMPTS, params)) != first
    other = ids(engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=8)))
    assert other != first
    torch.manual_seed(1)
    torch.rand(100)
    assert ids(engine.generate(PROMPTS, params)) == first  # a new seed starts afresh: the same draws


def test_seeded_sampling_scores_argmax_is_a_draw_from_the_nucleus_at_temperature():
    """The image-text path with a seed runs HF's generate greedy over SeededSampling's scores: their argmax must
    be distributed as softmax(logits / T) after top-p (40,000 draws, 4 standard errors)."""
    from slime.rollout.hf_engine import SeededSampling, top_p_filtered

    logits = torch.tensor([[2.0, 1.5, 0.3, -1.0, 0.9, -3.0]])
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (1.3, 0.6)):
        want = top_p_filtered(logits / temperature, top_p).softmax(-1)[0]
        sampler = SeededSampling(temperature, top_p, torch.Generator().manual_seed(0))
        draws = sampler(None, logits.expand(40_000, -1)).argmax(-1)
        got = torch.bincount(draws, minlength=logits.shape[1]).double() / len(draws)
        assert (got[want == 0] == 0).all(), (temperature, top_p)  # outside the nucleus: never
        torch.testing.assert_close(got, want.double(), atol=4 * (0.25 / len(draws)) ** 0.5, rtol=0)


def test_every_eos_of_the_generation_config_ends_a_response(tmp_path):
    """SGLang stops at the tokenizer's EOS and at each EOS of generation_config.json (Qwen lists two); the hf
    engine must end responses at the same tokens, or the two engines train on different responses."""
    from transformers import GenerationConfig as GenCfg

    path = make_tiny_model(tmp_path / "m", arch="qwen3", seed=1)
    tok = AutoTokenizer.from_pretrained(path)
    plain = HFEngine(ModelConfig(path=str(path), dtype="float32"), tok, device=torch.device("cpu"))
    params = SamplingParams(max_new_tokens=8, temperature=0, n=1)
    free = plain.generate([PROMPTS[0]], params)[0][0].response_ids
    second = free[2]  # greedy's third token: made an EOS of the generation config below
    assert tok.eos_token_id not in free[:3] and second != tok.eos_token_id
    GenCfg(eos_token_id=[tok.eos_token_id, second]).save_pretrained(path)
    engine = HFEngine(ModelConfig(path=str(path), dtype="float32"), tok, device=torch.device("cpu"))
    assert engine.eos_ids == sorted({tok.eos_token_id, second})
    stopped = engine.generate([PROMPTS[0]], params)[0][0]
    end = free.index(second) + 1
    assert stopped.response_ids == free[:end] and stopped.finish_reason == "stop"
    assert engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, temperature=0, n=1, ignore_eos=True)
                           )[0][0].response_ids == free


def test_prompts_past_the_context_length_are_warned_about_at_start(tiny_model, caplog):
    import logging

    from slime.models.loading import context_length, warn_past_context

    cfg = ModelConfig(path=str(tiny_model))
    limit = context_length(cfg)
    assert limit == 512  # make_tiny_model's max_pos
    log = logging.getLogger("test.context")
    with caplog.at_level("WARNING", logger="test.context"):
        assert not warn_past_context(cfg, limit - 64, 64, log)
        assert warn_past_context(cfg, limit - 64, 65, log)
    assert "max_position_embeddings=512" in caplog.text and "rollout.max_response_len" in caplog.text


def test_more_samples_per_prompt_than_batch_rows_run_in_chunks_of_the_batch(engine, monkeypatch):
    """n=10 with batch_size=4: the engine never decodes more than 4 rows at once, and gives the 10 samples of
    each prompt in order: greedy ones equal those of one batch, seeded ones differ between chunks (the chunks
    draw on one generator) and repeat with the seed."""
    rows = []
    decode = engine._decode
    monkeypatch.setattr(engine, "_decode", lambda r, *a: rows.append(len(r)) or decode(r, *a))
    greedy = SamplingParams(n=10, max_new_tokens=5, temperature=0.0, ignore_eos=True)
    whole = engine.generate(PROMPTS[:2], greedy)
    assert rows == [20]  # both prompts in one batch of 64 rows
    rows.clear()
    monkeypatch.setattr(engine, "batch_size", 4)
    chunked = engine.generate(PROMPTS[:2], greedy)
    assert rows == [4, 4, 2, 4, 4, 2]
    assert [[g.response_ids for g in p] for p in chunked] == [[g.response_ids for g in p] for p in whole]
    sampled = SamplingParams(n=10, max_new_tokens=5, temperature=1.0, ignore_eos=True, seed=3)
    first = [[g.response_ids for g in p] for p in engine.generate(PROMPTS[:1], sampled)]
    engine._seeded = None
    assert [[g.response_ids for g in p] for p in engine.generate(PROMPTS[:1], sampled)] == first
    assert len(first[0]) == 10 and len({tuple(t) for t in first[0]}) > 4  # later chunks did not repeat the first


def test_stop_ids_past_the_vocabulary_are_refused(tiny_model):
    from slime.models.loading import check_stop_ids, text_config_value

    cfg = ModelConfig(path=str(tiny_model))
    vocab = text_config_value(cfg, "vocab_size")
    check_stop_ids(cfg, [0, vocab - 1])
    with pytest.raises(ValueError, match=rf"rollout.stop_token_ids=\[5, {vocab}\]: \[{vocab}\] are past the model's "
                                         rf"vocabulary of {vocab} tokens"):
        check_stop_ids(cfg, [5, vocab])


def test_a_chat_templates_turn_end_past_the_vocabulary_is_refused(tiny_model):
    """A template ending turns in a token the model cannot produce: GRPO stopped at it never (and exported it as an
    EOS), SFT failed in its first step blaming "ids from another tokenizer"."""
    from transformers import AutoTokenizer

    from slime.models.loading import check_turn_end, text_config_value

    cfg = ModelConfig(path=str(tiny_model))
    vocab, tokenizer = text_config_value(cfg, "vocab_size"), AutoTokenizer.from_pretrained(tiny_model)
    check_turn_end(cfg, (vocab - 1,), tokenizer)
    check_turn_end(cfg, (), tokenizer)
    with pytest.raises(ValueError, match=rf"the chat template's turn end .* \(id {vocab}\) is past the model's "
                                         rf"vocabulary of {vocab} tokens .*cannot learn it"):
        check_turn_end(cfg, (vocab,), tokenizer)


def test_a_moe_checkpoint_saved_with_router_logits_on_generates(tmp_path):
    """A MoE config.json with output_router_logits=true (a training setting) made the model's forward compute its
    load-balancing loss at each one-token decode step, against the whole attention mask: a shape error at the
    first step (HF's generate fails the same way). The engine turns it off on its own copy; the trainer asks for
    router logits per call."""
    import json
    import shutil

    off = make_tiny_model(tmp_path / "off", arch="qwen3_moe", seed=1)
    on = shutil.copytree(off, tmp_path / "on")
    config = json.loads((on / "config.json").read_text())
    (on / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    params = SamplingParams(max_new_tokens=5, temperature=0, n=2, ignore_eos=True)
    gens = [HFEngine(ModelConfig(path=str(path), dtype="float32"), AutoTokenizer.from_pretrained(path),
                     device=torch.device("cpu")).generate(PROMPTS[:2], params) for path in (on, off)]
    assert gens[0] == gens[1] and len(gens[0][0][0].response_ids) == 5
