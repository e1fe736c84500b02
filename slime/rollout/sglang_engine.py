"""The `sglang` rollout engine: SGLang servers driven over HTTP from every rank.

Topology (`plan_engines`): colocated, ranks r*k .. r*k+k-1 (k = ranks_per_engine, default the TP
size) share engine r, which their first rank launches on its own GPU(s) and controls (sleep, wake,
weight updates); disaggregated, rank 0 launches and controls `num_engines` servers on GPUs after the
trainer's, and rank r generates on engine r % num_engines. `urls` attaches to running servers.

Every rank sends its own prompts to its engine, one request per sample (an exact request id, so
`abort` can cancel it; the radix cache shares the prompt), at most `max_concurrency` in flight.

Colocated order, which keeps the trainer's states and the engine's cache from being resident
together: `sleep()` after rollout releases weights and KV cache; `update_weights` first resumes
`weights`, loads the buckets (each call also flushes the radix cache, whose entries the old weights
computed), and checks the version; the next `wake()` resumes `kv_cache`. Every call is recorded in
`events` so tests can check that order. On CPU sleep and wake do nothing (`release_memory`).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import itertools
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import torch

from slime.config import SGLangConfig
from slime.models.adapters import adapter_for
from slime.models.loading import context_length
from slime.multimodal.images import to_png_base64
from slime.multimodal.processor import MultimodalInputs, check_contexts
from slime.rollout.engine import REQUEST_WAIT, Generation, NamedTensors, SamplingParams
from slime.rollout.sglang_server import (HOST, SGLangClient, SGLangServer, SGLangServerError, check_served_family,
                                         wait_for_url)
from slime.utils.net import address_toward, is_this_machine, local_world_size, node_address, url_host
from slime.rollout.sglang_weights import SharedBuffers, dtype_name, serialize_flat_bucket, split_by_dtype
from slime.utils.net import free_port

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")  # resume order: weights first, so a weight push never meets a live cache
GROUP_NAME = "slime_weight_update"


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    num_engines: int
    engine_of_rank: tuple[int, ...]
    owner_of_engine: tuple[int, ...]  # the rank that launches and controls each engine
    ranks_of_engine: tuple[tuple[int, ...], ...]  # colocated: the ranks whose GPUs the engine uses

    def imbalance(self) -> str | None:
        """Why the engines' loads differ, where they do (disaggregated, rank r on engine r % n, with n not dividing
        the ranks): each rollout waits for the busiest engine."""
        served = collections.Counter(self.engine_of_rank)
        most, least = max(served.values()), min(served.values())
        if most == least:
            return None
        busiest = sorted(e for e in served if served[e] == most)
        return (f"{self.num_engines} SGLang engines serve {len(self.engine_of_rank)} trainer ranks unevenly (rank r "
                f"generates on engine r % {self.num_engines}): engines {busiest} take {most} ranks' prompts, the "
                f"others {least}, and each rollout waits for the busiest; a "
                "rollout.sglang.num_engines (or urls) that divides the world size balances them")


def plan_engines(cfg: SGLangConfig, world_size: int, ranks_per_node: int | None = None) -> EnginePlan:
    if cfg.mode == "colocated":
        k = cfg.ranks_per_engine or cfg.tp_size
        if world_size % k:
            raise ValueError(f"rollout.sglang.ranks_per_engine (or tp_size) = {k} must divide the world size "
                             f"{world_size}")
        if ranks_per_node is not None and ranks_per_node % k:
            raise ValueError(f"rollout.sglang.ranks_per_engine (or tp_size) = {k} must divide the ranks per node "
                             f"({ranks_per_node}): a colocated engine serves ranks of its own node")
        n = world_size // k
        if cfg.urls and len(cfg.urls) != n:
            raise ValueError(f"rollout.sglang.urls lists {len(cfg.urls)} servers but colocated mode on {world_size} "
                             f"ranks with {k} ranks per engine needs {n}")
        return EnginePlan(n, tuple(r // k for r in range(world_size)), tuple(e * k for e in range(n)),
                          tuple(tuple(range(e * k, e * k + k)) for e in range(n)))
    n = len(cfg.urls) or cfg.num_engines
    if n > world_size:  # rank r sends its prompts to engine r % n: the engines past the ranks would get none
        raise ValueError(f"disaggregated rollout with {n} SGLang engines but {world_size} trainer rank(s): rank r "
                         f"sends its prompts to engine r % {n}, so engines {world_size}..{n - 1} would generate "
                         f"nothing; use at most {world_size} (rollout.sglang.num_engines or urls)")
    return EnginePlan(n, tuple(r % n for r in range(world_size)), (0,) * n, ((0,),) * n)


def server_args(cfg: SGLangConfig, *, dtype: torch.dtype, gpu_id: int | None, colocated: bool,
                seed: int | None = None) -> list[str]:
    """Launch arguments; the CPU flags are those of SGLang's torch-native text path. `seed`: the server's
    --random-seed (else SGLang draws one, and a run could not sample the same twice); extra_args may override it.

    --sleep-on-idle: an idle scheduler otherwise spins a CPU core at 100% between requests (while the trainer
    trains, in colocated mode); with it the scheduler waits on its request sockets, which wake it at once."""
    args = ["--tp-size", str(cfg.tp_size), "--dtype", dtype_name(dtype), "--nccl-port", str(free_port()),
            "--sleep-on-idle"]
    if seed is not None:
        args += ["--random-seed", str(seed)]
    if gpu_id is None:
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch"]
    else:
        args += ["--base-gpu-id", str(gpu_id)]
        if colocated:
            args += ["--enable-memory-saver"]  # release/resume free nothing without it
    if cfg.mem_fraction:
        args += ["--mem-fraction-static", str(cfg.mem_fraction)]
    return args + [str(a) for a in cfg.extra_args]


def _wait_unless_refused(done, calls: list[concurrent.futures.Future], poll_s: float = 0.05) -> None:
    """Wait until `done()`, a collective with the engines, unless one of their HTTP `calls` fails first: a server
    that refuses to join (or to receive) would leave the trainer waiting out the group's whole timeout, and its
    answer, which says why, would never be read. Raises that call's error."""
    while not done():
        finished, _ = concurrent.futures.wait(calls, timeout=poll_s, return_when=concurrent.futures.FIRST_EXCEPTION)
        for call in finished:
            if call.exception() is not None:
                call.result()
        if len(finished) == len(calls):  # every server has answered: only the collective is left
            while not done():
                time.sleep(poll_s)


class _Aborted(Exception):
    """A request of an aborted generate() call that was not sent."""


@dataclasses.dataclass(eq=False)
class _Call:
    """One generate() call: its requests in flight (request id -> client) and whether it was aborted."""
    inflight: dict = dataclasses.field(default_factory=dict)
    aborted: bool = False


class SGLangEngine:
    thread_safe = True  # requests go out over a pooled HTTP session: callers may generate concurrently
    ABORT_AGAIN_S = 0.5  # an aborted call's requests still in flight are aborted again this often (see _abort_again)
    _abandoned = False  # abandon() stopped the servers: no abort is sent after (each waited on a dead server)
    def __init__(self, cfg: SGLangConfig, model_cfg, tokenizer, dims, *, log_dir: str | None = None, seed: int = 0):
        from slime.models.loading import resolve_dtype

        self.cfg, self.dims, self.seed = cfg, dims, seed
        self._calls_made = (0, 0)  # (weight version, generate() calls at it so far): part of each request's seed
        self.plan = plan_engines(cfg, dims.world_size, local_world_size(dims.world_size))
        # SGLang ends a generation 2 positions short of the model's context (a response cut there is at its limit)
        self.context = context_length(model_cfg) if model_cfg is not None else None
        if dims.rank == 0 and (uneven := self.plan.imbalance()):
            logger.warning(uneven)
        self.colocated = cfg.mode == "colocated"
        # whether sleep()/wake() release and resume the engine's memory (SGLang's memory saver needs CUDA)
        self.releases = self.colocated and (torch.cuda.is_available() if cfg.release_memory is None
                                            else cfg.release_memory)
        self.eos_id = tokenizer.eos_token_id
        self._version = 0
        self._asleep: set[str] = set()
        self.weights_released = False  # released since the last push: the loop pushes again before generating
        self._servers: list[SGLangServer] = []
        self._group = None
        self._host_buffers = SharedBuffers() if self.colocated else None  # CPU pushes: kept shared-memory buckets
        self._rid, self._rid_tag = itertools.count(), uuid.uuid4().hex[:8]
        self._calls: set[_Call] = set()  # generate() calls running (from several threads with thread_safe)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=cfg.max_concurrency, thread_name_prefix="sglang-http")
        self._control: ThreadPoolExecutor | None = None  # weight-update calls (disaggregated), one thread per engine
        self.events: collections.deque = collections.deque(maxlen=1000)
        self._stats = collections.Counter()
        self._since = time.monotonic()  # last change between generating (awake) and released (asleep)
        self._group_device = torch.device("cpu")

        endpoints, error = {}, None
        if cfg.urls:
            endpoints = {e: (url, None) for e, url in enumerate(cfg.urls)}
            try:  # each by the rank that owns its engine, for them all to wait at once
                mine = cfg.urls[self.plan.engine_of_rank[dims.rank]]
                if self.colocated and not is_this_machine(url_host(mine)):  # warned: a container's bridge address
                    logger.warning(  # or a NAT'd one may still be this machine, where the handover works
                        "rollout.sglang.urls: %s, this rank's engine, is not an address of this machine: colocated "
                        "mode hands the weights over in shared memory (CUDA IPC on GPUs), which another host cannot "
                        "open, so the first weight push would fail. List each node's own server for its ranks, or "
                        "set rollout.sglang.mode=disaggregated", mine)
                family = adapter_for(model_cfg).family if model_cfg is not None else None
                for e, url in enumerate(cfg.urls):
                    if self.plan.owner_of_engine[e] == dims.rank:
                        wait_for_url(url, cfg.startup_timeout, f"rollout.sglang.urls[{e}]")
                        if family is not None:
                            check_served_family(url, f"rollout.sglang.urls[{e}]", model_cfg.path, family)
            except SGLangServerError as e:
                error = f"rank {dims.rank}: {e}"
        else:
            try:
                mine = [e for e in range(self.plan.num_engines) if self.plan.owner_of_engine[e] == dims.rank]
                log_dir = Path(log_dir) / "sglang" if log_dir else Path(tempfile.mkdtemp(prefix="slime-sglang-"))
                python = cfg.python or os.environ.get("SLIME_SGLANG_PYTHON") or sys.executable
                host = node_address(dims.world_size)  # 127.0.0.1 unless ranks on other nodes use the server
                for e in mine:
                    server = SGLangServer(python, model_cfg.path, port=free_port(), env=cfg.env, host=host,
                                          args=server_args(cfg, dtype=resolve_dtype(model_cfg.dtype),
                                                           gpu_id=self._gpu_of(e), colocated=self.colocated,
                                                           seed=seed + e),
                                          log_path=log_dir / f"engine{e}.log")
                    if not self._servers:
                        server.check_installed()
                    server.start()
                    self._servers.append(server)
                for e, server in zip(mine, self._servers):  # they start in parallel; wait for each
                    server.wait_ready(cfg.startup_timeout)
                    endpoints[e] = (server.url, str(server.log_path))
            except Exception as e:  # report to every rank instead of leaving the others in a collective
                error = f"rank {dims.rank}: {e}"
                self._kill_servers()
        gathered = self._all_gather((endpoints, error))
        errors = [err for _, err in gathered if err]
        if errors:
            self._kill_servers()
            raise SGLangServerError("SGLang engine start failed:\n" + "\n".join(errors))
        merged = {e: ep for part, _ in gathered for e, ep in part.items()}
        own = {s.url: s for s in self._servers}
        self.clients = [SGLangClient(merged[e][0], timeout=cfg.request_timeout, max_retries=cfg.max_retries,
                                     server=own.get(merged[e][0]), log_path=merged[e][1],
                                     pool_size=cfg.max_concurrency)
                        for e in range(self.plan.num_engines)]
        self.client = self.clients[self.plan.engine_of_rank[dims.rank]]
        self.owned = [c for c, owner in zip(self.clients, self.plan.owner_of_engine) if owner == dims.rank]
        if self.owned:
            self._read_memory()
        logger.info("sglang engine (%s): %d server(s) %s", cfg.mode, len(self.clients), [c.url for c in self.clients])

    def _gpu_of(self, engine: int) -> int | None:
        if not torch.cuda.is_available():
            return None
        if self.colocated:
            return self.dims.local_rank
        base = self.cfg.base_gpu_id if self.cfg.base_gpu_id >= 0 else \
            local_world_size(self.dims.world_size)
        return base + engine * self.cfg.tp_size

    # -- generation -------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 mm: list[MultimodalInputs | None] | None = None) -> list[list[Generation]]:
        stops = [] if params.ignore_eos else sorted({t for t in (self.eos_id, *params.stop_token_ids) if t is not None})
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "stop_token_ids": stops, "ignore_eos": params.ignore_eos, "n": 1}
        check_contexts(prompts, mm)
        images = [_image_data(m) for m in (mm or [None] * len(prompts))]
        start = time.monotonic()
        call = _Call()  # this call's requests and abort: another thread's generate() neither clears nor cuts them
        with self._lock:
            self._calls.add(call)
            version, made = self._calls_made
            nth = made if version == self._version else 0
            self._calls_made = (self._version, nth + 1)
        base = (self.seed, params.seed, self._version, self.dims.rank, nth)
        jobs = []
        try:
            for i, (p, data) in enumerate(zip(prompts, images)):  # a loop: a submit that fails leaves `jobs` to cancel
                for j in range(params.n):
                    jobs.append(self._submit(call, list(p), {**sampling, "sampling_seed": request_seed(*base, i, j)},
                                             data))
            # a failure ends the call at once, not after the jobs before it
            _wait_for_all_or_a_failure(jobs, every=self.ABORT_AGAIN_S, waiting=lambda: self._abort_again(call))
            for job in jobs:
                if job.done() and (job.cancelled() or job.exception() is not None):
                    job.result()  # raises
            flat = [job.result() for job in jobs]
        except BaseException:
            for job in jobs:
                job.cancel()
            self._abort_calls([call])
            raise
        finally:
            with self._lock:
                self._calls.discard(call)
        self._stats["gen_tokens"] += sum(len(g.response_ids) for g in flat)
        self._stats["gen_s"] += time.monotonic() - start
        self.events.append(("generate", len(flat)))
        return [flat[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _submit(self, call: "_Call", prompt: list[int], sampling: dict,
                image_data: list[str] | None) -> concurrent.futures.Future:
        clock = REQUEST_WAIT.get()  # a generate function's prompt: its requests' wait in the pool is not its time
        if clock is None:
            run, started = self._generate_one, None
        else:
            clock.enter()
            started = _once(clock.leave)

            def run(*args):
                started()
                return self._generate_one(*args)
        try:
            job = self._pool.submit(run, call, prompt, sampling, image_data)
        except RuntimeError:  # the pool was shut down under this call (abandon() from another thread)
            if started is not None:
                started()
            raise concurrent.futures.CancelledError(
                "this SGLang engine was abandoned (after an error) while generate() was queuing requests") from None
        if started is not None:
            job.add_done_callback(lambda _: started())  # cancelled before it started
        return job

    def _new_rid(self, call: "_Call", old: str | None = None) -> str:
        """A request id, registered with `call` for abort(); unique across engines and jobs that share a server (it
        refuses a duplicate id with a 400). Raises _Aborted when the call was aborted before it could register."""
        rid = f"slime-{self._rid_tag}-r{self.dims.rank}-{next(self._rid)}"
        with self._lock:
            call.inflight.pop(old, None)
            if call.aborted:  # checked under the lock abort() takes: no request starts after its abort
                raise _Aborted
            call.inflight[rid] = self.client
        return rid

    def _generate_one(self, call: "_Call", prompt: list[int], sampling: dict,
                      image_data: list[str] | None = None) -> Generation:
        try:
            body = {"rid": self._new_rid(call), "input_ids": prompt, "sampling_params": sampling,
                    "return_logprob": True}
        except _Aborted:
            return Generation([], [], "abort")
        if image_data:
            body["image_data"] = image_data

        def fresh_rid(body: dict) -> None:
            # A retry after a timeout or a reset: the server may still hold the old id (it notices a dropped
            # connection only at its next poll) and would refuse the same id as a duplicate. Abort it, take a new one.
            self._abort_rids({body["rid"]: self.client})
            body["rid"] = self._new_rid(call, old=body["rid"])

        try:
            out = self.client.post("/generate", body, before_retry=fresh_rid)
        except _Aborted:  # aborted while waiting to retry
            return Generation([], [], "abort")
        finally:
            with self._lock:
                call.inflight.pop(body["rid"], None)
        rid = body["rid"]
        try:
            meta = out["meta_info"]
            ids, logprobs = list(out["output_ids"]), [lp for lp, _tok, _text in meta["output_token_logprobs"]]
            finish = meta.get("finish_reason") or {}
            served = meta.get("prompt_tokens")
        except (TypeError, KeyError, ValueError) as e:
            raise SGLangServerError(f"{self.client.url}/generate answered request {rid} with something that is not "
                                    f"an SGLang generation ({type(e).__name__}: {e}): {str(out)[:300]!r}. Is "
                                    "rollout.sglang.urls pointing at an SGLang server?") from None
        if image_data and served is not None and served != len(prompt):
            # SGLang re-runs the image processor on image_data; other sizes would shift every position.
            raise SGLangServerError(
                f"{self.client.url} expanded request {rid} (a prompt of {len(prompt)} tokens with {len(image_data)} "
                f"image(s)) to {served} prompt tokens: its image processor sizes the images differently. Use the "
                "same model.min_pixels / model.max_pixels as the server's preprocessor_config.json")
        if len(logprobs) != len(ids):
            raise SGLangServerError(f"{self.client.url} returned {len(ids)} tokens but {len(logprobs)} logprobs")
        reason = finish.get("type") if isinstance(finish, dict) else None
        if reason not in ("stop", "length"):
            if not call.aborted:  # the server cut it short on its own (out of memory, a bad request, ...)
                raise SGLangServerError(f"{self.client.url} ended request {rid} (a prompt of {len(prompt)} tokens) "
                                        f"after {len(ids)} tokens with finish reason {finish!r:.300}: not a stop or "
                                        "the length limit, and no abort was asked for. The server's log says why")
            reason = "abort"
        elif reason == "length" and len(ids) < sampling["max_new_tokens"] and not call.aborted and not (
                self.context is not None and len(prompt) + len(ids) >= self.context - 2):
            # SGLang lowers a request's max_new_tokens, in silence, to what its context and KV pool leave
            raise SGLangServerError(
                f"{self.client.url} ended request {rid} (a prompt of {len(prompt)} tokens) at its length limit after "
                f"{len(ids)} of the {sampling['max_new_tokens']} new tokens asked for: the server caps prompt + "
                "response below its context length and its KV pool (--max-total-tokens; /server_info has both). "
                "Give the server a larger pool (rollout.sglang.mem_fraction, or --max-total-tokens in "
                "rollout.sglang.extra_args), or lower data.max_prompt_len / rollout.max_response_len (in an "
                "evaluation: eval.max_response_len)")
        return Generation(ids, logprobs, reason)

    def abort(self) -> None:
        """Stop this rank's outstanding requests, of every generate() call running: unsent ones return empty,
        running ones return what they have."""
        with self._lock:
            calls = list(self._calls)
        self._abort_calls(calls)

    def abandon(self) -> None:
        """After an error on this rank: stop what it has in flight, at once and without a collective. Queued
        requests are dropped (the pool's threads are joined at exit, after every queued request), running ones
        aborted, and this rank's servers stopped, so no request thread waits on them."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.abort()
        # the calls still waiting would abort again every ABORT_AGAIN_S, each warning that the killed server "does
        # not answer /health (stopped, or hung)"; servers given by url (rollout.sglang.urls) live on: abort there
        self._abandoned = bool(self._servers)
        self._kill_servers()

    def _abort_calls(self, calls: list["_Call"]) -> None:
        with self._lock:
            inflight = {}
            for call in calls:
                if not call.aborted:  # an aborted call's requests were aborted then
                    call.aborted = True
                    inflight.update(call.inflight)
        self._abort_rids(inflight)
        self.events.append(("abort", len(inflight)))

    def _abort_again(self, call: "_Call") -> None:
        """An abort travels on a connection of its own and can reach the server before a request it names (sent,
        not yet received). SGLang ignores an id it does not hold, and that request would then run its whole length:
        so while an aborted call waits, the requests it still has in flight are aborted again."""
        with self._lock:
            inflight = dict(call.inflight) if call.aborted else {}
        if inflight:
            self._abort_rids(inflight)

    def _abort_rids(self, inflight: dict[str, SGLangClient]) -> None:
        """All at once: one after another, a server that no longer answers held the caller 10 s per request (64
        requests in flight: over 10 minutes)."""
        if self._abandoned:
            return

        def abort(rid: str, client: SGLangClient) -> None:
            try:
                client.post("/abort_request", {"rid": rid}, timeout=10, retries=0)
            except SGLangServerError as e:
                logger.warning("abort of %s failed: %s", rid, e)

        if len(inflight) == 1:
            abort(*next(iter(inflight.items())))
        elif inflight:
            with ThreadPoolExecutor(max_workers=min(len(inflight), 64), thread_name_prefix="sglang-abort") as pool:
                list(pool.map(abort, inflight.keys(), inflight.values()))

    # -- colocated memory ---------------------------------------------------------------------

    def sleep(self, tags: Iterable[str] = TAGS) -> None:
        self._toggle("release", [t for t in TAGS if t in tags and t not in self._asleep])

    def wake(self, tags: Iterable[str] = TAGS) -> None:
        self._toggle("resume", [t for t in TAGS if t in tags and t in self._asleep])

    def _toggle(self, op: str, tags: list[str]) -> None:
        if not self.releases:
            return  # disaggregated engines keep their GPUs; on CPU there is nothing to release
        self.dims.barrier()  # release only once every rank sharing the engine has finished generating
        error = None
        if tags:
            error = _attempt(lambda: [c.post(f"/{op}_memory_occupation", {"tags": tags}, retries=0)
                                      for c in self.owned])
            if "kv_cache" in tags:  # the engine can generate exactly while its cache is resident
                now = time.monotonic()
                self._stats["asleep_s" if op == "resume" else "awake_s"] += now - self._since
                self._since = now
            self._asleep = self._asleep - set(tags) if op == "resume" else self._asleep | set(tags)
            if op == "release" and "weights" in tags:  # without a CPU backup SGLang keeps no copy: a resume
                self.weights_released = True  # brings back buffers, not these weights, until the next push
            self.events.append((op, tuple(tags)))
        self._check_everywhere(f"{op}_memory_occupation", error)  # also: generate only once the engine is back

    # -- weights ----------------------------------------------------------------------------------

    def update_weights(self, buckets: Iterable[NamedTensors], version: int) -> None:
        """Push every bucket (a collective: all ranks iterate `buckets`), then check the version.

        Errors do not stop the iteration (the ZeRO-3 gathers inside it are collective); they are
        gathered at the end and raised on every rank.
        """
        if "weights" in self._asleep:
            self._toggle("resume", ["weights"])
        start, nbytes = time.monotonic(), 0
        pushing = bool(self.owned)
        shared_tp = self.colocated and self.cfg.tp_size > 1  # every TP rank hands its own copy to its server
        error = _attempt(self._session, "begin") if pushing else None
        session_open = pushing and error is None
        try:
            for bucket in buckets:
                flats = split_by_dtype(bucket, self._host_buffers) if pushing or shared_tp else []
                nbytes += sum(f.nbytes for f in flats) if pushing else 0
                payloads = self._payloads(flats, pushing) if self.colocated else None
                if error is None and pushing:
                    error = _attempt(self._push, flats, payloads, version)
                if shared_tp:
                    self.dims.barrier()  # peers' tensors must outlive the owner's HTTP call
            if session_open:
                session_open = False
                ended = _attempt(self._session, "end")
                error = error or ended or _attempt(self._check_version, version)
        finally:
            if session_open:  # the buckets raised (a gather failed): a session left open refuses every later push
                self._end_open_session()
        self._check_everywhere("weight update", error)
        self._version = version
        self.weights_released = False
        self._stats["sync_s"] += time.monotonic() - start
        self._stats["sync_bytes"] += nbytes
        self.events.append(("update", version))

    def _check_version(self, version: int) -> None:
        for client in self.owned:
            served = client.get("/model_info").get("weight_version")
            if served != str(version):
                raise SGLangServerError(f"{client.url} serves weight version {served!r} after pushing {version}")

    def _check_everywhere(self, what: str, error: Exception | None) -> None:
        """Collective: raise on every rank if any rank failed, so none is left waiting in a collective."""
        errors = self._all_gather(None if error is None else f"rank {self.dims.rank}: {error}")
        if any(errors):
            raise SGLangServerError(f"{what} failed: " + "\n".join(e for e in errors if e)) from error

    def _session(self, which: str) -> None:
        for client in self.owned:
            try:
                client.post(f"/{which}_weight_update", {}, retries=0)
            except SGLangServerError as e:
                if which != "begin" or "already open" not in str(e):
                    raise
                # left open by a push that died part-way (this run's before a resume, or another job's, on servers
                # from rollout.sglang.urls): its tensors are overwritten by this push, which sends every weight
                logger.warning("%s had a weight-update session open (an earlier push that did not finish); ending "
                               "it and pushing every weight again", client.url)
                client.post("/end_weight_update", {}, retries=0)
                client.post("/begin_weight_update", {}, retries=0)

    def _end_open_session(self) -> None:
        """Best effort, on the way out of a failed push: the error being raised says what went wrong."""
        try:
            self._session("end")
        except Exception as e:  # noqa: BLE001
            logger.warning("could not end the weight-update session after a failed push: %s", e)

    def _payloads(self, flats, pushing: bool) -> list[list[str]] | None:
        """Colocated: for each flat bucket, the payload of every TP rank of this rank's engine."""
        if self.cfg.tp_size == 1:
            return [[serialize_flat_bucket(f)] for f in flats] if pushing else None
        everyone = self._all_gather([serialize_flat_bucket(f) for f in flats])
        tp_ranks = self.plan.ranks_of_engine[self.plan.engine_of_rank[self.dims.rank]][:self.cfg.tp_size]
        return [[everyone[r][i] for r in tp_ranks] for i in range(len(flats))] if pushing else None

    def _push(self, flats, payloads, version: int) -> None:
        # "flush_cache" on every call, not the /flush_cache endpoint: that one also empties the allocator's
        # cache, on CPU a garbage-collection pass of the server (~0.5 s per step)
        if self.colocated:
            for flat, per_rank in zip(flats, payloads):
                for client in self.owned:
                    client.post("/update_weights_from_tensor", {
                        "serialized_named_tensors": per_rank, "load_format": "flattened_bucket",
                        "flush_cache": True, "weight_version": str(version)}, retries=0)
            return
        self._ensure_group()
        for flat in flats:
            body = {"names": flat.names, "dtypes": [dtype_name(flat.dtype)] * len(flat.names), "shapes": flat.shapes,
                    "group_name": GROUP_NAME, "load_format": "flattened_bucket", "flush_cache": True,
                    "weight_version": str(version)}
            calls = [self._control.submit(c.post, "/update_weights_from_distributed", body, retries=0)
                     for c in self.owned]
            data = flat.flat.to(self._group_device)  # kept until the broadcast is done
            sent = torch.distributed.broadcast(data, src=0, group=self._group, async_op=True)
            _wait_unless_refused(sent.is_completed, calls)
            sent.wait()
            for call in calls:
                call.result()

    def _ensure_group(self) -> None:
        """Disaggregated: trainer rank 0 + every engine rank in one group (`init_weights_update_group`)."""
        if self._group is not None:
            return
        port, tp = free_port(), self.cfg.tp_size
        world = 1 + len(self.owned) * tp
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # The engines connect back to this rank: at the address on the route to them (127.0.0.1 when local).
        master = address_toward(url_host(self.owned[0].url)) if self.owned else HOST
        # Every engine's call returns only once all have joined: one thread each (the generation pool may be
        # smaller than the number of engines, rollout.sglang.max_concurrency).
        self._control = ThreadPoolExecutor(max_workers=len(self.owned) or 1, thread_name_prefix="sglang-sync")
        calls = [self._control.submit(c.post, "/init_weights_update_group", {
            "master_address": master, "master_port": port, "rank_offset": 1 + e * tp, "world_size": world,
            "group_name": GROUP_NAME, "backend": backend}, retries=0) for e, c in enumerate(self.owned)]
        made: dict = {}

        def make() -> None:  # blocks until every engine rank has joined
            try:
                made["group"] = self.dims.new_external_group(host=master, port=port, world_size=world,
                                                             group_name=GROUP_NAME, backend=backend,
                                                             timeout_s=self.cfg.request_timeout)
            except BaseException as e:  # noqa: BLE001 -- raised below, in the calling thread
                made["error"] = e
        maker = threading.Thread(target=make, name="sglang-group", daemon=True)
        maker.start()
        _wait_unless_refused(lambda: not maker.is_alive(), calls)  # a server that refuses to join ends the wait
        maker.join()
        if "error" in made:
            raise made["error"]
        self._group = made["group"]
        if backend == "nccl":
            self._group_device = torch.device("cuda", torch.cuda.current_device())
        for call in calls:
            call.result()
        self.events.append(("init_group", world))

    # -- metrics and shutdown -----------------------------------------------------------------

    def _read_memory(self) -> None:
        try:
            state = self.owned[0].get("/server_info", timeout=30)["internal_states"][0]
            usage = state.get("memory_usage") or {}
            self._memory = {f"sglang/mem_{k}_gb": float(usage[k]) for k in ("weight", "kvcache") if k in usage}
        except (SGLangServerError, KeyError, IndexError, TypeError, ValueError):
            self._memory = {}

    def metrics(self) -> dict:
        """Since the last call: generation tokens/s, weight-sync time and GB/s, time asleep/awake."""
        s, self._stats = self._stats, collections.Counter()
        out = dict(getattr(self, "_memory", {}))
        if s["gen_s"]:
            out["sglang/gen_tokens_per_s"] = s["gen_tokens"] / s["gen_s"]
        if s["sync_s"]:
            out["sglang/sync_s"] = s["sync_s"]
        if s["sync_bytes"]:  # on the ranks that push
            out["sglang/sync_gb_per_s"] = s["sync_bytes"] / 2**30 / s["sync_s"]
        if self.releases:
            out["sglang/asleep_s"], out["sglang/awake_s"] = s["asleep_s"], s["awake_s"]
        return out

    def _all_gather(self, obj) -> list:
        """Over every rank (engines are shared across dp and sp alike)."""
        return self.dims.all_gather_objects(obj, group=self.dims.world_group)

    def _kill_servers(self) -> None:
        for server in self._servers:
            server.kill()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._control is not None:
            self._control.shutdown(wait=False, cancel_futures=True)
        if self._group is not None:
            for client in self.owned:
                _attempt(client.post, "/destroy_weights_update_group", {"group_name": GROUP_NAME},
                         timeout=10, retries=0)  # a hung server must not hold the shutdown
            self.dims.destroy_group(self._group)
            self._group = None
        for client in getattr(self, "clients", []):
            client.close()
        self._kill_servers()
        self._servers = []


def request_seed(*key: int | None) -> int:
    """A request's `sampling_seed`, from the run's seed, the batch's, the weight version, the rank, the call and
    the sample. SGLang samples by it only when the server runs --enable-deterministic-inference (GPU attention
    backends); otherwise it draws from its own generator (--random-seed), in an order that batching changes."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # SGLang takes [-2**63, 2**63)


def _image_data(mm: MultimodalInputs | None) -> list[str] | None:
    """A prompt's images as PNG data URIs, at the size our processor gave them (so SGLang's keeps it)."""
    if mm is None:
        return None
    if mm.images is None:
        raise ValueError("image-text prompt without its images: SGLang needs them (MultimodalInputs.images)")
    return [f"data:image/png;base64,{to_png_base64(img)}" for img in mm.images]


def _once(fn: Callable[[], None]) -> Callable[..., None]:
    """`fn` on the first call only (from any thread)."""
    lock = threading.Lock()

    def call(*_) -> None:
        if lock.acquire(blocking=False):
            fn()
    return call


def _wait_for_all_or_a_failure(jobs: list[concurrent.futures.Future], every: float | None = None,
                               waiting: Callable[[], None] | None = None) -> None:
    """Until every job is done, or one failed or was cancelled; `waiting()` is called each `every` seconds until
    then. (concurrent.futures.wait misses the cancel of executor.shutdown(cancel_futures=True): such a future never
    wakes its waiters, only its callbacks.)"""
    settled, lock, left = threading.Event(), threading.Lock(), [len(jobs)]

    def on_done(job: concurrent.futures.Future) -> None:
        with lock:
            left[0] -= 1
            if not left[0] or job.cancelled() or job.exception() is not None:
                settled.set()

    if jobs:
        for job in jobs:
            job.add_done_callback(on_done)
        while not settled.wait(every):
            waiting()


def _attempt(fn, *args, **kwargs) -> Exception | None:
    """Run fn; return its exception instead of raising it (raised later on every rank at once)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        logger.error("%s failed: %s", getattr(fn, "__name__", fn), e)
        return e
    return None
