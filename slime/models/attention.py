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


def _length_groups(lengths: list[int]) -> list[list[int]]:
    """Sequence lengths -> groups of sequence numbers, longest first, each group's padded attention area
    within PAD_AREA of its real area (empty sequences are left out)."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    groups, current, area = [], [], 0
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] ** 2 > PAD_AREA * (area + lengths[i] ** 2):
            groups.append(current)
            current, area = [], 0
        current.append(i)
        area += lengths[i] ** 2
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


@functools.lru_cache(maxsize=64)
def _gather_plan(bounds: tuple[int, ...], prefixes: tuple[int, ...], device: torch.device):
    """Per group: token index of each padded slot (n, L_max) and the flat slots whose outputs are kept; and
    the permutation from the groups' concatenated kept outputs back to packed order. Built once per micro-
    batch and device (every layer reuses it).

    Segment k of the row (tokens bounds[k]:bounds[k+1]) attends first to its shared prompt, the tokens
    prefixes[2k]:prefixes[2k+1] (an empty span when it has none), then causally to itself; only its own
    tokens' outputs are kept (the prompt's are kept from the segment that holds it)."""
    spans = list(zip(bounds[:-1], bounds[1:]))
    pre = list(zip(prefixes[0::2], prefixes[1::2])) if prefixes else [(0, 0)] * len(spans)
    tokens = [torch.cat([torch.arange(ps, pe), torch.arange(s, e)]) for (s, e), (ps, pe) in zip(spans, pre)]
    plan, order = [], []
    for group in _length_groups([len(t) for t in tokens]):
        lmax = len(tokens[group[0]])
        # Padding slots repeat the row's first token: only padded queries (discarded) ever attend to them.
        slots = torch.stack([torch.cat([tokens[i], tokens[i][:1].expand(lmax - len(tokens[i]))]) for i in group])
        steps = torch.arange(lmax)
        own = torch.tensor([pre[i][1] - pre[i][0] for i in group])[:, None]
        length = torch.tensor([len(tokens[i]) for i in group])[:, None]
        kept = (steps >= own) & (steps < length)  # (n, L_max): the row's own tokens
        plan.append((slots.flatten().to(device), slots.shape, kept.flatten().nonzero().squeeze(1).to(device)))
        order.append(slots[kept])
    back = torch.empty(bounds[-1], dtype=torch.long)
    back[torch.cat(order)] = torch.arange(bounds[-1])
    return plan, back.to(device)


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        sliding_window=None, prompt_prefixes=None, **kwargs):
    """query (1, H, T, D), key/value (1, Hkv, T, D) -> (1, T, H, D), causal inside each packed sample.

    `prompt_prefixes` (S, 2): per segment of cu_seq_lens_q, the span of a shared prompt it attends to
    before its own tokens (slime/data/batch.py, share_prompts)."""
    if sliding_window is not None:
        raise NotImplementedError("packed_sdpa does not implement sliding-window attention")
    if attention_mask is not None:
        raise ValueError("packed_sdpa expects no attention mask; pass cu_seq_lens_q instead of padding")
    cu = kwargs.get("cu_seq_lens_q")
    gqa = query.shape[1] != key.shape[1]
    attend = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout if module.training else 0.0,
                               is_causal=True, scale=scaling, enable_gqa=gqa)
    bounds = tuple(cu.tolist()) if cu is not None else (0, query.shape[2])
    prefixes = tuple(prompt_prefixes.flatten().tolist()) if prompt_prefixes is not None else ()
    if len(bounds) == 2 and not any(prefixes):
        return attend(query, key, value).transpose(1, 2).contiguous(), None
    plan, back = _gather_plan(bounds, prefixes, query.device)
    outs = []
    for index, shape, kept in plan:  # (n, L_max) token indices -> (n, H, L_max, D)
        q, k, v = (t[0].index_select(1, index).unflatten(1, shape).transpose(0, 1) for t in (query, key, value))
        o = attend(q, k, v).transpose(1, 2)  # (n, L_max, H, D)
        outs.append(o.flatten(0, 1).index_select(0, kept))  # the rows' own tokens, in group order
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


def packed_attention_kwargs(cu_seqlens: torch.Tensor, max_len: int, prompt_prefixes: torch.Tensor | None = None) -> dict:
    """The kwargs transformers forwards to the attention function (flash-attn varlen names; shared prompts are
    packed_sdpa's own)."""
    kwargs = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_len, "max_length_k": max_len}
    if prompt_prefixes is not None:
        kwargs["prompt_prefixes"] = prompt_prefixes
    return kwargs
