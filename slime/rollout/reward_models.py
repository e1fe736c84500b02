"""Rewards that score a batch at a time: a remote reward server over HTTP, and a reward model checkpoint.

`rollout.reward.fn` picks them by prefix (alone or as a weighted entry, e.g. ``{"http://rm:8000/score": 1.0,
"format": 0.1}``):

- ``"http://host:port/path"`` / ``"https://..."``: `RemoteReward`. Each request POSTs up to
  ``rollout.reward.batch_size`` samples as JSON::

      {"samples": [{"index": 3, "prompt": "...", "response": "...", "label": "...", "metadata": {...}}, ...]}

  and expects ``{"rewards": [r_0, r_1, ...]}`` back, one per sample, in order; each r is a number or a dict
  with a "reward" key plus extra numbers (logged like a user function's). At most
  ``rollout.reward.max_concurrency`` requests are in flight; each answer must be complete within
  ``rollout.reward.timeout`` seconds (checked as it arrives, so at most one read later). A connection error,
  a timeout, a 5xx or 429 answer and a malformed body are retried
  ``rollout.reward.max_retries`` times with exponential backoff; then the run stops with the endpoint, the
  samples of the batch and what went wrong named. Other 4xx answers (the request is wrong) stop at once.
  A reward is never silently zero.
- ``"model:PATH"``: `RewardModel`, a Hugging Face sequence-classification checkpoint with one output
  (``num_labels=1``) loaded on every rank and scored there on that rank's samples, ``batch_size`` at a
  time, in eval mode under no_grad. It reads the policy's prompt and response tokens decoded together (chat
  template and end-of-turn token included, as the policy saw them) with its own tokenizer, so a reward model
  trained on another template should be served remotely instead (the server gets the rendered prompt, the
  response text and the row's metadata, where the data can carry the raw question). A sample past its context
  is read from its end (counted: ``reward/rm_truncated``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import queue
import random
import threading
import time
from typing import Any

import requests
import torch
import urllib3

from slime.config import REWARD_MAX_BACKOFF_S as MAX_BACKOFF_S
from slime.data.sample import Sample

logger = logging.getLogger(__name__)

MODEL_PREFIX = "model:"


def is_reward_model(spec: str) -> bool:
    return spec.startswith(MODEL_PREFIX)


def _label(label: Any) -> Any:
    return label if label is None or isinstance(label, (str, int, float, bool, list, dict)) else str(label)


def _describe(samples: list[Sample]) -> str:
    idx = [s.index for s in samples]
    first = samples[0]
    return (f"samples index={idx[0]}..{idx[-1]} ({len(idx)})" if len(idx) > 1 else f"sample index={idx[0]}") + \
        f", first prompt {first.prompt_text[-60:]!r}"


class RewardServerError(RuntimeError):
    """A reward server failed a batch after every retry (or refused it outright)."""


class _Retryable(Exception):
    def __init__(self, why: str, after: float | None = None):
        super().__init__(why)
        self.after = after  # the server's Retry-After, in seconds


class RemoteReward:
    """A reward server reached over HTTP (see the module docstring for the protocol)."""

    batched = True

    def __init__(self, url: str, *, batch_size: int = 16, timeout: float = 60.0, max_retries: int = 3,
                 retry_backoff: float = 1.0, max_concurrency: int = 8) -> None:
        if batch_size < 1 or max_concurrency < 1 or max_retries < 0 or timeout <= 0 or retry_backoff < 0:
            raise ValueError(f"remote reward {url}: batch_size and max_concurrency must be >= 1, max_retries and "
                             f"retry_backoff >= 0, timeout > 0")
        self.url, self.batch_size, self.timeout = url, batch_size, timeout
        self.max_retries, self.retry_backoff, self.max_concurrency = max_retries, retry_backoff, max_concurrency
        # Sessions (each a pool of kept-alive connections) taken by one request at a time: the worker threads are
        # new for every call (rewards.DaemonThreads), so sessions per thread connected afresh for every batch.
        self._idle: queue.SimpleQueue[requests.Session] = queue.SimpleQueue()

    def payload(self, samples: list[Sample]) -> dict:
        return {"samples": [{"index": s.index, "prompt": s.prompt_text, "response": s.response_text,
                             "label": _jsonable(_label(s.label)), "metadata": _jsonable(s.metadata)} for s in samples]}

    async def score_batch(self, samples: list[Sample]) -> list[Any]:
        """The server's value for every sample (numbers or dicts with a "reward" key), in order."""
        sem = asyncio.Semaphore(self.max_concurrency)
        batches = [samples[i:i + self.batch_size] for i in range(0, len(samples), self.batch_size)]
        failed = threading.Event()  # once a batch failed, the others neither start nor retry: the call has failed

        async def one(batch):
            async with sem:
                if failed.is_set():
                    return []
                try:
                    return await asyncio.to_thread(self._post, batch, failed)
                except BaseException:
                    failed.set()
                    raise

        return [v for values in await asyncio.gather(*(one(b) for b in batches)) for v in values]

    def _post(self, batch: list[Sample], failed: threading.Event | None = None) -> list[Any]:
        failed = failed or threading.Event()
        body = self.payload(batch)
        for attempt in range(self.max_retries + 1):
            try:
                return self._attempt(body, batch)
            except _Retryable as e:
                why = str(e)
                if attempt == self.max_retries:
                    break
                # exponential, at most a minute; a server's Retry-After (seconds) is waited for, within that minute
                delay = min(MAX_BACKOFF_S, e.after if e.after is not None else
                            self.retry_backoff * 2 ** attempt * (1 + 0.25 * random.random()))
                if failed.is_set():
                    return []  # another batch of the call failed: its error is the call's
                logger.warning("reward server %s: %s; retry %d/%d in %.1fs", self.url, why, attempt + 1,
                               self.max_retries, delay)
                if failed.wait(delay):
                    return []
        raise RewardServerError(
            f"reward server {self.url} failed for {_describe(batch)} after {self.max_retries + 1} attempts: {why}. "
            "Check the server (its log, that it answers {'rewards': [...]} with one value per sample) or raise "
            "rollout.reward.timeout / max_retries")

    def _attempt(self, body: dict, batch: list[Sample]) -> list[Any]:
        deadline = time.monotonic() + self.timeout
        try:
            session = self._idle.get_nowait()
        except queue.Empty:
            session = requests.Session()
        try:  # requests' timeout bounds each wait (connecting, each read); the deadline bounds the whole answer
            with session.post(self.url, json=body, timeout=self.timeout, stream=True) as r:
                status, content = r.status_code, self._read(r, deadline)
        except (requests.Timeout, urllib3.exceptions.TimeoutError):
            raise _Retryable(f"no answer within rollout.reward.timeout={self.timeout}s") from None
        except requests.ConnectionError as e:
            raise _Retryable(f"cannot connect ({type(e).__name__}: {str(e)[-300:]})") from None  # the end: why
        except (requests.RequestException, urllib3.exceptions.HTTPError) as e:  # e.g. an answer cut short
            raise _Retryable(f"{type(e).__name__}: {str(e)[:200]}") from None
        finally:
            self._idle.put(session)
        text = content.decode("utf-8", errors="replace")
        if status >= 500 or status in (408, 429):  # 408: the server timed the request out
            after = r.headers.get("Retry-After", "")
            raise _Retryable(f"HTTP {status}: {text[:200]!r}", after=float(after) if after.isdigit() else None)
        if status >= 400:
            raise RewardServerError(f"reward server {self.url} refused {_describe(batch)}: HTTP {status}: "
                                    f"{text[:300]!r}; the request is wrong, so it is not retried")
        try:
            rewards = json.loads(content)["rewards"]
        except (ValueError, KeyError, TypeError):
            raise _Retryable(f"malformed answer (want JSON {{'rewards': [...]}}): {text[:200]!r}") from None
        if not isinstance(rewards, list) or len(rewards) != len(batch):
            got = f"{len(rewards)} values" if isinstance(rewards, list) else type(rewards).__name__
            raise _Retryable(f"malformed answer: 'rewards' must list {len(batch)} values, got {got}")
        return rewards

    def _read(self, r: requests.Response, deadline: float) -> bytes:
        """The body as it arrives, until the deadline: a server that trickles its answer (each piece within the
        per-read timeout) is cut off at most one read after rollout.reward.timeout."""
        parts = []
        while part := r.raw.read1(1 << 16, decode_content=True):
            parts.append(part)
            if time.monotonic() > deadline:
                raise _Retryable(f"the answer was not complete within rollout.reward.timeout={self.timeout}s "
                                 f"({sum(map(len, parts))} bytes so far)")
        r.raw.release_conn()  # read to the end: the connection serves the next request (keep-alive)
        return b"".join(parts)


def _jsonable(obj: Any) -> Any:
    """Metadata as JSON: numbers, strings, lists and dicts pass; anything else becomes its str."""
    try:
        json.dumps(obj, allow_nan=False)
        return obj
    except (TypeError, ValueError):
        if isinstance(obj, dict):
            return {str(k): _jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [_jsonable(v) for v in obj]
        if isinstance(obj, float) and not math.isfinite(obj):
            return str(obj)
        return str(obj)


class RewardModel:
    """A sequence-classification checkpoint (one output) scoring prompt + response on this rank."""

    batched = True

    def __init__(self, spec: str, *, batch_size: int = 16, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, tokenizer=None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.modeling_layers import GenericForSequenceClassification

        self.path = os.path.expanduser(spec[len(MODEL_PREFIX):] if spec.startswith(MODEL_PREFIX) else spec)
        if not self.path:
            raise ValueError(f"reward spec {spec!r}: give the checkpoint as 'model:PATH'")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        if dtype is None:
            dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
            self.model, loading = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=dtype,
                                                                                     output_loading_info=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"reward model {spec!r}: cannot load a sequence-classification checkpoint from "
                             f"{self.path!r}: {e}") from e
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {spec!r} has num_labels={self.model.config.num_labels}; a reward model "
                             "has one output (num_labels=1), its score")
        if loading["missing_keys"]:  # e.g. a causal LM's checkpoint: its score head would be random on every load
            raise ValueError(f"reward model {spec!r}: the checkpoint lacks {sorted(loading['missing_keys'])[:4]}, "
                             "which would start random: give a trained sequence-classification checkpoint")
        if self.tokenizer.pad_token_id is None:  # batches are right-padded; the score is read at each row's end
            # (any id will do where there is no EOS either: the score is read at the last real token)
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.convert_ids_to_tokens(0)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"  # a text past the context is read from its end
        self.model.to(device).eval()
        self.device, self.batch_size = device, batch_size
        self.policy_tokenizer = tokenizer
        own = getattr(self.tokenizer, "chat_template", None)
        if tokenizer is not None and own and getattr(tokenizer, "chat_template", None) not in (None, own):
            logger.warning("reward model %s has a chat template of its own, which is not the policy's: it reads each "
                           "sample as the policy's tokenizer decodes it (the policy's template), not re-templated; a "
                           "reward model trained on its own template may score that text worse", self.path)
        limits = [getattr(self.model.config.get_text_config(), "max_position_embeddings", None),
                  self.tokenizer.model_max_length]
        self.max_len = min((n for n in limits if isinstance(n, int) and 0 < n < 10**9), default=None)
        self._warned_long = False
        # transformers' generic classifiers (a backbone and a `score` head): score_texts pools them itself
        self._own_pooling = isinstance(self.model, GenericForSequenceClassification)
        # Other decoders' heads (GPT-2, Falcon, OPT, ...) score every token, then take the last that is not the pad
        # id: where pad is EOS, the token before a closing EOS. Their per-token scores are read instead.
        head = getattr(self.model, "score", None)
        self._per_token = head if not self._own_pooling and isinstance(head, torch.nn.Linear) else None
        # Encoders (BERT, RoBERTa, DeBERTa) pool their [CLS] token: their tokenizer adds [CLS] and [SEP]
        self._special = not self._own_pooling and self._per_token is None
        self._n_special = self.tokenizer.num_special_tokens_to_add() if self._special else 0

    def texts(self, samples: list[Sample]) -> list[str]:
        """What the policy's sequence was, as text: with the policy's tokenizer, its prompt and response tokens
        decoded together, special tokens kept (the end-of-turn token where a reward model trained on chat text
        reads its score, and a multi-turn response's role markers); decoded apart, a SentencePiece response would
        lose its leading space. An image-text prompt keeps its text (not one pad token per image patch)."""
        tok = self.policy_tokenizer
        if tok is None:
            return [s.prompt_text + s.response_text for s in samples]
        return [tok.decode(list(s.prompt_ids) + list(s.response_ids), skip_special_tokens=False) if s.mm is None
                else s.prompt_text + tok.decode(s.response_ids, skip_special_tokens=False) for s in samples]

    def score_texts(self, texts: list[str]) -> list[dict[str, float]]:
        """{"reward": the score at each text's last token, "rm_truncated": 1.0 where the text was longer than the
        reward model's context and only its end was read}. Each distinct text is scored once, shortest first: a
        score moves a little with the padding of the batch it falls in (~1e-6 in fp32, ~1e-2 in bf16), and where
        identical responses of a group scored apart, GRPO's std normalisation made that noise advantages of +-1."""
        unique = sorted(dict.fromkeys(texts), key=len)  # similar lengths batched together: less padding too
        scored = dict(zip(unique, self._score_texts(unique)))
        return [dict(scored[t]) for t in texts]

    @torch.no_grad()
    def _score_texts(self, texts: list[str]) -> list[dict[str, float]]:
        out = []
        for i in range(0, len(texts), self.batch_size):
            batch = texts[i:i + self.batch_size]
            ids = self.tokenizer(batch, add_special_tokens=False).input_ids
            cut = [self.max_len is not None and len(row) + self._n_special > self.max_len for row in ids]
            if any(cut) and not self._warned_long:
                self._warned_long = True
                logger.warning("reward model %s reads %d tokens at most; a sample of %d is read from its end only "
                               "(counted in reward/rm_truncated)", self.path, self.max_len, max(map(len, ids)))
            if self._special:  # [CLS] text [SEP], the text's start cut where it is too long (truncation_side)
                ids = self.tokenizer(batch, truncation=self.max_len is not None, max_length=self.max_len).input_ids
            else:
                ids = [row[-self.max_len:] if c else row for row, c in zip(ids, cut)]
            enc = self.tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(self.device)
            rows, last = torch.arange(len(ids), device=self.device), enc["attention_mask"].sum(-1) - 1
            if self._own_pooling:
                # The score at each row's last real token: the model's own pooling takes the last token that is
                # not the pad id, which a text ending in EOS (the pad id, where there is no other) is not.
                hidden = getattr(self.model, self.model.base_model_prefix)(**enc).last_hidden_state
                scores = fp32_head(self.model.score, hidden[rows, last])
            elif self._per_token is not None:  # the same, from the states the head scores at every token
                seen = {}
                hook = self._per_token.register_forward_pre_hook(lambda m, args: seen.setdefault("states", args[0]))
                try:
                    self.model(**enc)
                finally:
                    hook.remove()
                each = seen["states"]  # (rows, tokens, H); (rows, H) where a head scores the pooled state
                scores = fp32_head(self._per_token, each[rows, last] if each.dim() == 3 else each)
            else:
                scores = self.model(**enc).logits[:, 0]
            out += [{"reward": v, "rm_truncated": float(c)} for v, c in zip(scores.float().tolist(), cut)]
        return out

    async def score_batch(self, samples: list[Sample]) -> list[dict[str, float]]:
        return self.score_texts(self.texts(samples))


def fp32_head(head: torch.nn.Linear, states: torch.Tensor) -> torch.Tensor:
    """The score head in fp32: bf16 scores fall on a grid of 2^-8 of their size (0.0625 near 10), coarser than
    the differences within a group that its advantages are made of."""
    bias = head.bias.float() if head.bias is not None else None
    return torch.nn.functional.linear(states.float(), head.weight.float(), bias)[:, 0]
