"""Plausible bugs the rest of the suite would let through: each test here fails on a small deliberate
breakage of the code it names (a flipped comparison, a deleted line, a changed constant)."""
from __future__ import annotations

import importlib.util
import math
import random

import numpy as np
import pytest
import torch

from slime.algorithms.advantages import gae_advantages, grpo_advantages
from slime.algorithms.policy_loss import aggregate_loss
from slime.config import DataConfig, load_config
from slime.data.batch import build_micro_batch
from slime.data.packing import _pack_per_rank, packing_stats, padded_fixed_batches, plan_micro_batches
from slime.data.sample import Sample
from slime.models.attention import PACKED_SDPA, resolve_attn_implementation
from slime.models.policy import logprobs_and_entropy
from slime.rollout.weight_sync import iter_gathered_buckets

BASE = ["model.path=m", "data.path=d.jsonl"]


# 1. weight_sync bucket sizing ------------------------------------------------------------------------

def test_buckets_hold_each_name_once_in_order_and_close_at_the_size():
    model = torch.nn.Sequential(*[torch.nn.Linear(8 + i, 8 + i) for i in range(6)])
    named = list(model.named_parameters())
    sizes = {n: p.numel() * p.element_size() for n, p in named}
    bucket_bytes = 700
    buckets = list(iter_gathered_buckets([[np_] for np_ in named], bucket_bytes=bucket_bytes))
    out = [n for b in buckets for n, _ in b]
    assert out == [n for n, _ in named]  # each name exactly once, in order (no re-sent earlier params)
    assert len(buckets) > 2  # neither one huge bucket ...
    for b in buckets[:-1]:
        total = sum(sizes[n] for n, _ in b)
        last = sizes[b[-1][0]]
        assert bucket_bytes <= total <= bucket_bytes + last  # ... nor one parameter per bucket
    for b in buckets:
        for n, t in b:
            torch.testing.assert_close(t, dict(named)[n].detach(), rtol=0, atol=0)


# 2. entropy sign ---------------------------------------------------------------------------------------

def test_entropy_is_the_categorical_entropy():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([0, 3, 10, 7, 2])
    logp, ent = logprobs_and_entropy(logits, targets)
    torch.testing.assert_close(ent, torch.distributions.Categorical(logits=logits).entropy())
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1)[torch.arange(5), targets])
    _, uniform = logprobs_and_entropy(torch.zeros(2, 11), torch.tensor([0, 1]))
    torch.testing.assert_close(uniform, torch.full((2,), math.log(11)))


# 3. packing: the retry path for ragged groups ---------------------------------------------------------

def test_ragged_groups_take_the_retry_path_and_keep_the_invariants(monkeypatch):
    import slime.data.packing as packing

    sizes = [3, 6, 1, 1, 6, 5]
    lengths = [64, 64, 64, 64, 13, 53, 64, 64, 64, 64, 64, 23, 64, 61, 64, 64, 64, 64, 64, 64, 64, 64]
    groups = [g for g, n in enumerate(sizes) for _ in range(n)]
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("equal_count", True))
        return _pack_per_rank(*args, **kwargs)

    monkeypatch.setattr(packing, "_pack_per_rank", spy)
    plan = plan_micro_batches(lengths, max_tokens=64, dp_size=2, groups=groups)
    assert calls == [True, False]  # the first pass fails, the retry balances sample counts
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(lengths)))
    assert len({len(rank) for rank in plan}) == 1
    for rank in plan:
        assert all(mb and sum(lengths[i] for i in mb) <= 64 for mb in rank)
    ranks_of = {}
    for r, rank in enumerate(plan):
        for mb in rank:
            for i in mb:
                ranks_of.setdefault(groups[i], set()).add(r)
    assert all(len(r) == 1 for r in ranks_of.values())  # groups stay whole


# 4. attention choice ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cuda, flash, requested, expected", [
    (False, False, "auto", PACKED_SDPA), (True, False, "auto", PACKED_SDPA), (False, True, "auto", PACKED_SDPA),
    (True, True, "auto", "flash_attention_2"), (False, False, PACKED_SDPA, PACKED_SDPA),
    (True, True, PACKED_SDPA, PACKED_SDPA), (True, True, "flash_attention_2", "flash_attention_2"),
])
def test_attention_choice(monkeypatch, cuda, flash, requested, expected):
    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" and flash
                        else (None if name == "flash_attn" else real(name, *a)))
    assert resolve_attn_implementation(requested, torch.bfloat16) == expected
    # flash-attn has no fp32 kernels: auto picked it for model.dtype=float32 on a GPU, and the first step failed
    if requested == "auto":
        assert resolve_attn_implementation(requested, torch.float32) == PACKED_SDPA
    elif requested == "flash_attention_2":
        with pytest.raises(ValueError, match=r"runs in bf16 or fp16 only, and the model runs in float32 "
                                             r"\(model.dtype\): set model.dtype=bfloat16"):
            resolve_attn_implementation(requested, torch.float32)


def test_flash_requested_without_the_package_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="flash-attn package"):
        resolve_attn_implementation("flash_attention_2", torch.bfloat16)


# 5. MicroBatch.to moves everything ----------------------------------------------------------------------

def test_micro_batch_to_moves_every_tensor():
    samples = [Sample(prompt_ids=[1, 2], response_ids=[3, 4], advantages=torch.ones(2), old_logprobs=torch.zeros(2))]
    mb = build_micro_batch(samples, [0]).to(torch.device("meta"))
    tensors = [getattr(mb, f) for f in ("input_ids", "position_ids", "cu_seqlens", "pred_index", "seq_ids",
                                        "loss_mask")] + list(mb.fields.values())
    assert len(mb.fields) == 2 and all(t.device.type == "meta" for t in tensors)


# 6. checkpoint RNG state, and a `latest` that cannot be loaded --------------------------------------------

def test_rng_state_round_trip_includes_cuda(monkeypatch):
    from slime.trainer import checkpoint

    cuda_state = {"now": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: cuda_state["now"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: cuda_state.update(now=s.clone()))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = checkpoint._rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    cuda_state["now"] = torch.tensor([9, 9, 9], dtype=torch.uint8)  # the generator moved on
    checkpoint._set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert cuda_state["now"].tolist() == [1, 2, 3]


class OneRank:
    is_main, rank, world_size, world_group = True, 0, 1, None

    def all_gather_objects(self, obj, group=None):
        return [obj]


def test_latest_without_a_loadable_checkpoint_is_an_error(tmp_path):
    from slime.trainer.checkpoint import load_checkpoint

    (tmp_path / "latest").write_text("step_3")
    (tmp_path / "step_3").mkdir()
    with pytest.raises(ValueError, match=r"holds checkpoints but none is usable:\n.*step_3: no manifest.json"):
        load_checkpoint({}, tmp_path, dims=OneRank(), identity={})
    assert load_checkpoint({}, tmp_path / "empty", dims=OneRank(), identity={}) is None  # nothing to resume


# 7. prompts --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def rows(tmp_path, items):
    import json

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def test_prompt_of_exactly_max_prompt_len_is_kept(tmp_path, tok):
    from slime.data.prompts import load_prompts

    path = rows(tmp_path, [{"prompt": "1" * 10, "label": "x"}, {"prompt": "1" * 11, "label": "x"}])
    cfg = DataConfig(path=str(path), apply_chat_template=False, max_prompt_len=10)
    prompts, report = load_prompts(cfg, tok)
    assert [len(p.prompt_ids) for p in prompts] == [10] and report.too_long == 1


def test_bos_tokenizer_gets_one_bos(tmp_path):
    """A Llama-style tokenizer adds BOS itself; the chat template renders it too: the prompt must hold one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from slime.data.prompts import load_prompts

    vocab = {t: i for i, t in enumerate(["<s>", "</s>", "<u>", "a", "b", "="])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    tok.add_special_tokens({"additional_special_tokens": ["<u>"]})
    tok.chat_template = "{{ bos_token }}{% for m in messages %}<u>{{ m['content'] }}{% endfor %}"
    assert tok("ab").input_ids[0] == 0  # the tokenizer does add a BOS by default
    prompts, _ = load_prompts(DataConfig(path=str(rows(tmp_path, [{"prompt": "ab=", "label": "x"}]))), tok)
    assert prompts[0].prompt_ids.count(0) == 1 and prompts[0].prompt_ids[0] == 0


def test_sft_samples_learn_label_then_eos(tok):
    from slime.data.prompts import Prompt, sft_samples

    samples = sft_samples([Prompt([5, 6], "q", 42, {"k": 1}, 7)], tok)
    s = samples[0]
    assert s.response_ids == tok("42", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert s.prompt_ids == [5, 6] and s.group_id == 7 and s.metadata == {"k": 1} and s.finish_reason == "stop"
    with pytest.raises(ValueError, match="prompt index 7 has none"):
        sft_samples([Prompt([5], "q", None, {}, 7)], tok)


def test_non_string_prompt_names_file_and_line(tmp_path, tok):
    from slime.data.prompts import load_prompts

    path = rows(tmp_path, [{"prompt": "ok", "label": "x"}, {"prompt": 17, "label": "x"}])
    with pytest.raises(TypeError, match=r"p.jsonl:2: field 'prompt' must be a string, got int"):
        load_prompts(DataConfig(path=str(path)), tok)


# 8. config boundaries ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("override", ["algo.lam=1.0", "algo.lam=0.0", "algo.gamma=1.0", "algo.clip_low=0.0",
                                      "algo.clip_high=0.0"])
def test_boundary_values_are_accepted(override):
    load_config(None, BASE + [override])


@pytest.mark.parametrize("override, key", [("algo.lam=1.01", "algo.lam"), ("algo.lam=-0.1", "algo.lam"),
                                           ("algo.gamma=1.5", "algo.gamma"), ("algo.clip_low=1.0", "algo.clip_low"),
                                           ("algo.clip_low=-0.1", "algo.clip_low"),
                                           ("algo.clip_high=-0.1", "algo.clip_high")])
def test_values_just_outside_are_rejected(override, key):
    with pytest.raises(ValueError, match=key):
        load_config(None, BASE + [override])


# 9. aggregate_loss shape check ---------------------------------------------------------------------------------

def test_aggregate_loss_refuses_a_column_that_would_broadcast():
    mask, seq = torch.ones(4), torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="1-D tensors of one shape"):
        aggregate_loss(torch.ones(4, 1), mask, seq, mode="token_mean", num_tokens=4, num_seqs=2)


# 10. unchecked metrics and messages ------------------------------------------------------------------------------

def test_gae_value_mean_and_packing_total_cost():
    values = torch.tensor([[1.0, 3.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, m = gae_advantages(torch.zeros(1, 3), values, mask, gamma=1.0, lam=1.0)
    assert m["value_mean"].item() == pytest.approx(2.0)  # (1 + 3) / 2: the masked value is not counted
    plan = [[[0, 1]], [[2]]]
    st = packing_stats([3, 5, 4], plan, cost_fn=lambda n: float(n * n))
    assert st["total_cost"] == 9 + 25 + 16


@pytest.mark.parametrize("rewards", [torch.ones(2, 2), torch.ones(4, dtype=torch.long)])
def test_rewards_must_be_a_float_vector(rewards):
    with pytest.raises(ValueError, match="1-D float tensor"):
        grpo_advantages(rewards, torch.zeros(rewards.shape[0], dtype=torch.long))


def test_zero_data_parallel_ranks_is_a_message_not_a_crash():
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        plan_micro_batches([3, 4], max_tokens=10, dp_size=0)
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        padded_fixed_batches([3, 4], micro_batch_size=1, dp_size=0)
