"""Packed (varlen) attention for HF models.

A packed micro-batch is one row of concatenated samples with `cu_seqlens` marking sample borders.
Attention must be causal *within* each sample and never cross a border. We register an attention
function `packed_sdpa` with transformers' AttentionInterface that runs sdpa once per sample slice,
which isolates samples exactly without building a (T, T) mask. On GPU, flash-attn's varlen kernel
gets the same `cu_seq_lens_*` kwargs through transformers' own `flash_attention_2` path.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

PACKED_SDPA = "packed_sdpa"


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        sliding_window=None, **kwargs):
    """query (1, H, T, D), key/value (1, Hkv, T, D) -> (1, T, H, D), causal inside each packed sample."""
    if sliding_window is not None:
        raise NotImplementedError("packed_sdpa does not implement sliding-window attention")
    if attention_mask is not None:
        raise ValueError("packed_sdpa expects no attention mask; pass cu_seq_lens_q instead of padding")
    cu = kwargs.get("cu_seq_lens_q")
    bounds = cu.tolist() if cu is not None else [0, query.shape[2]]
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        outs.append(F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling, enable_gqa=gqa))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)


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
