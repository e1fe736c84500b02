"""Custom rollouts (issue 14): user generate functions with observation tokens, the calculator tool example,
reward servers over HTTP and reward models as checkpoints."""
from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_ranks
from custom_rollouts import OBSERVATION
from slime.config import AlgoConfig
from slime.data.batch import build_micro_batch
from slime.data.prompts import Prompt
from slime.data.sample import Sample
from slime.rollout.engine import Generation, SamplingParams
from slime.rollout.reward_models import RemoteReward, RewardModel, RewardServerError
from slime.rollout.rewards import check_reward_spec, make_reward_fn
from slime.rollout.rollout import generate_rollout
from slime.trainer.advantages import compute_advantages
from slime.trainer.losses import actor_loss
from one_rank import OneRank


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def hf_engine(tiny_model):
    from slime.config import ModelConfig
    from slime.rollout.hf_engine import HFEngine
    from transformers import AutoTokenizer

    return HFEngine(ModelConfig(path=str(tiny_model)), AutoTokenizer.from_pretrained(tiny_model),
                    device=torch.device("cpu"))


def prompts_of(tokenizer, texts, labels=None):
    return [Prompt(prompt_ids=tokenizer(t).input_ids, prompt_text=t, label=(labels or [None] * len(texts))[i],
                   metadata={}, index=i, source=f"prompts.jsonl:{i + 1}") for i, t in enumerate(texts)]


def never_called(sample):
    raise AssertionError("the reward function scored a sample its generate function had graded")


# ----------------------------------------------------------------------------- generate functions


@pytest.mark.parametrize("fn", ["two_turns", "two_turns_async"])
def test_multi_turn_sample_appends_ids_and_its_logprobs_are_the_models(fn, hf_engine, tokenizer, tiny_model):
    """Observation ids are appended as given (no re-tokenising), masked, logprob 0; every generated token's
    rollout logprob is the model's logprob of it given everything before it, observation included."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=3)
    samples = generate_rollout(hf_engine, prompts_of(tokenizer, ["12+3=", "7-4=", "45+45="]), params, tokenizer,
                               make_reward_fn("e2e_rewards:digit_fraction"), first_group_id=0,
                               generate_fn=f"custom_rollouts:{fn}")
    obs = tokenizer(OBSERVATION, add_special_tokens=False).input_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    assert len(samples) == 9 and [s.group_id for s in samples] == [0] * 3 + [1] * 3 + [2] * 3
    for s in samples:
        mask = s.response_mask
        first = mask.index(0)  # the first turn's tokens, then the observation, then the second turn
        assert 1 <= first <= 3 and mask[first:first + len(obs)] == [0] * len(obs)
        assert s.response_ids[first:first + len(obs)] == obs
        assert all(m == 1 for m in mask[first + len(obs):]) and s.metadata["turns"] == 2
        assert torch.all(s.rollout_logprobs[torch.tensor(mask) == 0] == 0)
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float()
        p = len(s.prompt_ids)
        ref = torch.log_softmax(logits[p - 1:-1], -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        gen = torch.tensor(mask) == 1
        torch.testing.assert_close(s.rollout_logprobs[gen], ref[gen], atol=1e-4, rtol=0)
        assert 0 <= s.reward <= 1


def test_generate_fn_reward_and_errors(hf_engine, tokenizer):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=4)
    prompts = prompts_of(tokenizer, ["1+1=", "2+2="])
    graded = generate_rollout(hf_engine, prompts, params, tokenizer, make_reward_fn("test_custom_rollout:never_called"),
                              first_group_id=5, generate_fn="custom_rollouts:graded_by_length")
    assert [s.reward for s in graded] == [float(len(s.response_ids)) for s in graded]
    assert [s.index for s in graded] == list(range(8)) and graded[4].group_id == 6
    with pytest.raises(TypeError, match=r"custom_rollouts:wrong_count must return a list of 4 Sample.*"
                                        r"rollout.n_samples_per_prompt=4\), got a list of 1 \(Sample\) for the prompt "
                                        r"at prompts.jsonl:1"):
        generate_rollout(hf_engine, prompts, params, tokenizer, make_reward_fn("exact_match"), first_group_id=0,
                         generate_fn="custom_rollouts:wrong_count")
    evaluating = dataclasses.replace(params, trains=False)  # an evaluation asks for eval.n_samples_per_prompt
    with pytest.raises(TypeError, match=r"eval.n_samples_per_prompt=4\), got a list of 1"):
        generate_rollout(hf_engine, prompts, evaluating, tokenizer, make_reward_fn("exact_match"), first_group_id=0,
                         generate_fn="custom_rollouts:wrong_count")
    with pytest.raises(TypeError, match=r"got a list of 4 \(dict\) for the prompt at prompts.jsonl:1"):
        generate_rollout(hf_engine, prompts, params, tokenizer, make_reward_fn("exact_match"), first_group_id=0,
                         generate_fn="custom_rollouts:dicts")
    with pytest.raises(TypeError, match=r"got a coroutine \(an object whose __call__ is async is not recognised: "
                                        r"use an async def function\)"):
        generate_rollout(hf_engine, prompts, params, tokenizer, make_reward_fn("exact_match"), first_group_id=0,
                         generate_fn="custom_rollouts:async_object")
    with pytest.raises(ValueError, match=r"rollout.generate_fn='custom_rollouts:nope'.*nope"):
        generate_rollout(hf_engine, prompts, params, tokenizer, make_reward_fn("exact_match"), first_group_id=0,
                         generate_fn="custom_rollouts:nope")
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        generate_rollout(hf_engine, prompts, params, tokenizer, make_reward_fn("exact_match"), first_group_id=0,
                         generate_fn="custom_rollouts")


def test_a_given_reward_must_be_finite(hf_engine, tokenizer):
    with pytest.raises(ValueError, match=r"Trajectory.sample\(reward=inf\) for the prompt at prompts.jsonl:1: the "
                                         r"reward must be a finite number"):
        generate_rollout(hf_engine, prompts_of(tokenizer, ["1+1="]), SamplingParams(max_new_tokens=4, n=2), tokenizer,
                         make_reward_fn("exact_match"), first_group_id=0, generate_fn="custom_rollouts:infinite_reward")



def test_a_given_reward_key_in_the_data_does_not_stand_in_for_the_reward(hf_engine, tokenizer):
    """The generate function's own grade was a metadata key, and a data row's metadata is copied into its samples:
    a row with {"given_reward": 0.5} skipped the reward function, without or with a generate function."""
    prompts = prompts_of(tokenizer, ["1+1="], labels=["never"])
    prompts[0].metadata["given_reward"] = 0.5
    for generate_fn in (None, "custom_rollouts:two_turns"):
        samples = generate_rollout(hf_engine, prompts, SamplingParams(max_new_tokens=4, n=2), tokenizer,
                                   make_reward_fn("exact_match"), first_group_id=0, generate_fn=generate_fn)
        assert [s.reward for s in samples] == [0.0, 0.0], generate_fn  # exact_match of "never": scored, 0


@pytest.mark.parametrize("reward", ["0.75", float("nan"), "n/a", torch.tensor([1.0])])
def test_the_reward_a_trajectory_is_given_must_be_a_finite_number(tokenizer, reward):
    from slime.rollout.custom import RolloutContext

    ctx = RolloutContext(prompts_of(tokenizer, ["1+1="])[0], SamplingParams(max_new_tokens=4, n=1), tokenizer, None)
    with pytest.raises((TypeError, ValueError), match=r"Trajectory.sample\(reward=.*\) for the prompt at "
                                                     r"prompts.jsonl:1: the reward must be a finite number"):
        ctx.trajectory().sample(reward=reward)


def test_a_trajectory_takes_the_rewards_a_reward_function_may_return(tokenizer):
    """A bool (a verifier's verdict) and numpy or torch scalars, as a reward function's return value is taken."""
    import numpy as np
    from slime.rollout.custom import RolloutContext

    ctx = RolloutContext(prompts_of(tokenizer, ["1+1="])[0], SamplingParams(max_new_tokens=4, n=1), tokenizer, None)
    given = [ctx.trajectory().sample(reward=r).given_reward for r in (True, False, np.float32(0.5), torch.tensor(2))]
    assert given == [1.0, 0.0, 0.5, 2.0] and all(type(g) is float for g in given)


def test_a_turn_at_another_temperature_than_the_trainers_is_refused(tokenizer):
    """Its logprobs were the engine's at the turn's temperature, the trainer's at rollout.temperature: TIS
    weights 0.5-1.05 on a tiny model for identical weights. Evaluation (temperature 0, nothing trained) may."""
    from slime.rollout.custom import RolloutContext

    class Engine:
        def generate(self, prompts, params, mm=None):
            return [[Generation([7, 8], [-0.5, -0.5], "length")]]

    prompt = prompts_of(tokenizer, ["1+1="])[0]
    train = RolloutContext(prompt, SamplingParams(max_new_tokens=4, temperature=1.0, n=1), tokenizer, Engine())
    with pytest.raises(ValueError, match=r"Trajectory.generate\(temperature=0.3\) for the prompt at prompts.jsonl:1: "
                                         r"the trainer scores .* at rollout.temperature=1.0"):
        train.trajectory().generate(temperature=0.3)
    assert train.trajectory().generate(temperature=1.0).response_ids == [7, 8]
    assert train.generate(prompt.prompt_ids, max_new_tokens=2, temperature=0.3).response_ids == [7, 8]
    evaluation = RolloutContext(prompt, SamplingParams(max_new_tokens=4, temperature=0.0, n=1), tokenizer, Engine())
    assert evaluation.trajectory().generate(temperature=0.7).response_ids == [7, 8]
    sampled = RolloutContext(prompt, SamplingParams(max_new_tokens=4, temperature=1.0, n=4, trains=False), tokenizer,
                             Engine())  # eval.temperature > 0 (pass@k): nothing is trained either
    assert sampled.trajectory().generate(temperature=0.7).response_ids == [7, 8]


def test_observed_ids_may_be_numpy_integers_but_not_text(tokenizer):
    """A tool's ids from numpy (np.int64) were taken by observe() and then refused by the sample check as "not
    non-negative integers"; text given to observe() went in character by character."""
    import numpy as np

    from slime.rollout.custom import RolloutContext

    ctx = RolloutContext(prompts_of(tokenizer, ["1+1="])[0], SamplingParams(max_new_tokens=8, n=1), tokenizer, None)
    traj = ctx.trajectory()
    traj.observe(np.array([5, 6]))
    assert traj.response_ids == [5, 6] and all(type(t) is int for t in traj.response_ids)
    with pytest.raises(TypeError, match=r"observe\(\) for the prompt at prompts.jsonl:1 takes token ids.*tokenize "
                                        r"text"):
        traj.observe("19")


@pytest.mark.parametrize("timeout", [0, 30])
def test_a_generate_functions_own_error_keeps_its_type_and_names_the_prompt(tokenizer, timeout):
    """It came out bare (KeyError 'missing'), naming neither the function nor the prompt row; reward functions'
    errors name both."""
    import sys

    from slime.rollout.custom import run_generate_fn
    from custom_rollouts import tool_raises

    with pytest.raises(KeyError) as e:
        run_generate_fn(tool_raises, "custom_rollouts:tool_raises", None, prompts_of(tokenizer, ["1+1="]),
                        SamplingParams(max_new_tokens=4, n=1), tokenizer, timeout=timeout)
    if sys.version_info >= (3, 11):  # exception notes
        assert "raised by rollout.generate_fn custom_rollouts:tool_raises for the prompt at prompts.jsonl:1 " \
               "('1+1=')" in e.value.__notes__


def test_a_group_reward_is_not_given_part_of_a_group(hf_engine, tokenizer):
    """A generate function grading some samples of a group: a group-level reward function was called with the
    rest only (3 of 4), and ranked the wrong set."""
    from slime.rollout.rewards import RewardFn

    reward_fn = RewardFn("reward_fns_for_test:async_group_size", granularity="group")
    with pytest.raises(ValueError, match=r"custom_rollouts:grades_the_first_sample graded some samples of the prompt "
                                         r"at prompts.jsonl:1 but not all.*scores whole groups"):
        generate_rollout(hf_engine, prompts_of(tokenizer, ["1+1="]), SamplingParams(max_new_tokens=4, n=4), tokenizer,
                         reward_fn, first_group_id=0, generate_fn="custom_rollouts:grades_the_first_sample")
    # whole groups graded, whole groups not: the group function gets the ungraded groups, whole
    samples = generate_rollout(hf_engine, prompts_of(tokenizer, ["1+1=", "2+2="]),
                               SamplingParams(max_new_tokens=4, n=4), tokenizer, reward_fn, first_group_id=0,
                               generate_fn="custom_rollouts:grades_the_first_prompt")
    assert [s.reward for s in samples] == [0.5] * 4 + [4.0] * 4


@pytest.mark.parametrize("fn, error, words", [
    ("one_sample_repeated", ValueError, "returned one Sample object twice (the prompt at prompts.jsonl:1)"),
    ("mask_of_fives", ValueError, "has response mask values [5]"),
    ("text_reward", TypeError, "set given_reward='n/a' for a sample of the prompt at prompts.jsonl:1"),
    ("float_ids", ValueError, "has token ids that are not non-negative integers"),
    ("past_the_limit", ValueError, "has 10 response tokens, more than rollout.max_response_len=4"),
    ("nan_logprobs", ValueError, "has rollout logprobs [nan, nan]"),
    ("positive_logprobs", ValueError, "is finite and <= 0"),
    ("sets_reward_directly", ValueError, "set Sample.reward=1.0 for a sample of the prompt at prompts.jsonl:1 "
                                         "('1+1='), which the reward function's score would replace: give a sample's "
                                         "reward with trajectory.sample(reward=...)"),
    # these passed the checks: trained in another context than the engine's, or failed deep in the trainer
    ("other_prompt", ValueError, "has prompt_ids that are not the prompt's (7 ids, the prompt has 4)"),
    ("no_prompt", ValueError, "has prompt_ids that are not the prompt's (0 ids"),
    ("logprobs_2d", ValueError, "has 2 response tokens but 2 mask entries and logprobs of shape (2, 1)"),
    ("no_logprobs", ValueError, "has no rollout_logprobs: the trainer needs the engine's logprob"),
])
def test_malformed_samples_of_a_generate_function_name_it(hf_engine, tokenizer, fn, error, words):
    with pytest.raises(error) as e:
        generate_rollout(hf_engine, prompts_of(tokenizer, ["1+1="]), SamplingParams(max_new_tokens=4, n=2), tokenizer,
                         make_reward_fn("exact_match"), first_group_id=0, generate_fn=f"custom_rollouts:{fn}")
    assert f"custom_rollouts:{fn}" in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("fn", ["hangs", "hangs_async"])
def test_a_generate_function_that_hangs_ends_with_its_name_and_prompt_row(hf_engine, tokenizer, fn):
    with pytest.raises(TimeoutError, match=rf"rollout.generate_fn custom_rollouts:{fn} did not return within "
                                           r"rollout.generate_fn_timeout=0.5s for the prompt at prompts.jsonl:1"):
        generate_rollout(hf_engine, prompts_of(tokenizer, ["1+1="]), SamplingParams(max_new_tokens=4, n=2), tokenizer,
                         make_reward_fn("exact_match"), first_group_id=0, generate_fn=f"custom_rollouts:{fn}",
                         generate_fn_timeout=0.5)


def test_the_timeout_of_a_prompt_does_not_count_its_wait_for_a_busy_engine(tokenizer):
    """An async generate_fn starts every prompt at once on an engine that serves one call at a time: 12 prompts of
    one 0.4 s call each finish 4.8 s after they start, past a 1.2 s timeout, yet no prompt took 0.4 s of its own
    (0.8 s of slack for each). agenerate's requests each have a thread: with asyncio's pool (cpu + 4 threads) the
    later prompts also waited for a thread, a wait the engine's queue clock does not see (row 8 timed out)."""
    import time

    from slime.rollout.custom import run_generate_fn
    from custom_rollouts import one_turn_async

    class SlowEngine:  # one call at a time (no thread_safe), 0.4 s each
        def generate(self, prompts, params, mm=None):
            time.sleep(0.4)
            return [[Generation([7, 8], [-0.5, -0.5], "length")]]

    prompts = prompts_of(tokenizer, [f"{i}+1=" for i in range(12)])
    groups = run_generate_fn(one_turn_async, "custom_rollouts:one_turn_async", SlowEngine(), prompts,
                             SamplingParams(max_new_tokens=4, n=1), tokenizer, timeout=1.2)
    assert [len(g) for g in groups] == [1] * 12


def test_an_async_generate_fn_has_every_request_in_flight_at_once(tokenizer):
    """On an engine that takes concurrent requests (SGLang), the documented "every prompt concurrently": the
    engine lets no request return before all 40 are in (a barrier), which asyncio's pool of cpu + 4 threads
    never reached."""
    import threading

    from slime.rollout.custom import run_generate_fn
    from custom_rollouts import one_turn_async

    all_in = threading.Barrier(40, timeout=30)

    class ConcurrentEngine:
        thread_safe = True

        def generate(self, prompts, params, mm=None):
            all_in.wait()
            return [[Generation([7, 8], [-0.5, -0.5], "length")]]

    prompts = prompts_of(tokenizer, [f"{i}+1=" for i in range(40)])
    groups = run_generate_fn(one_turn_async, "custom_rollouts:one_turn_async", ConcurrentEngine(), prompts,
                             SamplingParams(max_new_tokens=4, n=1), tokenizer, timeout=60)
    assert [len(g) for g in groups] == [1] * 40


BLOCKS_THE_LOOP = """
import sys
from slime.data.sample import Sample
from slime.rollout.engine import Generation, SamplingParams
from slime.rollout.custom import run_generate_fn
from slime.rollout.rewards import check_reward_spec, make_reward_fn
import custom_rollouts
from test_custom_rollout import prompts_of
from transformers import AutoTokenizer


class Engine:
    def generate(self, prompts, params, mm=None):
        return [[Generation([7, 8], [-0.5, -0.5], "length")]]


if sys.argv[1] == "generate_fn":
    run_generate_fn(custom_rollouts.blocks_the_loop, "custom_rollouts:blocks_the_loop", Engine(),
                    prompts_of(AutoTokenizer.from_pretrained(sys.argv[2]), ["1+1="]),
                    SamplingParams(max_new_tokens=4, n=1), None, timeout=1)
else:
    make_reward_fn("reward_fns_for_test:blocks_the_loop", timeout=1).score([Sample(prompt_ids=[1], prompt_text="q",
                                                                                   index=3)])
print("returned")
"""


@pytest.mark.parametrize("where", ["generate_fn", "reward"])
def test_an_async_function_that_blocks_the_event_loop_ends_the_process_naming_it(tiny_model, where):
    """A blocking call made directly in async code (time.sleep here; requests.get, subprocess.run, a trajectory's
    generate() in practice) holds the event loop, so the asyncio timeout never fired: one rank hung for ever (the
    others until their collective timed out, saying only that a rank stopped answering). A watchdog ends the
    process past the limit, naming the function, the sample or prompt row, the fix and where it is blocked."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", BLOCKS_THE_LOOP, where, str(tiny_model)], capture_output=True,
                          text=True, env=env, cwd=tests, timeout=120)
    assert done.returncode == 1 and "returned" not in done.stdout, done.stderr[-3000:]
    what = ("rollout.generate_fn custom_rollouts:blocks_the_loop for the prompt at prompts.jsonl:1"
            if where == "generate_fn" else
            "reward function reward_fns_for_test:blocks_the_loop for sample index=3 (prompt 'q')")
    assert f"{what} ran" in done.stderr and "past its limit of 1 s, in synchronous code that holds the event loop" \
        in done.stderr and "must await its I/O" in done.stderr
    assert done.stderr.rstrip().endswith("time.sleep(600)"), done.stderr[-2000:]  # where: the user's own line, last


def test_a_reward_functions_own_timeout_error_is_its_error_not_the_timeout():
    """Python 3.11's asyncio.TimeoutError is TimeoutError: a grader call's own timeout read as the trainer's
    ("did not return within rollout.reward.timeout ... raise the timeout"), at once, its traceback dropped."""
    from slime.data.sample import Sample

    with pytest.raises(RuntimeError, match=r"reward_fns_for_test:raises_its_own_timeout raised TimeoutError: the "
                                           r"grader did not answer for sample index=3") as e:
        make_reward_fn("reward_fns_for_test:raises_its_own_timeout", timeout=60).score(
            [Sample(prompt_ids=[1], prompt_text="q", index=3)])
    assert isinstance(e.value.__cause__, TimeoutError)


@pytest.mark.parametrize("where", ["generate_fn", "reward"])
def test_a_tool_that_never_answers_in_a_thread_of_async_code_ends_in_the_timeout(tokenizer, where):
    """asyncio.to_thread(blocking_tool) in an async generate function or reward: at the timeout the coroutine was
    cancelled, but asyncio.run then waited for its thread pool, i.e. for the tool, for ever; the run hung instead
    of stopping with the timeout's error."""
    import threading

    from slime.data.sample import Sample
    from slime.rollout.custom import run_generate_fn
    from custom_rollouts import tool_never_answers

    class Engine:
        def generate(self, prompts, params, mm=None):
            return [[Generation([7, 8], [-0.5, -0.5], "length")]]

    def call():
        if where == "generate_fn":
            run_generate_fn(tool_never_answers, "custom_rollouts:tool_never_answers", Engine(),
                            prompts_of(tokenizer, ["1+1="]), SamplingParams(max_new_tokens=4, n=1), tokenizer,
                            timeout=0.5)
        else:
            make_reward_fn("reward_fns_for_test:tool_never_answers", timeout=0.5).score(
                [Sample(prompt_ids=[1], prompt_text="q", index=3)])

    raised = []
    worker = threading.Thread(target=lambda: raised.append(pytest.raises(TimeoutError, call)), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "still waiting for the tool's thread after the timeout"
    assert "did not return within" in str(raised[0].value)


def test_dynamic_sampling_that_keeps_no_group_says_why(hf_engine, tokenizer):
    """Every group all wrong (a label no response matches): nothing to train on, said with the keys to change."""
    from slime.config import RolloutConfig
    from slime.rollout.rollout import collect_rollout

    class Prompts:
        turn_end = ()  # the stop ids PromptSource adds for a chat template's end of turn

        def next_batch(self, n=None):
            return prompts_of(tokenizer, ["1+1=", "2+2="], labels=["never", "never"])

    cfg = RolloutConfig(batch_size=2, n_samples_per_prompt=2, max_response_len=3, dynamic_sampling=True,
                        max_sampling_attempts=2)
    with pytest.raises(RuntimeError, match=r"kept no group in 2 attempts.*rollout.dynamic_sampling=false"):
        collect_rollout(hf_engine, Prompts(), cfg, tokenizer, make_reward_fn("exact_match"), OneRank(), step=0)


def test_kept_groups_count_the_groups_drawn_not_the_batch_size(hf_engine, tokenizer):
    """A prompt skipped when drawn (a broken image, say) leaves fewer groups than rollout.batch_size: the metric
    counts those the step trains on."""
    from slime.config import RolloutConfig
    from slime.rollout.rollout import collect_rollout

    class Prompts:  # one of the batch's 3 prompts was skipped when drawn
        turn_end = ()  # the stop ids PromptSource adds for a chat template's end of turn

        def next_batch(self, n=None):
            return prompts_of(tokenizer, ["1+1=", "2+2="], labels=["2", "4"])

    cfg = RolloutConfig(batch_size=3, n_samples_per_prompt=2, max_response_len=3)
    samples, metrics = collect_rollout(hf_engine, Prompts(), cfg, tokenizer, make_reward_fn("exact_match"),
                                       OneRank(), step=0)
    assert len(samples) == 4 and metrics["rollout/kept_groups"] == 2 and metrics["rollout/kept_samples"] == 4


def test_dynamic_sampling_and_the_overlong_penalty_report_what_they_drew_cut_and_cost(tokenizer):
    """With the overlong penalty on, no metric showed the task's own reward (reward_mean has the penalty in it), and
    dynamic sampling reported neither what it drew nor why groups were left out, while reward_mean was over every
    group drawn, not the batch that trains. 4 prompts drawn for a batch of 1: prompts 0 and 2 have signal (rewards
    1 and 0, the 0 at 4 tokens, penalised -1), 1 and 3 none."""
    from slime.config import OverlongPenaltyConfig, RolloutConfig
    from slime.rollout.rollout import collect_rollout

    class Prompts:
        turn_end = ()

        def next_batch(self, n=None):
            return prompts_of(tokenizer, [f"{i}+1=" for i in range(n)])

    class Engine:
        weight_version = 0

        def wake(self):
            pass

        def sleep(self):
            pass

        def generate(self, prompts, params, mm=None):
            mixed = [Generation([1, 9], [-0.1] * 2, "stop"), Generation([0, 9, 9, 9], [-0.1] * 4, "length")]
            none = [Generation([0, 9], [-0.1] * 2, "stop")] * 2
            return [[*(mixed if i % 2 == 0 else none)] for i in range(len(prompts))]

    cfg = RolloutConfig(batch_size=1, n_samples_per_prompt=2, max_response_len=4, dynamic_sampling=True,
                        over_sample_factor=4.0, overlong_penalty=OverlongPenaltyConfig(max_len=4, buffer_len=2))
    kept, metrics = collect_rollout(Engine(), Prompts(), cfg, tokenizer,
                                    make_reward_fn("reward_fns_for_test:first_token_is_one"), OneRank(), step=0)
    assert [s.reward for s in kept] == [1.0, -1.0]
    assert {k: metrics[k] for k in ("rollout/reward_mean", "rollout/task_reward_mean",
                                    "rollout/overlong_penalized_frac", "rollout/drawn_groups",
                                    "rollout/no_signal_groups", "rollout/surplus_groups", "rollout/kept_groups",
                                    "rollout/kept_reward_mean")} == {
        "rollout/reward_mean": 0.0, "rollout/task_reward_mean": 0.25, "rollout/overlong_penalized_frac": 0.25,
        "rollout/drawn_groups": 4, "rollout/no_signal_groups": 2, "rollout/surplus_groups": 1,
        "rollout/kept_groups": 1, "rollout/kept_reward_mean": 0.0}


def test_dynamic_sampling_filters_on_the_task_reward_not_the_overlong_penalty():
    """DAPO drops prompts of accuracy 0 or 1: a group of wrong answers where one ran into the overlong buffer has
    unequal shaped rewards but nothing to learn about the task, so it is dropped; the penalty stays in the reward."""
    from slime.config import OverlongPenaltyConfig
    from slime.rollout.rollout import groups_with_signal, shape_overlong

    def group(gid, rewards, lengths):
        return [Sample(prompt_ids=[1], response_ids=[5] * n, reward=r, group_id=gid) for r, n in zip(rewards, lengths)]

    all_wrong = group(0, [0.0] * 4, [3, 3, 3, 9])  # the last one in the buffer zone
    mixed = group(1, [0.0, 1.0, 0.0, 1.0], [3, 3, 9, 3])
    all_right_long = group(2, [1.0] * 4, [12, 12, 12, 12])  # all beyond max_len: equal shaped rewards anyway
    samples = all_wrong + mixed + all_right_long
    shape_overlong(samples, OverlongPenaltyConfig(max_len=10, buffer_len=4, factor=1.0))
    assert [s.reward for s in all_wrong] == [0.0, 0.0, 0.0, -0.75]
    assert [s.task_reward for s in mixed] == [0.0, 1.0, 0.0, 1.0]
    assert groups_with_signal(samples) == [mixed]


def test_a_batch_generated_ahead_is_discarded_at_a_stop_without_raising_over_it(hf_engine, tokenizer, caplog):
    """A stop (or an error) while step k+1's batch is in flight: the batch is aborted and discarded, an error it
    ends with is logged, not raised in place of the stop's own exit."""
    import logging

    from slime.config import RolloutConfig
    from slime.rollout.rollout import RolloutAhead

    class Prompts:
        turn_end = ()  # the stop ids PromptSource adds for a chat template's end of turn

        def next_batch(self, n=None):
            return prompts_of(tokenizer, ["1+1="], labels=["2"])

        def state_dict(self):
            return {}

    def failing(samples):
        raise RuntimeError("reward server gone")

    ahead = RolloutAhead(hf_engine, Prompts(), RolloutConfig(batch_size=1, n_samples_per_prompt=2, max_response_len=4),
                         tokenizer, make_reward_fn({"reward_fns_for_test:length_reward": 1.0}), OneRank())
    ahead.reward_fn.score = failing
    ahead.start(0)
    with caplog.at_level(logging.WARNING):
        ahead.close()
    assert "the discarded batch generated ahead failed: RuntimeError: reward server gone" in caplog.text
    assert not ahead.in_flight


def test_a_batch_ahead_counts_only_its_own_skips(hf_engine, tokenizer):
    """data/skipped_* of step k counted the prompts skipped while step k+1's batch was drawn in the background.
    The skips as of batch k's draw are kept with it."""
    import collections

    from slime.config import RolloutConfig
    from slime.rollout.rollout import RolloutAhead

    class Prompts:
        turn_end = ()
        skipped_when_drawn = collections.Counter()

        def next_batch(self, n=None):
            self.skipped_when_drawn["corrupt_image"] += 1  # one prompt of each batch broke since load
            return prompts_of(tokenizer, ["1+1="], labels=["2"])

        def state_dict(self):
            return {}

    data = Prompts()
    ahead = RolloutAhead(hf_engine, data, RolloutConfig(batch_size=1, n_samples_per_prompt=2, max_response_len=4),
                         tokenizer, make_reward_fn("exact_match"), OneRank())
    ahead.start(0)
    ahead.take(trainer_version=0)
    ahead.start(1)  # drawn while step 0 trains
    assert ahead.skipped_when_drawn == {"corrupt_image": 1}
    ahead.take(trainer_version=1)
    assert ahead.skipped_when_drawn == {"corrupt_image": 2} == data.skipped_when_drawn


def test_a_batch_ahead_saved_for_a_checkpoint_is_taken_as_it_was(hf_engine, tokenizer, caplog):
    """finish() waits for the batch in flight and serializes it for a checkpoint, leaving it in flight; a run resumed
    from that checkpoint gets it back with restore() and takes the same samples and metrics. A batch that does not
    pickle (a generate function's metadata holding a lock) is not saved, said, and still taken."""
    import collections
    import logging

    from slime.config import RolloutConfig
    from slime.rollout.rollout import RolloutAhead

    class Prompts:
        turn_end = ()
        skipped_when_drawn = collections.Counter()

        def next_batch(self, n=None):
            return prompts_of(tokenizer, ["1+1=", "2+2="], labels=["2", "4"])

        def state_dict(self):
            return {}

    cfg = RolloutConfig(batch_size=2, n_samples_per_prompt=2, max_response_len=4)
    ahead = RolloutAhead(hf_engine, Prompts(), cfg, tokenizer, make_reward_fn("exact_match"), OneRank(), seed=3)
    ahead.start(1)
    blob = ahead.finish()
    assert ahead.in_flight and blob is not None
    samples, metrics = ahead.take(trainer_version=2)
    resumed = RolloutAhead(hf_engine, Prompts(), cfg, tokenizer, make_reward_fn("exact_match"), OneRank(), seed=3)
    resumed.restore(RolloutAhead.load(blob))
    again, again_metrics = resumed.take(trainer_version=2)
    assert [(s.response_ids, s.reward, s.metadata) for s in again] == \
        [(s.response_ids, s.reward, s.metadata) for s in samples]
    assert all(torch.equal(a.rollout_logprobs, b.rollout_logprobs) for a, b in zip(again, samples))
    assert again_metrics == metrics  # policy_lag included: the weight version each sample was generated by

    ahead.start(2)
    ahead._future.result()[0][0].metadata["client"] = threading.Lock()
    with caplog.at_level(logging.WARNING):
        assert ahead.finish() is None
    assert "the batch generated ahead cannot be saved with the checkpoint (TypeError" in caplog.text
    assert len(ahead.take(trainer_version=3)[0]) == 4


def test_a_stop_does_not_wait_for_a_batch_ahead_still_generating(monkeypatch):
    """A stop's checkpoint takes the batch in flight only where it has finished (finish(wait=False)): a launcher
    kills the ranks 30 s after its SIGTERM, and a checkpoint waiting on a long generation would be lost."""
    import slime.rollout.rollout as rollout_mod
    from slime.rollout.rollout import RolloutAhead

    release = threading.Event()
    monkeypatch.setattr(rollout_mod, "_draw_and_generate", lambda *a, **k: [] if release.wait(30) else None)
    ahead = RolloutAhead(None, types.SimpleNamespace(state_dict=dict), None, None, None, OneRank())
    ahead.start(0)
    assert ahead.finish(wait=False) is None and ahead.in_flight  # still generating: not waited for
    release.set()
    assert RolloutAhead.load(ahead.finish())["samples"] == [] and ahead.in_flight  # a checkpoint between steps waits
    assert ahead.waited_s > 0  # counted as the next step's wait for its batch (time/rollout), which take() skips


def test_a_batch_ahead_that_timed_out_is_said_at_a_stop_not_waited_for(monkeypatch, caplog):
    """A generate function's or a reward's TimeoutError is concurrent.futures.TimeoutError (Python 3.11): close()
    took it for its own wait running out, spun 60 s aborting (686,000 calls in 5 s) and said the batch did not
    finish, never what timed out."""
    import concurrent.futures
    import logging

    import slime.rollout.rollout as rollout_mod
    from slime.rollout.rollout import RolloutAhead

    def timed_out(*a, **k):
        raise TimeoutError("reward function grader:score timed out after 10 s")

    class Engine:
        aborts = 0

        def abort(self):
            Engine.aborts += 1

    monkeypatch.setattr(rollout_mod, "_draw_and_generate", timed_out)
    ahead = RolloutAhead(Engine(), types.SimpleNamespace(state_dict=dict), None, None, None, OneRank())
    ahead.start(0)
    concurrent.futures.wait([ahead._future])
    with caplog.at_level(logging.WARNING):
        ahead.close()
    assert "the discarded batch generated ahead failed: TimeoutError: reward function grader:score timed out" \
        in caplog.text and "did not finish" not in caplog.text
    assert Engine.aborts == 1


def test_a_saved_batch_ahead_serves_a_resume_that_changed_only_how_rewards_are_fetched():
    """batch_settings compared the reward section whole: raising rollout.reward.timeout after a run died of it
    threw the saved batch away. Settings that shape the samples still count, each by its dotted name: the
    rollout's, and (they were left out at first) the prompt data's, the image sizes and the sampling seed."""
    from slime.config import load_config
    from slime.rollout.rollout import batch_settings

    def settings(*overrides):
        return batch_settings(load_config(None, ["model.path=m", "data.path=d.jsonl", *overrides]))

    base = settings()
    assert settings("rollout.reward.timeout=120", "rollout.reward.max_retries=9",
                    "rollout.reward.max_concurrency=4", "data.image_fetch_timeout=60") == base
    other = settings('rollout.reward.fn={"math": 1.0, "format": 0.1}')
    assert other != base and other["rollout.reward.fn"] == {"math": 1.0, "format": 0.1}
    for key, value in [("rollout.temperature", 0.9), ("data.path", "other.jsonl"), ("data.system_prompt", "Be brief."),
                       ("train.seed", 7), ("model.max_pixels", 200_704)]:
        now = settings(f"{key}={value}")
        assert now[key] == value and now != base
    assert "rollout.overlong_penalty.max_len" in base and not any(k.startswith("rollout.sglang") for k in base)


def test_a_stop_aborts_a_batch_ahead_whose_generate_call_starts_after_the_first_abort(monkeypatch):
    """close() came while the thread was still drawing prompts: its one abort found no generate() call running,
    the call that started after it generated its whole batch, and close() waited for it (up to 60 s, past a
    launcher's SIGKILL). close() aborts again until the batch ends."""
    import slime.rollout.rollout as rollout_mod
    from slime.rollout.rollout import RolloutAhead

    class Engine:
        def __init__(self):
            self.running, self.first_abort = [], threading.Event()

        def abort(self):
            for call in self.running:
                call["aborted"] = True
            self.first_abort.set()

        def generate(self):
            assert self.first_abort.wait(30)  # still drawing prompts when the stop's first abort came
            call = {"aborted": False}
            self.running.append(call)
            deadline = time.monotonic() + 20  # a whole batch
            while not call["aborted"] and time.monotonic() < deadline:
                time.sleep(0.01)
            return "abort" if call["aborted"] else "length"

    engine, outcome = Engine(), []
    monkeypatch.setattr(rollout_mod, "_draw_and_generate", lambda engine, *a, **k: outcome.append(engine.generate()))
    ahead = RolloutAhead(engine, types.SimpleNamespace(state_dict=dict), None, None, None, OneRank())
    ahead.start(0)
    ahead.close()
    assert outcome == ["abort"] and not ahead.in_flight

def _multi_turn_sample(mask: list[int], seed: int) -> Sample:
    g = torch.Generator().manual_seed(seed)
    r = len(mask)
    s = Sample(prompt_ids=[3, 4, 5], response_ids=list(range(10, 10 + r)), response_mask=list(mask), reward=1.0)
    s.old_logprobs = -torch.rand(r, generator=g)
    s.ref_logprobs = -torch.rand(r, generator=g)
    s.rollout_logprobs = -torch.rand(r, generator=g)
    s.advantages = torch.randn(r, generator=g)
    return s


def test_observation_tokens_carry_no_policy_loss_kl_or_entropy():
    """Changing everything at the mask-0 positions (logprobs, old/ref/rollout logprobs, advantages, entropy)
    leaves the loss and every gradient unchanged, and the gradient there is exactly 0."""
    algo = AlgoConfig(entropy_coef=0.01, use_kl_loss=True, kl_coef=0.1)
    algo.tis.mode = "truncate"
    mask = [1, 1, 0, 0, 0, 1, 1]
    hole = torch.tensor(mask) == 0
    results = []
    for garbage in (0.0, 1.0):
        s = _multi_turn_sample(mask, seed=0)
        for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs", "advantages"):
            getattr(s, name)[hole] += 7.0 * garbage
        mb = build_micro_batch([s], [0])
        logp = (-torch.rand(7, generator=torch.Generator().manual_seed(1)) - 3.0 * garbage * hole).requires_grad_()
        entropy = (torch.rand(7, generator=torch.Generator().manual_seed(2)) + 5.0 * garbage * hole).requires_grad_()
        loss, sums = actor_loss(algo, mb, logp, entropy, num_tokens=4, num_seqs=1)
        loss.backward()
        assert torch.all(logp.grad[hole] == 0) and torch.all(entropy.grad[hole] == 0)
        results.append((loss.detach(), logp.grad[~hole], entropy.grad[~hole], sums["kl_ref"], sums["entropy"]))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    assert results[0][3] != 0 and results[0][0] != 0


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_pp", "gae"])
def test_advantages_are_zero_on_observations(estimator):
    """docs/algorithms.md: mask zeros are not actions. REINFORCE++ returns and GAE skip them: a hole changes
    no advantage of the generated tokens (compared with the same sample without the observation)."""
    dims = OneRank()
    with_hole = [_multi_turn_sample([1, 1, 0, 0, 1], seed=k) for k in range(2)]
    without = [_multi_turn_sample([1, 1, 1], seed=k) for k in range(2)]
    for k, (s, t, r) in enumerate(zip(with_hole, without, (1.0, 0.0))):
        s.reward, t.reward, s.index, t.index = r, r, k, k
        s.group_id = t.group_id = 0
        s.values = torch.tensor([0.1, 0.2, 9.0, 9.0, 0.3])
        t.values = torch.tensor([0.1, 0.2, 0.3])
    cfg = AlgoConfig(advantage_estimator=estimator, gamma=0.9, lam=0.8)
    compute_advantages(with_hole, cfg, dims)
    compute_advantages(without, cfg, dims)
    for s, t in zip(with_hole, without):
        assert torch.all(s.advantages[2:4] == 0)
        torch.testing.assert_close(s.advantages[[0, 1, 4]], t.advantages, atol=1e-6, rtol=1e-5)
        if estimator == "gae":
            torch.testing.assert_close(s.returns[[0, 1, 4]], t.returns, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- the calculator example


class ScriptedEngine:
    """Answers each call with the next scripted text (a fixed policy), so the tool's control flow is exact."""

    thread_safe = False

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.contexts = tokenizer, list(replies), []

    def generate(self, prompts, params, mm=None):
        self.contexts.append(list(prompts[0]))
        ids = self.tokenizer(self.replies.pop(0), add_special_tokens=False).input_ids[:params.max_new_tokens]
        stop = next((i for i, t in enumerate(ids) if t in params.stop_token_ids), None)
        ids = ids if stop is None else ids[:stop + 1]
        reason = "stop" if stop is not None else "length"
        return [[Generation(ids, [-0.5] * len(ids), reason)]]


def test_a_trajectory_ends_at_its_length_limit_when_an_observation_is_cut_and_a_zero_budget_generates_nothing(
        tokenizer):
    """An observation cut at rollout.max_response_len ends the sample as 'length' (rollout/truncated_frac counts
    it); generate(max_new_tokens=0) is a budget of 0, not "no limit"."""
    from slime.rollout.custom import RolloutContext, Trajectory

    engine = ScriptedEngine(tokenizer, ["12", "34"])
    prompt = prompts_of(tokenizer, ["1+1="])[0]
    traj = Trajectory(RolloutContext(prompt, SamplingParams(max_new_tokens=4, n=1), tokenizer, engine))
    assert traj.generate(max_new_tokens=0).response_ids == [] and engine.contexts == []
    traj.finish_reason = "stop"
    first = traj.generate(max_new_tokens=2)
    traj.finish_reason = "stop"  # as if the turn had ended on a stop token
    traj.observe([3] * 10)
    sample = traj.sample()
    assert sample.response_ids == first.response_ids + [3] * (4 - len(first.response_ids))
    assert sample.finish_reason == "length" and sample.response_mask[len(first.response_ids):] == [0] * 2
    fits = Trajectory(RolloutContext(prompt, SamplingParams(max_new_tokens=8, n=1), tokenizer, engine))
    fits.generate(max_new_tokens=2)
    fits.finish_reason = "stop"
    fits.observe([3, 3])
    assert fits.sample().finish_reason == "stop"  # nothing cut


def test_token_ids_as_numpy_integers_in_a_tuple_are_taken_as_a_list(hf_engine, tokenizer):
    """They were refused as "not non-negative integers" (numpy, torch) or failed in the trainer (a tuple), though
    observe() takes them."""
    samples = generate_rollout(hf_engine, prompts_of(tokenizer, ["1+1="], labels=["2"]),
                               SamplingParams(max_new_tokens=4, n=2), tokenizer, make_reward_fn("exact_match"),
                               first_group_id=0, generate_fn="custom_rollouts:numpy_and_tuple_ids")
    assert all(type(s.response_ids) is list and all(type(t) is int for t in s.response_ids) for s in samples)


def test_the_error_of_several_prompts_is_logged_once(tokenizer, caplog):
    """After the first prompt's error, the next prompt's call (started as the first released the engine) failed
    too, and asyncio logged its error as "Future exception was never retrieved", a second traceback under the
    run's own."""
    import gc
    import logging

    from slime.rollout.custom import run_generate_fn
    from custom_rollouts import tool_raises

    with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(KeyError):
        run_generate_fn(tool_raises, "custom_rollouts:tool_raises", None,
                        prompts_of(tokenizer, ["1+1=", "2+2=", "3+3="]), SamplingParams(max_new_tokens=4, n=1),
                        tokenizer, timeout=30)
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_logprobs_given_as_a_list_are_taken_as_a_tensor(hf_engine, tokenizer):
    samples = generate_rollout(hf_engine, prompts_of(tokenizer, ["1+1="], labels=["2"]),
                               SamplingParams(max_new_tokens=4, n=2), tokenizer, make_reward_fn("exact_match"),
                               first_group_id=0, generate_fn="custom_rollouts:list_logprobs")
    assert len(samples) == 2 and all(isinstance(s.rollout_logprobs, torch.Tensor) and
                                     len(s.rollout_logprobs) == len(s.response_ids) for s in samples)


def test_calculator_tool_appends_its_result_as_an_observation(tokenizer):
    from examples.tool_calc import calculate, calculator_rollout
    from slime.rollout.custom import RolloutContext

    assert calculate("12+7") == "19" and calculate(" 6 * -3 ") == "-18" and calculate("1/0") is None
    eos = tokenizer.eos_token
    engine = ScriptedEngine(tokenizer, ["12+7=", "19" + eos, "3*4=", "12" + eos])
    prompt = prompts_of(tokenizer, ["12+7="], labels=["19"])[0]
    params = SamplingParams(max_new_tokens=32, n=2, stop_token_ids=(tokenizer.eos_token_id,))
    first, second = calculator_rollout(RolloutContext(prompt, params, tokenizer, engine))
    call = tokenizer("12+7=", add_special_tokens=False).input_ids
    result = tokenizer("19\n", add_special_tokens=False).input_ids
    assert first.response_ids[:len(call) + len(result)] == call + result
    assert first.response_mask == [1] * len(call) + [0] * len(result) + [1] * (len(first.response_ids) - len(call) - len(result))
    assert engine.contexts[1] == prompt.prompt_ids + call + result  # the second turn saw the observation's ids
    assert first.given_reward == 1.0 and first.metadata["tool_calls"] == 1
    assert second.given_reward == 0.0  # called the tool on 3*4, answered 12: wrong for 12+7


# ----------------------------------------------------------------------------- reward servers


class RewardServer:
    """A local reward server whose behaviour the test sets: ok, error (500), hang, trickle, bad_json, short,
    bad_request."""

    def __init__(self):
        self.mode, self.fail_first, self.requests = "ok", 0, []
        self.release = threading.Event()
        self.in_flight = self.max_in_flight = 0
        lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    server.requests.append(body)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    failing = server.fail_first > 0
                    server.fail_first -= failing
                try:
                    self._answer(body, failing)
                finally:
                    with lock:
                        server.in_flight -= 1

            def _answer(self, body, failing):
                mode = "error" if failing else server.mode
                if mode == "hang":
                    server.release.wait()
                    return
                if mode in ("error", "bad_request"):
                    self.send_response(500 if mode == "error" else 400)
                    self.end_headers()
                    self.wfile.write(b"boom")
                    return
                rewards = [{"reward": len(s["response"]), "has_label": float(s["label"] is not None)}
                           for s in body["samples"]]
                out = b"{not json" if mode == "bad_json" else json.dumps({"rewards": rewards}).encode()
                if mode == "short":
                    out = json.dumps({"rewards": rewards[:-1]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if mode == "trickle":  # each byte well within the timeout, the whole answer far beyond it
                    self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                if mode != "trickle":
                    self.wfile.write(out)
                    return
                for k in range(len(out)):
                    if server.release.wait(0.05):
                        return
                    try:
                        self.wfile.write(out[k:k + 1])
                        self.wfile.flush()
                    except OSError:  # the client gave up
                        return

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = RewardServer()
    yield s
    s.close()


def text_samples(n):
    return [Sample(prompt_ids=[1], response_ids=[2], prompt_text=f"q{i}", response_text="x" * i,
                   label=str(i) if i % 2 else None, index=100 + i) for i in range(n)]


def remote(server, **kw):
    opts = dict(batch_size=3, max_concurrency=2, timeout=5.0, max_retries=2, retry_backoff=0.01) | kw
    return make_reward_fn(server.url, **{k: v for k, v in opts.items()})


def test_remote_reward_keeps_its_connections_alive():
    """Sessions were kept per worker thread, and the threads are new for every call: each batch opened a new
    connection (and TLS handshake). 12 batches, one in flight at a time, over 2 score() calls: one connection."""
    connections = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def setup(self):
            connections.append(self.client_address)
            super().setup()

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = json.dumps({"rewards": [1.0] * len(body["samples"])}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        fn = make_reward_fn(f"http://127.0.0.1:{httpd.server_address[1]}/score", batch_size=1, max_concurrency=1)
        assert fn.score(text_samples(6)) == [1.0] * 6 and fn.score(text_samples(6)) == [1.0] * 6
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert len(connections) == 1


def test_remote_reward_scores_in_batches_with_extras(server):
    samples = text_samples(7)
    rewards = remote(server).score(samples)
    assert rewards == [float(i) for i in range(7)]
    # batches of 3, at most 2 in flight; the order they reach the server's handler threads is the scheduler's
    assert sorted(len(r["samples"]) for r in server.requests) == [1, 3, 3]
    assert server.max_in_flight <= 2
    got = {s["index"]: s for r in server.requests for s in r["samples"]}
    assert got[103] == {"index": 103, "prompt": "q3", "response": "xxx", "label": "3", "metadata": {}}
    assert samples[3].metadata["reward_info"] == {"has_label": 1.0}
    weighted = make_reward_fn({server.url: 2.0, "format": 1.0}, batch_size=4, retry_backoff=0.01)
    assert weighted.score(text_samples(3)) == [0.0, 2.0, 4.0]


def test_a_label_json_cannot_hold_reaches_the_server_as_text(server):
    """A NaN label (or one holding a set) made requests refuse to encode the body: retried, then blamed on the
    server ("Check the server"), which never saw a request. Labels are made JSON as metadata is."""
    samples = text_samples(3)
    samples[0].label, samples[1].label = float("nan"), [1, {2}]
    assert remote(server, max_retries=0).score(samples) == [0.0, 1.0, 2.0]
    got = {s["index"]: s["label"] for r in server.requests for s in r["samples"]}
    assert got == {100: "nan", 101: [1, "{2}"], 102: None}


def test_remote_reward_retries_a_failing_server_then_succeeds(server):
    server.fail_first = 2
    assert remote(server, batch_size=8).score(text_samples(4)) == [0.0, 1.0, 2.0, 3.0]
    assert len(server.requests) == 3


def test_remote_reward_waits_as_the_server_asks_and_at_most_a_minute(monkeypatch):
    """A 408 (the server timed the request out) is retried as a 5xx; a Retry-After is waited for; the exponential
    backoff stops growing at a minute (max_retries=10 with retry_backoff=1 waited 512 s and more at the end)."""
    import types

    from slime.rollout import reward_models

    answers = [(408, {}), (429, {"Retry-After": "7"}), *[(503, {})] * 8]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            code, headers = answers.pop(0) if answers else (200, {})
            out = json.dumps({"rewards": [1.0] * len(body["samples"])} if code == 200 else {}).encode()
            self.send_response(code)
            for k, v in {"Content-Length": str(len(out)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(out)

    waits = []

    class Failed:  # a batch's wait between attempts, which another batch's failure would cut short
        is_set, set = (lambda self: False), (lambda self: None)

        def wait(self, delay):
            waits.append(delay)
            return False

    monkeypatch.setattr(reward_models, "threading", types.SimpleNamespace(Event=Failed))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        fn = make_reward_fn(f"http://127.0.0.1:{httpd.server_address[1]}/score", max_retries=10, retry_backoff=1.0)
        assert fn.score(text_samples(1)) == [1.0]
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert len(waits) == 10 and waits[1] == 7.0  # the Retry-After
    assert waits[0] < 1.3 and max(waits) == 60.0  # 408 retried at the first backoff; later ones capped


@pytest.mark.parametrize("mode, why, attempts", [
    ("error", r"HTTP 500: 'boom'", 3),
    ("bad_json", r"malformed answer \(want JSON", 3),
    ("short", r"'rewards' must list 2 values, got 1", 3),
    ("hang", r"no answer within rollout.reward.timeout=0.3s", 3),
    ("trickle", r"within rollout.reward.timeout=0.3s", 3),
    ("bad_request", r"refused samples index=100..101 \(2\).*HTTP 400", 1),
])
def test_remote_reward_failures_name_the_endpoint_and_the_samples(server, mode, why, attempts):
    """The short timeout only where the server is meant not to answer in time: an answer slowed past it by a loaded
    machine would read as a timeout."""
    server.mode = mode
    timeout = 0.3 if mode in ("hang", "trickle") else 30.0
    with pytest.raises(RewardServerError, match=why) as e:
        remote(server, batch_size=2, timeout=timeout).score(text_samples(2))
    assert server.url in str(e.value) and "samples index=100..101" in str(e.value)
    if attempts > 1:
        assert f"after {attempts} attempts" in str(e.value)
    assert len(server.requests) == attempts


def test_a_failed_batch_stops_the_other_batches_retries():
    """One batch refused (HTTP 400) fails the call; another batch, told to come back in a second (503), went on
    retrying in its thread after the error had been raised."""
    refused, retried = threading.Event(), []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            first = body["samples"][0]["index"] == 100
            if not first:
                retried.append(1)
                refused.wait(10)  # answered once the other batch's refusal is on its way
            self.send_response(400 if first else 503)
            if not first:
                self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"no")
            if first:
                refused.set()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        fn = make_reward_fn(f"http://127.0.0.1:{httpd.server_address[1]}/score", batch_size=2, max_concurrency=2,
                            max_retries=3)
        with pytest.raises(RewardServerError, match="refused"):
            fn.score(text_samples(4))
        time.sleep(2.5)  # the retries at 1 s and 2 s, had they gone on
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert len(retried) == 1

def test_remote_reward_that_nobody_serves():
    from slime.utils.net import free_port

    url = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(RewardServerError, match=rf"{url} failed for sample index=100.*cannot connect "
                                                r"\(ConnectionError: .*[Cc]onnection refused"):  # why, not the type
        make_reward_fn(url, max_retries=1, retry_backoff=0.01).score(text_samples(1))


def test_remote_reward_specs_are_checked():
    with pytest.raises(ValueError, match="granularity 'group' must be one user function"):
        make_reward_fn("http://127.0.0.1:1/x", granularity="group")
    with pytest.raises(ValueError, match="batch_size and max_concurrency must be >= 1"):
        RemoteReward("http://127.0.0.1:1/x", batch_size=0)


# ----------------------------------------------------------------------------- reward models


def make_reward_model(model_dir: Path, out: Path, num_labels: int = 1) -> Path:
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    if out.exists():
        return out
    cfg = AutoConfig.from_pretrained(model_dir, num_labels=num_labels)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_rm(tiny_model, tmp_path_factory):
    return make_reward_model(tiny_model, tmp_path_factory.mktemp("rm") / "tiny-rm")


def test_reward_model_scores_batches_as_one_by_one(tiny_rm):
    """Right-padded batches score each sample at its own last token: the same as scoring it alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    samples = [Sample(prompt_ids=[1], response_ids=[2], prompt_text=f"{i}+{i}=", response_text="7" * (1 + 3 * i),
                      index=i) for i in range(5)]
    rm = RewardModel(f"model:{tiny_rm}", batch_size=4)
    got = make_reward_fn(f"model:{tiny_rm}", batch_size=4).score(samples)
    tok = AutoTokenizer.from_pretrained(tiny_rm)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm).eval()
    with torch.no_grad():
        want = [model(**tok(s.prompt_text + s.response_text, return_tensors="pt", add_special_tokens=False)
                      ).logits[0, 0].item() for s in samples]
    assert got == pytest.approx(want, abs=1e-5)
    text = samples[4].prompt_text + samples[4].response_text
    assert rm.score_texts([text]) == [{"reward": pytest.approx(want[4], abs=1e-5), "rm_truncated": 0.0}]
    assert len(set(round(w, 4) for w in want)) == 5  # a random head: the texts get different scores


def test_a_bf16_reward_model_scores_in_fp32(tiny_rm, tmp_path):
    """bf16 scores fell on a grid of 2^-8 of their size (0.0625 near 10): the head now runs in fp32 on the bf16
    model's last state, as the reference here does by hand."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm)
    with torch.no_grad():
        model.score.weight.mul_(10 / model.score.weight.norm())  # scores of a few units
    model.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny_rm).save_pretrained(tmp_path / "rm")
    texts = [f"{i}+{i}={2 * i} " * (1 + i) for i in range(6)]
    got = [d["reward"] for d in RewardModel(f"model:{tmp_path / 'rm'}", batch_size=1,
                                           dtype=torch.bfloat16).score_texts(texts)]
    tok = AutoTokenizer.from_pretrained(tmp_path / "rm")  # loaded in bf16 (cast after, its rope table is bf16 too)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = [(model.model(**tok(t, return_tensors="pt", add_special_tokens=False)).last_hidden_state[0, -1].float()
                 @ model.score.weight[0].float()).item() for t in texts]
    assert max(abs(w) for w in want) > 1
    # one text per batch: in bf16 another text's padding moves the states themselves (~0.2% here), grid or not
    assert got == pytest.approx(want, abs=1e-4)


def other_reward_model(out: Path, kind: str) -> Path:
    """A tiny GPT-2 reward model (its own pooling: the last token that is not the pad id; its tokenizer has only an
    EOS, as GPT-2's) or BERT one ([CLS] pooling), with a head large enough to tell positions apart."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (BertConfig, BertForSequenceClassification, BertTokenizerFast, GPT2Config,
                              GPT2ForSequenceClassification, PreTrainedTokenizerFast)

    torch.manual_seed(1)
    if kind == "gpt2":
        special = ["<eos>", "<user>", "<assistant>"]
        vocab = {t: i for i, t in enumerate(special + sorted(pre_tokenizers.ByteLevel.alphabet()))}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        tk.add_special_tokens(special)
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", bos_token="<eos>")
        model = GPT2ForSequenceClassification(GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=32, n_layer=2,
                                                         n_head=2, num_labels=1, eos_token_id=0, bos_token_id=0))
        head = model.score
    else:
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase, *string.digits, *"+=.,?!"]
        tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(words)})
        model = BertForSequenceClassification(BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2,
                                                         num_attention_heads=2, intermediate_size=64,
                                                         max_position_embeddings=64, num_labels=1))
        head = model.classifier
    with torch.no_grad():
        head.weight.normal_(0, 1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_reward_models_of_other_architectures_score_each_text_as_it_is_alone(tmp_path, kind):
    """GPT-2's own pooling (the last token that is not the pad id, which is EOS where the tokenizer has no pad)
    read a text ending in EOS at the token before it; a BERT reward model got no [CLS] / [SEP] (tokenised without
    special tokens). Each text alone, through the model as its tokenizer encodes it, is the reference."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = other_reward_model(tmp_path / kind, kind)
    texts = ["what is 3+4? 7<eos>", "ok fine<eos>", "x"] if kind == "gpt2" else ["what is 3+4? 7", "ok fine", "x"]
    got = [d["reward"] for d in RewardModel(f"model:{path}", batch_size=4).score_texts(texts)]
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        want = [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
    assert got == pytest.approx(want, abs=1e-4)


def test_a_reward_model_whose_tokenizer_has_no_pad_and_no_eos_scores(tmp_path):
    """Its pad was set to its EOS, None: it loaded, then the first batch failed in the tokenizer's pad()."""
    from transformers import AutoTokenizer

    path = other_reward_model(tmp_path / "gpt2", "gpt2")
    tok = AutoTokenizer.from_pretrained(path)
    tok.eos_token = tok.bos_token = None
    tok.save_pretrained(path)
    rm = RewardModel(f"model:{path}", batch_size=4)
    batch = rm.score_texts(["ab", "abc d"])
    assert [d["reward"] for d in batch] == pytest.approx([rm.score_texts([t])[0]["reward"] for t in ("ab", "abc d")],
                                                         abs=1e-5)


def test_reward_model_reads_the_policys_tokens_end_of_turn_included(tiny_model, tiny_rm, tmp_path):
    """It read prompt_text + response_text, the response decoded without special tokens: the end-of-turn token,
    where a reward model trained on chat text reads its score, was gone (and a multi-turn response's role markers,
    and a SentencePiece response's leading space). It now reads the policy's ids decoded together. Its tokenizer
    pads with EOS here (as where it has no pad token): the model's own pooling would read a text ending in EOS
    before it."""
    import shutil

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy = AutoTokenizer.from_pretrained(tiny_model)
    rm_dir = shutil.copytree(tiny_rm, tmp_path / "rm-eos-pads")
    config = json.loads((rm_dir / "tokenizer_config.json").read_text())
    (rm_dir / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": policy.eos_token}))
    eos = policy.eos_token_id
    samples = [Sample(prompt_ids=policy("3+4=", add_special_tokens=False).input_ids, response_ids=ids,
                      prompt_text="3+4=", response_text=policy.decode(ids, skip_special_tokens=True), index=i)
               for i, ids in enumerate([[20, 21, eos], [20, eos], [22, 23, 24, 25]])]
    rm = RewardModel(f"model:{rm_dir}", batch_size=3, tokenizer=policy)
    assert rm.tokenizer.pad_token_id == eos
    texts = rm.texts(samples)
    assert texts[0] == policy.decode(samples[0].prompt_ids + [20, 21, eos]) and texts[0].endswith(policy.eos_token)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    model.config.pad_token_id = None  # one text at a time: the score at its very last token
    with torch.no_grad():
        want = [model(**rm.tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                for t in texts]
    got = make_reward_fn(f"model:{rm_dir}", batch_size=3, tokenizer=policy).score(samples)
    assert got == pytest.approx(want, abs=1e-5)


def test_reward_model_reads_a_sample_past_its_context_from_its_end_and_counts_it(tiny_rm, caplog):
    """A sample longer than the reward model's positions failed with a bare IndexError (learned positions) or was
    scored past the context without a word (rotary ones)."""
    from transformers import AutoModelForSequenceClassification

    rm = RewardModel(f"model:{tiny_rm}", batch_size=2)
    assert rm.max_len == 512  # make_tiny_model's max_position_embeddings
    long = "1+2=" * 200  # 800 tokens
    with caplog.at_level("WARNING"):
        got = rm.score_texts(["1+2=", long])
    assert [g["rm_truncated"] for g in got] == [0.0, 1.0] and "reads 512 tokens at most" in caplog.text
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm).eval()
    ids = rm.tokenizer(long, add_special_tokens=False, return_tensors="pt").input_ids[:, -512:]
    with torch.no_grad():
        assert got[1]["reward"] == pytest.approx(model(input_ids=ids).logits[0, 0].item(), abs=1e-5)


def test_a_checkpoint_without_a_trained_score_head_is_refused(tiny_model, tmp_path):
    """A causal LM's checkpoint whose config says num_labels=1 (a value-head export, say) loaded as a sequence
    classifier with a random head: a different reward on every load, and on every rank."""
    import shutil

    from transformers import AutoConfig

    lm = shutil.copytree(tiny_model, tmp_path / "lm")
    AutoConfig.from_pretrained(tiny_model, num_labels=1).save_pretrained(lm)
    with pytest.raises(ValueError, match=r"lacks \['score.weight'\], which would start random"):
        make_reward_fn(f"model:{lm}")


def test_reward_model_must_have_one_output(tiny_model, tmp_path):
    path = make_reward_model(tiny_model, tmp_path / "two-labels", num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2; a reward model has one output"):
        make_reward_fn(f"model:{path}")
    with pytest.raises(ValueError, match="cannot load a sequence-classification checkpoint"):
        make_reward_fn(f"model:{tmp_path / 'missing'}")


def test_an_evaluation_whose_generate_fn_samples_leaves_the_training_stream_alone(hf_engine, tokenizer):
    """A generate_fn that samples (ctx.generate(temperature=1.0), as docs/custom_rollouts.md suggests) drew from
    torch's global generator during evaluation: with eval.interval=1 a run trained differently than without
    evaluation (12 train keys differed at step 1), and the step-0 evaluation of one model moved with train.seed."""
    from slime.config import load_config
    from slime.trainer.evaluate import EvalSet, evaluate

    cfg = load_config(None, ["model.path=m", "data.path=d.jsonl", "eval.path=e.jsonl",
                             "rollout.generate_fn=custom_rollouts:sampled_hint"])
    evalset = EvalSet(prompts_of(tokenizer, ["12+3=", "7-4=", "45+45=", "2+2="]), {})
    reward = make_reward_fn("e2e_rewards:digit_fraction")
    torch.manual_seed(5)
    before = torch.get_rng_state()
    first = evaluate(hf_engine, evalset, cfg, tokenizer, reward, OneRank())
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(3)  # the training stream moves on: the next evaluation samples as the first did
    second = evaluate(hf_engine, evalset, cfg, tokenizer, reward, OneRank())
    assert {k: v for k, v in first.items() if k != "time/eval"} == {k: v for k, v in second.items() if k != "time/eval"}


def test_identical_responses_score_the_same_whatever_batch_they_fall_in(tiny_rm):
    """A score moves with the padding of its batch (~1e-6 in fp32, ~1e-2 in bf16): identical responses of a group
    that fell in two batches scored apart, and GRPO's std normalisation made that noise advantages of +-1 (a group
    dynamic sampling then kept as one with a signal)."""
    from slime.algorithms.advantages import grpo_advantages

    same = "2+2=7"
    texts = ["1+1=" + "7" * 9, same, same, "3+3=" + "7" * 40, same, same]  # batches of 3: two of `same` in each
    got = [d["reward"] for d in RewardModel(f"model:{tiny_rm}", batch_size=3).score_texts(texts)]
    assert got[1] == got[2] == got[4] == got[5]
    adv, _ = grpo_advantages(torch.tensor(got[1:3] + got[4:6]), torch.zeros(4, dtype=torch.long))
    assert adv.abs().max() == 0


def test_reward_model_specs_are_checked_before_the_models_load(tiny_model, tiny_rm, tmp_path):
    """A missing folder failed after the policy, the reference and the engine had loaded, as a hub "Repo id"
    error naming neither the key nor the folder (and --dry-run passed it); a causal LM's checkpoint was refused
    for its num_labels=2 (the default), which sent the user to edit that."""
    check_reward_spec(f"model:{tiny_rm}")  # a classifier with one output
    check_reward_spec({f"model:{tiny_rm}": 1.0, "math": 0.5})
    two = make_reward_model(tiny_model, tmp_path / "two-labels", num_labels=2)
    for name, words in ((f"model:{tmp_path / 'missing'}", r"rollout.reward.fn: reward model .*missing.* is not a "
                                                           r"folder with a config.json"),
                        ("model:relative/rm", r"relative/rm is not a folder .*relative paths are read from"),
                        (f"model:{tiny_model}", r"is a causal LM's checkpoint \(Qwen2ForCausalLM\), not a sequence-"),
                        (f"model:{two}", r"has num_labels=2; a reward model has one output")):
        with pytest.raises(ValueError, match=words):
            check_reward_spec({"math": 1.0, name: 1.0})


def test_a_reward_model_with_another_chat_template_is_warned(tiny_model, tmp_path, caplog):
    """It reads the policy's text (its template's markers), which a model trained on another template may misread."""
    from transformers import AutoTokenizer

    policy = AutoTokenizer.from_pretrained(tiny_model)
    own = make_reward_model(tiny_model, tmp_path / "own")
    tok = AutoTokenizer.from_pretrained(own)
    tok.chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    tok.save_pretrained(own)
    with caplog.at_level("WARNING"):
        RewardModel(f"model:{make_reward_model(tiny_model, tmp_path / 'same')}", tokenizer=policy)
    assert "chat template" not in caplog.text
    with caplog.at_level("WARNING"):
        RewardModel(f"model:{own}", tokenizer=policy)
    assert "has a chat template of its own, which is not the policy's" in caplog.text


def test_a_reward_model_under_the_home_folder(tiny_rm, tmp_path, monkeypatch):
    """`model:~/rm` passed the early check (which expands ~) and then failed to load as a hub id."""
    import shutil

    shutil.copytree(tiny_rm, tmp_path / "rm")
    monkeypatch.setenv("HOME", str(tmp_path))
    check_reward_spec("model:~/rm")
    assert RewardModel("model:~/rm").score_texts(["1+1=2"])[0]["rm_truncated"] == 0.0


def test_a_truncation_by_one_of_two_reward_models_is_counted(tiny_model, tiny_rm, tmp_path):
    """Two reward models in one spec: the second's rm_truncated (0) overwrote the first's (1)."""
    from transformers import AutoConfig

    roomy = make_reward_model(tiny_model, tmp_path / "roomy")
    AutoConfig.from_pretrained(roomy, max_position_embeddings=2048).save_pretrained(roomy)
    sample = Sample(prompt_ids=[1], response_ids=[2], prompt_text="1+2=" * 200, response_text="3", index=0)
    fn = make_reward_fn({f"model:{tiny_rm}": 0.5, f"model:{roomy}": 0.5})
    fn.score([sample])
    assert sample.metadata["reward_info"]["rm_truncated"] == 1.0  # 800 tokens: past 512, within 2048


# ----------------------------------------------------------------------------- the loop on 2 ranks


def launch(tiny_model, task_dir, run_dir, *overrides, config="examples/cpu_tiny_grpo.yaml"):
    run_ranks([str(REPO / "run.py"), "--config", str(REPO / config), f"model.path={tiny_model}",
               f"data.path={task_dir / 'train.jsonl'}", f"log.run_dir={run_dir}", "rollout.batch_size=4",
               "rollout.n_samples_per_prompt=4", "rollout.max_response_len=10", "train.max_tokens_per_gpu=96",
               "eval.path=null", "checkpoint.export_hf=false", "log.plot=false", *overrides])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_rank_multi_turn_run_with_a_reward_model(tiny_model, task_dir, tiny_rm, tmp_path):
    """Step 1 of a multi-turn run: the trainer's logprobs of the generated tokens are the engine's (as in a
    single-turn run), so the first PPO step starts at ratio 1; the reward model scores on each rank."""
    rows = launch(tiny_model, task_dir, tmp_path / "run", "train.num_steps=2", "rollout.generate_fn=custom_rollouts:two_turns",
                  f"rollout.reward.fn=model:{tiny_rm}", "train.lr=1e-3")
    first = rows[0]
    assert first["rollout/turns"] == 2.0 and 0 < first["rollout/observation_frac"] < 1
    assert first["rollout/train_logprob_abs_diff"] < 1e-4
    assert abs(first["train/ppo_kl"]) < 1e-6
    assert first["rollout/reward_std"] > 0 and first["train/grad_norm"] > 0
    assert [r["step"] for r in rows] == [1, 2]


def test_two_rank_async_generate_fn_with_gae(tiny_model, task_dir, tmp_path):
    rows = launch(tiny_model, task_dir, tmp_path / "run", "train.num_steps=1", "algo.advantage_estimator=gae",
                  "rollout.generate_fn=custom_rollouts:two_turns_async", "rollout.reward.fn=e2e_rewards:digit_fraction")
    assert rows[0]["rollout/turns"] == 2.0 and rows[0]["rollout/train_logprob_abs_diff"] < 1e-4
    assert math.isfinite(rows[0]["critic/value_loss"])


def test_tool_example_runs(tmp_path):
    rows = launch(REPO / "assets/tiny-arith", REPO / "assets/tiny-arith-data", tmp_path / "run", "train.num_steps=1",
                  config="examples/cpu_tiny_tool_grpo.yaml")
    # The tiny model never calls the tool (docs/custom_rollouts.md): one turn per sample. The tool's own turns are
    # test_calculator_tool_appends_its_result_as_an_observation's, with a scripted policy.
    assert rows[0]["rollout/turns"] == 1.0 and math.isfinite(rows[0]["train/grad_norm"])


def test_token_ids_past_the_models_vocabulary_are_named_before_the_embedding():
    """ids of another tokenizer (from a generate function, say) would fail as an IndexError deep in torch."""
    from slime.data.batch import build_micro_batch
    from slime.data.sample import Sample
    from slime.trainer.policy_engine import PolicyEngine

    actor = object.__new__(PolicyEngine)
    actor.vocab_size, actor.role, actor.model_path = 100, "critic", "models/critic"
    samples = [Sample(prompt_ids=[1, 2], response_ids=[3, 4]), Sample(prompt_ids=[5], response_ids=[100, 7])]
    with pytest.raises(ValueError, match=r"token id 100 of the samples at positions \[0, 1\] on this rank is outside "
                                         r"the critic's vocabulary \[0, 100\) \(models/critic\)"):
        actor.forward(build_micro_batch(samples, [0, 1]))
