"""The RolloutEngine protocol: what the trainer needs from a generation backend.

Engines take token ids and return token ids with per-token logprobs (never re-tokenised text).
`sleep`/`wake` follow SGLang's tags: after training, wake `weights`, push the new weights, then
wake `kv_cache`, so the trainer's states and the engine's cache are never resident together.
"""
from __future__ import annotations

import contextvars
import dataclasses
from typing import Iterable, Protocol

import torch

REQUEST_WAIT: contextvars.ContextVar = contextvars.ContextVar("slime_request_wait", default=None)
"""Set by a generate function's trajectory around its engine call to its prompt's QueueClock: an engine whose
requests queue before they start (SGLang's pool of rollout.sglang.max_concurrency) counts that wait on it
(`enter()` when queued, `leave()` when started), which rollout.generate_fn_timeout leaves out."""


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks, tests); no stop token ends a response
    seed: int | None = None  # hf engine: sample from a generator of this seed instead of torch's global one
    # (made at a call with a new seed, then drawn on by the calls that follow with the same seed)
    trains: bool = True  # the trainer trains on these tokens (False in evaluation: a generate_fn may pick any
    # temperature for its turns, as nothing rescores them)

    def __post_init__(self):  # custom generate functions build these directly, past the config's checks
        if self.max_new_tokens < 1 or self.n < 1:
            raise ValueError(f"SamplingParams: max_new_tokens={self.max_new_tokens} and n={self.n} must be >= 1")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"SamplingParams: temperature={self.temperature} must be >= 0 and finite (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p={self.top_p} must be in (0, 1]")


@dataclasses.dataclass
class Generation:
    response_ids: list[int]
    logprobs: list[float]  # log p(token) under the sampling distribution at `temperature` (T=1 when greedy)
    finish_reason: str  # "stop" or "length" ("abort" for an aborted request; "image_token" for a turn a trajectory
    # refused after the policy sampled the image token, custom.Trajectory.generate)


NamedTensors = list[tuple[str, torch.Tensor]]


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 mm: list | None = None) -> list[list[Generation]]:
        """For each prompt, `params.n` generations. `mm[i]`: prompt i's MultimodalInputs (image-text), or None."""

    def sleep(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None: ...

    def wake(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None: ...

    def update_weights(self, buckets: Iterable[NamedTensors], version: int) -> None:
        """Load HF-named tensors, bucket by bucket; `version` identifies the trainer step."""

    @property
    def weight_version(self) -> int: ...

    def abort(self) -> None: ...

    def abandon(self) -> None:
        """After an error on this rank: stop everything in flight at once, with no collective."""

    def metrics(self) -> dict:
        """Engine-side figures since the last call (tokens/s, sync GB/s, memory), for the step's log."""

    def shutdown(self) -> None: ...


def make_engine(cfg, model_cfg, tokenizer, dims, *, run_dir: str | None = None, seed: int = 0) -> RolloutEngine:
    """`run_dir`: where the sglang engine writes its servers' logs (a temp dir when None); `seed`: the SGLang
    servers' and requests' seeds (the hf engine samples from torch's generators, seeded by the trainer)."""
    if cfg.engine == "hf":
        from slime.rollout.hf_engine import HFEngine

        return HFEngine(model_cfg, tokenizer, device=dims.device, batch_size=cfg.gen_batch_size,
                        packed_weights=cfg.hf_packed_weights, compiled=cfg.hf_compile)
    if cfg.engine == "sglang":
        from slime.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(cfg.sglang, model_cfg, tokenizer, dims, log_dir=run_dir, seed=seed)
    raise ValueError(f"rollout.engine={cfg.engine!r} is not one of: hf, sglang")
