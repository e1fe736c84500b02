"""Rule-based and user-supplied rewards, chosen by a spec string or a dict of weights.

Spec forms:
  - a built-in name: ``"math"``, ``"exact_match"``, ``"format"``;
  - a user function ``"package.module:function"`` (sync or async);
  - a reward server ``"http://host:port/path"`` or a reward model ``"model:PATH"`` (slime.rollout.reward_models);
  - weights over sample-level functions, ``{"math": 1.0, "format": 0.1}`` -> weighted sum.

A sample-level function maps a `Sample` to a number, or to a dict with a ``"reward"`` key plus
extra numbers that are stored in ``sample.metadata["reward_info"]``. A group-level function maps
the samples of one ``group_id`` to one number (or dict) per sample, in order.

Where things run: built-ins are CPU-bound Python, so they run inline on the calling thread (threads
would not speed them up under the GIL); off the main thread (one-step-off rollout) `math` runs in a child
process, where math-verify's signal-based timeouts work. User sync functions run in a thread pool (they may do
I/O, e.g. call a reward server); user async functions run concurrently. At most ``max_concurrency`` user calls
are in flight.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import difflib
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import os
import re
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slime.data.sample import Sample, answer_kind, label_text, unscorable_answers
from slime.config import is_remote
from slime.rollout.reward_models import MODEL_PREFIX, RemoteReward, RewardModel, is_reward_model

logger = logging.getLogger(__name__)

MATH_VERIFY_TIMEOUT_S = 5
"""Per parse/compare limit (math-verify uses SIGALRM: the main thread's; elsewhere see _math_off_main)."""

# ----------------------------------------------------------------------------- answer extraction

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_LINE = re.compile(r"(?:####|\banswer\s*:)[ \t]*([^\n]*)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{")


_BRACE = re.compile(r"[{}]")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance (nested braces allowed). One pass over the braces
    pairs each with its match: scanning on from every box in turn was quadratic in a response of unclosed boxes
    (8 s for one sample of 36k characters, inline in the rollout)."""
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    closing, open_at = {}, []
    for brace in _BRACE.finditer(text, boxes[0].end() - 1):
        if brace.group() == "{":
            open_at.append(brace.start())
        elif open_at:
            closing[open_at.pop()] = brace.start()
    for m in reversed(boxes):
        if (end := closing.get(m.end() - 1)) is not None:
            return text[m.end():end]
    return None


def after_reasoning(text: str, prompt: str = "") -> str:
    """A response without its reasoning: the text after the last "</think>" (reasoning models, Qwen3's template
    and the SFT that learns it); nothing where the reasoning was opened, by the response's start or by the prompt's
    end (templates whose generation prompt opens it: Qwen3-Thinking's, DeepSeek-R1's), and never closed (cut at
    the length limit while thinking: no answer yet); all of it otherwise (a "<think>" mentioned mid-answer is
    text). An answer written while thinking is not the final one, and the block around an answer made the whole
    response differ from its label."""
    end = text.rfind("</think>")
    if end >= 0:
        return text[end + len("</think>"):]
    opened = text.lstrip().startswith("<think>") or prompt.rstrip().endswith("<think>")
    return "" if opened else text


def extract_answer(text: str) -> str | None:
    """The final answer in a response: last <answer> span, last \\boxed{}, or text after
    'Answer:'/'####' (in that order of preference). None when the response marks no answer."""
    spans = _ANSWER_TAG.findall(text)
    if spans:
        inner = spans[-1]
        boxed = _last_boxed(inner)
        return (boxed if boxed is not None else inner).strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    lines = [m.group(1).strip() for m in _ANSWER_LINE.finditer(text)]
    lines = [line for line in lines if line]
    return lines[-1] if lines else None


def _labels(sample: Sample, reward: str) -> list[str]:
    """The acceptable answers of a sample as strings; a missing label is a data error."""
    label = sample.label
    if label is None or (isinstance(label, (list, tuple)) and not label):
        raise ValueError(
            f"sample index={sample.index} has no label; the {reward!r} reward compares against "
            "ground truth, so put the answer in the prompt file's 'label' field"
        )
    if bad := unscorable_answers(label):  # (a label from a generate_fn: not checked at load)
        raise TypeError(f"sample index={sample.index} has the label {label!r}: the {reward!r} reward compares the "
                        f"answer with a string or a (finite) number, or a list of them, not {answer_kind(bad[0])}; "
                        "fix the prompt file's 'label' field (data.label_key), or score it with a reward function "
                        "of your own")
    answers = list(label) if isinstance(label, (list, tuple)) else [label]
    return [label_text(x) for x in answers]  # a float as its digits (math-verify reads 1e+20 as 1 times e+20)


# ----------------------------------------------------------------------------- built-ins

_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")


def normalize_answer(text: str) -> str:
    """Canonical form for string comparison: case, spaces, $...$, a trailing period, number
    formatting ('1,000' == '1000', '19.0' == '19')."""
    s = " ".join(text.lower().split()).rstrip(".").strip("$ ").rstrip(". ")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if _NUMBER.fullmatch(s):
        # By hand, not Decimal: Decimal rounds to 28 significant digits.
        sign = "-" if s.startswith("-") else ""
        whole, _, frac = s.lstrip("+-").partition(".")
        whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
        s = sign + whole + ("." + frac if frac else "")
        s = "0" if s == "-0" else s
    return s


def exact_match_reward(sample: Sample) -> float:
    """1.0 when the extracted answer (or the whole stripped response) equals a label."""
    text = after_reasoning(sample.response_text, sample.prompt_text or "")
    pred = extract_answer(text)
    pred = normalize_answer(text if pred is None else pred)
    return float(any(pred == normalize_answer(g) for g in _labels(sample, "exact_match")))


def format_reward(sample: Sample) -> float:
    """1.0 when the response ends with exactly one non-empty <answer> span, or (without answer
    tags) has a non-empty \\boxed{}."""
    text = sample.response_text
    n_open, n_close = text.count("<answer>"), text.count("</answer>")
    if n_open or n_close:
        m = _ANSWER_TAG.search(text)
        return float(
            n_open == n_close == 1 and m is not None and bool(m.group(1).strip())
            and not text[m.end():].strip()
        )
    boxed = _last_boxed(text)
    return float(boxed is not None and bool(boxed.strip()))


def _mv_parse(text: str, timeout: int | None, *, bare: bool) -> list:
    """math-verify parse. A `bare` answer such as 'x^2+1' is only found inside math delimiters,
    so it is wrapped in $...$ first; free text is left to math-verify's own extraction."""
    from math_verify import parse  # imported when first used: with sympy ~0.35 s of every process's start

    has_delims = _MATH_DELIMITER.search(text) is not None  # an escaped \$ is a dollar sign, not a delimiter
    candidates = [f"${text}$", text] if bare and not has_delims else [text]
    for candidate in candidates:
        parsed = parse(candidate, parsing_timeout=timeout, raise_on_error=True)
        if parsed:
            return parsed
    return []


def math_reward(sample: Sample) -> dict[str, float]:
    """Symbolic/numeric equivalence of the final answer with a label (math-verify): 1/2 == 0.5.

    Never raises on a garbage response: math-verify's parse/compare failures and timeouts give
    reward 0 and are counted in the returned ``math/error`` (also ``math/pred_unparsed`` when the
    response holds no parseable expression). Off the main thread it runs in a child process (_math_off_main).
    """
    golds = _labels(sample, "math")  # a missing label fails here, in the caller's thread
    if threading.current_thread() is not threading.main_thread():
        return _math_off_main(sample)
    from math_verify import verify
    from math_verify.errors import TimeoutException

    timeout = MATH_VERIFY_TIMEOUT_S
    text = after_reasoning(sample.response_text, sample.prompt_text or "")
    pred_text = extract_answer(text)
    info = {"reward": 0.0, "math/pred_unparsed": 0.0, "math/error": 0.0}
    try:
        pred = (_mv_parse(pred_text, timeout, bare=True) if pred_text is not None
                else _mv_parse(text, timeout, bare=False))
        info["math/pred_unparsed"] = float(all(isinstance(p, str) for p in pred))
        for gold_text in golds:
            gold = _mv_parse(gold_text, timeout, bare=True)
            if not gold:
                logger.warning("math reward: cannot parse label %r (sample index=%d)",
                               gold_text, sample.index)
                continue
            if pred and verify(gold, pred, timeout_seconds=timeout, raise_on_error=True):
                info["reward"] = 1.0
                break
    except TimeoutException:
        logger.warning("math reward: math-verify timed out (sample index=%d)", sample.index)
        info["math/error"] = 1.0
    except Exception:  # math-verify's parse/compare failures (sympy/latex2sympy raise anything)
        logger.debug("math reward: math-verify failed (sample index=%d)", sample.index,
                     exc_info=True)
        info["math/error"] = 1.0
    return info


MATH_CHILD_LIMIT_S = 30
"""Off the main thread: seconds a child process may take on one sample before it is killed (its own alarms
stop math-verify after MATH_VERIFY_TIMEOUT_S per parse/compare; this catches what they cannot interrupt)."""
_math_pool: list = []  # the child process scoring math off the main thread, started on first use
_math_lock = threading.Lock()


def _kill_pool(pool) -> None:
    """Kill a ProcessPoolExecutor's child and shut it down without waiting for it."""
    for proc in list((getattr(pool, "_processes", None) or {}).values()):  # None once the pool broke
        proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def _kill_at_exit(pool) -> None:
    """Kill `pool`'s child when the interpreter exits. concurrent.futures joins its pools at exit, after the
    sample in their child is scored: a run ending while a thread scores one (a one-step-off batch discarded at a
    stop) waited for it, up to MATH_CHILD_LIMIT_S. Hooks of threading's exit run last registered first, so this
    one runs before concurrent.futures' join; atexit's run after it (too late)."""
    def kill():
        _math_exiting.set()
        _kill_pool(pool)

    try:
        threading._register_atexit(kill)
    except (AttributeError, RuntimeError):  # another Python; or exiting already: shut down by atexit, as before
        atexit.register(pool.shutdown, wait=False, cancel_futures=True)


_math_exiting = threading.Event()


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """The math child's initializer: it ends when the process that started it is gone. A rank killed by SIGKILL
    (or ended by os._exit) runs no exit hook, and its child, with multiprocessing's resource tracker, stayed
    behind for good (275 MB each). Polled, since the kernel's parent-death signal follows the thread that
    started the child (a rollout thread), not its process."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _math_in_child(response_text: str, label: Any, index: int) -> dict[str, float]:
    return math_reward(Sample(prompt_ids=[], response_text=response_text, label=label, index=index))


def _math_off_main(sample: Sample) -> dict[str, float]:
    """math_reward from a thread (the one-step-off rollout's): math-verify's timeouts use SIGALRM, which only the
    main thread gets, and a pathological answer (9^{9^{9^{9}}}) would run unbounded and hold the GIL. So a child
    process, in whose main thread the alarms work, scores it; one past MATH_CHILD_LIMIT_S is killed, counted
    as math/error, and replaced, as is one that dies (killed from outside)."""
    import concurrent.futures
    import multiprocessing

    with _math_lock:  # one sample at a time: the child is one process
        if not _math_pool:
            _math_pool.append(concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_exit_with_parent))
            _kill_at_exit(_math_pool[0])
        pool = _math_pool[0]
        future = pool.submit(_math_in_child, sample.response_text, sample.label, sample.index)
        try:
            return future.result(timeout=MATH_CHILD_LIMIT_S)
        except (concurrent.futures.TimeoutError, concurrent.futures.process.BrokenProcessPool) as e:
            if isinstance(e, concurrent.futures.TimeoutError):
                why = f"math-verify ran past {MATH_CHILD_LIMIT_S}s on it; its process was killed"
            else:  # killed from outside (the kernel's OOM killer, say): the pool is broken for every later call
                why = f"its process died ({e}); a new one scores the next"
            if not _math_exiting.is_set():  # at exit the child was killed by _kill_at_exit
                logger.warning("math reward of sample index=%d counted as math/error: %s", sample.index, why)
            _kill_pool(pool)
            _math_pool.clear()
            return {"reward": 0.0, "math/pred_unparsed": 0.0, "math/error": 1.0}


BUILTIN_REWARDS: dict[str, Callable[[Sample], float | dict[str, float]]] = {
    "math": math_reward,
    "exact_match": exact_match_reward,
    "format": format_reward,
}

# ----------------------------------------------------------------------------- spec -> functions

GRANULARITIES = ("sample", "group")
_SPEC_HELP = (f"use a built-in name {sorted(BUILTIN_REWARDS)}, a user function as "
              "'package.module:function', a reward server 'http://host:port/path', a reward model "
              "'model:PATH', or a dict of weights such as {'math': 1.0, 'format': 0.1}")


def spec_weights(spec, granularity: str = "sample") -> dict:
    """name -> weight of a reward spec, or ValueError saying what is wrong with it (no module is imported)."""
    weights = {spec: 1.0} if isinstance(spec, str) else spec
    if not isinstance(weights, dict) or not weights:
        raise ValueError(f"bad reward spec {spec!r}: {_SPEC_HELP}")
    for name, w in weights.items():
        if not isinstance(name, str) or isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise ValueError(f"bad reward spec {spec!r}: entry {name!r}: {w!r} must map a "
                             f"name to a number; {_SPEC_HELP}")
        if not math.isfinite(w) or abs(w) > 1e6:
            raise ValueError(f"bad reward spec {spec!r}: the weight of {name!r} is {w!r}; weights must be finite "
                             "numbers of moderate size (|w| <= 1e6)")
    if granularity == "group":
        name = next(iter(weights))
        if len(weights) != 1 or name in BUILTIN_REWARDS or is_remote(name) or is_reward_model(name):
            raise ValueError(f"reward spec {spec!r} with granularity 'group' must be one user "
                             "function 'package.module:function' taking a group's samples")
    return weights


def _check_call(fn: Callable, path: str, granularity: str) -> None:
    """A user function that cannot be called as the rollout calls it (with one argument: a sample, or a group's
    list of samples) failed at its first call, after a whole rollout: said when it loads."""
    try:  # the callable itself: a functools.wraps decorator's (*args, **kwargs) wrapper is what the rollout calls
        signature = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return
    try:
        signature.bind(None)
    except TypeError as e:
        raise ValueError(f"reward spec {path!r}: {path.partition(':')[2]}{signature} cannot be called with one "
                         f"{'list of samples (granularity group)' if granularity == 'group' else 'sample'} ({e}); "
                         f"{_SPEC_HELP}") from None


def _load_user_fn(path: str) -> Callable:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"bad reward spec {path!r}: {_SPEC_HELP}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"reward spec {path!r}: cannot import {module_name!r} ({e}); "
                         f"{_SPEC_HELP}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward spec {path!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def _kind(name: str) -> str | None:
    """What a spec name is: "remote" (a reward server), "model", "builtin", "user" ('module:function'), or None."""
    if is_remote(name):
        return "remote"
    if is_reward_model(name):
        return "model"
    if name in BUILTIN_REWARDS:
        return "builtin"
    return "user" if ":" in name else None


def _resolve(name: str, batched: dict, tokenizer=None) -> Callable:
    kind = _kind(name)
    if kind == "remote":
        return RemoteReward(name, **batched)
    if kind == "model":  # it reads the policy's tokens as text: the policy's tokenizer decodes them
        return RewardModel(name, batch_size=batched["batch_size"], tokenizer=tokenizer)
    if kind == "builtin":
        return BUILTIN_REWARDS[name]
    if kind == "user":
        return _load_user_fn(name)
    raise ValueError(f"unknown reward spec {name!r}: {_SPEC_HELP}")


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


def _as_reward(value: Any, fn_name: str, sample: Sample | None = None) -> tuple[float, dict[str, float]]:
    """(reward, extras) from a function's return value; wrong types name the function."""
    extras: dict[str, float] = {}
    where = f" for sample index={sample.index}" if sample is not None else ""
    if isinstance(value, dict):
        if "reward" not in value:
            raise TypeError(f"reward function {fn_name} returned a dict without a 'reward' key{where}: keys "
                            f"{sorted(map(repr, value))}")
        extras = {k: v for k, v in value.items() if k != "reward"}
        value = value["reward"]
        for k, v in extras.items():
            if not isinstance(v, numbers.Real):
                raise TypeError(f"reward function {fn_name} returned non-number {type(v).__name__}"
                                f" for extra key {k!r}{where}; extras must be numbers")
            check_finite(v, f"{fn_name} (extra key {k!r})", sample)  # a metric: NaN would poison its mean
    if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # numpy's bool_, a 0-d array or tensor: the Python number it holds
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward function {fn_name} returned {type(value).__name__} ({value!r:.80}){where}; return a "
                        "float or a dict with a 'reward' key")
    check_finite(value, fn_name, sample)
    return float(value), {k: float(v) for k, v in extras.items()}


F32_MAX = 3.4028234663852886e38


def check_finite(value: float, fn_name: str, sample: Sample | None = None) -> None:
    """Rewards feed float32 tensors: a value that is not finite there (1e39 is, in float64) would make the
    advantages and then the loss NaN."""
    try:
        big = not math.isfinite(value) or abs(value) > F32_MAX
    except OverflowError:  # an int beyond any float, e.g. 10**400
        big = True
    if big:
        where = f" for sample index={sample.index} (prompt {sample.prompt_text[-80:]!r})" if sample is not None else ""
        raise ValueError(f"reward function {fn_name} returned {value!r:.40}{where}, which is not a finite float32; "
                         "rewards must be finite numbers of moderate size")


class RewardFn:
    """``await reward_fn(samples)`` or ``reward_fn.score(samples)`` -> one reward per sample.

    Also records ``sample.metadata["reward_info"]``: the extra numbers a function returned and,
    for a weighted spec, each component's unweighted score under its spec name. Does not set
    ``sample.reward``; the caller decides (e.g. after shaping).
    """

    def __init__(self, spec: str | dict[str, float], *, granularity: str = "sample",
                 max_concurrency: int = 32, timeout: float | None = None, batch_size: int = 16,
                 max_retries: int = 3, retry_backoff: float = 1.0, tokenizer=None) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"reward granularity {granularity!r} is not one of {GRANULARITIES}")
        if max_concurrency < 1:
            raise ValueError(f"reward max_concurrency must be >= 1, got {max_concurrency}")
        weights = spec_weights(spec, granularity)
        self.spec = spec
        self.granularity = granularity
        self.weights = {name: float(w) for name, w in weights.items()}
        batched = dict(batch_size=batch_size, timeout=60.0 if timeout is None else timeout,
                       max_retries=max_retries, retry_backoff=retry_backoff, max_concurrency=max_concurrency)
        self.fns = {name: _resolve(name, batched, tokenizer) for name in weights}
        for name, fn in self.fns.items():
            if _kind(name) == "user":
                _check_call(fn, name, granularity)
        self._max_concurrency = max_concurrency
        self.timeout = timeout

    async def __call__(self, samples: list[Sample]) -> list[float]:
        # A fresh semaphore per call: asyncio primitives bind to the loop they are first used on.
        sem = asyncio.Semaphore(self._max_concurrency)
        if self.granularity == "group":
            return await self._score_groups(samples, sem)
        per_fn = {}
        for name, fn in self.fns.items():
            if getattr(fn, "batched", False):  # a reward server or model: whole batches at a time
                per_fn[name] = [_as_reward(v, name, s) for v, s in zip(await fn.score_batch(samples), samples)]
            else:
                per_fn[name] = await asyncio.gather(*(self._run(fn, name, s, sem) for s in samples))
        rewards = []
        for i, sample in enumerate(samples):
            info: dict[str, float] = {}
            total = 0.0
            for name, results in per_fn.items():
                value, extras = results[i]
                check_finite(value, name, sample)
                total += self.weights[name] * value
                for k, v in extras.items():  # several reward models: a sample is truncated where any of them cut it
                    info[k] = max(info[k], v) if k == "rm_truncated" and k in info else v
                if len(self.fns) > 1:
                    info[name] = value
            if info:
                sample.metadata.setdefault("reward_info", {}).update(info)
            check_finite(total, str(self.spec), sample)
            rewards.append(total)
        return rewards

    def score(self, samples: list[Sample]) -> list[float]:
        """Synchronous entry point for code that is not running an event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop: run one (outside this except, so a reward error is not chained to this one)
        else:
            raise RuntimeError("RewardFn.score() called inside a running event loop; "
                               "use `await reward_fn(samples)` there instead")
        return run_user_coroutine(self(samples))

    async def _score_groups(self, samples: list[Sample], sem: asyncio.Semaphore) -> list[float]:
        (name, fn), = self.fns.items()
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.group_id, []).append(i)
        members = [[samples[i] for i in idx] for idx in groups.values()]
        outputs = await asyncio.gather(*(self._call(fn, g, sem, name=name, sample=g[0]) for g in members))
        rewards = [0.0] * len(samples)
        for idx, group, out in zip(groups.values(), members, outputs):
            if not isinstance(out, (list, tuple)) or len(out) != len(group):
                got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
                raise TypeError(f"group reward function {name} must return a list with one value per sample of "
                                f"the group ({len(group)}), got {got} for the group of sample index="
                                f"{group[0].index} (prompt {group[0].prompt_text[-80:]!r})")
            for i, sample, value in zip(idx, group, out):
                rewards[i], extras = _as_reward(value, name, sample)
                if extras:
                    sample.metadata.setdefault("reward_info", {}).update(extras)
        weighted = [self.weights[name] * r for r in rewards]
        for sample, r in zip(samples, weighted):
            check_finite(r, str(self.spec), sample)
        return weighted

    async def _run(self, fn: Callable, name: str, sample: Sample,
                   sem: asyncio.Semaphore) -> tuple[float, dict[str, float]]:
        if fn is BUILTIN_REWARDS.get(name):
            return _as_reward(fn(sample), name, sample)
        return _as_reward(await self._call(fn, sample, sem, name=name, sample=sample), name, sample)

    async def _call(self, fn: Callable, arg: Any, sem: asyncio.Semaphore, *, name: str, sample: Sample) -> Any:
        """Run a user function with the per-call timeout: an async one is cancelled; a sync one runs in a
        daemon thread that is abandoned (Python cannot stop a thread), so a hang cannot hold the job."""
        where = f"sample index={sample.index} (prompt {sample.prompt_text[-80:]!r})"
        async with sem:
            call = asyncio.ensure_future(watched(fn(arg), f"reward function {name} for {where}", self.timeout)
                                         if _is_async(fn) else in_daemon_thread(fn, arg))
            try:
                done, _ = await asyncio.wait({call}, timeout=self.timeout)
            finally:
                call.cancel()  # a no-op once it is done; cancelled with the caller otherwise
            if not done:  # the function's own TimeoutError (a grader's HTTP call, say) is its error, below
                raise TimeoutError(f"reward function {name} did not return within rollout.reward.timeout="
                                   f"{self.timeout}s for {where}; fix the function or raise the timeout")
            try:
                return call.result()
            except Exception as e:  # the user's own error, with which function and which sample (its traceback below)
                raise RuntimeError(f"reward function {name} raised {type(e).__name__}: {e} for {where}") from e


class DaemonThreads(concurrent.futures.ThreadPoolExecutor):
    """The default executor of the event loops that run user code (asyncio.to_thread, run_in_executor(None, ...)):
    a daemon thread per call, and a shutdown that does not wait. With asyncio's own pool, asyncio.run waits at its
    end for every thread the user's coroutine started: a blocking tool that never answers, called through
    asyncio.to_thread, held the run for ever after its caller's timeout instead of raising the timeout's error.
    (A ThreadPoolExecutor subclass: Python 3.11's loops accept no other default executor.)"""

    def __init__(self):
        super().__init__(max_workers=1)  # no worker thread is ever started: submit() is replaced

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work():
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 -- handed to the awaiting coroutine as is
                future.set_exception(e)
            else:
                future.set_result(result)

        threading.Thread(target=work, name="user-code", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass  # a thread still running is abandoned: it is a daemon, and its result goes nowhere


class _Steps:
    """The step of a user coroutine that a loop runs now, if any: `now` = (what, limit in seconds, when it began)."""

    def __init__(self) -> None:
        self.now: tuple[str, float, float] | None = None


_STEPS: contextvars.ContextVar[_Steps] = contextvars.ContextVar("slime_user_steps")
STALL_POLL_S = 0.5  # how often the watchdog of run_user_coroutine looks


@types.coroutine
def watched(coro, what: str, limit: float):
    """Await `coro`, a user's coroutine, marking each of its steps (the code between two awaits) for the watchdog of
    run_user_coroutine: a step that runs past `limit` seconds is an `async def` function blocked in synchronous code
    (requests, subprocess.run, time.sleep), which holds the event loop, so no asyncio timeout can fire."""
    steps = _STEPS.get(None)
    if steps is None or not limit:
        return (yield from coro.__await__())
    send, value = coro.send, None
    while True:
        steps.now = (what, limit, time.monotonic())
        try:
            pending = send(value)
        except StopIteration as e:
            return e.value
        finally:
            steps.now = None
        try:
            value, send = (yield pending), coro.send
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as e:  # noqa: BLE001 -- a cancellation or the awaited future's error: the user's to see
            value, send = e, coro.throw


def _watch(steps: _Steps, loop_thread: int, done: threading.Event) -> None:
    """Ends the process, saying why and where, when a user coroutine's step overruns its limit: nothing else can
    (the loop is held, and Python cannot stop a thread); left alone, one rank would hang and the others wait on it."""
    while not done.wait(STALL_POLL_S):
        now = steps.now
        if now is None or time.monotonic() - now[2] <= now[1]:
            continue
        frame = sys._current_frames().get(loop_thread)
        stack = traceback.extract_stack(frame) if frame is not None else []
        inner = max((i + 1 for i, f in enumerate(stack) if f.name == "watched" and f.filename == __file__), default=0)
        logger.error("%s ran %.1f s, past its limit of %g s, in synchronous code that holds the event loop, so its "
                     "timeout could not fire: an `async def` function must await its I/O (aiohttp or httpx, "
                     "asyncio.create_subprocess_exec, asyncio.sleep, a trajectory's agenerate) or be a plain def (run "
                     "in a thread, under the timeout). Exiting. Where it is:\n%s", now[0], time.monotonic() - now[2],
                     now[1], "".join(traceback.format_list(stack[inner:])) or "(not found)")
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(1)


def run_user_coroutine(coro) -> Any:
    """asyncio.run(coro) with DaemonThreads as the loop's default executor, and a watchdog over the steps of the
    user coroutines it runs through `watched`."""
    steps, done = _Steps(), threading.Event()

    async def main():
        _STEPS.set(steps)  # the tasks made from here on see it
        asyncio.get_running_loop().set_default_executor(DaemonThreads())
        return await coro

    threading.Thread(target=_watch, args=(steps, threading.get_ident(), done), name="user-code-watchdog",
                     daemon=True).start()
    try:
        return asyncio.run(main())
    finally:
        done.set()


def in_daemon_thread(fn: Callable, arg: Any, name: str = "reward") -> asyncio.Future:
    """`fn(arg)` in a daemon thread, as a future of the running loop: awaited with a timeout, a call that never
    returns is abandoned instead of holding the process at exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(how, value):
        try:  # after a timeout the loop may be gone: the result is simply dropped
            loop.call_soon_threadsafe(lambda: future.done() or how(value))
        except RuntimeError:
            pass

    def work():
        try:
            result = fn(arg)
        except BaseException as e:  # noqa: BLE001 -- handed to the awaiting coroutine as is
            settle(future.set_exception, e)
        else:
            settle(future.set_result, result)

    threading.Thread(target=work, name=name, daemon=True).start()
    return future


LABELLED_REWARDS = ("math", "exact_match")
"""Built-in rewards that compare against the row's label."""


def needs_label(spec: str | dict) -> bool:
    """Whether every row must have a label for this reward spec (user functions decide for themselves)."""
    names = [spec] if isinstance(spec, str) else list(spec)
    return any(name in LABELLED_REWARDS for name in names)


def make_reward_fn(spec: str | dict[str, float], *, granularity: str = "sample",
                   max_concurrency: int = 32, timeout: float | None = None, **batched) -> RewardFn:
    """Build the reward callable for a run's reward spec (see the module docstring). `batched` (batch_size,
    max_retries, retry_backoff) configures reward servers and models."""
    return RewardFn(spec, granularity=granularity, max_concurrency=max_concurrency, timeout=timeout, **batched)


def check_reward_spec(spec: str | dict, key: str = "rollout.reward.fn", granularity: str = "sample") -> None:
    """Refuse a spec that cannot load, before anything slow runs (models load before the reward function): weights
    that are no numbers, a group granularity of anything but one function of the user's, an unknown name (with the
    built-in it is closest to), or a user function whose module is not importable. Imports no user module (a
    module's own import errors show when the run loads it) and loads no model."""
    try:
        spec_weights(spec, granularity)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    for name in ([spec] if isinstance(spec, str) else list(spec) if isinstance(spec, dict) else []):
        if isinstance(name, str) and _kind(name) == "model":
            _check_reward_model(name, key)
            continue
        if not isinstance(name, str) or (kind := _kind(name)) not in (None, "user"):
            continue  # a server or a built-in; a bad entry type is the RewardFn's to explain
        if kind is None:
            close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1)
            raise ValueError(f"{key}: unknown reward spec {name!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else "") + f"; {_SPEC_HELP}")
        module_name, _, attr = name.partition(":")
        try:
            found = bool(module_name and attr) and importlib.util.find_spec(module_name) is not None
        except (ImportError, ValueError):  # a parent package that is missing, or a relative name
            found = False
        if not found:
            raise ValueError(f"{key}: reward spec {name!r}: "
                             + (f"no module {module_name!r} is importable (is its directory on PYTHONPATH?)"
                                if module_name and attr else "give it as 'package.module:function'")
                             + f"; {_SPEC_HELP}")


def load_user_reward_fns(spec: str | dict, granularity: str = "sample") -> None:
    """Import the user functions of a valid spec (check_reward_spec) and refuse one its module lacks or that cannot
    take one sample (or group): at start, before the models load, so that such a typo is said in seconds."""
    for name in spec_weights(spec, granularity):
        if _kind(name) == "user":
            _check_call(_load_user_fn(name), name, granularity)


def _check_reward_model(name: str, key: str) -> None:
    """A `model:PATH` spec: a local folder whose config.json is a classifier's with one output (its config only is
    read: the weights load after the policy's, minutes later on a large model)."""
    from transformers import AutoConfig

    path = Path(os.path.expanduser(name[len(MODEL_PREFIX):]))
    if not path.is_dir() or not (path / "config.json").is_file():
        where = "" if path.is_absolute() else f" ({path.resolve()}: relative paths are read from {Path.cwd()})"
        raise ValueError(f"{key}: reward model {name!r}: {path} is not a folder with a config.json{where}; give "
                         "'model:PATH' with PATH a sequence-classification checkpoint's folder")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)  # a config read: no code run, no prompt
    except (OSError, ValueError):
        return  # a config transformers cannot read: RewardModel says so when it loads
    causal = [a for a in config.architectures or () if a.endswith(("ForCausalLM", "LMHeadModel"))]
    if causal:
        raise ValueError(f"{key}: reward model {name!r} is a causal LM's checkpoint ({causal[0]}), not a sequence-"
                         "classification one: a reward model is a classifier with one output (e.g. "
                         "Qwen2ForSequenceClassification, num_labels=1) trained to score responses")
    if config.num_labels != 1:
        raise ValueError(f"{key}: reward model {name!r} has num_labels={config.num_labels}; a reward model has one "
                         "output (num_labels=1), its score")


def reward_fn_from_config(cfg, tokenizer=None) -> RewardFn:
    """The run's reward from its `rollout.reward` section; `tokenizer` is the policy's (a reward model decodes the
    policy's tokens with it)."""
    return make_reward_fn(cfg.fn, granularity=cfg.granularity, timeout=cfg.timeout, max_concurrency=cfg.max_concurrency,
                          batch_size=cfg.batch_size, max_retries=cfg.max_retries, retry_backoff=cfg.retry_backoff,
                          tokenizer=tokenizer)
