"""The loop every rank runs (SPMD): rollout -> advantages -> old logprobs -> update -> weight sync.

With algo.policy_loss=sft the rollout is replaced by the prompts' labels as responses.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import random
import re
import socket
import time
from pathlib import Path

import numpy as np
import torch

from slime.config import PATH_KEYS, Config
from slime.data.prompts import PromptSource, rows_on_every_rank, sft_samples
from slime.distributed.ds_config import build_ds_config, check_offloadable, read_ds_json, zero_stage
from slime.distributed.parallel_dims import ParallelDims
from slime.models.export import exported_step
from slime.models.loading import (check_critic, check_packing, check_prompt_vocab, check_stop_ids, check_turn_end,
                                  critic_model, load_processor, load_tokenizer, resolve_dtype, warn_past_context)
from slime.rollout.custom import load_generate_fn
from slime.rollout.engine import make_engine
from slime.rollout.rewards import check_reward_spec, load_user_reward_fns, needs_label, reward_fn_from_config
from slime.rollout.rollout import RolloutAhead, batch_settings, collect_rollout, over_sampled
from slime.trainer.advantages import compute_advantages
from slime.trainer.checkpoint import (check_resume_early, load_checkpoint, newer_than, rank_file_name,
                                     save_checkpoint, saved_decay_groups)
from slime.trainer.layout import RankBatch, distribute
from slime.trainer.losses import actor_loss, critic_loss
from slime.trainer.policy_engine import PolicyEngine
from slime.trainer.evaluate import evaluate, load_eval_prompts
from slime.utils.cpu_malloc import retain_freed_memory
from slime.utils.cpu_threads import main_thread_only
from slime.utils.metrics import MetricsLogger, wandb_mode
from slime.utils.plot import plot_metrics
from slime.utils.signals import StopRequest, Stopped, exit_with_launcher

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def sync_weights(actor: PolicyEngine, engine, version: int, bucket_mb: float) -> dict:
    start = time.time()
    engine.update_weights(actor.gathered_weight_buckets(bucket_mb), version=version)
    return {"time/sync": time.time() - start}


def logprob_metrics(samples, dims: ParallelDims, *, ref_on: bool) -> dict:
    """How far the trainer's logprobs are from the engine's (rollout/training mismatch), and KL to the
    reference: token means over every rank."""
    # Over the tokens the policy generated (mask 1): observations carry rollout logprob 0 by convention.
    sums = {"diff": sum(float(((s.old_logprobs - s.rollout_logprobs).abs() * s.loss_mask).sum()) for s in samples),
            "n": sum(s.num_loss_tokens for s in samples)}
    if ref_on:
        sums["kl"] = sum(float(((s.old_logprobs - s.ref_logprobs) * s.loss_mask).sum()) for s in samples)
    g = dict(zip(sums, dims.all_reduce_sum(list(sums.values()))))
    n = g["n"] or float("nan")  # no generated token: NaN (null in metrics.jsonl), not 0
    out = {"rollout/train_logprob_abs_diff": g["diff"] / n}
    if "kl" in g:
        out["rollout/kl_ref_k1"] = g["kl"] / n
    return out


def score_batch(batch: RankBatch, cfg: Config, actor: PolicyEngine, ref: PolicyEngine | None,
                critic: PolicyEngine | None, dims: ParallelDims) -> dict:
    """Everything the loss needs before the update: pi_old and reference logprobs, values, advantages.
    With algo.old_logprobs=train_forward pi_old comes from the update's own forward instead, with rollout from the
    engine's logprobs."""
    if cfg.algo.old_logprobs == "rollout":  # the sampling policy's own logprobs, as the engine reported them
        for s in batch.samples:
            s.old_logprobs = s.rollout_logprobs
    if cfg.algo.old_logprobs == "recompute":
        for s, lp in zip(batch.samples, actor.score(batch)):
            s.old_logprobs = lp
        bad = sum(not bool(torch.isfinite(s.old_logprobs).all()) for s in batch.samples)
        if dims.all_reduce_sum([float(bad)], group=dims.world_group)[0]:
            raise RuntimeError("the trainer's logprobs of this batch are not finite: the weights have blown up (a "
                               f"learning rate far too high? train.lr={cfg.train.lr:g}) or the model is broken")
    if ref is not None:
        for s, lp in zip(batch.samples, ref.score(batch)):
            s.ref_logprobs = lp
    if critic is not None:
        for s, v in zip(batch.samples, critic.score(batch)):
            s.values = v
    metrics = compute_advantages(batch.samples, cfg.algo, dims)
    if cfg.algo.old_logprobs == "recompute":  # else the update reports train/train_rollout_logprob_abs_diff
        metrics.update(logprob_metrics(batch.samples, dims, ref_on=ref is not None))
    return metrics


def checkpoint_identity(cfg: Config) -> dict:
    """What a checkpoint must match to be resumed (the model), and the settings it was trained with."""
    def sha256(path: str) -> str | None:
        config = Path(path) / "config.json"
        return hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None

    t, critic = cfg.train, cfg.algo.critic.path or cfg.model.path
    return {"model_path": str(Path(cfg.model.path).resolve()),
            "model_config_sha256": sha256(cfg.model.path),
            "dtype": str(resolve_dtype(cfg.model.dtype)),  # DeepSpeed lays bf16 and fp32 states out apart
            **({"critic_path": str(Path(critic).resolve()), "critic_config_sha256": sha256(critic)}
               if cfg.trains_critic else {}),
            "zero_stage": zero_stage(read_ds_json(t)[0]),  # the states' layout on disk
            "parallel_ep": cfg.parallel.ep,  # AutoEP's experts: their modules and states, per ep
            "critic_schedule": True,  # the critic's scheduler state is saved (before, it had none)
            "optim": {"train.lr": t.lr, "train.min_lr": t.min_lr, "train.lr_schedule": t.lr_schedule,
                      "train.warmup_steps": t.warmup_steps, "train.weight_decay": t.weight_decay,
                      "train.betas": list(t.betas), "train.grad_clip": t.grad_clip,
                      "train.num_steps": t.num_steps, "train.num_mini_batches": t.num_mini_batches,  # the schedule's length
                      "algo.critic.lr": cfg.algo.critic.lr,
                      **({"algo.critic.warmup_steps": cfg.algo.critic.warmup_steps} if cfg.trains_critic else {})}}


def check_critic_warmup(changed: dict, step: int) -> None:
    """A resume with another algo.critic.warmup_steps (the steps in which only the critic trains; the actor's
    schedule spans the rest): said, and refused where the actor has trained since the old warmup ended and the new
    one is longer (it froze the actor again, and its schedule, shortened, ran out at min_lr)."""
    if "algo.critic.warmup_steps" not in changed:
        return
    old, new = changed["algo.critic.warmup_steps"]
    if old is None:  # a checkpoint from before the key was recorded
        return
    if old < step and new > old:
        again = f"would freeze it again until step {new + 1} and " if new > step else ""
        raise ValueError(f"algo.critic.warmup_steps={new} at the resume of step {step}: the checkpoint's run had a "
                         f"warmup of {old} steps, so its actor has trained since step {old + 1}; the longer warmup "
                         f"{again}shortens the actor's lr schedule below the updates it has made (the rest at "
                         f"train.min_lr). Keep algo.critic.warmup_steps={old}")
    logger.warning("resumed with algo.critic.warmup_steps %d -> %d: the actor trains from step %d (its lr schedule "
                   "spans train.num_steps minus the warmup)", old, new, max(new, step) + 1)


def check_same_config(cfg: Config) -> None:
    """Every rank must run one config (collective, on the world): nodes started with other settings (a train.lr, a
    rollout.batch_size) trained together to the end, diverging in silence. Paths may differ (each node's own copy
    of a model, data, run dir; a reward model's in rollout.reward.fn)."""
    import torch.distributed as dist

    mine = {k: v for k, v in cfg.settings().items() if k not in PATH_KEYS and  # paths: each node's own copy
            not (k == "rollout.reward.fn" and "model:" in v)}
    digest, world = hashlib.sha256(repr(sorted(mine.items())).encode()).hexdigest(), dist.get_world_size()
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    every = [None] * world
    dist.all_gather_object(every, mine)
    differ = [k for k in sorted(set().union(*every)) if len({c.get(k) for c in every}) > 1]
    shown = "; ".join(f"{k}: " + ", ".join(f"rank {r} {c.get(k)}" for r, c in enumerate(every)) for k in differ[:5])
    raise ValueError(f"the ranks were started with different configs ({len(differ)} key(s) differ: {shown}); start "
                     "every node with the same config file and overrides")


def check_run_dir(cfg: Config, run_dir: Path) -> None:
    """A used run directory is continued (checkpoint.resume) or refused, never mixed into; one that cannot be
    written, or a logger that is not installed, is said before any model loads."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"log.run_dir={run_dir} cannot be written ({e.strerror}: {e.filename}); give a writable "
                         "directory") from None
    for name in ("checkpoints", "hf"):  # where checkpoints and the HF export go: found at the first save otherwise
        if (run_dir / name).exists() and not (run_dir / name).is_dir():
            raise ValueError(f"{run_dir / name} is a file, where this run keeps its "
                             f"{'checkpoints' if name == 'checkpoints' else 'HF export'}: move it away, or use another "
                             "log.run_dir")
    for logger_name in ("wandb", "tensorboard"):  # the flag and the package share the name
        if getattr(cfg.log, logger_name) and importlib.util.find_spec(logger_name) is None:
            raise ValueError(f"log.{logger_name}=true but {logger_name} is not installed: pip install {logger_name}, "
                             f"or set log.{logger_name}=false")
    if cfg.log.wandb and wandb_mode(cfg.log) == "online":  # else wandb.init failed after the models loaded
        import wandb

        if not wandb.login(verify=False, prompt=False):
            raise ValueError("log.wandb=true in online mode, but no W&B API key is configured: set WANDB_API_KEY "
                             "or run `wandb login`, or log offline (log.wandb_mode=offline; `wandb sync` uploads "
                             "later)")
    metrics = run_dir / "metrics.jsonl"
    saved = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    held = metrics if metrics.is_file() and metrics.stat().st_size else saved[0] if saved else None
    if not cfg.checkpoint.resume and held is not None:  # checkpoints alone too: the first save would prune them
        raise ValueError(f"log.run_dir={run_dir} already holds a run ({held}); with checkpoint.resume=false it "
                         "would be mixed with this one. Use a new log.run_dir, delete the old one, or set "
                         "checkpoint.resume=true to continue it")


_RUN_DIR_LOCKS: dict[Path, object] = {}  # run dir -> its open lock file, held until the process exits


def lock_run_dir(run_dir: Path) -> None:
    """Rank 0 holds an exclusive lock on run_dir/.lock while its process lives: a second run started in the same
    directory would resume from the first one's checkpoints while they are written, and both would write its
    metrics and checkpoints. It is refused, naming the holder (flock: released by the kernel however the
    holder ends, so a killed run leaves no stale lock)."""
    key = run_dir.resolve()
    if key in _RUN_DIR_LOCKS:  # this process holds it already (run() called again)
        return
    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise ValueError(f"log.run_dir={run_dir} is in use by another run ({holder or 'a process holds its .lock'}): "
                         "wait for it to end, or give this one another log.run_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _RUN_DIR_LOCKS[key] = f


def check_prompts_fit(prompts: list, cfg: Config) -> None:
    """A prompt longer than a training micro-batch holds stops the step that draws it, after its rollout (the
    layout's check): said here, before the models load, for the prompts of the file that can never fit."""
    budget = cfg.parallel.sp * cfg.train.max_tokens_per_gpu
    over = [p for p in prompts if len(p.prompt_ids) > budget]
    if over:
        longest = max(over, key=lambda p: len(p.prompt_ids))
        n = len(longest.prompt_ids)
        raise ValueError(f"{cfg.data.path}: {len(over)} prompt(s) are longer than a training micro-batch holds "
                         f"(parallel.sp x train.max_tokens_per_gpu = {budget} tokens), the longest {n} tokens "
                         f"({longest.where}); a step that draws one would stop. Raise train.max_tokens_per_gpu to "
                         f"{-(-(n + cfg.rollout.max_response_len - 1) // cfg.parallel.sp)} (that prompt with "
                         f"rollout.max_response_len), or set data.max_prompt_len below {budget} to drop them")


_started = False


def started() -> bool:
    """Whether this process's run got past its start-up (models, data, checkpoint, logger): run.py prints an error
    of start-up (a path, a setting, the data) as its message alone, one line per rank."""
    return _started


def run(cfg: Config) -> dict:
    """Train for cfg.train.num_steps; returns the last logged metrics."""
    global _started
    _started = False
    if not torch.cuda.is_available():  # before the process group's threads run any op, or allocate
        logger.info("CPU threads: %s", main_thread_only())
        if cfg.train.cpu_malloc == "retain":
            logger.info("train.cpu_malloc=retain: %s", retain_freed_memory())
    dims = ParallelDims.build(sp=cfg.parallel.sp, ep=cfg.parallel.ep,
                              timeout=datetime.timedelta(minutes=cfg.train.dist_timeout_minutes),
                              agree=functools.partial(check_same_config, cfg))  # before groups that sp shapes
    seed_everything(cfg.train.seed + dims.rank)  # per-rank sampling streams, reproducible
    run_dir, sft = Path(cfg.log.run_dir), cfg.algo.policy_loss == "sft"
    check_run_dir(cfg, run_dir)
    if dims.is_main:
        lock_run_dir(run_dir)
    if cfg.scores_generations:
        # before the models load: a typo found in seconds, not minutes
        check_reward_spec(cfg.rollout.reward.fn, granularity=cfg.rollout.reward.granularity)
        importing = Phase()  # user modules: a sys.exit(0) at a top level ended the run here with exit code 0
        importing.now = f"importing rollout.reward.fn={cfg.rollout.reward.fn}"
        with importing.guard(0, cfg.train.dist_timeout_minutes):
            load_user_reward_fns(cfg.rollout.reward.fn, cfg.rollout.reward.granularity)
        if cfg.rollout.generate_fn:  # likewise (loaded at the first rollout or evaluation)
            importing.now = f"importing rollout.generate_fn={cfg.rollout.generate_fn}"
            with importing.guard(0, cfg.train.dist_timeout_minutes):
                load_generate_fn(cfg.rollout.generate_fn)
    stop = StopRequest.install()
    exit_with_launcher()  # under run.sh: a kill -9 of it must not leave the ranks training
    said = cfg.longest_sample_warning(), cfg.user_timeout_warning(dims.world_size), cfg.off_policy_warning(), \
        cfg.warmup_warning(), cfg.accuracy_warning()
    for warning in said:
        if dims.rank == 0 and warning is not None:
            logger.warning(warning)
    ckpt_dir, identity = run_dir / "checkpoints", checkpoint_identity(cfg)
    if cfg.checkpoint.resume:  # a resume of another model or layout, refused before any model loads
        check_resume_early(ckpt_dir, identity, dims)
    # the DeepSpeed JSON as parallelize() reads it, before any model loads (its refusals came after them all)
    ds = build_ds_config(cfg.train, bf16=resolve_dtype(cfg.model.dtype) == torch.bfloat16)
    if cfg.rollout.engine == "sglang" and cfg.rollout.sglang.mode == "colocated" and (not sft or cfg.eval.path):
        check_offloadable(ds, cfg.train.ds_config)  # the actor's states leave the GPU while the engine generates
    tokenizer = load_tokenizer(cfg.model)
    check_stop_ids(cfg.model, cfg.rollout.stop_token_ids)
    check_packing(cfg)
    check_critic(cfg, tokenizer)  # a critic of its own: before any model loads, named as algo.critic.path
    processor = load_processor(cfg.model, tokenizer)  # image-text models only
    data = PromptSource(cfg.data, tokenizer, batch_size=cfg.rollout.batch_size, dp_rank=dims.dp_rank,
                        dp_size=dims.dp, seed=cfg.train.seed, processor=processor,
                        label_required=sft or needs_label(cfg.rollout.reward.fn), label_is_text=sft,
                        max_sample_len=(cfg.train.max_tokens_per_gpu * cfg.parallel.sp,  # packing's budget only
                                        "parallel.sp x train.max_tokens_per_gpu")
                        if sft and cfg.train.packing else None)
    check_turn_end(cfg.model, data.turn_end, tokenizer)
    if dims.world_size > 1:  # every rank loaded the file on its own: the same list everywhere, or none draws right
        dropped = data.keep_only(rows_on_every_rank(data.prompts, dims))
        if dropped:
            logger.warning("%s: %d prompt(s) another rank could not load (an image fetch that failed there) are "
                           "left out on this rank too, so that every rank draws from the same list", cfg.data.path,
                           dropped)
    if not sft and cfg.train.packing:
        check_prompts_fit(data.prompts, cfg)
    if cfg.rollout.dynamic_sampling:  # the first attempt draws the most: over_sample_factor x the whole batch
        most = over_sampled(cfg.rollout.batch_size, cfg.rollout.over_sample_factor, dims.dp)
        if most > len(data.prompts):
            raise ValueError(f"{cfg.data.path} has {len(data.prompts)} usable prompts, but dynamic sampling draws up "
                             f"to {most} at once (rollout.batch_size={cfg.rollout.batch_size} x "
                             f"rollout.over_sample_factor={cfg.rollout.over_sample_factor:g}, rounded up to a multiple "
                             f"of dp={dims.dp}): lower one of them")
    evalset = load_eval_prompts(cfg, tokenizer, dims, processor) if cfg.eval.path else None
    problem = None  # every rank raises it: each holds only its slice of the eval file
    try:
        check_prompt_vocab(data.prompts, cfg.model, tokenizer)
        if evalset is not None:
            check_prompt_vocab(evalset.prompts, cfg.model, tokenizer, key="eval.path")
    except ValueError as e:
        problem = str(e)
    if found := [p for p in dims.all_gather_objects(problem, group=dims.world_group) if p]:
        raise ValueError(found[0])
    if dims.is_main:
        longest = max((len(p.prompt_ids) for p in data.prompts), default=0)
        warn_past_context(cfg.model, longest, cfg.rollout.max_response_len, logger)
        if cfg.trains_critic and cfg.algo.critic.path:
            warn_past_context(critic_model(cfg), longest, cfg.rollout.max_response_len, logger,
                              what="prompt, for the critic (algo.critic.path),")
        if evalset is not None:
            warn_past_context(cfg.model, evalset.longest_prompt, cfg.eval.max_response_len or
                              cfg.rollout.max_response_len, logger, what=f"eval prompt ({cfg.eval.path})",
                              lower="data.max_prompt_len or eval.max_response_len")
    # A colocated engine starts before the trainer and releases its memory at once, so the trainer's
    # states and the engine's cache are never on the GPU together (the trainer offloads around rollout).
    engine = make_engine(cfg.rollout, cfg.model, tokenizer, dims, run_dir=str(run_dir), seed=cfg.train.seed) \
        if not sft or evalset is not None else None
    colocate = engine is not None and cfg.rollout.engine == "sglang" and cfg.rollout.sglang.mode == "colocated"
    if colocate:
        engine.sleep()
    # The sampling streams seeded above must not depend on the layout: AutoEP's expert set-up (parallel.ep > 1)
    # draws from the global generator, so ep=2's rollouts differed from ep=1's from the first step.
    # With weight decay, norm gains and biases go in a group without it; a resumed run keeps its checkpoint's
    # grouping, which its optimizer states fit (one group: written without decay, or before the groups)
    decay_groups = bool(cfg.train.weight_decay)
    saved = saved_decay_groups(ckpt_dir) if cfg.checkpoint.resume else None
    if saved is not None and saved != decay_groups:
        decay_groups = saved
        if dims.is_main and cfg.train.weight_decay:
            logger.warning("%s holds one optimizer group (written without weight decay, or before norm gains and "
                           "biases were left out of it): this run keeps it, so train.weight_decay=%g applies to "
                           "them too; a new log.run_dir leaves them out", ckpt_dir, cfg.train.weight_decay)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        actor = PolicyEngine.actor(cfg, dims, decay_groups=decay_groups)
        ref = PolicyEngine.reference(cfg, dims) if cfg.algo.needs_reference and not sft else None
    critic = PolicyEngine.critic(cfg, dims, decay_groups=decay_groups) if cfg.trains_critic else None
    trained = {"actor": actor, **({"critic": critic} if critic is not None else {})}
    phase = Phase(f"waited on an SGLang engine that does not answer (rollout.sglang.request_timeout="
                  f"{cfg.rollout.sglang.request_timeout:g} s)" if cfg.rollout.engine == "sglang" else "")
    with phase.guard(0, cfg.train.dist_timeout_minutes):  # imports the user's reward module
        phase.now = "loading the reward function"
        # not for SFT without evaluation (a reward model would sit in memory unused)
        reward_fn = reward_fn_from_config(cfg.rollout.reward, tokenizer) if cfg.scores_generations else None

    # decay_groups: norm gains and biases in an optimizer group of their own (parallelize)
    identity, start_step, batch_ahead = {**identity, "decay_groups": decay_groups}, 0, None
    abandoned: list[str] = []  # checkpoints the resume skipped as unusable: removed by the first save
    if cfg.checkpoint.resume:
        state = load_checkpoint({k: e.engine for k, e in trained.items()}, ckpt_dir, dims=dims, identity=identity)
        if state is not None:
            start_step = state["step"]
            abandoned = newer_than(ckpt_dir, start_step)
            batch_ahead = saved_batch_ahead(state, cfg, dims)
            data.load_state_dict(state["ahead"]["data"] if batch_ahead is not None else state["data"])
            check_critic_warmup(state["changed_optim"], start_step)
            for role, e in trained.items():
                e.apply_optim_settings(cfg, changed=state["changed_optim"])
                e.consecutive_skips = state.get("consecutive_skips", {}).get(role, 0)  # older checkpoints: none
    bucket_mb = cfg.rollout.sync_bucket_mb
    if engine is not None:
        sync_weights(actor, engine, version=start_step, bucket_mb=bucket_mb)  # the engine starts from the trainer's weights

    if start_step >= cfg.train.num_steps:
        logger.warning("%s already holds a run finished at step %d: nothing to do (raise train.num_steps, or "
                       "pick another log.run_dir)", run_dir, start_step)
    log = MetricsLogger(cfg.log, run_config=cfg.to_dict(), enabled=dims.is_main, total_steps=cfg.train.num_steps,
                        resume_step=start_step)
    _started = stop.in_loop = True
    logger.info("%s for %d steps on %d rank(s): %d prompts x %d samples per step; %d prompts dropped as too long",
                "SFT" if sft else "RL", cfg.train.num_steps - start_step, dims.world_size, cfg.rollout.batch_size,
                1 if sft else cfg.rollout.n_samples_per_prompt, data.num_too_long)

    def run_eval(done: int) -> None:
        logger.info("evaluating after step %d", done)  # minutes on a large eval set: said before, not only after
        if colocate:  # as around rollout: the trainer's states leave the GPU while the engine's cache is there
            actor.offload()
        result = evaluate(engine, evalset, cfg, tokenizer, reward_fn, dims)
        if colocate:
            engine.sleep()
            actor.reload()
        log.log(done, result)

    def maybe_eval(done: int) -> None:
        last = done == cfg.train.num_steps
        if evalset is not None and (done == 0 or last or done % cfg.eval.interval == 0):
            run_eval(done)

    # One-step-off rollout: the batch of step k+1 is generated while step k trains. Weights are pushed (and
    # evaluation runs) only while nothing generates: after the batch in flight is taken, before the next starts.
    ahead = RolloutAhead(engine, data, cfg.rollout, tokenizer, reward_fn, dims, seed=cfg.train.seed) \
        if cfg.rollout.one_step_off and not sft else None
    if batch_ahead is not None:
        ahead.restore(batch_ahead)  # the batch in flight when the checkpoint was saved, as that run trained on it
    pending_eval: list[int] = []
    # The micro-batch plan must fit every trained model's rows: a critic that cannot share prompts (a MoE critic
    # under a dense actor) lays each sample's prompt out again, beyond a budget planned with shared prompts.
    plan_layout = critic.train_layout if critic is not None and actor.share_prompts and not critic.share_prompts \
        else actor.train_layout

    def checkpoint(done: int, stopping: bool = False) -> Path:
        # One-step-off: the batch in flight (generated by the weights before this step's update) is saved too, so
        # that a resumed run trains on it as this one will; "data" is the prompt position before it, for a resume
        # that cannot use it (another rollout setting, a batch that would not pickle). A stop does not wait for
        # it: a launcher kills the ranks 30 s after its SIGTERM, and the checkpoint matters more than the batch.
        files, loop_state = {}, {}
        if ahead is not None and ahead.in_flight:
            blob = ahead.finish(wait=not stopping)
            if dims.all_reduce_sum([float(blob is None)], group=dims.world_group)[0] == 0:
                files["ahead"] = blob
                loop_state["ahead"] = {"data": data.with_skips_of_all_ranks(data.state_dict(), dims.all_reduce_sum),
                                       "settings": batch_settings(cfg)}
            elif stopping:
                logger.info("the batch for step %d is still generating (or failed): not saved with the checkpoint; a "
                            "resumed run generates it again", done + 1)
        data_state = ahead.data_state if ahead is not None and ahead.in_flight else data.state_dict()
        data_state = data.with_skips_of_all_ranks(data_state, dims.all_reduce_sum)
        skips = {role: e.consecutive_skips for role, e in trained.items()}  # train.max_skipped_steps counts on
        log.sync()
        logger.info("saving the checkpoint of step %d%s", done, " and the batch generated ahead" if files else "")
        loop_state.update(data=data_state, consecutive_skips=skips)
        saved = save_checkpoint(trained, ckpt_dir, step=done, dims=dims, identity=identity, keep=cfg.checkpoint.keep,
                                loop_state=loop_state, abandoned=abandoned, rank_files=files)
        abandoned.clear()
        return saved

    try:
        # A resumed step keeps the evaluation the run it continues logged of it (rank 0 read that history); one
        # it has not (a one-step-off run stopped before its pending evaluation) is made now, where it is due.
        evaluated = dims.all_reduce_sum([float(log.evaluated_at_resume)], group=dims.world_group)[0] > 0
        with phase.guard(start_step, cfg.train.dist_timeout_minutes):
            phase.now = "evaluation"
            if not evaluated:
                maybe_eval(start_step)
        metrics: dict = {}
        for step in range(start_step, cfg.train.num_steps):
            with phase.guard(step + 1, cfg.train.dist_timeout_minutes):
                t0 = time.time()
                phase.now = "rollout"
                if sft:
                    local, metrics = sft_samples(data.next_batch(), tokenizer, data.turn_end), {}
                elif ahead is not None:
                    if not ahead.in_flight:
                        ahead.start(step)
                    local, metrics = ahead.take(trainer_version=step)
                    t0 -= ahead.waited_s  # what the last checkpoint waited for it is this step's wait (and time)
                    ahead.waited_s = 0.0
                    metrics["time/rollout"] = time.time() - t0  # the wait for the batch generated during the last step
                    if step > start_step:  # the previous update, now that nothing generates
                        phase.now = "weight sync (the previous step's update)"
                        metrics.update(sync_weights(actor, engine, version=step, bucket_mb=bucket_mb))
                        metrics.update(engine.metrics())
                    t_eval = time.time()
                    for done_before in pending_eval:
                        phase.now = f"evaluation (of step {done_before})"
                        run_eval(done_before)
                    pending_eval.clear()
                    t0 += time.time() - t_eval  # time/step leaves it out, as a step without one-step-off does
                    if step + 1 < cfg.train.num_steps:
                        phase.now = "rollout (starting the next batch)"
                        ahead.start(step + 1)  # with the weights of `step` updates, while this step trains
                else:
                    if colocate and engine.weights_released:  # an evaluation put the engine to sleep after the
                        actor.offload(params=False)  # last push: SGLang kept no copy of those weights
                        sync_weights(actor, engine, version=step, bucket_mb=bucket_mb)
                    if colocate:
                        actor.offload()  # every state, parameters included, off the GPU while the engine is awake
                    local, metrics = collect_rollout(engine, data, cfg.rollout, tokenizer, reward_fn, dims, step=step)
                    if colocate:
                        actor.reload()
                    metrics["time/rollout"] = time.time() - t0

                t1 = time.time()
                phase.now = "balancing"
                batch = distribute(local, dims, plan_layout, num_mini_batches=cfg.train.num_mini_batches)
                metrics["train/moved_sample_frac"] = batch.moved / batch.num_samples
                phase.now = "scoring (old/reference logprobs, values, advantages)"
                if not sft:
                    metrics.update(score_batch(batch, cfg, actor, ref, critic, dims))
                phase.now = "training"
                if critic is not None:
                    metrics.update(critic.train_step(batch, functools.partial(critic_loss, cfg.algo.critic)))
                if critic is None or step >= cfg.algo.critic.warmup_steps:
                    metrics.update(actor.train_step(batch, functools.partial(actor_loss, cfg.algo)))
                    if cfg.algo.old_logprobs == "train_forward":  # the scoring pass's metrics, from the update's forward
                        if "train/train_rollout_logprob_abs_diff" in metrics:
                            metrics["rollout/train_logprob_abs_diff"] = metrics["train/train_rollout_logprob_abs_diff"]
                        if "train/old_kl_ref_k1" in metrics:
                            metrics["rollout/kl_ref_k1"] = metrics.pop("train/old_kl_ref_k1")
                t_train = time.time() - t1

                done = step + 1
                phase.now = "weight sync"
                last = done == cfg.train.num_steps
                if ahead is not None and not last:
                    pass  # pushed at the next step, once the batch in flight is taken
                elif engine is not None and (not sft or (evalset is not None and (done % cfg.eval.interval == 0 or last))):
                    if colocate:
                        actor.offload(params=False)  # the gather below still needs the parameters
                    metrics.update(sync_weights(actor, engine, version=done, bucket_mb=bucket_mb))
                    metrics.update(engine.metrics())
                metrics.update(data.skipped_metrics(dims.all_reduce_sum,  # one-step-off: not the next batch's
                                                    ahead.skipped_when_drawn if ahead is not None else None))
                metrics.update({"time/train": t_train, "time/step": time.time() - t0})
                if "train/tokens" in metrics:
                    metrics["perf/train_tokens_per_s"] = metrics["train/real_tokens"] / t_train
                if "rollout/gen_tokens" in metrics:  # one-step-off: time/rollout is only the wait for the batch
                    metrics["perf/gen_tokens_per_s"] = \
                        metrics["rollout/gen_tokens"] / metrics.get("time/generate", metrics["time/rollout"])
                log.log(done, metrics)
                phase.now = "evaluation"
                if ahead is not None and not last:
                    if evalset is not None and done % cfg.eval.interval == 0:
                        pending_eval.append(done)  # the engine is generating: evaluated after the next push
                else:
                    maybe_eval(done)
                phase.now = "checkpoint"
                stopping = dims.all_reduce_sum([float(stop.requested)], group=dims.world_group)[0] > 0
                if stopping:
                    stop.step_ended()
                if stopping or (cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0) or \
                        (cfg.checkpoint.save_final and done == cfg.train.num_steps):
                    saved = checkpoint(done, stopping=stopping)
                if stopping and done < cfg.train.num_steps:
                    stop.saved = str(saved)
                    log.close()
                    logger.warning("stopped by signal after step %d of %d; checkpoint %s saved. Run the same command "
                                   "again to continue from it", done, cfg.train.num_steps, saved)
                    if ahead is not None:
                        ahead.close()
                    if engine is not None:
                        engine.shutdown()
                    # together: a rank that exits first (143) makes the launcher signal the others again, one of
                    # them perhaps still stopping its SGLang server
                    dims.barrier()
                    raise Stopped(stop.exit_code)
        if ahead is not None:
            ahead.close()
    except BaseException:
        # This rank fails (or stops): what generates in the background must not hold it. The engine's request
        # threads are joined at exit, after finishing every queued request, before atexit stops the servers.
        if engine is not None:
            engine.abandon()
        raise
    final_step = max(start_step, cfg.train.num_steps)
    # Whenever this process trained (an export of the same step may be an earlier run's: a fresh start in a used
    # run dir), and when resumed at the end: an export the finished run did not complete (a full disk, a kill).
    trained_here = start_step < cfg.train.num_steps
    stale = cfg.checkpoint.export_hf and (trained_here or exported_step(run_dir / "hf") != final_step)
    if dims.all_reduce_sum([float(stale)], group=dims.world_group)[0]:  # every rank joins the gather
        stop.step_ended()  # a stop that came during the last step's save: the export takes the time it needs
        savers = [tokenizer] + ([processor.image_processor] if processor is not None else [])
        logger.info("exporting the HF model of step %d to %s", final_step, run_dir / "hf")
        actor.export_hf(str(run_dir / "hf"), *savers, bucket_mb=bucket_mb, step=final_step, stop_ids=data.turn_end)
    log.close()
    if dims.is_main and (run_dir / "metrics.jsonl").is_file():
        plot = plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png") if cfg.log.plot else "off (log.plot)"
        logger.info("metrics: %s, plot: %s", run_dir / "metrics.jsonl", plot)
    if engine is not None:
        engine.shutdown()
    return metrics


def saved_batch_ahead(state: dict, cfg: Config, dims: ParallelDims) -> dict | None:
    """Collective. The batch a one-step-off run had in flight when it saved the checkpoint `state` was loaded from
    (RolloutAhead.finish), if this run can train on it: a one-step-off run of the same rollout settings, every
    rank's file readable. Else None, said why: the batch is generated again, with the saved weights."""
    saved = state.get("ahead")
    if saved is None:  # none was in flight (the run's last step, a synchronous run), or a checkpoint of before
        return None
    problem, batch = None, None
    was, now = saved.get("settings"), batch_settings(cfg)
    if not cfg.rollout.one_step_off or cfg.algo.policy_loss == "sft":
        problem = "this run is not one-step-off (rollout.one_step_off)"
    elif was is None:
        problem = "the checkpoint does not record the settings it was generated with (an older version saved it)"
    elif was != now:
        changed = [f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(was) | set(now))
                   if was.get(k) != now.get(k)]
        problem = f"this run's settings differ ({', '.join(changed)})"
    else:
        try:  # verified against the manifest with the rest of the checkpoint
            batch = RolloutAhead.load((state["path"] / rank_file_name("ahead", dims.rank)).read_bytes())
        except Exception as e:  # noqa: BLE001 -- unpickling runs user objects' code (a generate function's metadata)
            problem = f"rank {dims.rank} could not read it ({type(e).__name__}: {e})"
    problems = [p for p in dims.all_gather_objects(problem, group=dims.world_group) if p]
    if problems:
        if dims.is_main:
            logger.warning("%s holds the batch generated ahead for step %d, not used: %s; it is generated again "
                           "with the saved weights (so the step is on-policy)", state["path"], state["step"] + 1,
                           problems[0])
        return None
    return batch


# What torch's backends raise when a peer does not answer within the process group's timeout: the store's and the
# network's errors (a peer gone), NCCL's backend error with a timeout in its text, gloo a plain RuntimeError with
# one of these texts. Other errors are this rank's own (a reward server's that mentions its timeout, an NCCL
# error from this rank's CUDA) and keep their message.
_GLOO_TIMEOUT = re.compile(r"timed out waiting \d+ ?ms for (recv|send)|application timeout caused pair closure",
                           re.IGNORECASE)
_NCCL_TIMEOUT = re.compile(r"timed? ?out", re.IGNORECASE)
# gloo's own words when the other end of a collective's connection is gone (a rank killed, or crashed mid-call)
_GLOO_PEER_GONE = re.compile(r"gloo/transport/tcp/pair\.cc:\d+\].*(connection (reset|closed) by peer|read error)",
                             re.IGNORECASE)


def is_collective_timeout(e: BaseException) -> bool:
    dist = torch.distributed
    if isinstance(e, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    if isinstance(e, dist.DistBackendError):
        return bool(_NCCL_TIMEOUT.search(str(e)))
    return bool(_GLOO_TIMEOUT.search(str(e)))


class Phase:
    """Where the loop is, for the message of a collective that timed out or of user code that exited."""

    def __init__(self, engine_hint: str = "") -> None:
        self.now, self.engine_hint = "start", engine_hint  # engine_hint: how a rank may hang on its engine


    @contextlib.contextmanager
    def guard(self, step: int, minutes: float):
        try:
            yield
        except Stopped:
            raise
        except SystemExit as e:  # from user code (a reward, a generate_fn): exit code 0 would pass for success
            raise RuntimeError(f"step {step}, {self.now}: user code called sys.exit({e.code!r}) (a reward function, "
                               "rollout.generate_fn, ...); a run cannot end from there: raise an exception instead") \
                from e
        except RuntimeError as e:
            if _GLOO_PEER_GONE.search(str(e)):
                raise RuntimeError(f"step {step}, {self.now}: another rank's connection closed in the middle of a "
                                   "collective: that rank crashed or was killed (out of memory? a signal?); its log, or "
                                   "the launcher's, has the cause") from e
            if not is_collective_timeout(e):
                raise
            engine = f", {self.engine_hint}" if self.engine_hint and self.now.startswith(("rollout", "weight")) else ""
            raise RuntimeError(f"step {step}, {self.now}: a collective waited more than train.dist_timeout_minutes="
                               f"{minutes:g} for another rank, which stopped answering (crashed, hung in a reward "
                               f"function or a data loader{engine}, or ran out of memory): its log has the cause") \
                from e
