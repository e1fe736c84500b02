"""Packed (varlen) attention for HF models.

A packed micro-batch is one row of concatenated samples with `cu_seqlens` marking sample borders.
Attention must be causal *within* each sample and never cross a border. We register an attention
function `packed_sdpa` with transformers' AttentionInterface that never builds a (T, T) mask: the
samples are sorted by length and cut into groups of similar length; each group is gathered into a
right-padded (n, H, L_max, D) batch and runs ONE causal sdpa call (a query never sees the padding at its
row's end), and the outputs are gathered back to packed order. Within a group the padded area n * L_max^2
is at most PAD_AREA times the real one, so padding cannot cost more than that in attention; one group per
similar-length run replaces one sdpa call per sample (`python bench/packed_attention.py`, one layer's
forward + backward, 1 thread, per sample -> grouped, on the flash path below: 64 x 71 tokens 165 -> 61 ms, a
long-tailed batch of 64 404 -> 196 ms).
With shared prompts (slime/data/batch.py) a segment may first attend to another segment's prompt: its
queries are its own tokens, its keys the prompt's then its own, under a lower-right causal mask, one sdpa
call per group of segments with prompts of one length (`python bench/shared_prompts.py`).
On CPU the groups go straight to sdpa's CPU flash kernel, forward and backward (`_PackedFlash`), gathered and
scattered in the token-major layout that HF's projections give and the kernel writes; the same calls through
autograd (elsewhere, and with dropout) cost a third more per layer in index_select, cat and their backward's
zero-filled buffers.
On GPU, flash-attn's varlen kernel gets the same `cu_seq_lens_*` kwargs through transformers' own
`flash_attention_2` path.
"""
from __future__ import annotations

import contextvars
import functools
import importlib.util
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "packed_sdpa"
ATTENTION_LAYERS = ("full_attention", "sliding_attention")  # layer_types that only attend (no state across tokens)
PAD_AREA = 1.5  # a group's padded attention area (n * L_max^2) stays within this factor of sum(L^2)


def _length_groups(lengths: list[int], offset: int = 0) -> list[list[int]]:
    """Query lengths (each row also attending to `offset` earlier keys) -> groups of row numbers, longest first,
    each group's padded attention area n * L_max * (offset + L_max) within PAD_AREA of its real area (empty rows
    are left out)."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    groups, current, area = [], [], 0
    for i in order:
        top, n = (lengths[current[0]] if current else lengths[i]), lengths[i]
        if current and (len(current) + 1) * top * (offset + top) > PAD_AREA * (area + n * (offset + n)):
            groups.append(current)
            current, area = [], 0
        current.append(i)
        area += n * (offset + n)
    if current:
        groups.append(current)
    return groups


def attention_groups(bounds: tuple[int, ...]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Sample borders -> groups of (L_max, starts, lengths), longest samples first, each group's padded
    attention area within PAD_AREA of its real area."""
    spans = list(zip(bounds[:-1], bounds[1:]))
    lengths = [e - s for s, e in spans]
    return [(lengths[g[0]], tuple(spans[i][0] for i in g), tuple(lengths[i] for i in g))
            for g in _length_groups(lengths)]


class _Group(NamedTuple):
    """One sdpa call of a packed micro-batch: n segments padded to L query slots, each with P prompt keys first."""
    queries: torch.Tensor  # (n * L,) the token of each query slot (a padding slot repeats its row's first token)
    shape: tuple[int, int]  # (n, L)
    keys: torch.Tensor  # (n * (P + L),) the token of each key slot
    prompt: int  # P (0: plain causal)
    real: torch.Tensor | None  # the slots holding real tokens (None: all of them)
    real_tokens: torch.Tensor  # their tokens, in slot order
    padding: torch.Tensor | None  # the other slots


@functools.lru_cache(maxsize=64)
def _gather_plan(bounds: tuple[int, ...], prefixes: tuple[int, ...], device: torch.device) -> list[_Group]:
    """Sample borders and prompt spans -> the micro-batch's sdpa calls. Built once per micro-batch and device
    (every layer reuses it).

    Segment k of the row (tokens bounds[k]:bounds[k+1]) attends to a shared prompt of P tokens first, the
    tokens prefixes[2k]:prefixes[2k+1] (none when empty), then causally to itself: its queries are its own
    tokens, its keys the prompt's and its own, and query i sees keys up to P + i (causal, lower right).
    Segments are grouped by P, then by length; every token is a real query slot of exactly one group."""
    spans = list(zip(bounds[:-1], bounds[1:]))
    pre = list(zip(prefixes[0::2], prefixes[1::2])) if prefixes else [(0, 0)] * len(spans)
    by_prompt: dict[int, list[int]] = {}
    for k, (ps, pe) in enumerate(pre):
        by_prompt.setdefault(pe - ps, []).append(k)
    plan = []
    for p, segments in sorted(by_prompt.items()):
        for group in _length_groups([spans[k][1] - spans[k][0] for k in segments], offset=p):
            rows = [segments[i] for i in group]
            lmax = spans[rows[0]][1] - spans[rows[0]][0]
            steps = torch.arange(lmax)
            starts = torch.tensor([spans[k][0] for k in rows])[:, None]
            real = steps < torch.tensor([spans[k][1] - spans[k][0] for k in rows])[:, None]  # (n, L_max)
            # Padding slots repeat the row's first token: only padded queries (discarded) ever attend to them.
            queries = torch.where(real, starts + steps, starts)
            keys = torch.cat([torch.tensor([pre[k][0] for k in rows])[:, None] + torch.arange(p), queries], 1)
            slots = real.flatten()
            padded = not bool(slots.all())
            plan.append(_Group(queries.flatten().to(device), tuple(queries.shape), keys.flatten().to(device), p,
                               slots.nonzero().squeeze(1).to(device) if padded else None,
                               queries[real].to(device), (~slots).nonzero().squeeze(1).to(device) if padded else None))
    return plan


@functools.lru_cache(maxsize=16)
def _lower_right_causal(length: int, prompt: int, device: torch.device, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """(length, prompt + length): query i sees the prompt and its own tokens up to i. Bool, or additive (0 /
    -inf) in a float dtype. Cached apart from the plans, which hold only index tensors of the micro-batch's size."""
    seen = torch.ones(length, prompt + length, dtype=torch.bool).tril(prompt)
    if dtype != torch.bool:
        seen = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf"))
    return seen.to(device)


def _flash_args(group: _Group, dtype: torch.dtype, device: torch.device) -> dict:
    if group.prompt:
        return {"is_causal": False, "attn_mask": _lower_right_causal(group.shape[1], group.prompt, device, dtype)}
    return {"is_causal": True}


def _to_tokens(out: torch.Tensor, group: _Group, slots: torch.Tensor) -> torch.Tensor:
    """Copy a group's rows per query slot (n * L, ...) to their tokens' rows of `out` (T, ...), real slots only."""
    if group.real is None:
        return out.index_copy_(0, group.queries, slots)
    return out.index_copy_(0, group.real_tokens, slots.index_select(0, group.real))


class _PackedFlash(torch.autograd.Function):
    """All of a micro-batch's groups through sdpa's CPU flash kernel, forward and backward, token-major: each group
    gathers its tokens' rows of q, k and v ((T, H, D) views, the layout HF's projections give), the kernel writes
    (n, L, H, D), and the real slots are copied into the (T, H, D) output; backward gathers the output's gradient
    the same way (zero at padding slots), copies the query gradients to their tokens and adds up the key and value
    gradients (a shared prompt's keys are keys of many rows). Against the same calls through autograd (index_select,
    cat, and their backward's zero-filled buffers): one copy per tensor each way instead of two or three."""

    @staticmethod
    def forward(ctx, query, key, value, plan, scale):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
        out = q.new_empty(q.shape)
        saved = []
        for g in plan:
            n, length = g.shape
            qg = q.index_select(0, g.queries).unflatten(0, (n, length)).transpose(1, 2)  # (n, H, L, D)
            kg, vg = (t.index_select(0, g.keys).unflatten(0, (n, -1)).transpose(1, 2) for t in (k, v))
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qg, kg, vg, 0.0, scale=scale, **_flash_args(g, q.dtype, q.device))
            flat = o.transpose(1, 2).reshape(n * length, *q.shape[1:])
            _to_tokens(out, g, flat)
            saved += [qg, kg, vg, o, lse]
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.scale, ctx.kv_shape = plan, scale, k.shape
        return out[None]

    @staticmethod
    def backward(ctx, grad):
        grad = grad[0]  # (T, H, D)
        dq = grad.new_empty(grad.shape)
        dk, dv = (grad.new_zeros(ctx.kv_shape) for _ in range(2))
        saved = ctx.saved_tensors
        for i, g in enumerate(ctx.plan):
            qg, kg, vg, o, lse = saved[5 * i:5 * i + 5]
            n, length = g.shape
            go = grad.index_select(0, g.queries)
            if g.padding is not None:
                go.index_fill_(0, g.padding, 0.0)  # padded queries' outputs are discarded: no gradient
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                go.unflatten(0, (n, length)).transpose(1, 2), qg, kg, vg, o, lse, 0.0, scale=ctx.scale,
                **_flash_args(g, grad.dtype, grad.device))
            gq = gq.transpose(1, 2).reshape(n * length, *dq.shape[1:])
            _to_tokens(dq, g, gq)
            dk.index_add_(0, g.keys, gk.transpose(1, 2).reshape(-1, *dk.shape[1:]))
            dv.index_add_(0, g.keys, gv.transpose(1, 2).reshape(-1, *dv.shape[1:]))
        return (*(t.transpose(0, 1)[None] for t in (dq, dk, dv)), None, None)


# Set by PolicyModel.forward around a packed row's forward: packed_sdpa then needs the samples' borders.
PACKED_ROW: contextvars.ContextVar[bool] = contextvars.ContextVar("packed_row", default=False)


def packing_refusal(config, longest: int, packing: bool = True) -> str | None:
    """Why the samples of a packed row (or a padded batch) would not compute as each alone, or None: layers that
    carry state from token to token (linear attention, convolutions) across the samples' borders, or a rope whose
    frequencies follow the row's (batch's) largest position once it passes the original context."""
    text = config.get_text_config()
    kinds = sorted({k for k in getattr(text, "layer_types", None) or () if k not in ATTENTION_LAYERS})
    if kinds and packing:
        return (f"has {', '.join(kinds)} layers, which packed samples cannot run as each alone (they carry state "
                "from each token to the next across the samples' borders, or attend in a way packed_sdpa does not "
                "implement); set train.packing=false")
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    ropes = [rope] if "rope_type" in rope or "type" in rope else [r for r in rope.values() if isinstance(r, dict)]
    for r in ropes:
        kind = r.get("rope_type", r.get("type"))
        original = (r.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings", None)
                    or getattr(text, "max_position_embeddings", None))
        if kind in ("dynamic", "longrope") and original is not None and longest > original:
            return (f"uses {kind} rope, whose frequencies follow the largest position of a packed row or padded "
                    f"batch once it passes {original} (a sample of data.max_prompt_len + rollout.max_response_len = "
                    f"{longest} tokens can): set train.packing=false and train.micro_batch_size=1, or keep samples "
                    f"within {original} tokens")
    return None


@torch.compiler.disable  # compiled layers (train.compile) call it eagerly: its plans are Python over the borders
def packed_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        sliding_window=None, prompt_prefixes=None, **kwargs):
    """query (1, H, T, D), key/value (1, Hkv, T, D) -> (1, T, H, D), causal inside each packed sample.

    `prompt_prefixes` (S, 2): per segment of cu_seq_lens_q, the span of a shared prompt it attends to
    before its own tokens (slime/data/batch.py, share_prompts)."""
    if sliding_window is not None:
        raise NotImplementedError("packed_sdpa does not implement sliding-window attention")
    if attention_mask is not None:
        raise ValueError("packed_sdpa expects no attention mask; pass cu_seq_lens_q instead of padding")
    unsupported = [k for k in ("softcap", "s_aux", "sinks") if kwargs.get(k) is not None]
    if unsupported:
        raise NotImplementedError(f"packed_sdpa does not implement {' or '.join(unsupported)} (attention logit "
                                  "soft-capping, attention sinks), which this model's attention asks for")
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None and PACKED_ROW.get():
        raise ValueError(f"{type(module).__name__} got no cu_seq_lens_q for a packed row: this model's decoder layers "
                         "do not pass their keyword arguments on to the attention, which would attend across the "
                         "samples of the row; set train.packing=false")
    dropout = dropout if module.training else 0.0
    attend = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout, scale=scaling,
                               enable_gqa=query.shape[1] != key.shape[1])
    bounds = tuple(cu.tolist()) if cu is not None else (0, query.shape[2])
    prefixes = tuple(prompt_prefixes.flatten().tolist()) if prompt_prefixes is not None else ()
    if bounds[-1] != query.shape[2]:
        raise ValueError(f"packed_sdpa: cu_seq_lens_q ends at {bounds[-1]} but the row holds {query.shape[2]} tokens; "
                         "every token must belong to a sample")
    if len(bounds) == 2 and not any(prefixes):
        return attend(query, key, value, is_causal=True).transpose(1, 2).contiguous(), None
    plan = _gather_plan(bounds, prefixes, query.device)
    if _use_flash_cpu(query, dropout):
        return _PackedFlash.apply(query, key, value, plan, scaling), None
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # (T, H, D)
    for g in plan:  # elsewhere (CUDA without flash-attn, dropout): the same calls through autograd
        q = query[0].index_select(1, g.queries).unflatten(1, g.shape).transpose(0, 1)  # (n, H, L, D)
        k, v = (t[0].index_select(1, g.keys).unflatten(1, (g.shape[0], -1)).transpose(0, 1) for t in (key, value))
        mask = {"attn_mask": _lower_right_causal(g.shape[1], g.prompt, query.device)} if g.prompt \
            else {"is_causal": True}
        o = attend(q, k, v, **mask).transpose(1, 2).flatten(0, 1)
        _to_tokens(out, g, o)
    return out[None], None


def _use_flash_cpu(query: torch.Tensor, dropout: float) -> bool:
    """Whether packed_sdpa calls sdpa's CPU flash kernel itself (_PackedFlash): on CPU, without dropout."""
    return query.device.type == "cpu" and not dropout


AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)

GQA_SDPA = "gqa_sdpa"  # the hf engine's attention


def gqa_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """HF's sdpa, except that on CPU grouped KV heads are not copied: HF repeats them to the query heads whenever
    there is a mask (left padding in generation), which copies the whole KV cache in every layer at every decode
    step (on CUDA masked GQA falls back to the math kernel, so there HF's way stays). A decode step (one query per
    row) on CPU takes _decode_attention."""
    if query.device.type == "cpu" and query.shape[2] == 1 and kwargs.get("position_bias") is None \
            and (attention_mask is None or attention_mask.dtype == torch.bool):
        return _decode_attention(query, key, value, attention_mask, scaling), None
    if attention_mask is None or query.device.type != "cpu" or query.shape[1] == key.shape[1] \
            or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         dropout_p=dropout if module.training else 0.0, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _decode_attention(query, key, value, mask, scaling):
    """One query per row (a decode step): (B, H, 1, D) against keys (B, Hkv, L, D) and values (B, Hkv, L, Dv), mask
    (B, 1, 1, L) bool or None -> (B, 1, H, Dv) (DeepSeek's values are narrower than its queries and keys). Two
    batched matmuls over each row's KV heads, the query heads of a group stacked as rows; about 20% faster here
    than sdpa's CPU kernel, whose fixed cost per (row, head) dominates at one query. In bf16 or fp16 the matmuls
    would round the scores to that dtype before the softmax (logprobs 2-3x further from a teacher-forced forward than
    HF's own decoding): sdpa's kernel, whose scores and softmax stay fp32, takes those."""
    if query.dtype != torch.float32:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                              enable_gqa=True).transpose(1, 2)
    b, h, _, d = query.shape
    scores = torch.matmul(query.reshape(b, key.shape[1], h // key.shape[1], d), key.transpose(-1, -2))
    scores = scores.mul_(d ** -0.5 if scaling is None else scaling)
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), value).reshape(b, 1, h, value.shape[-1])  # V's heads may be narrower


# Below this many (row, key) pairs a compiled call's fixed cost (its guards and wrapper: ~20 us more than the
# matmuls' calls) exceeds what its loops save; one row is also left to the matmuls (torch.compile specializes
# sizes 0 and 1: a second compile).
FUSED_DECODE_MIN_PAIRS = 2048


def use_fused_decode_attention(rows: int, keys: int) -> bool:
    return rows > 1 and rows * keys >= FUSED_DECODE_MIN_PAIRS


@torch.compile(dynamic=True)
def decode_attention_fused(query, key, value, mask, scaling):
    """`_decode_attention` as inductor's fused loops (one compile for any batch of 2 rows or more, any head or key
    count): the scores as sums of q * k over D, the softmax, and the output as sums of p * v over the keys, each
    (row, KV head)'s keys and values read in one pass per query head. The two batched matmuls pay a fixed cost per
    (row, KV head) as large as their work at one query. 1 thread, 4 heads of 128 over 2 KV heads, keys and values
    cold, batched matmuls -> fused: 64 rows x 64 keys 1.50 -> 1.14 ms, x 256 keys 5.68 -> 3.44 ms; 16 rows x 256
    keys 1.51 -> 0.98 ms; 2 rows x 32 keys 0.06 -> 0.12 ms (`python bench/hf_generation.py` on whole rollouts)."""
    b, h, _, d = query.shape
    q = query.reshape(b, key.shape[1], h // key.shape[1], d).float()  # bf16: the sums and softmax in fp32, fused
    scores = (q.unsqueeze(3) * key.float().unsqueeze(2)).sum(-1) * (d ** -0.5 if scaling is None else scaling)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = (scores.softmax(-1).unsqueeze(-1) * value.float().unsqueeze(2)).sum(3)
    return out.to(query.dtype).reshape(b, 1, h, value.shape[-1])


AttentionInterface.register(GQA_SDPA, gqa_sdpa_forward)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)  # the same boolean masks as sdpa


def resolve_attn_implementation(requested: str, dtype: torch.dtype) -> str:
    """'auto' -> flash-attn varlen on GPU when installed and the model runs in 16 bits (flash-attn has no fp32
    kernels), else packed sdpa."""
    half = dtype in (torch.bfloat16, torch.float16)
    if requested != "auto":
        if requested == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise ValueError("model.attn_implementation=flash_attention_2 needs the flash-attn package "
                             "(pip install -e '.[gpu]'), or use packed_sdpa")
        if requested == "flash_attention_2" and not half:
            raise ValueError(f"model.attn_implementation=flash_attention_2 runs in bf16 or fp16 only, and the model "
                             f"runs in {str(dtype).removeprefix('torch.')} (model.dtype): set model.dtype=bfloat16, "
                             "or attn_implementation=packed_sdpa")
        return requested
    if half and torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return PACKED_SDPA


def packed_attention_kwargs(cu_seqlens: torch.Tensor, max_len: int,
                            prompt_prefixes: torch.Tensor | None = None) -> dict:
    """The kwargs transformers forwards to the attention function (flash-attn varlen names; shared prompts are
    packed_sdpa's own)."""
    kwargs = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens,
              "max_length_q": max_len, "max_length_k": max_len}
    if prompt_prefixes is not None:
        kwargs["prompt_prefixes"] = prompt_prefixes
    return kwargs
