"""User generate functions: multi-turn rollouts, tool calls, anything beyond one completion per sample.

`rollout.generate_fn = "package.module:function"` replaces the single-turn generation. The function is
called once per prompt (one group of `rollout.n_samples_per_prompt` samples) with a `RolloutContext` and
returns the group's samples; sync and async functions both work:

    def my_rollout(ctx: RolloutContext) -> list[Sample]:
        out = []
        for _ in range(ctx.n):
            traj = ctx.trajectory()
            gen = traj.generate(stop_token_ids=[...])      # the policy's turn: loss and logprobs
            traj.observe(ctx.tokenizer(tool_output, add_special_tokens=False).input_ids)  # mask 0
            traj.generate()
            out.append(traj.sample(reward=None))           # None: the configured reward scores it
        return out

A trajectory only appends token ids: the context sent to the engine is always the prompt ids plus every
id appended so far, never re-tokenised text, so the trainer scores exactly the tokens the engine saw.
Generated tokens carry loss (mask 1) and the engine's logprobs; observations carry neither (mask 0,
logprob 0), so they are excluded from the policy loss, the KL terms, the entropy and the mismatch metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import math
import numbers
import operator
import threading
import time
from typing import Any, Callable

import torch

from slime.data.prompts import Prompt
from slime.data.sample import Sample, as_token_tensor
from slime.rollout.engine import REQUEST_WAIT, Generation, RolloutEngine, SamplingParams
from slime.rollout.rewards import in_daemon_thread, run_user_coroutine, watched


class Trajectory:
    """One sample built turn by turn."""

    def __init__(self, ctx: "RolloutContext"):
        self.ctx = ctx
        self.response_ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason = "stop"
        self.turns = 0
        self.sampled_image_token = False  # the policy generated the image token: no engine can go on from here
        self.ended_at_image_token = False  # ... and a generate() call after it was refused for that

    @property
    def context_ids(self) -> list[int]:
        return self.ctx.prompt.prompt_ids + self.response_ids

    @property
    def remaining(self) -> int:
        """Tokens left of rollout.max_response_len for this trajectory (generated and observed together); 0 once a
        turn was refused after the policy sampled the image token (a loop on it ends)."""
        return 0 if self.ended_at_image_token else self._room()

    def _room(self) -> int:
        return self.ctx.params.max_new_tokens - len(self.response_ids)

    def generate(self, *, max_new_tokens: int | None = None, stop_token_ids: tuple[int, ...] | list[int] = (),
                 temperature: float | None = None) -> Generation:
        """The policy's next turn from everything so far; its tokens carry loss and logprobs. `temperature` may
        differ from rollout.temperature only in evaluation (nothing trained, params.trains false): the trainer
        scores every generated token at rollout.temperature, and TIS and the PPO ratio would compare logprobs of
        two distributions. (`RolloutContext.generate` takes any temperature, for text the trajectory observes.)"""
        run_t = self.ctx.params.temperature
        if temperature is not None and temperature != run_t and run_t != 0 and self.ctx.params.trains:
            raise ValueError(f"Trajectory.generate(temperature={temperature}) for {self.ctx.prompt.where}: "
                             f"the trainer scores the trajectory's generated tokens at rollout.temperature={run_t}, so "
                             "their rollout logprobs must be sampled at it too; generate text at another temperature "
                             "with ctx.generate() and add it with trajectory.observe() (no loss)")
        if self.sampled_image_token:
            self.ended_at_image_token = True
            return Generation([], [], "image_token")
        budget = self.remaining if max_new_tokens is None else min(max_new_tokens, self.remaining)
        if budget <= 0:
            self.finish_reason = "length"
            return Generation([], [], "length")
        gen = self.ctx.generate(self.context_ids, max_new_tokens=budget, stop_token_ids=stop_token_ids,
                                temperature=temperature)
        mm = self.ctx.prompt.mm
        # The policy sampled the image token: no image fills it, so no engine can go on from this context (the
        # trainer reads the token as text, as the engine did). The trajectory's turns end here, not the run: a
        # later generate() returns nothing (rollout/image_token_ends counts the samples that asked for one).
        self.sampled_image_token |= mm is not None and mm.token_id in gen.response_ids
        self.response_ids += gen.response_ids
        self.mask += [1] * len(gen.response_ids)
        self.logprobs += gen.logprobs
        self.finish_reason = gen.finish_reason
        self.turns += 1
        return gen

    async def agenerate(self, **kwargs) -> Generation:
        """`generate` for async generate functions: the request runs in a thread of its own, so the groups'
        trajectories wait on the engine concurrently, all of them (a pool's few threads would queue requests
        before the engine, and that wait would count against rollout.generate_fn_timeout)."""
        return await in_daemon_thread(lambda _: self.generate(**kwargs), None, name="agenerate")

    def observe(self, ids: list[int]) -> None:
        """Append tokens the policy did not choose (a tool's output, the user's next message): no loss. What does
        not fit in rollout.max_response_len is cut, and the sample then ends at its length limit."""
        try:  # numpy's or torch's integers as Python ints; a float is refused
            ids = [operator.index(t) for t in ids]
        except TypeError:
            raise TypeError(f"trajectory.observe() for {self.ctx.prompt.where} takes token ids (integers), "
                            f"got {list(ids)[:5]!r:.80}; tokenize text with ctx.tokenizer first") from None
        room = max(self._room(), 0)
        if len(ids) > room:
            ids, self.finish_reason = ids[:room], "length"
        self.response_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def sample(self, *, reward: float | None = None, metadata: dict | None = None) -> Sample:
        p = self.ctx.prompt
        s = Sample(prompt_ids=list(p.prompt_ids), response_ids=list(self.response_ids), response_mask=list(self.mask),
                   rollout_logprobs=as_token_tensor(self.logprobs), prompt_text=p.prompt_text,
                   response_text=self.ctx.tokenizer.decode(self.response_ids, skip_special_tokens=True),
                   label=p.label, metadata={**p.metadata, **(metadata or {}), "turns": self.turns,
                                            **({"ended_at_image_token": True} if self.ended_at_image_token else {})},
                   finish_reason=self.finish_reason)
        if reward is not None:
            if not isinstance(reward, numbers.Real) and getattr(reward, "ndim", None) == 0 and hasattr(reward, "item"):
                reward = reward.item()  # numpy's scalars, 0-d arrays and tensors, as reward functions may return
            if not isinstance(reward, numbers.Real) or not math.isfinite(reward):  # a bool is 0 or 1, as there
                error = ValueError if isinstance(reward, numbers.Real) else TypeError
                raise error(f"Trajectory.sample(reward={reward!r:.60}) for {p.where}: the reward must be "
                            "a finite number (or None, for the reward function to score the sample)")
            s.given_reward = float(reward)
        return s


def _token_ids(ids, what: str) -> list[int]:
    """A sample's token ids as a list of ints (numpy and torch integers, tuples taken); else ValueError."""
    out, bad = [], []
    for t in ids:
        try:
            n = operator.index(t)
        except TypeError:
            bad.append(t)
            continue
        if isinstance(t, bool) or n < 0:
            bad.append(t)
        out.append(n)
    if bad:
        raise ValueError(f"{what} has token ids that are not non-negative integers: {bad[:5]}")
    return out


class QueueClock:
    """How long a prompt's requests waited for an engine (one that serves one call at a time, or SGLang's request
    pool): the time during which at least one of them waited (run_generate_fn does not count it against the
    prompt's timeout)."""

    def __init__(self):
        self._lock, self._waiting, self._since, self._total = threading.Lock(), 0, 0.0, 0.0

    def enter(self) -> None:
        """A request starts to wait."""
        with self._lock:
            if not self._waiting:
                self._since = time.monotonic()
            self._waiting += 1

    def leave(self) -> None:
        """A request waits no more."""
        with self._lock:
            self._waiting -= 1
            if not self._waiting:
                self._total += time.monotonic() - self._since

    @contextlib.contextmanager
    def waiting(self):
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def seconds(self) -> float:
        with self._lock:
            return self._total + (time.monotonic() - self._since if self._waiting else 0.0)


@dataclasses.dataclass
class RolloutContext:
    prompt: Prompt
    params: SamplingParams
    tokenizer: Any
    engine: RolloutEngine
    lock: threading.Lock | None = None
    queue: QueueClock = dataclasses.field(default_factory=QueueClock)  # its waits for `lock` or an engine queue

    @property
    def n(self) -> int:
        """Samples to return for this prompt (rollout.n_samples_per_prompt; eval.n_samples_per_prompt in evaluation)."""
        return self.params.n

    def trajectory(self) -> Trajectory:
        return Trajectory(self)

    def generate(self, input_ids: list[int], *, max_new_tokens: int, stop_token_ids=(), temperature=None
                 ) -> Generation:
        """One completion of `input_ids` with the run's sampling settings (EOS always stops). A context holding image
        tokens goes with the prompt's images; one without any (a judge's or a user simulator's text) without."""
        input_ids = list(input_ids)  # once: an iterator would be spent by the image-token test below
        params = dataclasses.replace(self.params, n=1, max_new_tokens=max_new_tokens,
                                     stop_token_ids=tuple(self.params.stop_token_ids) + tuple(stop_token_ids),
                                     temperature=self.params.temperature if temperature is None else temperature)
        p = self.prompt
        # The prompt's images go with a context that holds image tokens (the engine checks that they fill them all);
        # a context without any (a judge's or a user simulator's own text) goes without
        mm = [p.mm] if p.mm is not None and p.mm.token_id in input_ids else None
        if self.lock is None:  # an engine serving calls at once; one with a request queue counts its waits here
            token = REQUEST_WAIT.set(self.queue)
            try:
                return self.engine.generate([input_ids], params, mm=mm)[0][0]
            finally:
                REQUEST_WAIT.reset(token)
        with self.queue.waiting():  # an in-process engine serves one call at a time
            self.lock.acquire()
        try:
            return self.engine.generate([input_ids], params, mm=mm)[0][0]
        finally:
            self.lock.release()


def load_generate_fn(spec: str) -> Callable:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"rollout.generate_fn={spec!r} must look like 'package.module:function'")
    import importlib

    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ModuleNotFoundError, AttributeError) as e:
        raise ValueError(f"rollout.generate_fn={spec!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"rollout.generate_fn={spec!r} is not callable")
    return fn


def run_generate_fn(fn: Callable, spec: str, engine: RolloutEngine, prompts: list[Prompt], params: SamplingParams,
                    tokenizer, *, timeout: float = 0.0) -> list[list[Sample]]:
    """The user's samples per prompt, checked: every group has n samples whose token fields line up.

    Each prompt's call gets `timeout` seconds (0: no limit), not counting the time its requests queue for an engine
    that serves one at a time (async functions start every prompt at once): an async function is cancelled, a sync
    one runs in a daemon thread that is abandoned (Python cannot stop a thread), so a tool that never answers ends
    the run with the function and the prompt named instead of hanging it. Sync functions run one group at a
    time, or up to 64 at once on an engine that serves concurrent requests."""
    lock = None if getattr(engine, "thread_safe", False) else threading.Lock()
    contexts = [RolloutContext(p, params, tokenizer, engine, lock) for p in prompts]
    is_async = inspect.iscoroutinefunction(fn)

    async def all_groups():
        at_once = asyncio.Semaphore(len(contexts) if is_async else 64 if lock is None else 1)

        async def finished(ctx, call):
            """The call's result; the user's own exception as it is, with the function and the prompt added."""
            try:
                return await call
            except Exception as e:
                if hasattr(e, "add_note"):  # Python 3.11+
                    e.add_note(f"raised by rollout.generate_fn {spec} for {ctx.prompt.where} "
                               f"({ctx.prompt.prompt_text[-80:]!r})")
                raise

        async def one(ctx):
            async with at_once:
                where = f"rollout.generate_fn {spec} for {ctx.prompt.where}"
                call = asyncio.ensure_future(watched(fn(ctx), where, timeout) if is_async else
                                             in_daemon_thread(fn, ctx, name="generate_fn"))
                if not timeout:
                    return await finished(ctx, call)
                start = time.monotonic()
                try:
                    while (left := start + timeout + ctx.queue.seconds() - time.monotonic()) > 0:
                        done, _ = await asyncio.wait({call}, timeout=left)
                        if done:
                            return await finished(ctx, call)
                finally:  # also when another prompt's error stops this one: its own error is not logged as lost
                    if call.done() and not call.cancelled():
                        call.exception()
                    call.cancel()
                raise TimeoutError(f"rollout.generate_fn {spec} did not return within rollout.generate_fn_timeout="
                                   f"{timeout:g}s for {ctx.prompt.where} "
                                   f"({ctx.prompt.prompt_text[-80:]!r}); fix the function (a tool that never "
                                   "answers?) or raise the timeout")
        return await asyncio.gather(*(one(ctx) for ctx in contexts))

    groups = run_user_coroutine(all_groups())
    seen: set[int] = set()
    for ctx, group in zip(contexts, groups):
        if not isinstance(group, (list, tuple)) or len(group) != params.n or \
                not all(isinstance(s, Sample) for s in group):
            if inspect.iscoroutine(group):  # an async __call__ of an object: not seen as async, never awaited
                group.close()
                got = "a coroutine (an object whose __call__ is async is not recognised: use an async def function)"
            elif isinstance(group, (list, tuple)):
                kinds = sorted({type(s).__name__ for s in group})
                got = f"a {type(group).__name__} of {len(group)} ({', '.join(kinds) or 'empty'})"
            else:
                got = type(group).__name__
            count = "rollout" if params.trains else "eval"  # evaluation asks for eval.n_samples_per_prompt
            raise TypeError(f"rollout.generate_fn {spec} must return a list of {params.n} Sample objects per prompt "
                            f"(RolloutContext.trajectory().sample(); {count}.n_samples_per_prompt={params.n}), got "
                            f"{got} for {ctx.prompt.where}")
        for s in group:
            if id(s) in seen:
                raise ValueError(f"rollout.generate_fn {spec} returned one Sample object twice ("
                                 f"{ctx.prompt.where}); build each of the n samples from its own trajectory")
            seen.add(id(s))
            what = f"rollout.generate_fn {spec}: a sample of {ctx.prompt.where}"
            s.prompt_ids, s.response_ids = _token_ids(s.prompt_ids, what), _token_ids(s.response_ids, what)
            if s.prompt_ids != ctx.prompt.prompt_ids:  # the trainer would score the response in another context
                raise ValueError(f"{what} has prompt_ids that are not the prompt's ({len(s.prompt_ids)} ids, the "
                                 f"prompt has {len(ctx.prompt.prompt_ids)}): the engine conditioned on the prompt, "
                                 "and its group is the prompt's. Build samples with ctx.trajectory(), or keep "
                                 "ctx.prompt.prompt_ids; text added before the reply goes in with observe()")
            if s.mm is not None and s.mm is not ctx.prompt.mm:  # the trainer gives every sample its prompt's images
                raise ValueError(f"{what} has images of its own (Sample.mm): a sample's images are its prompt's, "
                                 "with which the engine generated, and the trainer gives it those; a generate "
                                 "function cannot add any (leave Sample.mm unset)")
            r = len(s.response_ids)
            if r == 0:
                raise ValueError(f"{what} has no response tokens; call trajectory.generate() at least once")
            if r > params.max_new_tokens:  # the trainer sizes micro-batches (and says what to change) by this limit
                raise ValueError(f"{what} has {r} response tokens, more than rollout.max_response_len="
                                 f"{params.max_new_tokens} (a trajectory's generate() and observe() stop at it; a "
                                 "sample built by hand must too)")
            if s.rollout_logprobs is None:
                raise ValueError(f"{what} has no rollout_logprobs: the trainer needs the engine's logprob of every "
                                 "generated token (0 for observations) for the importance-sampling correction and "
                                 "the mismatch metrics. A trajectory's generate() records them; a sample built by "
                                 "hand takes the engine's Generation.logprobs (zeros would pass for certainty)")
            if not isinstance(s.rollout_logprobs, torch.Tensor):  # a list: the batch concatenates tensors
                s.rollout_logprobs = as_token_tensor(s.rollout_logprobs)
            if len(s.loss_mask) != r or s.rollout_logprobs.shape != (r,):
                raise ValueError(f"{what} has {r} response tokens but {len(s.loss_mask)} mask entries and "
                                 f"logprobs of shape {tuple(s.rollout_logprobs.shape)} (one per response token)")
            logps = s.rollout_logprobs.float()
            if not bool(torch.isfinite(logps).all()) or bool((logps > 1e-4).any()):
                wrong = logps[~torch.isfinite(logps) | (logps > 1e-4)].tolist()
                raise ValueError(f"{what} has rollout logprobs {wrong[:5]}: a token's log-probability is finite "
                                 "and <= 0 (observation tokens carry 0)")
            if s.response_mask is not None and any(m not in (0, 1) for m in s.response_mask):
                raise ValueError(f"{what} has response mask values {sorted(set(s.response_mask) - {0, 1})[:5]}; "
                                 "the mask is 1 for tokens the policy generated and 0 for observations")
    return [list(g) for g in groups]
