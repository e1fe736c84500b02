"""Rollout on this rank's share: prompts -> n responses each -> rewards (+ DAPO shaping and filtering).

Samples stay on the rank that generated them; only counts are exchanged. Dynamic sampling (DAPO)
runs in lockstep on every rank: each attempt draws prompts, generates, drops groups whose rewards
are all equal, and all ranks agree (all-reduce) whether the global batch is full. The kept groups
are then cut to exactly rollout.batch_size groups, lower ranks first, from gathered counts.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import io
import json
import logging
import math
import numbers
import threading
import time

import torch

from slime.config import Config, RolloutConfig
from slime.data.prompts import Prompt, PromptSource
from slime.data.sample import Sample, as_token_tensor
from slime.distributed.parallel_dims import ParallelDims
from slime.rollout.custom import load_generate_fn, run_generate_fn
from slime.rollout.engine import RolloutEngine, SamplingParams
from slime.rollout.rewards import check_finite

logger = logging.getLogger(__name__)


def sampling_params(cfg: RolloutConfig, turn_end: tuple[int, ...] = ()) -> SamplingParams:
    """The rollout's sampling; `turn_end`: the chat template's end of turn where it is not EOS (turn_end_stops)."""
    stops = tuple(cfg.stop_token_ids) + tuple(t for t in turn_end if t not in cfg.stop_token_ids)
    return SamplingParams(max_new_tokens=cfg.max_response_len, temperature=cfg.temperature, top_p=cfg.top_p,
                          stop_token_ids=stops, n=cfg.n_samples_per_prompt, ignore_eos=cfg.ignore_eos)


def generate_rollout(engine: RolloutEngine, prompts: list[Prompt], params: SamplingParams, tokenizer, reward_fn,
                     *, first_group_id: int, first_index: int = 0, generate_fn: str | None = None,
                     generate_fn_timeout: float = 0.0) -> list[Sample]:
    """`params.n` responses per prompt (one completion each, or what `generate_fn` builds), scored. Group
    ids start at first_group_id, sample indices (positions in the global batch, named in logs) at first_index."""
    if generate_fn:
        groups = run_generate_fn(load_generate_fn(generate_fn), generate_fn, engine, prompts, params, tokenizer,
                                 timeout=generate_fn_timeout)
    else:
        mm = [p.mm for p in prompts] if any(p.mm is not None for p in prompts) else None
        outputs = engine.generate([p.prompt_ids for p in prompts], params, mm=mm)
        groups = [[Sample(prompt_ids=list(prompt.prompt_ids), response_ids=gen.response_ids,
                          rollout_logprobs=as_token_tensor(gen.logprobs), prompt_text=prompt.prompt_text,
                          response_text=tokenizer.decode(gen.response_ids, skip_special_tokens=True),
                          label=prompt.label, metadata=dict(prompt.metadata), finish_reason=gen.finish_reason)
                   for gen in gens] for prompt, gens in zip(prompts, outputs)]
    samples = []
    for g, (prompt, group) in enumerate(zip(prompts, groups)):
        for s in group:
            s.group_id, s.index = first_group_id + g, first_index + len(samples)
            s.mm = None if prompt.mm is None else prompt.mm.without_images()
            samples.append(s)
    # A generate function may grade its own samples (Sample.given_reward); the reward function scores the rest.
    direct = next((s for s in samples if s.given_reward is None and s.reward != 0.0), None) if generate_fn else None
    if direct is not None:  # the reward function's score would replace it in silence
        raise ValueError(f"rollout.generate_fn {generate_fn} set Sample.reward={direct.reward!r:.60} for a sample "
                         f"of {prompts[direct.group_id - first_group_id].where} ({direct.prompt_text[-80:]!r}), which "
                         "the reward function's score would replace: give a sample's reward with "
                         "trajectory.sample(reward=...), or leave it to rollout.reward.fn")
    to_score = [s for s in samples if s.given_reward is None]
    graded_groups = {s.group_id for s in samples if s.given_reward is not None}
    mixed = next((s for s in to_score if s.group_id in graded_groups), None)
    if mixed is not None and getattr(reward_fn, "granularity", "sample") == "group":
        raise ValueError(f"rollout.generate_fn {generate_fn} graded some samples of "
                         f"{prompts[mixed.group_id - first_group_id].where} but not all, and the reward function "
                         f"{reward_fn.spec} scores whole groups: grade all of a group's samples or none")
    for sample, reward in zip(to_score, reward_fn.score(to_score) if to_score else []):
        sample.reward = float(reward)
    for s in samples:
        if s.given_reward is not None:
            given = s.given_reward
            if isinstance(given, bool) or not isinstance(given, numbers.Real):
                raise TypeError(f"rollout.generate_fn {generate_fn} set given_reward={given!r:.60} for a sample of "
                                f"{prompts[s.group_id - first_group_id].where} ({s.prompt_text[-80:]!r}); it must be "
                                "a number")
            check_finite(given, f"rollout.generate_fn {generate_fn}", s)
            s.reward = float(given)
    return samples


def _generate_shared(engine, prompts: list[Prompt], params: SamplingParams, tokenizer, reward_fn,
                     dims: ParallelDims, *, first_group_id: int, first_index: int,
                     generate_fn: str | None = None, generate_fn_timeout: float = 0.0) -> list[Sample]:
    """The dp rank's prompts, generated once: with sequence parallelism its sp peers (which train on the same
    samples) each generate a contiguous part and all-gather the rest, so they all hold the same batch."""
    if dims.sp == 1:
        return generate_rollout(engine, prompts, params, tokenizer, reward_fn, first_group_id=first_group_id,
                                first_index=first_index, generate_fn=generate_fn,
                                generate_fn_timeout=generate_fn_timeout)
    bounds = [len(prompts) * r // dims.sp for r in range(dims.sp + 1)]
    a, b = bounds[dims.sp_rank], bounds[dims.sp_rank + 1]
    mine = generate_rollout(engine, prompts[a:b], params, tokenizer, reward_fn, first_group_id=first_group_id + a,
                            first_index=first_index + a * params.n, generate_fn=generate_fn,
                            generate_fn_timeout=generate_fn_timeout) if b > a else []
    return [s for part in dims.all_gather_objects(mine, group=dims.sp_group) for s in part]


def overlong_penalty(length: int, *, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to max_len - buffer_len, then a linear ramp to -factor."""
    if max_len <= 0 or length <= max_len - buffer_len:
        return 0.0
    if length > max_len or buffer_len == 0:
        return -factor
    return factor * ((max_len - buffer_len) - length) / buffer_len


def shape_overlong(samples: list[Sample], op) -> None:
    """Add DAPO's overlong penalty (rollout.overlong_penalty) to each sample's reward; the reward before it stays
    in `task_reward`, which dynamic sampling filters on."""
    for s in samples:
        s.task_reward = s.reward
        s.reward += overlong_penalty(len(s.response_ids), max_len=op.max_len, buffer_len=op.buffer_len,
                                     factor=op.factor)


def groups_with_signal(samples: list[Sample]) -> list[list[Sample]]:
    """Groups (in order) whose rewards before the overlong penalty are not all equal. As in DAPO, which drops the
    prompts of accuracy 0 or 1, the penalty does not count: a group of wrong answers, one of them long, has nothing
    to learn about the task, and its penalised samples would take the place of a group that has."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)

    def task(s: Sample) -> float:
        return s.reward if s.task_reward is None else s.task_reward

    return [g for g in groups.values() if max(map(task, g)) > min(map(task, g))]


def over_sampled(need: int, factor: float, dp: int) -> int:
    """Prompts dynamic sampling draws for `need` more groups: factor x need, rounded up to a multiple of dp."""
    return math.ceil(need * factor / dp) * dp


def collect_rollout(engine: RolloutEngine, data: PromptSource, cfg: RolloutConfig, tokenizer, reward_fn,
                    dims: ParallelDims, *, step: int) -> tuple[list[Sample], dict]:
    """This rank's share of the step's batch (its own generations) and global rollout metrics."""
    kept: list[Sample] = []  # this rank's kept samples
    generated: list[Sample] = []
    attempts, n_kept_groups, drawn_groups = 0, 0, 0
    engine.wake()
    while True:
        need = cfg.batch_size - n_kept_groups
        n_prompts = over_sampled(need, cfg.over_sample_factor, dims.dp) if cfg.dynamic_sampling else None
        samples = _draw_and_generate(engine, data, cfg, tokenizer, reward_fn, dims, step=step, attempt=attempts,
                                     n_prompts=n_prompts)
        generated += samples
        attempts += 1
        if not cfg.dynamic_sampling:
            kept = samples
            break
        mine = groups_with_signal(samples)
        kept += [s for g in mine for s in g]
        got, drawn = dims.all_reduce_sum([len(mine), len({s.group_id for s in samples})])
        n_kept_groups, drawn_groups = n_kept_groups + int(got), drawn_groups + int(drawn)
        if n_kept_groups >= cfg.batch_size or attempts >= cfg.max_sampling_attempts:
            break
    engine.sleep()
    with_signal = n_kept_groups  # every group with signal, before the cut to the batch size
    if cfg.dynamic_sampling:
        kept = _cut_to_batch_size(kept, cfg.batch_size, dims)
        n_kept_groups = min(n_kept_groups, cfg.batch_size)
        if n_kept_groups == 0:
            raise RuntimeError(
                f"dynamic sampling kept no group in {attempts} attempts (rollout.max_sampling_attempts): in every "
                "group all samples got the same reward before any overlong penalty (all solved or all failed), so "
                "none has a task signal to train on. Check the reward function and the prompts' difficulty, raise "
                "rollout.max_sampling_attempts or rollout.over_sample_factor, or set rollout.dynamic_sampling=false")
        if n_kept_groups < cfg.batch_size and dims.rank == 0:  # global figures: said once
            logger.warning("dynamic sampling kept %d of %d groups after %d attempts (rollout.max_sampling_attempts)",
                           n_kept_groups, cfg.batch_size, attempts)
    metrics = rollout_metrics(generated, dims)
    metrics.update({"rollout/sampling_attempts": attempts, **kept_counts(kept, dims)})
    if cfg.dynamic_sampling:  # what was drawn, and why groups were left out; the reward of what trains
        reward, count = dims.all_reduce_sum([sum(s.reward for s in kept), len(kept)])
        metrics.update({"rollout/drawn_groups": drawn_groups, "rollout/no_signal_groups": drawn_groups - with_signal,
                        "rollout/surplus_groups": with_signal - n_kept_groups,
                        "rollout/kept_reward_mean": reward / max(count, 1)})
    return kept, metrics


def kept_counts(kept: list[Sample], dims: ParallelDims) -> dict[str, int]:
    """The groups and samples the step trains on, over all ranks (fewer groups than rollout.batch_size where
    dynamic sampling kept fewer, or prompts were skipped when drawn: data/skipped_*)."""
    groups, samples = dims.all_reduce_sum([len({s.group_id for s in kept}), len(kept)])
    return {"rollout/kept_groups": int(groups), "rollout/kept_samples": int(samples)}


def _draw_and_generate(engine, data: PromptSource, cfg: RolloutConfig, tokenizer, reward_fn, dims: ParallelDims, *,
                       step: int, attempt: int, n_prompts: int | None, seed: int | None = None) -> list[Sample]:
    """One sampling attempt on this rank: draw prompts, generate, score, shape. Each sample records the engine
    weight version that generated it (metadata weight_version)."""
    params = dataclasses.replace(sampling_params(cfg, data.turn_end), seed=seed)
    version = engine.weight_version
    prompts = data.next_batch(n_prompts)
    # Ids from the share drawn, not from the prompts kept: a rank whose image broke since load has fewer, and
    # its neighbour's group ids and sample indices must not run into its own.
    share = (n_prompts or cfg.batch_size) // dims.dp
    first = (step * cfg.max_sampling_attempts + attempt) * 10**6 + dims.dp_rank * share
    samples = _generate_shared(engine, prompts, params, tokenizer, reward_fn, dims, first_group_id=first,
                               first_index=dims.dp_rank * share * params.n, generate_fn=cfg.generate_fn,
                               generate_fn_timeout=cfg.generate_fn_timeout)
    if cfg.overlong_penalty.max_len:
        shape_overlong(samples, cfg.overlong_penalty)
    for s in samples:
        s.metadata["weight_version"] = version
    return samples


class RolloutAhead:
    """One-step-off-policy rollout (rollout.one_step_off): step k+1's batch is generated in a background thread
    while the trainer trains on step k's. The thread runs no collective (the trainer's collectives run at the
    same time): it draws this rank's prompts, generates and scores; the metrics, which reduce over ranks, are
    computed when the batch is taken. The caller pushes weights only between `take` and the next `start`,
    when nothing is generating.

    The thread is a daemon: a run that stops (an error, a signal) does not wait at exit for a batch it will not
    use. Each batch samples from its own generator, seeded by `seed`, the step and the rank: the trainer's
    activation checkpointing saves and restores torch's global generator while this thread would draw from it,
    which made runs irreproducible."""

    STOP_WAIT_S = 60.0  # at close, how long a batch in flight may take to finish before it is abandoned
    ABORT_EVERY_S = 0.5

    def __init__(self, engine, data: PromptSource, cfg: RolloutConfig, tokenizer, reward_fn, dims: ParallelDims,
                 seed: int = 0):
        self.engine, self.data, self.cfg, self.tokenizer, self.reward_fn, self.dims = \
            engine, data, cfg, tokenizer, reward_fn, dims
        self.seed = seed
        self._future = None
        self.skipped_when_drawn: collections.Counter = collections.Counter()
        """The prompt source's skips when drawn as the batch taken last was drawn: the next batch, drawn while
        that one trains, must not count in its step's data/skipped_*."""
        self.waited_s = 0.0
        """How long checkpoints waited for the batch in flight (finish): the step that takes it counts that as
        its wait for the batch (time/rollout), which take() found over."""
        self.data_state = data.state_dict()
        """The prompt source's position before the batch in flight: what a checkpoint records for a resumed run
        that cannot use the batch `finish` saved (it generates that batch again)."""

    def start(self, step: int) -> None:
        assert self._future is None, "a rollout is already in flight"
        self.data_state = self.data.state_dict()
        future: concurrent.futures.Future = concurrent.futures.Future()
        seed = (self.seed * 1_000_003 + step) * 1009 + self.dims.rank

        def work():
            start = time.perf_counter()
            try:
                samples = _draw_and_generate(self.engine, self.data, self.cfg, self.tokenizer, self.reward_fn,
                                             self.dims, step=step, attempt=0, n_prompts=None, seed=seed)
                skipped = collections.Counter(getattr(self.data, "skipped_when_drawn", {}))
            except BaseException as e:  # noqa: BLE001 -- handed to the main thread by take()
                future.set_exception(e)
            else:
                future.set_result((samples, time.perf_counter() - start, skipped))

        threading.Thread(target=work, name="rollout-ahead", daemon=True).start()
        self._future = future

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def finish(self, wait: bool = True) -> bytes | None:
        """Wait for the batch in flight and return it serialized (this rank's samples and their generation time),
        for a checkpoint: a resumed run trains on it (`restore`) as this run will, instead of generating it again
        with newer weights. The batch stays in flight for `take`. None when its generation failed (`take` raises
        that), it cannot be pickled (a generate function's metadata: a lock, a client), or, without `wait`, it is
        still generating."""
        if not wait and not self._future.done():
            return None
        start = time.perf_counter()
        try:
            samples, seconds, _ = self._future.result()
        except BaseException:  # noqa: BLE001 -- take() raises it where the run would have met it
            return None
        finally:
            self.waited_s += time.perf_counter() - start
        buffer = io.BytesIO()
        try:
            torch.save({"samples": samples, "generate_s": seconds}, buffer)
        except Exception as e:  # noqa: BLE001 -- pickling runs user objects' __reduce__
            logger.warning("the batch generated ahead cannot be saved with the checkpoint (%s: %s): a resumed run "
                           "generates it again, with the saved weights", type(e).__name__, e)
            return None
        return buffer.getvalue()

    @staticmethod
    def load(blob: bytes) -> dict:
        """What `finish` returned, read back (for `restore`); raises what unpickling raises."""
        return torch.load(io.BytesIO(blob), weights_only=False)

    def restore(self, saved: dict) -> None:
        """Put a batch `finish` saved (read by `load`) in flight, the prompt source at the position after it, as
        when it was saved; `take` returns it."""
        assert self._future is None, "a rollout is already in flight"
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result((saved["samples"], saved["generate_s"], collections.Counter(self.data.skipped_when_drawn)))
        self._future = future

    def take(self, trainer_version: int) -> tuple[list[Sample], dict]:
        """Wait for the batch in flight; its samples and metrics (a collective: every rank calls it). A checkpoint's
        wait for it (`waited_s`) is the caller's to count, and to reset."""
        future, self._future = self._future, None
        samples, seconds, self.skipped_when_drawn = future.result()
        metrics = rollout_metrics(samples, self.dims)
        metrics["time/generate"] = seconds  # in the background, while the last step trained
        lag, n = self.dims.all_reduce_sum([sum(trainer_version - s.metadata["weight_version"] for s in samples),
                                           len(samples)])
        metrics.update({"rollout/sampling_attempts": 1, **kept_counts(samples, self.dims),
                        "rollout/policy_lag": lag / max(n, 1)})
        return samples, metrics

    def close(self) -> None:
        """Discard a batch in flight (an error; or a stop, whose checkpoint saved it with `finish` unless its
        generation failed). Its engine requests are aborted; it gets STOP_WAIT_S to finish
        before the engine goes away, and an error it ends with is logged, not raised over the stop's own."""
        future, self._future = self._future, None
        if future is None:
            return
        deadline = time.monotonic() + self.STOP_WAIT_S
        while True:
            # again every ABORT_EVERY_S: an abort cuts the generate() calls running when it comes, and the thread
            # may still be drawing prompts, or start another call (a multi-turn generate function)
            self.engine.abort()
            # done or not, not by the exception result() raises: since Python 3.11 the TimeoutError of a
            # generate function or a reward that timed out is concurrent.futures.TimeoutError too
            concurrent.futures.wait([future], timeout=max(0.0, min(self.ABORT_EVERY_S, deadline - time.monotonic())))
            if not future.done():
                if time.monotonic() < deadline:
                    continue
                logger.warning("the batch generated ahead did not finish within %.0f s of the stop; abandoned",
                               self.STOP_WAIT_S)
            elif (e := future.exception()) is not None:
                logger.warning("the discarded batch generated ahead failed: %s: %s", type(e).__name__, e)
            return


# Settings of a rollout that do not change its samples: a batch generated ahead and saved with a checkpoint
# serves a resumed run whose rollout differs in these alone.
_NOT_IN_A_BATCH = ("engine", "gen_batch_size", "hf_packed_weights", "hf_compile", "generate_fn_timeout",
                   "one_step_off", "sync_bucket_mb", "sglang", "max_sampling_attempts", "over_sample_factor",
                   "reward.timeout", "reward.max_concurrency", "reward.max_retries", "reward.retry_backoff",
                   "reward.batch_size")
# ... and the settings outside `rollout` that do: which prompts a batch holds and how they read, its sampling seed
_DATA_NOT_IN_A_BATCH = ("image_fetch_timeout", "max_skipped_frac")
_MODEL_IN_A_BATCH = ("min_pixels", "max_pixels")


def batch_settings(cfg: Config) -> dict:
    """The settings a rollout batch's samples follow from, by dotted name (JSON, as a checkpoint's manifest
    records them): the rollout's, the prompt data's, the image sizes and the seed."""
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and k != "fn" else {f"{prefix}{k}": v})
        return out

    rollout = {f"rollout.{k}": v for k, v in flat(dataclasses.asdict(cfg.rollout), "").items()
               if k not in _NOT_IN_A_BATCH and not k.startswith("sglang.")}
    data = {f"data.{k}": v for k, v in dataclasses.asdict(cfg.data).items() if k not in _DATA_NOT_IN_A_BATCH}
    settings = {**rollout, **data, "train.seed": cfg.train.seed,
                **{f"model.{k}": getattr(cfg.model, k) for k in _MODEL_IN_A_BATCH}}
    return json.loads(json.dumps(settings))


def _cut_to_batch_size(kept: list[Sample], batch_size: int, dims: ParallelDims) -> list[Sample]:
    """Keep exactly `batch_size` groups over all ranks (or all there are): rank 0's first, then rank 1's..."""
    group_order = list(dict.fromkeys(s.group_id for s in kept))
    counts = dims.all_gather_objects(len(group_order))
    allowed = max(0, batch_size - sum(counts[:dims.dp_rank]))
    chosen = set(group_order[:allowed])
    return [s for s in kept if s.group_id in chosen]


def rollout_metrics(samples: list[Sample], dims: ParallelDims) -> dict:
    """Global means over every rank's generated samples (before any filtering)."""
    shaped = [s for s in samples if s.task_reward is not None]  # the overlong penalty is on
    n, r, r2, length, trunc, turned, turns, masked, n_shaped, task, penalised, image_ends = dims.all_reduce_sum([
        len(samples), sum(s.reward for s in samples), sum(s.reward ** 2 for s in samples),
        sum(len(s.response_ids) for s in samples), sum(s.finish_reason == "length" for s in samples),
        sum("turns" in s.metadata for s in samples), sum(s.metadata.get("turns", 0) for s in samples),
        sum(len(s.response_ids) - s.num_loss_tokens for s in samples), len(shaped),
        sum(s.task_reward for s in shaped), sum(s.reward < s.task_reward for s in shaped),
        sum(bool(s.metadata.get("ended_at_image_token")) for s in samples)])
    if not n:
        raise RuntimeError("no rank has a sample this step (every prompt drawn was skipped; see the warnings "
                           "above)")
    mean = r / n
    out = {"rollout/reward_mean": mean, "rollout/reward_std": max(r2 / n - mean ** 2, 0.0) ** 0.5,
           "rollout/response_len": length / n, "rollout/truncated_frac": trunc / n,
           "rollout/gen_tokens": length - masked}
    if n_shaped:  # reward_mean has the overlong penalty in it: the task's own, and how many it cost
        out.update({"rollout/task_reward_mean": task / n_shaped,
                    "rollout/overlong_penalized_frac": penalised / n_shaped})
    if turned:  # samples of a generate function: policy turns, and the share of tokens it did not generate
        out.update({"rollout/turns": turns / turned, "rollout/observation_frac": masked / max(length, 1)})
    if image_ends:  # trajectories a sampled image token ended (custom.Trajectory.generate)
        out["rollout/image_token_ends"] = image_ends
    out.update(reward_info_metrics(samples, dims))
    return out


def reward_info_metrics(samples: list[Sample], dims: ParallelDims) -> dict:
    """`reward/<key>`: the mean over every rank's samples of each extra number reward functions returned
    (metadata reward_info: e.g. math/error, a weighted spec's components), over the samples that carry it.
    Ranks may hold different keys, so each sends its (sum, count) per key."""
    local: dict[str, list[float]] = {}
    for s in samples:
        for key, value in s.metadata.get("reward_info", {}).items():
            acc = local.setdefault(key, [0.0, 0])
            acc[0], acc[1] = acc[0] + float(value), acc[1] + 1
    merged: dict[str, list[float]] = {}
    for part in dims.all_gather_objects(local):
        for key, (total, count) in part.items():
            acc = merged.setdefault(key, [0.0, 0])
            acc[0], acc[1] = acc[0] + total, acc[1] + count
    return {f"reward/{key}": total / count for key, (total, count) in sorted(merged.items())}
