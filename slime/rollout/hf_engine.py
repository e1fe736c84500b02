"""In-process generation with HF transformers on its own copy of the weights.

The copy is a plain (unpartitioned) model: generation never touches the ZeRO-3 module, and the
trainer pushes gathered weights into it after every step, exactly as it would to SGLang.

Text prompts decode in our own loop over the model's forward with a KV cache: the n samples of a prompt
are rows of one batch that share one prefill of the prompt (its cache rows are copied to each), and a
row that has stopped leaves the batch (its cache rows are dropped), so
responses of very different lengths cost what they generate, not n x the longest (HF's generate keeps
finished rows to the end). The cache is written in place (PreallocatedLayer) and a decode step's attention is
two batched matmuls (slime/models/attention.py). For Llama, Qwen2 and Qwen3 a decode step skips HF's forward
(slime/models/decode_step.py: the same computation in a few tensor calls per layer); other families decode through
the model's forward. Image-text prompts use HF's generate, which knows each family's multimodal rope and pixel
inputs.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import types
from typing import Iterable

import torch
from transformers import (DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList)
from transformers.cache_utils import DynamicLayer

from slime.models import fused
from slime.models.attention import GQA_SDPA
from slime.models.decode_step import DecodeStep
from slime.models.loading import load_model, resolve_dtype
from slime.models.onednn import linear as onednn_linear, resolve_cpu_linear, use_onednn_linears
from slime.multimodal.processor import MultimodalInputs, check_contexts
from slime.rollout.engine import Generation, NamedTensors, SamplingParams

logger = logging.getLogger(__name__)
NO_TOKEN = 2**40  # a stop id no token has (ignore_eos): generate fills a None from the model's own eos


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch._C._nn.linear(x, self.weight, self.bias)


@dataclasses.dataclass(eq=False)
class _Call:
    aborted: bool = False


class _AbortedCall(StoppingCriteria):
    """Ends HF's generate (the image-text path) after the step in which the call was aborted, as the text path's
    own loop does."""

    def __init__(self, call: _Call):
        self.call = call

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.call.aborted, dtype=torch.bool, device=input_ids.device)


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers sized ahead (`cache_capacity`): a step writes its new
    position in place, where DynamicLayer concatenates, i.e. copies the whole cache of every layer at every step
    (and on CPU page-faults the fresh copy in). Past the capacity the buffers double."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._keys, self._values = (t.new_empty((*t.shape[:2], self.capacity, t.shape[3]))
                                    for t in (key_states, value_states))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.length
        self._reserve(start + key_states.shape[-2])
        self.length = start + key_states.shape[-2]
        self._keys[:, :, start:self.length] = key_states
        self._values[:, :, start:self.length] = value_states
        return self._views()

    def _reserve(self, length: int) -> None:
        if length > self._keys.shape[2]:
            grown = max(length, 2 * self._keys.shape[2])
            self._keys, self._values = (torch.cat([t[:, :, :self.length],
                                                   t.new_empty((*t.shape[:2], grown - self.length, t.shape[3]))], 2)
                                        for t in (self._keys, self._values))

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers (B, Hkv, capacity, D), of which `get_seq_length()` positions are written,
        with room for one more (DecodeStep's compiled graph reads them, then `update` writes its keys: a capacity
        always above the length keeps the graph's view of the written part of one layout)."""
        self._reserve(self.length + 1)
        return self._keys, self._values

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = self._keys[:, :, :self.length], self._values[:, :, :self.length]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (in that order), copying only the positions written: the rest of the buffers
        (most of them while responses are short against max_new_tokens) is not even resident on CPU until touched,
        and copying it would make it so, at a cost that grows with the capacity."""
        if self.length:
            self._keys, self._values = (self._select(t, indices) for t in (self._keys, self._values))
            self._views()

    def _select(self, buffer: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        kept = buffer.new_empty((len(indices), *buffer.shape[1:]))
        torch.index_select(buffer[:, :, :self.length], 0, indices, out=kept[:, :, :self.length])
        return kept


GPU_CACHE_STEP = 256  # new tokens a GPU cache has room for at first (it doubles past them)


def cache_capacity(prompt_width: int, max_new_tokens: int, device: torch.device) -> int:
    """Positions a decode's PreallocatedLayer buffers hold at first. On CPU the whole decode: a page is resident only
    once written, so room never used costs nothing. On a GPU the buffers are allocated whole (64 rows of a 7B model
    at 8k new tokens would take ~30 GB), so there they start at the prompt and GPU_CACHE_STEP tokens and double as
    the rows grow: at most twice what the longest row uses."""
    return prompt_width + (max_new_tokens if device.type == "cpu" else min(max_new_tokens, GPU_CACHE_STEP))


def _compile(setting: bool | str, model: torch.nn.Module, device: torch.device) -> tuple[bool | str, bool | str]:
    """rollout.hf_compile for this model and device -> DecodeStep's (`fused_attention`, `compiled`)."""
    if setting is False:
        return False, False
    if device.type != "cpu":
        if setting != "auto":
            raise ValueError(f"rollout.hf_compile={setting} is built and tested on CPU; this engine runs on "
                             f"{device.type}: use rollout.hf_compile=auto or false")
        return False, False
    if setting == "attention":
        return True, False
    swiglu = getattr(model.config, "hidden_act", None) == "silu"
    if setting == "step":
        if not swiglu:
            raise ValueError(f"rollout.hf_compile=step compiles SwiGLU MLPs; this model's hidden_act is "
                             f"{model.config.hidden_act!r}: use rollout.hf_compile=attention or false")
        return False, True
    if model.config.get_text_config().hidden_size < fused.MIN_HIDDEN:
        return False, False
    # In bf16 the compiled step's fused chains round elsewhere than the model's forward: its logprobs stood ~4x
    # further from a teacher-forced forward than HF's own decoding (the eager step's, attention in fp32, do not)
    return "fallback", "fallback" if swiglu and model.dtype == torch.float32 else False


def plain_linear(model: torch.nn.Module) -> None:
    """Make the model's nn.Linear layers call torch's own linear (layers that call F.linear themselves, such as
    some MoE experts, keep the process-wide one: slower, as correct). A ZeRO-3 engine replaces
    torch.nn.functional.linear process-wide with an autograd Function for partitioned weights; the engine's
    weights are whole, and that Function costs ~10% of generation on the 3.6M model of bench/vs_trl.py.
    Per module, not by restoring the global: one-step-off rollout generates while the trainer trains."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_linear_forward, module)


def top_p_filtered(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """(B, V) scores with the tokens outside the nucleus at -inf, as HF's TopPLogitsWarper."""
    if top_p >= 1:
        return scores
    ordered, order = scores.sort(-1)
    drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
    drop[:, -1] = False  # the most likely token always stays
    return scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))


class SeededSampling(LogitsProcessor):
    """For HF's generate run greedy: scores whose argmax is a draw from softmax(logits / T) after top-p (the
    Gumbel-max trick: argmax(log p + G) with G = -log(-log U) is distributed as p), U from `generator`; at T = 0
    the logits themselves. Each step's drawn token's logprob under softmax(logits / T) before top-p (what SGLang
    reports) is kept, (B,) a step, so that no step's full-vocabulary logits need keeping."""

    def __init__(self, temperature: float, top_p: float, generator: torch.Generator | None):
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scaled = scores.float() / (self.temperature or 1.0)
        if self.temperature == 0:
            out = scaled
        else:
            logp = top_p_filtered(scaled, self.top_p).log_softmax(-1)
            u = torch.rand(logp.shape, generator=self.generator, device=logp.device)
            out = logp - torch.log(-torch.log(u))
        token = out.argmax(-1)
        self.logprobs.append(scaled.log_softmax(-1).gather(1, token[:, None]).squeeze(1))
        return out


class HFEngine:
    def __init__(self, model_cfg, tokenizer, *, device: torch.device, batch_size: int = 64,
                 decode_step: bool = True, packed_weights: bool = True, compiled: bool | str = "auto"):
        self.model, self.adapter = load_model(model_cfg, attn_implementation=GQA_SDPA, dtype=resolve_dtype(model_cfg.dtype))
        self.model.to(device).eval()
        for config in (self.model.config, getattr(self.model.config, "text_config", None)):
            if getattr(config, "output_router_logits", False):  # a MoE checkpoint's training setting: the
                config.output_router_logits = False  # aux loss over one-token steps fails (HF's generate too)
        onednn = device.type == "cpu" and resolve_cpu_linear(model_cfg.cpu_linear) == "onednn" and \
            use_onednn_linears(self.model, fallback=torch._C._nn.linear)
        if not onednn:
            plain_linear(self.model)
        # Text decode steps of Llama-family models skip HF's forward (slime/models/decode_step.py).
        why = DecodeStep.unsupported(self.model) if decode_step else "turned off"
        linear = functools.partial(onednn_linear, fallback=torch._C._nn.linear) if onednn else torch._C._nn.linear
        if why and compiled not in (False, "auto"):
            raise ValueError(f"rollout.hf_compile={compiled} compiles the engine's own decode step, which this model "
                             f"does not get ({why}): use rollout.hf_compile=auto or false")
        fused_attention, compiled = (False, False) if why else _compile(compiled, self.model, device)
        self._step = None if why else DecodeStep(self.model, linear, fused_attention=fused_attention,
                                                  compiled=compiled,
                                                  pack=self._pack(onednn, packed_weights, device))
        if why:
            logger.info("hf engine: decode steps run the model's own forward (%s)", why)
        elif self._step.pack is not None:
            logger.info("hf engine: decode steps read %s copies of the matmul weights (~%.1f MB more memory; "
                        "rollout.hf_packed_weights=false saves it)", self._step.pack,
                        self._step.packed_bytes() / 2 ** 20)
        self.device, self.batch_size = device, batch_size
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        # What ends a response, as SGLang has it: the tokenizer's EOS and every EOS of the model's generation config
        # (Qwen's lists <|im_end|> and <|endoftext|>).
        model_eos = getattr(self.model.generation_config, "eos_token_id", None)
        model_eos = model_eos if isinstance(model_eos, (list, tuple)) else [model_eos]
        self.eos_ids = sorted({t for t in (self.eos_id, *model_eos) if t is not None})
        # HF's generate fills every option we leave unset from the model's generation_config.json (Qwen-VL Instruct
        # ships top_p=0.001 and repetition_penalty=1.05: near-greedy, penalised sampling whose logprobs we would
        # report as those of the plain distribution). Ours says everything: nothing of the model's applies.
        self.model.generation_config = GenerationConfig()
        self._seeded: tuple[int, torch.Generator] | None = None
        self._params = dict(self.model.named_parameters())
        self._load_plan = self.adapter.load_plan(self.model)  # checkpoint name -> where it goes in memory
        self._version = 0
        self._calls: set[_Call] = set()  # the generate() calls running (one-step-off rollout: in another thread)
        self._calls_lock = threading.Lock()

    def _pack(self, onednn: bool, packed_weights: bool, device: torch.device) -> str | None:
        """DecodeStep's `pack`: on CPU with rollout.hf_packed_weights, for an fp32 model (the packed kernels' dtype;
        other dtypes decode on the plain weights, and copies would go unread), oneDNN's blocked layout where the engine
        runs oneDNN, else (MKL's sgemm) transposed copies."""
        if not packed_weights or device.type != "cpu" or self.model.lm_head.weight.dtype != torch.float32:
            return None
        return "onednn" if onednn else "transposed"

    @property
    def weight_version(self) -> int:
        return self._version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 mm: list[MultimodalInputs | None] | None = None) -> list[list[Generation]]:
        out: list[list[Generation]] = []
        per_call = max(1, self.batch_size // params.n)
        mm = mm or [None] * len(prompts)
        check_contexts(prompts, mm)
        self._check_ids(prompts)
        call = _Call()  # abort() cuts the calls running when it is called, as SGLang's does; not a later one
        with self._calls_lock:
            self._calls.add(call)
        try:
            for i in range(0, len(prompts), per_call):
                if call.aborted:  # the chunks not started return empty, as SGLang's unsent requests do
                    out.extend([Generation([], [], "abort") for _ in range(params.n)]
                               for _ in prompts[i:i + per_call])
                elif params.n <= self.batch_size:
                    out.extend(self._generate_batch(prompts[i:i + per_call], params, mm[i:i + per_call], call))
                else:  # one prompt's n samples in chunks of batch_size rows (each chunk prefills the prompt again)
                    gens: list[Generation] = []
                    for start in range(0, params.n, self.batch_size):
                        chunk = dataclasses.replace(params, n=min(self.batch_size, params.n - start))
                        gens += ([Generation([], [], "abort")] * chunk.n if call.aborted else
                                 self._generate_batch(prompts[i:i + 1], chunk, mm[i:i + 1], call)[0])
                    out.append(gens)
        finally:
            with self._calls_lock:
                self._calls.discard(call)
        return out

    def _check_ids(self, prompts: list[list[int]]) -> None:
        """An empty context would decode from padding alone, an id past the embedding fail deep in the model."""
        vocab = self.model.get_input_embeddings().num_embeddings
        for i, ids in enumerate(prompts):
            if not len(ids):
                raise ValueError(f"prompt {i} of this generate call is empty: a context needs at least one token "
                                 "(a prompt that tokenises to nothing, or a chat template that gave none)")
            if min(ids) < 0 or max(ids) >= vocab:
                bad = [t for t in ids if not 0 <= t < vocab]
                raise ValueError(f"prompt {i} of this generate call has token ids outside the model's vocabulary "
                                 f"[0, {vocab}): {bad[:5]}; the tokenizer does not match model.path")

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        mm: list[MultimodalInputs | None], call: "_Call") -> list[list[Generation]]:
        if all(m is None for m in mm):
            try:
                gens = self._decode([p for p in prompts for _ in range(params.n)], params, call)
            except RuntimeError as e:
                if "probability tensor contains" not in str(e):
                    raise
                raise self._not_finite() from e
            return [gens[k:k + params.n] for k in range(0, len(gens), params.n)]
        # Image inputs follow their rows, so each prompt is repeated n times here rather than expanded by generate
        # (which does not repeat pixel patches along with the rows).
        prompts = [p for p in prompts for _ in range(params.n)]
        images = [m for m in mm for _ in range(params.n) if m is not None]
        ids, mask = self._left_padded(prompts)
        width = ids.shape[1]
        extra = {"pixel_values": torch.cat([m.pixel_values for m in images]).to(self.device, self.model.dtype),
                 "image_grid_thw": torch.cat([m.image_grid_thw for m in images]).to(self.device),
                 "mm_token_type_ids": (ids == self.model.config.image_token_id).int()}
        stops = [] if params.ignore_eos else [*self.eos_ids, *params.stop_token_ids]
        # HF's generate runs greedy over SeededSampling's scores, whose argmax is a draw from the engine's own
        # generator (the seed's; without one, seeded from torch's global generator), and which keeps each step's
        # token logprob: HF's output_logits would keep every step's (rows, vocabulary) logits to the end. A fresh
        # GenerationConfig: the model's own defaults (top_k=50, a repetition penalty, ...) would change the
        # distribution away from the logprobs we report; top_k=0, not None, which generate fills with 50.
        generator = None
        if params.temperature > 0:
            generator = self._generator(params.seed) if params.seed is not None else torch.Generator(
                self.device).manual_seed(int(torch.randint(2**62, (1,))))
        sampler = SeededSampling(params.temperature, params.top_p, generator)
        gen_cfg = GenerationConfig(do_sample=False, top_k=0, max_new_tokens=params.max_new_tokens,
                                   eos_token_id=stops or [NO_TOKEN],
                                   pad_token_id=self.pad_id, return_dict_in_generate=True)
        res = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                  logits_processor=LogitsProcessorList([sampler]),
                                  stopping_criteria=StoppingCriteriaList([_AbortedCall(call)]), **extra)
        new = res.sequences[:, width:].cpu()  # (B*n, L)
        token_logps = torch.stack(sampler.logprobs, 1).cpu()[:, :new.shape[1]]
        if not torch.isfinite(token_logps).all():
            raise self._not_finite()
        stop_set = set(stops)
        gens = []
        for row in range(new.shape[0]):
            toks = new[row].tolist()
            end = next((j + 1 for j, t in enumerate(toks) if t in stop_set), None)
            reason = "stop" if end is not None else "abort" if call.aborted else "length"
            end = end or len(toks)
            gens.append(Generation(toks[:end], token_logps[row, :end].tolist(), reason))
        return [gens[k:k + params.n] for k in range(0, len(gens), params.n)]  # n generations per prompt, in order

    def _generator(self, seed: int | None) -> torch.Generator | None:
        """The generator of `seed`: made when the seed is new, then drawn on across calls (a batch's chunks and a
        generate function's calls share a seed and must not repeat each other's draws)."""
        if seed is None:
            return None
        if self._seeded is None or self._seeded[0] != seed:
            self._seeded = (seed, torch.Generator(self.device).manual_seed(seed))
        return self._seeded[1]

    def _left_padded(self, rows: list[list[int]] | list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids and attention mask (B, width) on the device, left-padded: generation continues from the right edge."""
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(rows):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _not_finite(self) -> RuntimeError:
        return RuntimeError(f"the policy's next-token probabilities are not finite (inf or NaN logits) with the "
                            f"weights of version {self._version}: training has blown the weights up (a learning "
                            "rate far too high?), or a checkpoint holds such weights")

    def _decode(self, rows: list[list[int]], params: SamplingParams, call: "_Call") -> list[Generation]:
        """One response per row: left-padded prefill (once per distinct prompt), then one token per step for the
        rows still going.

        Sampling is HF's: softmax(logits / T), nucleus filtering as TopPLogitsWarper, one multinomial draw;
        the reported logprob is that of the temperature-scaled distribution before top-p (as SGLang's)."""
        greedy, stops = params.temperature == 0, set() if params.ignore_eos else {*self.eos_ids, *params.stop_token_ids}
        stop_ids = torch.tensor(sorted(stops), dtype=torch.long, device=self.device)
        unique: dict[tuple[int, ...], int] = {}  # the n samples of a prompt share its prefill
        copy_of = torch.tensor([unique.setdefault(tuple(r), len(unique)) for r in rows], device=self.device)
        ids, mask = self._left_padded(list(unique))
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        if all(type(layer) is DynamicLayer for layer in cache.layers):  # sliding-window layers keep their own
            capacity = cache_capacity(ids.shape[1], params.max_new_tokens, self.device)
            cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
        if self._step is not None:
            self._step.check()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1]
        if len(unique) < len(rows):  # each row gets its prompt's cache rows and next-token logits
            logits, mask, positions = logits[copy_of], mask[copy_of], positions[copy_of]
            cache.batch_select_indices(copy_of)
        # A seed (one-step-off rollout: generation in a thread while the trainer's activation checkpointing saves
        # and restores torch's global generator) gives this call its own generator.
        gen = self._generator(params.seed)
        live = torch.arange(len(rows), device=self.device)  # the original row of each row still decoding
        next_pos = positions[:, -1] + 1
        tokens, logps = [[] for _ in rows], [[] for _ in rows]
        finished = [False] * len(rows)
        for step in range(params.max_new_tokens):
            scores = logits.float() / (1.0 if greedy else params.temperature)
            logp = torch.log_softmax(scores, dim=-1)
            if greedy:
                tok = scores.argmax(-1)
            else:
                tok = torch.multinomial(top_p_filtered(scores, params.top_p).softmax(-1), 1, generator=gen).squeeze(1)
            tok_logp = logp.gather(1, tok[:, None]).squeeze(1)
            if not torch.isfinite(tok_logp).all():  # NaN logits: greedy decoding would pick token 0 silently
                raise self._not_finite()
            for r, t, lp in zip(live.tolist(), tok.tolist(), tok_logp.tolist()):
                tokens[r].append(t)
                logps[r].append(lp)
            going = ~torch.isin(tok, stop_ids)
            for r in live[~going].tolist():
                finished[r] = True
            if step + 1 == params.max_new_tokens or not going.any() or call.aborted:
                break
            if not going.all():  # stopped rows leave the batch, their cache rows with them
                keep = going.nonzero().squeeze(1)
                live, tok, next_pos, mask = live[keep], tok[keep], next_pos[keep], mask[keep]
                cache.batch_select_indices(keep)
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            if self._step is not None:
                logits = self._step(tok, next_pos, mask.bool(), cache)
            else:
                logits = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                                    past_key_values=cache, use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
        cut = "abort" if call.aborted else "length"
        return [Generation(t, lp, "stop" if done else cut) for t, lp, done in zip(tokens, logps, finished)]

    def update_weights(self, buckets: Iterable[NamedTensors], version: int) -> None:
        """Load checkpoint-named tensors (as SGLang would) into the in-memory parameters."""
        seen = set()
        try:
            for bucket in buckets:
                for name, tensor in bucket:
                    if name not in self._load_plan:
                        raise KeyError(f"weight '{name}' from the trainer has no counterpart in the hf engine's model")
                    target, positions = self._load_plan[name]
                    param = self._params[target].data
                    tensor = tensor.to(param.device, param.dtype)
                    if positions is None:
                        param.copy_(tensor)
                    else:
                        param.view(-1)[positions.to(param.device)] = tensor.reshape(-1)
                    seen.add(name)
        finally:  # a push that fails part-way has written some parameters: the step's copies follow them too
            if self._step is not None and seen:
                self._step.refresh()  # its packed weights are copies
        missing = set(self._load_plan) - seen
        if missing:
            raise RuntimeError(f"weight update {version} left {len(missing)} tensors stale, e.g. {sorted(missing)[:3]}")
        self._version = version

    def sleep(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        """In-process engine: nothing to release on CPU; on GPU, the weights could move to host."""

    def wake(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        pass

    def abandon(self) -> None:
        """After an error on this rank: stop generating (the same as abort here: nothing runs elsewhere)."""
        self.abort()

    def abort(self) -> None:
        """End the generate() calls in flight (in another thread) after their current decode step; the rows cut
        and the chunks not started return with finish_reason "abort", to be discarded."""
        with self._calls_lock:
            for call in self._calls:
                call.aborted = True

    def metrics(self) -> dict:
        return {}

    def shutdown(self) -> None:
        self.model = None
        self._params = {}
