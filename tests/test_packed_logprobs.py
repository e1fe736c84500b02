"""Packed micro-batches give the same logprobs (and gradients) as running each sample alone."""
import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from data_tools.make_tiny_model import make_tiny_model
from slime.data.batch import build_micro_batch
from slime.data.sample import Sample
from slime.models.attention import PACKED_SDPA
from slime.models.policy import PolicyModel


def random_samples(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(prompt_ids=torch.randint(5, 250, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist(),
                   response_ids=torch.randint(5, 250, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist())
            for _ in range(n)]


def per_sample_logprobs(model, s):
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    logits = model(input_ids=ids).logits[0].float()
    p = len(s.prompt_ids)
    return torch.log_softmax(logits, -1)[p - 1:-1].gather(-1, ids[0, p:, None]).squeeze(-1)


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def model_dir(request, tmp_path_factory):
    # A bigger random init than the default makes cross-sample leaks visible in the logprobs.
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param, seed=1)


def test_packed_equals_per_sample(model_dir):
    torch.manual_seed(0)
    packed = PolicyModel(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=PACKED_SDPA))
    alone = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    samples = random_samples()
    mb = build_micro_batch(samples, range(len(samples)))
    with torch.no_grad():
        logp, _ = packed(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len, chunk_size=5,
                         target_ids=mb.target_ids)
        for s, got in zip(samples, mb.split(logp)):
            torch.testing.assert_close(got, per_sample_logprobs(alone, s), rtol=1e-5, atol=1e-5)


def packed_and_alone(path, *, seed: int, alone_attn: str = "sdpa", chunk_size: int = 4):
    """The model at `path` packed (PolicyModel on packed_sdpa) and plain, random samples, their micro-batch and
    its packed logprobs (with grad)."""
    packed = PolicyModel(AutoModelForCausalLM.from_pretrained(path, attn_implementation=PACKED_SDPA))
    alone = AutoModelForCausalLM.from_pretrained(path, attn_implementation=alone_attn)
    samples = random_samples(seed=seed)
    mb = build_micro_batch(samples, range(len(samples)))
    logp, _ = packed(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
                     chunk_size=chunk_size, target_ids=mb.target_ids)
    return packed, alone, samples, mb, logp


def assert_same_gradients(packed, alone, samples, logp, atol: float) -> None:
    """The packed logprobs' summed gradients against each sample's alone."""
    logp.sum().backward()
    sum(per_sample_logprobs(alone, s).sum() for s in samples).backward()
    ref = dict(alone.named_parameters())
    for name, p in packed.hf.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")


def test_packed_gradients_equal_per_sample(model_dir):
    packed, alone, samples, _, logp = packed_and_alone(model_dir, seed=3)
    assert_same_gradients(packed, alone, samples, logp, atol=1e-6)


def test_unmasked_packing_would_leak(model_dir):
    """Control: attention over the whole packed row (one causal sequence) gives different logprobs,
    so the equality above is a real check of isolation."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    samples = random_samples()
    mb = build_micro_batch(samples, range(len(samples)))
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None],
                       attention_mask=torch.ones_like(mb.input_ids)[None]).logits[0]
    leaked = torch.log_softmax(logits.float(), -1)[mb.pred_index].gather(-1, mb.target_ids[:, None])
    alone = torch.cat([per_sample_logprobs(model, s) for s in samples])
    assert (leaked.squeeze(-1) - alone).abs().max() > 1e-3


@pytest.mark.parametrize("lengths", [[7] * 9, [1, 50, 3, 3, 49, 20, 1, 12, 30, 31, 2], [5], [40, 1]])
def test_length_groups_cover_each_sample_once_within_the_padding_bound(lengths):
    from slime.models.attention import PAD_AREA, attention_groups

    bounds = (0, *torch.tensor(lengths).cumsum(0).tolist())
    groups = attention_groups(bounds)
    spans = sorted((s, s + n) for _, starts, lens in groups for s, n in zip(starts, lens))
    assert spans == list(zip(bounds[:-1], bounds[1:]))
    for lmax, _, lens in groups:
        assert lmax == max(lens) and len(lens) * lmax ** 2 <= PAD_AREA * sum(n * n for n in lens)
    if len(set(lengths)) == 1:
        assert len(groups) == 1  # equal lengths: one sdpa call


@pytest.fixture(params=["flash", "autograd"])
def packed_path(request, monkeypatch):
    """packed_sdpa's two ways: its own calls of the CPU flash kernel (_PackedFlash), and the same calls through
    autograd (taken on CUDA without flash-attn, and with dropout)."""
    from slime.models import attention

    if request.param == "autograd":
        monkeypatch.setattr(attention, "_use_flash_cpu", lambda query, dropout: False)
    return request.param


def check_path(out, path):
    assert (type(out.grad_fn).__name__ == "_PackedFlashBackward") == (path == "flash"), out.grad_fn


def test_grouped_attention_equals_one_call_per_sample(packed_path):
    """packed_sdpa (length groups, padded calls, gathered back) against plain sdpa on each sample alone:
    outputs and the gradients of q, k, v, with GQA, over lengths that make several groups and 1-token samples."""
    import torch.nn.functional as F

    from slime.models.attention import attention_groups, packed_sdpa_forward

    class Module:
        training = False

    lengths = [1, 50, 3, 3, 49, 20, 1, 12, 30, 31, 2]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    assert len(attention_groups(tuple(cu.tolist()))) > 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, int(cu[-1]), 16, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2))
    got = packed_sdpa_forward(Module, q, k, v, None, cu_seq_lens_q=cu)[0]
    check_path(got, packed_path)
    want = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                     enable_gqa=True)
                      for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], 2).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad((want * weights).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_packed_attention_refuses_tokens_outside_every_sample():
    from slime.models.attention import packed_sdpa_forward

    class Module:
        training = False

    q, k, v = (torch.randn(1, h, 10, 8) for h in (4, 2, 2))
    with pytest.raises(ValueError, match="cu_seq_lens_q ends at 8 but the row holds 10 tokens"):
        packed_sdpa_forward(Module, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 3, 8]))


def grouped_samples(seed=0, one_token_sibling=False):
    """GRPO-like: 3 prompts x 3 samples in mixed order, plus one sample with a prompt of its own; a later sample of a
    prompt has an empty response, and with `one_token_sibling` another a one-token one (shared, neither has a
    segment of its own)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 250, (n,), generator=g).tolist() for n in (5, 1, 9, 4)]
    lengths = [int(n) for n in torch.randint(1, 12, (10,), generator=g)]
    order = [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]
    lengths[4] = 0
    if one_token_sibling:
        lengths[7] = 1
    return [Sample(prompt_ids=prompts[p], response_ids=torch.randint(5, 250, (n,), generator=g).tolist())
            for p, n in zip(order, lengths)]


def test_shared_prompt_layout():
    """Hand-checked: the second sample of a prompt carries only its response, attends to the first one's prompt,
    continues its positions and is scored from the prompt's last position. A sample's last token is a target only,
    not an input: a one-token response after a shared prompt (d) has no segment of its own, nor an empty one (e)."""
    a = Sample(prompt_ids=[10, 11, 12], response_ids=[20, 21])
    b = Sample(prompt_ids=[10, 11, 12], response_ids=[30, 31, 32])
    c = Sample(prompt_ids=[40], response_ids=[41])
    d = Sample(prompt_ids=[10, 11, 12], response_ids=[50])
    e = Sample(prompt_ids=[10, 11, 12], response_ids=[])
    mb = build_micro_batch([a, b, c, d, e], [0, 1, 2, 3, 4], share_prompts=True)
    assert mb.input_ids.tolist() == [10, 11, 12, 20, 30, 31, 40]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 3, 4, 0]
    assert mb.cu_seqlens.tolist() == [0, 4, 6, 7]
    assert mb.prompt_prefixes.tolist() == [[0, 0], [0, 3], [0, 0]]
    assert mb.pred_index.tolist() == [2, 3, 2, 4, 5, 6, 2]
    assert mb.target_ids.tolist() == [20, 21, 30, 31, 32, 41, 50]
    assert mb.response_lens == [2, 3, 1, 1, 0] and mb.seq_ids.tolist() == [0, 0, 1, 1, 1, 2, 3]
    assert mb.input_ids.numel() == sum(s.row_len for s in (a, b, c, d, e)) - 3 * 3  # b, d, e: no prompt copy
    plain = build_micro_batch([a, b, c, d, e], [0, 1, 2, 3, 4])
    assert plain.prompt_prefixes is None
    assert plain.input_ids.tolist() == [10, 11, 12, 20, 10, 11, 12, 30, 31, 40, 10, 11, 12, 10, 11, 12]
    assert plain.input_ids.numel() == sum(s.row_len for s in (a, b, c, d, e))
    assert plain.pred_index.tolist() == [2, 3, 6, 7, 8, 9, 12] and plain.target_ids.tolist() == mb.target_ids.tolist()


def test_shared_prompt_attention_equals_separate_copies(packed_path):
    """packed_sdpa with prompt prefixes against the unshared layout (each sample with its own prompt copy): the
    same outputs at every token, and the same q/k/v gradients, a shared token's being the sum over its copies."""
    from slime.models.attention import packed_sdpa_forward

    class Module:
        training = False

    samples, seen = [], set()  # those with a segment of their own: a prompt's first, and responses of 2+ tokens
    for s in grouped_samples():
        if tuple(s.prompt_ids) not in seen or len(s.response_ids) > 1:
            samples.append(s)
        seen.add(tuple(s.prompt_ids))
    shared = build_micro_batch(samples, range(len(samples)), share_prompts=True)
    plain = build_micro_batch(samples, range(len(samples)))
    assert len(shared.cu_seqlens) == len(samples) + 1
    copy_of = []  # each unshared token's position in the shared row
    for k, s in enumerate(samples):
        (start, end), (ps, pe) = shared.cu_seqlens[k:k + 2].tolist(), shared.prompt_prefixes[k].tolist()
        copy_of += [*range(ps, pe), *range(start, end)]
    copy_of = torch.tensor(copy_of)
    assert torch.equal(shared.input_ids[copy_of], plain.input_ids) and len(copy_of) > shared.input_ids.numel()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, shared.input_ids.numel(), 16, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2))
    got = packed_sdpa_forward(Module, q, k, v, None, cu_seq_lens_q=shared.cu_seqlens,
                              prompt_prefixes=shared.prompt_prefixes)[0]
    check_path(got, packed_path)
    got = got[0]
    want = packed_sdpa_forward(Module, *(t.index_select(2, copy_of) for t in (q, k, v)), None,
                               cu_seq_lens_q=plain.cu_seqlens)[0][0]
    torch.testing.assert_close(got[copy_of], want, rtol=1e-12, atol=1e-12)
    weights = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((got[copy_of] * weights).sum(), (q, k, v)),
                    torch.autograd.grad((want * weights).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_shared_prompts_give_the_logprobs_and_gradients_of_separate_copies(model_dir):
    model = PolicyModel(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=PACKED_SDPA,
                                                             dtype=torch.float64))
    samples = grouped_samples(seed=1, one_token_sibling=True)
    results = []
    for share in (False, True):
        mb = build_micro_batch(samples, range(len(samples)), share_prompts=share)
        extra = {"prompt_prefixes": mb.prompt_prefixes} if share else {}
        model.zero_grad()
        logp, ent = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
                          chunk_size=7, target_ids=mb.target_ids, **extra)
        (logp * torch.linspace(-1, 1, len(logp), dtype=logp.dtype)).sum().backward()
        results.append((mb.input_ids.numel(), logp.detach(), ent.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
        if share:  # control: the shared layout without its prefixes is a different computation
            with torch.no_grad():
                alone, _ = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
                                 target_ids=mb.target_ids)
            assert (alone - logp).abs().max() > 1e-3
    (n_plain, lp_plain, ent_plain, g_plain), (n_shared, lp_shared, ent_shared, g_shared) = results
    assert n_shared < n_plain
    torch.testing.assert_close(lp_shared, lp_plain, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent_shared, ent_plain, rtol=1e-10, atol=1e-10)
    for name, grad in g_plain.items():  # the models' norms compute in fp32: gradients agree to its rounding
        torch.testing.assert_close(g_shared[name], grad, rtol=1e-6, atol=1e-6 * grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_shared_prompts_refused_where_attention_cannot_see_them(model_dir):
    model = PolicyModel(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa"))
    samples = grouped_samples()
    mb = build_micro_batch(samples, range(len(samples)), share_prompts=True)
    with pytest.raises(ValueError, match="share_prompts.*packed_sdpa"):
        model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
              target_ids=mb.target_ids, prompt_prefixes=mb.prompt_prefixes)


TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=1)


def other_family(tmp_path, name: str, **overrides):
    """A tiny random model of a family without an adapter, saved, from its transformers config class."""
    import transformers

    kind, extra = {"cohere": ("CohereConfig", {"logit_scale": 0.0625}),
                   "granite": ("GraniteConfig", {"logits_scaling": 4.0}),
                   "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "layer_types": ["full_attention"] * 2,
                                                        "final_logit_softcapping": 30.0}),
                   "gemma2": ("Gemma2Config", {"head_dim": 16, "layer_types": ["full_attention"] * 2,
                                               "final_logit_softcapping": None}),
                   "hyperclovax": ("HyperCLOVAXConfig", {"logits_scaling": 4.0}),  # multiplies: Granite divides
                   "stablelm": ("StableLmConfig", {})}[name]
    module = transformers if hasattr(transformers, kind) else transformers.models.hyperclovax.configuration_hyperclovax
    config = getattr(module, kind)(**{**TINY, **extra, **overrides})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("name", ["cohere", "granite", "gemma3_text", "hyperclovax"])
def test_a_familys_own_final_logits_are_the_logprob_heads(tmp_path, name):
    """Cohere scales its logits (logit_scale), Granite divides them (logits_scaling), Gemma 2/3 soft-cap them
    (final_logit_softcapping) after the LM head: the trainer's head applied none of it (logprobs off by up to 4.6)."""
    import transformers

    from slime.models.policy import final_logits

    assert final_logits(transformers.MptConfig(logit_scale="inv_sqrt_d_model")) == (1.0, None)  # HF's MPT reads none
    packed, alone, samples, mb, logp = packed_and_alone(other_family(tmp_path, name), seed=2, alone_attn="eager",
                                                        chunk_size=5)
    for s, got in zip(samples, mb.split(logp)):
        torch.testing.assert_close(got, per_sample_logprobs(alone, s), rtol=1e-5, atol=1e-5)
    assert_same_gradients(packed, alone, samples, logp, atol=1e-4)


@pytest.mark.parametrize("dtype, limit", [("float32", "0.001"), ("bfloat16", "0.02")])
def test_a_family_without_an_adapter_is_checked_packed_against_alone_at_start(tmp_path, dtype, limit):
    """What the families above got wrong in silence (a packed row attending across its samples) is measured when an
    unknown family's actor starts: its borders dropped, the same model is refused (bf16 too: the GPU default)."""
    from conftest import REPO, run_ranks

    run_ranks([str(REPO / "tests/dist/packing_probe_checks.py"), str(other_family(tmp_path, "cohere")),
               str(tmp_path), f"model.dtype={dtype}"], nproc=1)
    refused = json.loads((tmp_path / "result.json").read_text())["refused"]
    assert re.search(rf"the 'cohere' family scores two samples packed in one row unlike each alone \(mean logprob "
                     rf"gap [\d.]+, more than {limit} of torch.{dtype}\).*train.packing=false", refused), refused


def test_what_packed_attention_cannot_compute_is_refused_not_dropped(tmp_path):
    """StableLM's decoder layers call their attention without its keyword arguments (the samples' borders): a
    packed row attended across its samples. Gemma 2's attention soft-capping was dropped in silence. Each is an
    error now; a padded batch (no borders to pass) still runs StableLM."""
    samples = random_samples(seed=4)
    mb = build_micro_batch(samples, range(len(samples)))
    stablelm = PolicyModel(AutoModelForCausalLM.from_pretrained(other_family(tmp_path, "stablelm"),
                                                                attn_implementation=PACKED_SDPA))
    with pytest.raises(ValueError, match="StableLmAttention got no cu_seq_lens_q for a packed row.*packing=false"):
        stablelm(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len, chunk_size=5,
                 target_ids=mb.target_ids)
    one = build_micro_batch(samples[:1], [0])  # one sample: as a padded row of one
    stablelm(one.input_ids[None], one.position_ids[None], None, one.pred_index, max_len=one.max_len, chunk_size=5,
             target_ids=one.target_ids)
    gemma2 = PolicyModel(AutoModelForCausalLM.from_pretrained(
        other_family(tmp_path, "gemma2", attn_logit_softcapping=50.0), attn_implementation=PACKED_SDPA))
    with pytest.raises(NotImplementedError, match="packed_sdpa does not implement softcap"):
        gemma2(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len, chunk_size=5,
               target_ids=mb.target_ids)


def test_models_whose_packed_samples_would_not_compute_alone_are_refused():
    """Linear attention and short convolutions carry state across a packed row's borders; dynamic and longrope
    rope pick their frequencies from the row's largest position once past the original context."""
    import transformers

    from slime.models.attention import packing_refusal

    assert "linear_attention layers" in packing_refusal(transformers.Qwen3NextConfig(), 100)
    assert packing_refusal(transformers.Qwen3NextConfig(), 100, packing=False) is None  # padded rows: state ends
    lfm2 = transformers.Lfm2Config(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"])
    assert packing_refusal(lfm2, 100).startswith("has conv layers")
    dynamic = transformers.LlamaConfig(max_position_embeddings=64, rope_parameters={"rope_type": "dynamic",
                                                                                    "factor": 2.0})
    assert packing_refusal(dynamic, 64) is None and "dynamic rope" in packing_refusal(dynamic, 65)
    assert "dynamic rope" in packing_refusal(dynamic, 65, packing=False)  # a padded batch's too
    for plain in (transformers.LlamaConfig(), transformers.Qwen3Config(), transformers.Gemma2Config()):
        assert packing_refusal(plain, 10**6) is None


def test_checkpointed_layers_recompute_with_dropout_still_off_or_are_refused(tmp_path):
    """HF checkpoints a layer only in training mode: the layers alone are marked training (their children, and so
    a qwen2 model's dropout, stay in eval), and the logits are those of eval mode. OPT applies its dropout (0.1 by
    default) in the layer's own forward by that mode: refused, where it would have trained on random masks."""
    import transformers

    from slime.trainer.policy_engine import checkpoint_layers

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "q", arch="qwen2", seed=1))
    model.config.attention_dropout = 0.5  # read by the attention module, a child: stays off
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids = torch.randint(5, 250, (1, 12))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    checkpoint_layers(model)
    assert all(layer.training and not layer.self_attn.training for layer in model.model.layers)
    runs = [0]
    model.model.layers[0].register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    after = model(input_ids=ids).logits
    after.sum().backward()
    assert runs[0] == 2  # recomputed in backward
    torch.testing.assert_close(after.detach(), before, rtol=0, atol=0)
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                             ffn_dim=128, vocab_size=300, word_embed_proj_dim=64))
    with pytest.raises(ValueError, match=r"OPTDecoderLayer applies dropout by its training mode.*'dropout': 0.1"):
        checkpoint_layers(opt)
