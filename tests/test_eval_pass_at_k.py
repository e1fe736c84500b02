"""Evaluation with n sampled answers per prompt: eval/pass@k, the reward functions' extras, the settings' checks."""
from __future__ import annotations

import itertools

import pytest
import torch

from one_rank import OneRank
from slime.config import load_config
from slime.data.prompts import Prompt
from slime.rollout.engine import Generation
from slime.rollout.rewards import make_reward_fn
from slime.trainer.evaluate import EvalSet, evaluate, pass_at_k_sums, pass_at_ks

BASE = ["model.path=m", "data.path=d.jsonl", "eval.path=e.jsonl"]


def brute_pass_at_k(group: list[bool], k: int) -> float:
    """The share of the k-subsets of a prompt's answers that hold a correct one (what the estimator computes)."""
    subsets = list(itertools.combinations(group, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_pass_at_k_equals_the_count_over_every_subset_of_k_answers(n):
    assert pass_at_ks(n) == {1: [], 2: [1, 2], 3: [1, 2, 3], 4: [1, 2, 4], 5: [1, 2, 4, 5], 8: [1, 2, 4, 8]}[n]
    groups = [[bool(b >> i & 1) for i in range(n)] for b in range(2 ** n)]  # every pattern of n answers
    for k, (total, count) in zip(pass_at_ks(n), pass_at_k_sums(groups, pass_at_ks(n))):
        assert count == len(groups)
        assert total == pytest.approx(sum(brute_pass_at_k(g, k) for g in groups), rel=1e-12)


def test_a_group_of_fewer_answers_than_k_is_left_out_of_that_k():
    """A guard (a generate_fn must return exactly n answers per prompt): pass@4 cannot be computed from 2 answers,
    and an empty group (n - c = 0 < k) must not count as a pass."""
    assert pass_at_k_sums([[]], [1]) == [(0.0, 0)]
    (t1, c1), (t4, c4) = pass_at_k_sums([[True, False], [False, False, True, False]], [1, 4])
    assert (c1, c4) == (2, 1) and t1 == pytest.approx(0.5 + 0.25) and t4 == 1.0


class Tok:
    def decode(self, ids, **_):
        return "".join(map(str, ids))


class ScriptedEngine:
    """Answers prompt i's j-th sample with `answers[i][j]`; records the sampling parameters it was given."""

    def __init__(self, answers):
        self.answers, self.params = answers, []

    def wake(self):
        pass

    def generate(self, prompts, params, mm=None):
        self.params.append(params)
        return [[Generation(list(self.answers[p[0]][j]), [-0.1] * len(self.answers[p[0]][j]), "stop")
                 for j in range(params.n)] for p in prompts]


def with_extra(sample) -> dict:
    """exact_match with an extra number, as a reward function may return."""
    hit = float(sample.response_text == sample.label)
    return {"reward": hit, "digits": float(len(sample.response_text))}


def test_an_evaluation_of_four_answers_per_prompt_logs_pass_at_k_and_the_extras():
    answers = {0: [[5, 6], [5], [5, 6], [1, 2, 3]],  # 2 of 4 correct ("56")
               1: [[9], [9], [9], [9]],  # none
               2: [[5, 6], [5, 6], [5, 6], [5, 6]]}  # all
    prompts = [Prompt(prompt_ids=[i], prompt_text="q", label="56", metadata={}, index=i, source=f"e:{i + 1}")
               for i in range(3)]
    cfg = load_config(None, BASE + ["eval.n_samples_per_prompt=4", "eval.temperature=0.7", "eval.top_p=0.9"])
    engine = ScriptedEngine(answers)
    out = evaluate(engine, EvalSet(prompts, {}), cfg, Tok(), make_reward_fn("test_eval_pass_at_k:with_extra"),
                   OneRank())
    (params,) = engine.params
    assert (params.n, params.temperature, params.top_p) == (4, 0.7, 0.9)
    assert out["eval/accuracy"] == pytest.approx(6 / 12) and out["eval/pass@1"] == pytest.approx(6 / 12)
    assert out["eval/pass@2"] == pytest.approx((1 - 1 / 6 + 0 + 1) / 3)  # 2 of 4: 1 - C(2,2)/C(4,2)
    assert out["eval/pass@4"] == pytest.approx(2 / 3)
    assert out["eval/num_prompts"] == 3 and out["eval/num_samples"] == 12
    assert out["eval/reward/digits"] == pytest.approx((2 + 1 + 2 + 3 + 4 * 1 + 4 * 2) / 12)


def test_a_greedy_evaluation_keeps_its_keys():
    prompts = [Prompt(prompt_ids=[0], prompt_text="q", label="56", metadata={}, index=0, source="e:1")]
    engine = ScriptedEngine({0: [[5, 6]]})
    out = evaluate(engine, EvalSet(prompts, {}), load_config(None, BASE), Tok(), make_reward_fn("exact_match"),
                   OneRank())
    assert engine.params[0].temperature == 0.0 and engine.params[0].n == 1
    assert out["eval/accuracy"] == 1.0 and out["eval/num_prompts"] == 1
    assert not [k for k in out if k.startswith("eval/pass@") or k == "eval/num_samples"]


def test_sampled_answers_of_the_real_engine_are_reproducible_and_pass_at_k_is_monotone(tiny_model):
    """The hf engine samples n answers per prompt from the evaluation's own seeded stream: two evaluations of one
    model agree, and pass@k does not fall with k."""
    from transformers import AutoTokenizer

    from slime.config import ModelConfig
    from slime.rollout.hf_engine import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    engine = HFEngine(ModelConfig(path=str(tiny_model)), tokenizer, device=torch.device("cpu"))
    prompts = [Prompt(prompt_ids=tokenizer(t).input_ids, prompt_text=t, label=None, metadata={}, index=i,
                      source=f"e:{i + 1}") for i, t in enumerate(["12+3=", "7-4=", "45+45="])]
    cfg = load_config(None, BASE + ["eval.n_samples_per_prompt=4", "eval.temperature=1.0",
                                    "rollout.max_response_len=6", "eval.accuracy_threshold=0.1"])
    reward = make_reward_fn("e2e_rewards:digit_fraction")
    first = evaluate(engine, EvalSet(prompts, {}), cfg, tokenizer, reward, OneRank())
    second = evaluate(engine, EvalSet(prompts, {}), cfg, tokenizer, reward, OneRank())
    assert {k: v for k, v in first.items() if k != "time/eval"} == {k: v for k, v in second.items() if k != "time/eval"}
    assert first["eval/num_samples"] == 12
    assert first["eval/pass@1"] <= first["eval/pass@2"] <= first["eval/pass@4"]
    assert first["eval/pass@4"] > first["eval/pass@1"]  # the answers differ: sampled, not n greedy copies
    assert first["eval/pass@1"] == pytest.approx(first["eval/accuracy"])


@pytest.mark.parametrize("overrides, words", [
    (["eval.n_samples_per_prompt=4"], r"eval.n_samples_per_prompt=4 with eval.temperature=0: greedy answers"),
    (["eval.n_samples_per_prompt=0"], r"eval.n_samples_per_prompt=0 must be >= 1"),
    (["eval.temperature=-1"], r"eval.temperature=-1.0 must be >= 0"),
    (["eval.top_p=0.9"], r"eval.top_p=0.9 with eval.temperature=0: greedy decoding takes no nucleus"),
    (["eval.temperature=1", "eval.top_p=0"], r"eval.top_p=0.0 must be in \(0, 1\]"),
])
def test_eval_sampling_settings_that_cannot_work_are_refused(overrides, words):
    with pytest.raises(ValueError, match=words):
        load_config(None, BASE + overrides)


def test_eval_settings_without_an_eval_file_are_said_to_be_ignored():
    cfg = load_config(None, ["model.path=m", "data.path=d.jsonl", "eval.n_samples_per_prompt=4",
                             "eval.temperature=1.0"])
    assert any("eval.n_samples_per_prompt=4, eval.temperature=1.0 ignored: eval.path is not set" in line
               for line in cfg.ignored_settings())
