import asyncio
import re
import threading
from pathlib import Path

import pytest

from slime.data.sample import Sample
from slime.rollout import rewards
from slime.rollout.rewards import (
    RewardFn, exact_match_reward, extract_answer, format_reward, make_reward_fn, math_reward,
)


@pytest.fixture(autouse=True)
def _user_fns_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def S(response: str, label=None, group_id: int = 0, index: int = 0) -> Sample:
    return Sample(prompt_ids=[1], response_text=response, label=label, group_id=group_id, index=index)


GARBAGE = ["", "}{", "\\boxed{", "\\boxed{}}}", "<answer>", "</answer><answer>", "$$$",
           "\\frac{", "答案 ∞∞ \x00 \\\\\\", "Answer:", "#### ", "<answer>\\boxed{</answer>",
           "\\boxed{\\frac{1}{0}}", "x" * 5000]


# ----------------------------------------------------------------------------- extraction

@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{42}", "42"),
    ("\\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
    ("\\boxed{\\sqrt{\\frac{1}{2}}}", "\\sqrt{\\frac{1}{2}}"),
    ("<answer> 7 </answer>", "7"),
    ("\\boxed{1} <answer>2</answer>", "2"),          # an answer span wins over a stray box
    ("<answer>\\boxed{5}</answer>", "5"),
    ("<answer>1</answer><answer>2</answer>", "2"),
    ("work...\nAnswer: 12\n", "12"),
    ("steps\n#### 1,234", "1,234"),
    ("\\boxed{unclosed and \\boxed{3}", "3"),
    ("just 19", None),
    ("\\boxed{never closed", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ----------------------------------------------------------------------------- math

@pytest.mark.parametrize("response,label", [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5"),
    ("<answer>0.5</answer>", "1/2"),
    ("<answer>1/2</answer>", "\\frac{1}{2}"),
    ("Answer: 0.5", "\\frac{1}{2}"),
    ("So \\boxed{x^2+1}.", "1+x^2"),
    ("#### 1,000", "1000"),
    ("19", 19),
    ("\\boxed{3}", ["2", "3"]),
    ("\\boxed{\\$5}", "5"),                  # an escaped dollar sign is no math delimiter
    ("\\boxed{3.50}", "\\$3.50"),            # a MATH-style currency label
    ("\\boxed{0.00001}", 0.00001),           # a float label is compared as its digits, not '1e-05'
    ("\\boxed{100000000000000000000}", 1e20),
])
def test_math_correct(response, label):
    assert math_reward(S(response, label))["reward"] == 1.0


@pytest.mark.parametrize("response,label", [
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("<answer>0.51</answer>", "1/2"),
    ("\\boxed{x^2-1}", "x^2+1"),
    ("I think 20", "19"),
    ("\\boxed{4}", ["2", "3"]),
    ("\\boxed{e+20}", 1e20),                 # str(1e20) is '1e+20', which math-verify read as 1 times e+20
])
def test_math_wrong(response, label):
    assert math_reward(S(response, label))["reward"] == 0.0


@pytest.mark.parametrize("response", GARBAGE)
def test_math_garbage_scores_zero_without_raising(response):
    info = math_reward(S(response, "3"))
    assert info["reward"] == 0.0
    assert set(info) == {"reward", "math/pred_unparsed", "math/error"}


def test_math_reads_the_answer_after_the_reasoning():
    assert math_reward(S("<think>is it \\boxed{2}? no</think>\n\n\\boxed{\\frac{1}{2}}", "0.5"))["reward"] == 1.0
    assert math_reward(S("<think>\\boxed{0.5}</think> I am not sure", "0.5"))["reward"] == 0.0
    assert math_reward(S("<think>so it is 0.5", "0.5"))["reward"] == 0.0  # cut while thinking: no answer yet
    assert math_reward(S("the tag <think> aside, \\boxed{0.5}", "0.5"))["reward"] == 1.0  # mentioned, not opened
    opened = Sample(prompt_ids=[1], prompt_text="<|im_start|>assistant\n<think>\n", response_text="so it is 0.5",
                    label="0.5")  # a template whose generation prompt opens the reasoning: still thinking
    assert math_reward(opened)["reward"] == 0.0 and exact_match_reward(opened) == 0.0
    opened.response_text = "so it is 0.5</think>\n\n\\boxed{0.5}"
    assert math_reward(opened)["reward"] == 1.0 and exact_match_reward(opened) == 1.0


def test_math_counts_unparsed_prediction():
    assert math_reward(S("no number here", "3"))["math/pred_unparsed"] == 1.0
    assert math_reward(S("\\boxed{3}", "3"))["math/pred_unparsed"] == 0.0


def test_math_timeout_is_counted_not_hung(monkeypatch):
    monkeypatch.setattr(rewards, "MATH_VERIFY_TIMEOUT_S", 1)
    info = math_reward(S("\\boxed{9^{9^{9^{9}}}}", "5"))  # sympy would compare this for ages
    assert info == {"reward": 0.0, "math/pred_unparsed": 0.0, "math/error": 1.0}


def test_math_works_off_the_main_thread():
    # math-verify's default signal timeout raises ValueError outside the main thread.
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(S("\\boxed{1/2}", "0.5"))))
    t.start()
    t.join()
    assert out and out[0]["reward"] == 1.0


def test_a_math_child_that_dies_counts_its_sample_and_the_next_sample_gets_a_new_child(monkeypatch, caplog):
    """Off the main thread math is scored in a child process. One killed from outside (the kernel's OOM killer on a
    sympy blow-up) raised a bare BrokenProcessPool naming nothing, and the broken pool failed every later sample."""
    import logging
    import os

    def off_main(sample):
        out = []
        t = threading.Thread(target=lambda: out.append(math_reward(sample)))
        t.start()
        t.join(120)
        return out[0]

    assert off_main(S("\\boxed{2}", "2"))["reward"] == 1.0  # the child is up
    pool = rewards._math_pool[0]
    submit = pool.submit

    def submit_then_die(*args, **kwargs):  # the child dies on this sample, whatever the machine's load (a kill
        return submit(os._exit, 9)  # sent after submit lost the race to a child that had scored it already)

    monkeypatch.setattr(pool, "submit", submit_then_die)
    with caplog.at_level(logging.WARNING, logger="slime.rollout.rewards"):
        assert off_main(S("\\boxed{2}", "2")) == {"reward": 0.0, "math/pred_unparsed": 0.0, "math/error": 1.0}
    assert "math reward of sample index=0 counted as math/error: its process died" in caplog.text
    assert off_main(S("\\boxed{2}", "2"))["reward"] == 1.0 and rewards._math_pool[0] is not pool


def test_missing_label_is_an_error():
    with pytest.raises(ValueError, match="no label"):
        math_reward(S("\\boxed{1}"))
    with pytest.raises(ValueError, match="no label"):
        exact_match_reward(S("1", []))


@pytest.mark.parametrize("label", [{"answer": "1"}, [["1"]], True])
def test_a_label_the_builtin_rewards_cannot_compare_is_an_error_not_its_repr(label):
    for reward in (math_reward, exact_match_reward):
        with pytest.raises(TypeError, match=r"compares the answer with a string or a \(finite\) number, or a list"):
            reward(S("1", label))


# ----------------------------------------------------------------------------- exact_match

@pytest.mark.parametrize("response,label,expected", [
    ("19", "19", 1.0),
    (" 19\n", 19, 1.0),
    ("19.0", "19", 1.0),
    ("20", "19", 0.0),
    ("119", "19", 0.0),
    ("<answer>19</answer>", "19", 1.0),
    ("Answer: Paris.", ["paris", "Paris, France"], 1.0),
    ("#### 1,000", "1000", 1.0),
    ("\\boxed{1/2}", "0.5", 0.0),          # no maths: that is what "math" is for
    ("-0", "0", 1.0),
    ("12345678901234567890123456789012", "12345678901234567890123456789013", 0.0),
    ("0.00001", 0.00001, 1.0),                 # a float label from JSON: not '1e-05'
    ("<think>\n\n</think>\n\n19", "19", 1.0),  # a reasoning model's (and Qwen3's template's) empty block
    ("<think>Answer: 20? no</think> 19", "19", 1.0),  # what it wrote while thinking is not its answer
    ("<think>so it is 19", "19", 0.0),         # still thinking at the length limit: no answer
    ("<think>Answer: 19", "19", 0.0),          # (even where it wrote an answer marker)
    ("I would not <think> long: 19", "19", 0.0),  # a tag mid-answer is text: compared whole, as before
    ("I would not <think> long. Answer: 19", "19", 1.0),
])
def test_exact_match(response, label, expected):
    assert exact_match_reward(S(response, label)) == expected


@pytest.mark.parametrize("response", GARBAGE)
def test_exact_match_garbage(response):
    assert exact_match_reward(S(response, "3")) == 0.0


# ----------------------------------------------------------------------------- format

@pytest.mark.parametrize("response,expected", [
    ("think...\n<answer>7</answer>", 1.0),
    ("<answer>7</answer>  \n", 1.0),
    ("so \\boxed{7}.", 1.0),
    ("<answer>7</answer> and more text", 0.0),
    ("<answer>7</answer><answer>8</answer>", 0.0),
    ("<answer>  </answer>", 0.0),
    ("<answer>7", 0.0),
    ("\\boxed{7} <answer>", 0.0),
    ("\\boxed{}", 0.0),
    ("7", 0.0),
])
def test_format(response, expected):
    assert format_reward(S(response)) == expected


# ----------------------------------------------------------------------------- RewardFn

def test_weighted_combination_and_reward_info():
    samples = [S("<answer>1/2</answer>", "0.5"), S("1/2", "0.5"), S("<answer>3</answer>", "0.5"),
               S("3", "0.5")]
    fn = make_reward_fn({"math": 1.0, "format": 0.1})
    assert fn.score(samples) == pytest.approx([1.1, 1.0, 0.1, 0.0])
    info = samples[0].metadata["reward_info"]
    assert info["math"] == 1.0 and info["format"] == 1.0 and info["math/error"] == 0.0
    assert samples[3].metadata["reward_info"]["format"] == 0.0


def test_single_builtin_by_name():
    assert RewardFn("exact_match").score([S("19", "19"), S("18", "19")]) == [1.0, 0.0]


def test_user_sync_function_runs_in_pool():
    import reward_fns_for_test as user

    user.CALL_THREADS.clear()
    fn = make_reward_fn("reward_fns_for_test:length_reward")
    assert fn.score([S("ab"), S("abcd"), S("")]) == [2.0, 4.0, 0.0]
    assert len(user.CALL_THREADS) == 3
    assert all(name.startswith("reward") for name in user.CALL_THREADS)


def test_user_dict_extras_recorded():
    samples = [S("abc")]
    assert make_reward_fn("reward_fns_for_test:reward_with_info").score(samples) == [2.0]
    assert samples[0].metadata["reward_info"] == {"n_chars": 3.0}


def test_user_async_function_concurrency_bounded():
    import reward_fns_for_test as user

    user.MAX_IN_FLIGHT = 0
    samples = [S("a", "a"), S("b", "x")] * 5
    fn = make_reward_fn("reward_fns_for_test:slow_async_reward", max_concurrency=3)
    assert fn.score(samples) == [1.0, 0.0] * 5
    assert user.MAX_IN_FLIGHT == 3


def test_user_function_combined_with_builtin():
    fn = make_reward_fn({"exact_match": 1.0, "reward_fns_for_test:length_reward": 0.5})
    assert fn.score([S("19", "19"), S("7", "19")]) == [2.0, 0.5]  # 1 + 0.5*len


def test_group_function_maps_back_to_input_order():
    samples = [S("aaa", group_id=1), S("a", group_id=0), S("a", group_id=1),
               S("aaaa", group_id=0), S("b", group_id=2)]
    fn = make_reward_fn("reward_fns_for_test:rank_in_group", granularity="group")
    assert fn.score(samples) == [1.0, 0.0, 0.0, 1.0, 1.0]


def test_async_group_function():
    samples = [S("x", group_id=g) for g in (5, 5, 5, 9)]
    fn = make_reward_fn("reward_fns_for_test:async_group_size", granularity="group")
    assert fn.score(samples) == [3.0, 3.0, 3.0, 1.0]


def test_awaitable_inside_loop_and_score_refuses_it():
    fn = make_reward_fn("exact_match")

    async def main():
        rewards_ = await fn([S("1", "1")])
        with pytest.raises(RuntimeError, match="await"):
            fn.score([S("1", "1")])
        return rewards_

    assert asyncio.run(main()) == [1.0]


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("spec,kwargs,match", [
    ("maths", {}, r"'maths'.*exact_match.*format.*math.*package\.module:function"),
    ("no_such_module_xyz:f", {}, "no_such_module_xyz"),
    ("reward_fns_for_test:missing", {}, "has no callable 'missing'"),
    ("reward_fns_for_test:NOT_CALLABLE", {}, "NOT_CALLABLE"),
    (":f", {}, "':f'"),
    ({}, {}, "bad reward spec"),
    ({"math": "1.0"}, {}, "must map a name to a number"),
    ({"math": 1.0, "oops": 1.0}, {}, "'oops'"),
    ("math", {"granularity": "group"}, "granularity 'group'"),
    ("reward_fns_for_test:rank_in_group", {"granularity": "batch"}, "'batch'"),
    ("math", {"max_concurrency": 0}, "max_concurrency"),
])
def test_bad_specs(spec, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_reward_fn(spec, **kwargs)


@pytest.mark.parametrize("spec,match", [
    ("exact_mach", r"rollout.reward.fn: unknown reward spec 'exact_mach' \(did you mean 'exact_match'\?\)"),
    ("no_such_module_xyz:f", r"rollout.reward.fn: reward spec 'no_such_module_xyz:f': no module 'no_such_module_xyz'"),
    ("no_such_pkg_xyz.sub:f", "no module 'no_such_pkg_xyz.sub'"),
    (":f", "'package.module:function'"),
    ({"math": 1.0, "oops": 1.0}, "unknown reward spec 'oops'"),
    ("model:/no/such/dir", "reward model 'model:/no/such/dir': /no/such/dir is not a folder with a config.json"),
])
def test_a_spec_that_cannot_load_is_refused_before_the_run_loads_anything(spec, match):
    """check_reward_spec (called before the models load) names the key and the fix; it imports no user module."""
    with pytest.raises(ValueError, match=match):
        rewards.check_reward_spec(spec)


@pytest.mark.parametrize("spec", ["math", "reward_fns_for_test:rank_in_group", "reward_fns_for_test:missing",
                                  "http://127.0.0.1:1/score", {"math": 1.0, "format": 0.1}])
def test_a_spec_that_may_load_passes_the_early_check(spec):
    """What only loading can tell (a missing function in a module that exists, a reward model's weights) is left to
    the load, with its own message (test_bad_specs)."""
    rewards.check_reward_spec(spec)


def test_the_user_functions_of_a_spec_load_at_start_and_a_missing_one_is_named():
    """load_user_reward_fns runs before the models load: a function its module lacks is refused there
    (check_reward_spec imports no module), as is one that cannot take one sample (make_reward_fn's test below)."""
    rewards.load_user_reward_fns({"reward_fns_for_test:rank_in_group": 1.0, "math": 0.5})
    with pytest.raises(ValueError, match=r"module 'reward_fns_for_test' has no callable 'missing'"):
        rewards.load_user_reward_fns({"math": 1.0, "reward_fns_for_test:missing": 0.5})


@pytest.mark.parametrize("fn_name,granularity,match", [
    ("returns_string", "sample", r"returns_string returned str \('1.0'\) for sample index=0"),
    ("dict_without_reward", "sample", r"dict_without_reward returned a dict without a 'reward' key for sample "
                                      r"index=0: keys \[\"'score'\"\]"),
    ("dict_of_mixed_keys", "sample", r"dict_of_mixed_keys returned a dict without a 'reward' key for sample index=0: "
                                     r"keys \[\"'score'\", '1'\]"),  # sorted(value) failed on str and int
    ("wrong_length_group", "group", r"wrong_length_group must return a list with one value per sample of the group "
                                    r"\(2\), got 1 values for the group of sample index=0"),
])
def test_bad_return_values_name_the_function(fn_name, granularity, match):
    fn = make_reward_fn(f"reward_fns_for_test:{fn_name}", granularity=granularity)
    with pytest.raises(TypeError, match=match):
        fn.score([S("a", group_id=0), S("b", group_id=0)])


def test_numpy_rewards_are_their_numbers():
    """np.bool_ was refused with "returned bool_", though a Python bool passes."""
    fn = make_reward_fn("reward_fns_for_test:numpy_values")
    assert fn.score([S("a", index=0), S("b", index=1)]) == [1.0, 0.25]


def test_non_finite_reward_is_rejected():
    with pytest.raises(ValueError, match="returns_nan returned nan.*not a finite float32"):
        make_reward_fn("reward_fns_for_test:returns_nan").score([S("a")])


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), 1e30])
@pytest.mark.parametrize("granularity", ["sample", "group"])
def test_weights_must_be_finite_and_moderate(weight, granularity):
    name = "reward_fns_for_test:rank_in_group" if granularity == "group" else "exact_match"
    with pytest.raises(ValueError, match=re.escape(f"the weight of '{name}' is {weight!r}")):
        make_reward_fn({name: weight}, granularity=granularity)


def test_a_group_reward_beyond_float32_after_weighting_is_rejected():
    """Each value passes; 1e38 x 10 does not fit a float32."""
    fn = make_reward_fn({"reward_fns_for_test:scaled_group": 10.0}, granularity="group")
    with pytest.raises(ValueError, match="returned 1e\\+39 for sample index=.*not a finite float32"):
        fn.score([S("a", group_id=0), S("b", group_id=0)])


def test_an_int_too_large_for_a_float_names_the_function():
    with pytest.raises(ValueError, match="reward_fns_for_test:returns_huge_int returned 1000000000.*not a finite"):
        make_reward_fn("reward_fns_for_test:returns_huge_int").score([S("a")])


def test_a_reward_extra_that_is_not_finite_is_named():
    with pytest.raises(ValueError, match=r"reward function reward_fns_for_test:nan_extra \(extra key 'format'\) "
                                         r"returned nan for sample index="):
        make_reward_fn("reward_fns_for_test:nan_extra").score([S("a")])


def test_a_reward_function_that_raises_is_named_with_the_sample():
    with pytest.raises(RuntimeError, match=r"reward function reward_fns_for_test:raises_key_error raised KeyError: "
                                           r"'wrong' for sample index=") as e:
        make_reward_fn("reward_fns_for_test:raises_key_error").score([S("wrong")])
    assert isinstance(e.value.__cause__, KeyError)  # the user's traceback stays attached


def test_reward_info_is_reported_as_means_over_the_samples_that_carry_it():
    from one_rank import OneRank
    from slime.rollout.rollout import reward_info_metrics

    samples = [S("ab"), S("abcd"), S("x")]
    make_reward_fn("reward_fns_for_test:reward_with_info").score(samples[:2])  # n_chars 2 and 4; the third has none
    assert reward_info_metrics(samples, OneRank()) == {"reward/n_chars": 3.0}


def test_math_off_the_main_thread_is_bounded(monkeypatch):
    """In a thread (one-step-off rollout) math-verify's alarms do not fire: a child process scores instead, one
    past the limit is killed and counted as math/error, and the next sample gets a fresh child."""
    out = {}

    def work():
        out["good"] = rewards.math_reward(S("so \\boxed{1/2}", label="0.5"))  # starts the child
        monkeypatch.setattr(rewards, "MATH_CHILD_LIMIT_S", 1)  # the child's own alarm needs 5 s on this one
        out["hung"] = rewards.math_reward(S("\\boxed{9^{9^{9^{9}}}}", label="3"))
        monkeypatch.setattr(rewards, "MATH_CHILD_LIMIT_S", 120)
        out["next"] = rewards.math_reward(S("\\boxed{3}", label="3"))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(300)
    assert out["good"]["reward"] == 1.0 and out["next"]["reward"] == 1.0
    assert out["hung"] == {"reward": 0.0, "math/pred_unparsed": 0.0, "math/error": 1.0}


def test_the_last_balanced_box_is_found_in_one_pass_as_by_scanning_from_each_box():
    """The last \\boxed{...} whose braces balance, found by pairing braces in one pass: scanning on from every box in
    turn (kept here as the reference) was quadratic, 8 s for one degenerate sample of 36k characters of unclosed
    boxes, inline in the rollout. Random texts of boxes and braces give what the scan gives."""
    import random
    import re

    from slime.rollout.rewards import _last_boxed

    def scanned(text):
        for m in reversed(list(re.finditer(r"\\boxed\s*\{", text))):
            depth = 1
            for i in range(m.end(), len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[m.end():i]
        return None

    rng = random.Random(0)
    pieces = ["{", "}", "}", "{", "a", "x+1", "\\boxed{", "\\boxed {", "\\boxed"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 24))) for _ in range(5000)]
    found = [_last_boxed(t) for t in texts]
    assert found == [scanned(t) for t in texts]
    assert sum(f is not None for f in found) > 1000 and sum(f is None for f in found) > 1000
    assert _last_boxed("\\boxed{a{b}c} then \\boxed{d") == "a{b}c"
    assert _last_boxed("\\boxed{x+" * 5000 + "\\boxed{7}") == "7"


EXIT_SCRIPT = '''
import sys, threading, time
from pathlib import Path
from slime.data.sample import Sample
from slime.rollout import rewards
import stuck_math

rewards._math_in_child = stuck_math.stuck  # a sample the child never finishes scoring
rewards.MATH_CHILD_LIMIT_S = 3600
out = []
if __name__ == "__main__":
    sample = Sample(prompt_ids=[], response_text="x", label="1")
    threading.Thread(target=lambda: out.append(rewards.math_reward(sample)), daemon=True).start()
    started = Path(sys.argv[1])
    while not started.exists():
        time.sleep(0.05)
    print("main thread done", flush=True)
'''


def test_a_run_that_ends_while_its_math_child_scores_does_not_wait_for_it(tmp_path):
    """A run stopping while a thread has a sample in the math child (a one-step-off batch discarded at a stop) waited
    at exit until the child finished or the thread's limit (MATH_CHILD_LIMIT_S) killed it: concurrent.futures joins
    its pools at exit. The child is killed at exit instead. Here the child never finishes: without the kill the
    process would not end."""
    import subprocess
    import sys

    started = tmp_path / "started"
    (tmp_path / "stuck_math.py").write_text(
        "import time\nfrom pathlib import Path\n\n"
        f"def stuck(*args):\n    Path({str(started)!r}).touch()\n    time.sleep(3600)\n")
    (tmp_path / "script.py").write_text(EXIT_SCRIPT)
    try:
        path = f"{tmp_path}:{Path(__file__).parents[1]}"  # the checkout under test, not an installed slime
        proc = subprocess.run([sys.executable, "script.py", str(started)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={**__import__("os").environ, "PYTHONPATH": path})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit with its math child busy: {e}")
    assert proc.returncode == 0, proc.stderr
    assert "main thread done" in proc.stdout and started.exists()
    assert "counted as math/error" not in proc.stderr  # the kill at exit is no failure of a sample


KILLED_SCRIPT = EXIT_SCRIPT.replace('''    print("main thread done", flush=True)''',
                                   '''    child, = rewards._math_pool[0]._processes
    Path(sys.argv[2]).write_text(str(child))
    time.sleep(3600)  # killed here, by SIGKILL: no exit hook runs''')


def test_the_math_child_of_a_process_killed_by_sigkill_exits(tmp_path):
    """A rank killed by SIGKILL (or ended by os._exit, as the launcher's death ends it) runs no exit hook: its math
    child stayed behind for good, 275 MB. The child watches for its parent and ends with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    started, pid_file = tmp_path / "started", tmp_path / "child.pid"
    (tmp_path / "stuck_math.py").write_text(
        "import time\nfrom pathlib import Path\n\n"
        f"def stuck(*args):\n    Path({str(started)!r}).touch()\n    time.sleep(3600)\n")
    (tmp_path / "script.py").write_text(KILLED_SCRIPT)
    path = f"{tmp_path}:{Path(__file__).parents[1]}"
    proc = subprocess.Popen([sys.executable, "script.py", str(started), str(pid_file)], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": path})
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_file.exists(), "the math child did not start"
        time.sleep(0.2)  # the pid written fully
        child = int(pid_file.read_text())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"  # a zombie has exited (its parent, init here, reaps it)

    deadline = time.monotonic() + 60
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"the math child {child} outlived its killed parent")


def test_a_bad_spec_is_refused_before_the_models_load_and_a_wrong_signature_when_it_loads(tmp_path, monkeypatch):
    """Weights that are no numbers and a group granularity of a built-in were refused only once every model had
    loaded; a function of two parameters failed at its first call, after a whole rollout."""
    from slime.rollout.rewards import check_reward_spec, make_reward_fn

    for spec, granularity, message in (({"exact_match": "high"}, "sample", r"'high' must map a name to a number"),
                                       ({"exact_match": float("nan")}, "sample", r"the weight of 'exact_match' is nan"),
                                       ({}, "sample", r"bad reward spec \{\}"),
                                       ("exact_match", "group", r"with granularity 'group' must be one user function")):
        with pytest.raises(ValueError, match=r"rollout.reward.fn: .*" + message):
            check_reward_spec(spec, granularity=granularity)
    (tmp_path / "two_args.py").write_text("import functools\n\n"
                                          "def reward(sample, extra):\n    return 1.0\n\n"
                                          "def flexible(sample, scale=1.0, **kw):\n    return scale\n\n"
                                          "def logged(fn):\n    @functools.wraps(fn)\n"
                                          "    def wrapper(*args, **kw):\n        return fn(args[0], 1.0)\n"
                                          "    return wrapper\n\n"
                                          "@logged\ndef decorated(sample, scale):\n    return scale\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"reward spec 'two_args:reward': reward\(sample, extra\) cannot be called "
                                         r"with one sample \(missing a required argument: 'extra'\)"):
        make_reward_fn("two_args:reward")
    make_reward_fn("two_args:flexible")
    make_reward_fn("two_args:decorated")  # the rollout calls the wrapper (*args, **kw), not the function it wraps
