"""Packed micro-batches give the same logprobs (and gradients) as running each sample alone."""
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
        logp, _ = packed(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len, chunk_size=5)
        for s, got in zip(samples, mb.split(logp)):
            torch.testing.assert_close(got, per_sample_logprobs(alone, s), rtol=1e-5, atol=1e-5)


def test_packed_gradients_equal_per_sample(model_dir):
    packed = PolicyModel(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=PACKED_SDPA))
    alone = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    samples = random_samples(seed=3)
    mb = build_micro_batch(samples, range(len(samples)))
    logp, _ = packed(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len, chunk_size=4)
    logp.sum().backward()
    sum(per_sample_logprobs(alone, s).sum() for s in samples).backward()
    ref = dict(alone.named_parameters())
    for name, p in packed.hf.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-6)


def test_unmasked_packing_would_leak(model_dir):
    """Control: attention over the whole packed row (one causal sequence) gives different logprobs,
    so the equality above is a real check of isolation."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    samples = random_samples()
    mb = build_micro_batch(samples, range(len(samples)))
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None],
                       attention_mask=torch.ones_like(mb.input_ids)[None]).logits[0]
    leaked = torch.log_softmax(logits.float(), -1)[mb.pred_index].gather(-1, mb.input_ids[mb.pred_index + 1, None])
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


def test_grouped_attention_equals_one_call_per_sample():
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
    want = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                     enable_gqa=True)
                      for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], 2).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad((want * weights).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
