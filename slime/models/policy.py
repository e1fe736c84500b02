"""The module DeepSpeed wraps: an HF model whose forward returns per-token logprobs (actor, reference)
or per-token values (critic). One forward serves all three roles, packed and padded layouts alike,
so attention, position-id and multimodal changes land in one place.

Logprobs are computed only at response positions and in chunks, so full-vocabulary logits never
exist for the whole micro-batch at once; with grad, each chunk is recomputed in backward
(activation checkpointing) so only one chunk's logits are alive at a time.

The chunks run inside ONE call of `LogprobHead`, a module that shares the LM head's weight: under
ZeRO-3 every module call gathers its parameters, so calling the LM head once per chunk would
re-gather the (large) vocabulary projection per chunk, and ranks with different token counts
would issue different numbers of gathers, a collective mismatch.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

from slime.distributed.ulysses import SequenceShard, gather_shards
from slime.models.adapters import ModelAdapter, get_adapter
from slime.models.attention import PACKED_ROW, PACKED_SDPA, packed_attention_kwargs


def logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V) fp32, targets (N,) -> logprob of target (N,), entropy (N,)."""
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


def final_logits(config) -> tuple[float, float | None]:
    """(scale, softcap) of the logits a family's causal LM makes after its LM head, as its forward does:
    Cohere's `logits * logit_scale`, Granite's `logits / logits_scaling`, HyperCLOVAX's `logits * logits_scaling`,
    and `cap * tanh(logits / cap)` where a config sets final_logit_softcapping (Gemma 2/3/4). A multiplier of
    another family is refused, not left out (MPT's `logit_scale` is one its HF model never reads)."""
    text = config.get_text_config()
    kind, scale = text.model_type, 1.0
    if kind.startswith("cohere"):
        scale = float(text.logit_scale if text.logit_scale is not None else 1.0)
    elif kind.startswith("granite"):
        scale = 1.0 / float(text.logits_scaling or 1.0)
    elif kind.startswith("hyperclovax"):
        scale = float(getattr(text, "logits_scaling", None) or 1.0)
    elif getattr(text, "lm_head_multiplier", None) not in (None, 1, 1.0):
        raise ValueError(f"{kind} multiplies its logits by lm_head_multiplier={text.lm_head_multiplier}, which the "
                         "trainer's logprob head does not: this model family is not supported")
    return scale, getattr(text, "final_logit_softcapping", None)


class LogprobHead(nn.Module):
    def __init__(self, lm_head: nn.Linear, config=None):
        super().__init__()
        self.weight = lm_head.weight  # shared, like tied embeddings; named once, under hf.
        self.bias = lm_head.bias
        self.scale, self.softcap = final_logits(config) if config is not None else (1.0, None)

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (N, H), targets (N,) -> logprobs (N,), entropies (N,)."""
        def chunk_fn(h: torch.Tensor, t: torch.Tensor):
            logits = F.linear(h, self.weight, self.bias)
            if self.scale != 1.0:
                logits = logits * self.scale
            if self.softcap is not None:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            return logprobs_and_entropy(logits.float() / temperature, t)

        logps, ents = [], []
        for i in range(0, max(hidden.shape[0], 1), chunk_size):
            h, t = hidden[i:i + chunk_size], targets[i:i + chunk_size]
            if torch.is_grad_enabled():
                lp, ent = ckpt.checkpoint(chunk_fn, h, t, use_reentrant=False)
            else:
                lp, ent = chunk_fn(h, t)
            logps.append(lp)
            ents.append(ent)
        return torch.cat(logps), torch.cat(ents)


def compile_layers(model: nn.Module) -> int:
    """Regional compilation (train.compile): every decoder layer's forward goes through torch.compile with dynamic
    shapes, so micro-batches of any length reuse the graphs (one set each for grad and no-grad passes, with and
    without shared prompts). Compiling layer by layer keeps the compile short (the layers of a model share their
    code) and leaves module hooks, gradient checkpointing and the attention kernel (packed_sdpa, marked
    torch.compiler.disable) eager. The compiled code fuses what eager runs op by op: the norms, rotary
    embedding, SwiGLU and residual adds. Returns the number of layers compiled."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    adapter = get_adapter(model.config.model_type)
    if adapter.multimodal or adapter.moe:
        raise ValueError(f"train.compile=true is built and tested for text-only dense models; this "
                         f"{model.config.model_type} model is {'an image-text' if adapter.multimodal else 'a MoE'} "
                         "model: use train.compile=false")
    attention = model.config._attn_implementation
    if attention.startswith("ulysses_sp"):  # slime/distributed/ulysses.py's all-to-all around the attention
        raise ValueError(f"train.compile=true does not run with sequence parallelism (parallel.sp > 1: this model "
                         f"runs {attention}): set parallel.sp=1 or train.compile=false")
    if attention != PACKED_SDPA:  # flash-attn's path would be traced into the layers' graphs: not tested (no GPU)
        raise ValueError(f"train.compile=true is built and tested with {PACKED_SDPA} attention (CPU), which stays "
                         f"eager; this model runs {attention}: use train.compile=false")
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"train.compile=true: {type(model).__name__} has no decoder layers transformers marks as "
                         "repeated blocks (GradientCheckpointingLayer); use train.compile=false")
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    return len(layers)


class PolicyModel(nn.Module):
    """`hf` is a causal LM (head "logprobs") or a backbone without LM head (head "value").

    The value head starts at zero, so a fresh critic predicts V = 0 and the first advantages are
    the raw returns.
    """

    def __init__(self, hf_model: nn.Module, *, head: str = "logprobs", adapter: ModelAdapter | None = None,
                 sp: SequenceShard | None = None):
        super().__init__()
        self.hf, self.head = hf_model, head
        self.adapter = adapter or get_adapter(hf_model.config.model_type)
        self.sp = sp  # sequence parallel: this rank runs one shard of each row (slime/distributed/ulysses.py)
        if head == "logprobs":
            self.logprob_head = LogprobHead(hf_model.get_output_embeddings(), hf_model.config)
        elif head == "value":
            self.value_head = nn.Linear(hf_model.config.get_text_config().hidden_size, 1,
                                        dtype=next(hf_model.parameters()).dtype)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        else:
            raise ValueError(f"unknown head {head!r}; use 'logprobs' or 'value'")

    @property
    def config(self):
        """The HF config, where DeepSpeed's AutoEP looks for the model's expert counts."""
        return self.hf.config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
                pred_index: torch.Tensor, *, max_len: int, target_ids: torch.Tensor, temperature: float = 1.0,
                chunk_size: int = 1024, prompt_prefixes: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None,
                **extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """input_ids (T,) packed or (B, L) right-padded; position_ids of the same shape, or with a leading
        axis of rope rows (mrope); pred_index (N,) positions of the flattened tokens whose hidden states
        score target_ids (N,) (each sample's last token is a target only, not an input: slime/data/batch.py);
        prompt_prefixes: shared prompts and token_mask: the samples' own tokens, not padding (slime/data/batch.py);
        `extra`: the adapter's extra inputs (images).

        Returns logprobs (N,) and entropies (N,) of the targets at `temperature` (and, for a mixture of
        experts, the router's aux loss and balance sums of this rank's tokens), or values (N,) of the
        states at pred_index (the state before each response token).
        """
        if input_ids.dim() == 1:
            input_ids, position_ids = input_ids[None], position_ids[..., None, :]
        if prompt_prefixes is not None and (self.sp is not None
                                            or self.hf.config._attn_implementation != PACKED_SDPA):
            raise ValueError("shared prompts (train.share_prompts) need the packed_sdpa attention and no sequence "
                             f"parallelism; this model runs {self.hf.config._attn_implementation!r}"
                             f"{' with sp' if self.sp is not None else ''}: build its micro-batches unshared")
        kwargs = packed_attention_kwargs(cu_seqlens, max_len, prompt_prefixes) if cu_seqlens is not None else {}
        start, end = self.sp.bounds(input_ids.shape[-1]) if self.sp is not None else (0, input_ids.shape[-1])
        packed = PACKED_ROW.set(cu_seqlens is not None)  # packed_sdpa refuses a packed row that reaches it bare
        try:
            hidden = self.adapter.hidden_states(self.hf, input_ids, position_ids, extra, shard=(start, end), **kwargs)
        finally:
            PACKED_ROW.reset(packed)
        router = None
        if isinstance(hidden, tuple):  # MoE: (hidden, router logits of this rank's tokens)
            hidden, logits = hidden
            real = token_mask.view(input_ids.shape)[..., start:end].flatten() if token_mask is not None else None
            router = self.adapter.router_stats(self.hf, logits, real, self.sp) if self.head == "logprobs" else None
        mine, targets = pred_index, target_ids
        if self.sp is not None:  # the scored positions of this shard (a target may lie in the next shard)
            here = (pred_index >= start) & (pred_index < end)
            mine, targets = pred_index[here], targets[here]
        hidden = hidden.flatten(0, 1)[mine - start]  # (n, H): the scored positions of this shard
        if self.head == "value":
            out = (self.value_head(hidden).squeeze(-1).float(),)
        else:
            out = self.logprob_head(hidden, targets, temperature=temperature, chunk_size=chunk_size)
        if self.sp is not None:  # every sp peer gets the whole micro-batch's values, in order
            local = (end - start)
            counts = [int(((pred_index >= r * local) & (pred_index < (r + 1) * local)).sum())
                      for r in range(self.sp.size)]
            out = tuple(gather_shards(t, counts, self.sp) for t in out)
        if self.head == "value":
            return out[0]
        return (*out, router) if router is not None else out
