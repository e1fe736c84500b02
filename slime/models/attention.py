"""Packed (varlen) attention for HF models.

A packed micro-batch is one row of concatenated samples with `cu_seqlens` marking sample borders.
Attention must be causal *within* each sample and never cross a border. We register an attention
function `packed_sdpa` with transformers' AttentionInterface that never builds a (T, T) mask: the
samples are sorted by length and cut into groups of similar length; each group is gathered into a
right-padded (n, H, L_max, D) batch and runs ONE causal sdpa call (a query never sees the padding at its
row's end), and the outputs are gathered back to packed order. Within a group the padded area n * L_max^2
is at most PAD_AREA times the real one, so padding cannot cost more than that in attention; one group per
similar-length run replaces one sdpa call per sample (`python bench/packed_attention.py`, one layer's
forward + backward, 1 thread: 64 x 71 tokens 122 -> 46 ms, a long-tailed batch of 64 254 -> 183 ms).
On GPU, flash-attn's varlen kernel gets the same `cu_seq_lens_*` kwargs through transformers' own
`flash_attention_2` path.
"""
from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "packed_sdpa"
PAD_AREA = 1.5  # a group's padded attention area (n * L_max^2) stays within this factor of sum(L^2)


def attention_groups(bounds: tuple[int, ...]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Sample borders -> groups of (L_max, starts, lengths), longest samples first, each group's padded
    attention area within PAD_AREA of its real area."""
    spans = sorted(((e - s, s) for s, e in zip(bounds[:-1], bounds[1:]) if e > s), key=lambda x: (-x[0], x[1]))
    groups, current, area = [], [], 0
    for length, start in spans:
        if current and (len(current) + 1) * current[0][0] ** 2 > PAD_AREA * (area + length ** 2):
            groups.append(current)
            current, area = [], 0
        current.append((length, start))
        area += length ** 2
    if current:
        groups.append(current)
    return [(g[0][0], tuple(s for _, s in g), tuple(n for n, _ in g)) for g in groups]


@functools.lru_cache(maxsize=64)
def _gather_plan(bounds: tuple[int, ...], device: torch.device):
    """Per group: token index of each padded slot (n, L_max) and the flat slots holding real tokens; and
    the permutation from the groups' concatenated real tokens back to packed order. Built once per micro-
    batch and device (every layer reuses it)."""
    plan, order = [], []
    for lmax, starts, lengths in attention_groups(bounds):
        steps = torch.arange(lmax)
        real = steps < torch.tensor(lengths)[:, None]  # (n, L_max)
        # Padding slots repeat the row's first token: only padded queries (discarded) ever attend to them.
        slots = torch.where(real, torch.tensor(starts)[:, None] + steps, torch.tensor(starts)[:, None])
        plan.append((slots.flatten().to(device), slots.shape, real.flatten().nonzero().squeeze(1).to(device)))
        order.append(slots[real])
    back = torch.empty(bounds[-1], dtype=torch.long)
    back[torch.cat(order)] = torch.arange(bounds[-1])
    return plan, back.to(device)


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        sliding_window=None, **kwargs):
    """query (1, H, T, D), key/value (1, Hkv, T, D) -> (1, T, H, D), causal inside each packed sample."""
    if sliding_window is not None:
        raise NotImplementedError("packed_sdpa does not implement sliding-window attention")
    if attention_mask is not None:
        raise ValueError("packed_sdpa expects no attention mask; pass cu_seq_lens_q instead of padding")
    cu = kwargs.get("cu_seq_lens_q")
    gqa = query.shape[1] != key.shape[1]
    attend = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout if module.training else 0.0,
                               is_causal=True, scale=scaling, enable_gqa=gqa)
    bounds = tuple(cu.tolist()) if cu is not None else (0, query.shape[2])
    if len(bounds) == 2:
        return attend(query, key, value).transpose(1, 2).contiguous(), None
    plan, back = _gather_plan(bounds, query.device)
    outs = []
    for index, shape, real in plan:  # (n, L_max) token indices -> (n, H, L_max, D)
        q, k, v = (t[0].index_select(1, index).unflatten(1, shape).transpose(0, 1) for t in (query, key, value))
        o = attend(q, k, v).transpose(1, 2)  # (n, L_max, H, D)
        outs.append(o.flatten(0, 1).index_select(0, real))  # real tokens, in group order
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.index_select(0, back)[None], None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)

GQA_SDPA = "gqa_sdpa"  # the hf engine's attention


def gqa_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """HF's sdpa, except that on CPU grouped KV heads are not copied: HF repeats them to the query heads whenever
    there is a mask (left padding in generation), which copies the whole KV cache in every layer at every decode
    step (on CUDA masked GQA falls back to the math kernel, so there HF's way stays)."""
    if attention_mask is None or query.device.type != "cpu" or query.shape[1] == key.shape[1] \
            or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         dropout_p=dropout if module.training else 0.0, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA, gqa_sdpa_forward)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)  # the same boolean masks as sdpa


def resolve_attn_implementation(requested: str) -> str:
    """'auto' -> flash-attn varlen on GPU when installed, else packed sdpa."""
    if requested != "auto":
        if requested == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise ValueError("model.attn_implementation=flash_attention_2 needs the flash-attn package "
                             "(pip install -e '.[gpu]'), or use packed_sdpa")
        return requested
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return PACKED_SDPA


def packed_attention_kwargs(cu_seqlens: torch.Tensor, max_len: int) -> dict:
    """The kwargs transformers forwards to the attention function (flash-attn varlen names)."""
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_len, "max_length_k": max_len}
