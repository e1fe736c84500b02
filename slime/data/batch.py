"""Turn a list of samples into one packed micro-batch (no padding) and back.

Layout: the samples' prompt+response tokens are concatenated into one row of T tokens with
position ids reset per sample and `cu_seqlens` marking borders. A response's last token is a target only: no
later token reads its hidden state, so the row leaves it out (a forward and backward of one token per sample
less; 1.5% of the tokens of bench/vs_trl.py's 64-token responses). The padded baseline
(`build_padded_micro_batch`) instead right-pads each sample to the longest into a (B, L) batch;
causal attention never looks right, so real tokens never see the padding and no mask is needed.
Per-token training values live on the N response tokens, in sample order; `pred_index[j]` is the
position whose hidden state predicts response token j (`target_ids[j]`), `seq_ids[j]` the token's
sample within the batch, and `fields` holds the samples' per-token tensors (advantages, logprobs, ...)
concatenated the same way.

Shared prompts (`share_prompts=True`, packed only): the n samples of one prompt that land in the same
micro-batch carry that prompt once. The first lays out prompt + response; each later one only its
response, as a segment of its own whose `prompt_prefixes` entry names the first one's prompt span, which
it attends to before its own tokens (packed_sdpa does this), with positions continuing after the prompt.
Its first response token is predicted from the prompt's last position (a response of one token or none has no
segment: that is all it needs). So each sample adds `Sample.row_len` tokens to a row, less its prompt where a
sibling carries it: what packing plans count (slime/data/packing.py, micro_batch_tokens). Every logprob and
gradient is that of the unshared layout; the prompt's forward and backward run once instead of n times (GRPO with
n samples of a long prompt spends most of its tokens on prompt copies).

An empty micro-batch (`build_micro_batch(samples, [])`) is one dummy token with no loss (and zeros
in the per-token fields that `samples` carry, so loss code runs unchanged): a rank
with fewer micro-batches than its peers runs it so that every rank calls the model equally often
(ZeRO-3 gathers parameters inside every call).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from slime.data.sample import TOKEN_FIELDS, Sample

_DUMMY = Sample(prompt_ids=[0], response_ids=[0], response_mask=[0])


@dataclasses.dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (T,) long packed, or (B, L) padded
    position_ids: torch.Tensor  # same shape, reset per sample
    cu_seqlens: torch.Tensor | None  # (S+1,) int32 when packed
    max_len: int
    pred_index: torch.Tensor  # (N,) long, into the flattened input_ids
    target_ids: torch.Tensor  # (N,) long: the scored tokens (the response tokens, in sample order)
    seq_ids: torch.Tensor  # (N,) long in [0, S)
    loss_mask: torch.Tensor  # (N,) float
    indices: list[int]  # the samples' positions in the caller's list (empty for a dummy batch)
    response_lens: list[int]
    fields: dict[str, torch.Tensor]  # (N,) float per-token fields that every sample carries
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """The model's extra inputs: image pixel patches concatenated in sample order, grids stacked."""
    prompt_prefixes: torch.Tensor | None = None
    """(S, 2) long, packed with shared prompts: per cu_seqlens segment, the span of the prompt it attends to
    before its own tokens ((0, 0): none)."""
    token_mask: torch.Tensor | None = None
    """(T,) bool over the flattened input_ids: True on the samples' own tokens, False on padding (sequence
    parallel's pad segment, the padded layout's row ends) and on a dummy batch's token; None: all True.
    Per-input-token terms (a MoE router's aux loss and balance metrics) count only the True ones."""

    @property
    def num_tokens(self) -> int:
        """Tokens the model processes (padding included)."""
        return int(self.input_ids.numel())

    @property
    def is_dummy(self) -> bool:
        return not self.indices

    def field(self, name: str) -> torch.Tensor | None:
        """An (N,) per-token field, None when the samples do not carry it (zeros in a dummy batch)."""
        return self.fields.get(name)

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """(N,) -> one detached float32 CPU tensor per sample (nothing for a dummy batch)."""
        if self.is_dummy:
            return []
        return list(torch.split(values.detach().float().cpu(), self.response_lens))

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        moved["fields"] = {k: v.to(device) for k, v in self.fields.items()}
        moved["extra"] = {k: v.to(device) for k, v in self.extra.items()}
        return MicroBatch(**moved)


Positions = Callable[[Sample], torch.Tensor]
"""A sample's position ids over its prompt + response: (L,), or (rows, L) for multimodal rope."""


def build_micro_batch(samples: Sequence[Sample], indices: Sequence[int], positions: Positions | None = None,
                      pad_to: int = 1, share_prompts: bool = False, dummy_fields: Sequence[str] = ()) -> MicroBatch:
    """`pad_to` (sequence parallel: sp): the row is padded to a multiple of it by a pad segment that is its
    own document (own cu_seqlens entry, positions from 0, nothing scored), so it can be cut into equal shards.
    `share_prompts`: samples with the same (text-only) prompt carry it once (the module docstring).
    `dummy_fields`: the fields a dummy carries when `samples` is empty (a rank with no sample this step), as the
    other ranks' samples do."""
    rows = [samples[i] for i in indices] or [_DUMMY]
    input_ids, position_ids, cu, pred, seq, resp_lens, prefixes = [], [], [0], [], [], [], []
    first: dict[tuple[int, ...], int] = {}  # prompt -> where its one copy starts in the row
    share_prompts = share_prompts and all(s.mm is None for s in rows)  # image rows keep their own layout
    for s_pos, s in enumerate(rows):
        start, p, r = cu[-1], len(s.prompt_ids), len(s.response_ids)
        if p == 0:
            raise ValueError(f"sample {s.index} has an empty prompt; there is no token to predict its first "
                             "response token")
        pos = positions(s) if positions is not None else torch.arange(p + r)
        key = tuple(s.prompt_ids) if share_prompts else None
        fed = s.response_ids[:-1]  # the last token is only a target: no later token reads its hidden state
        if key in first:  # the response alone, after the prompt's one copy
            shared = first[key]
            if r:
                pred.append(shared + p - 1)
            if fed:  # (a response of one token or none needs no segment of its own)
                input_ids.extend(fed)
                position_ids.append(pos[..., p:p + len(fed)])
                cu.append(start + len(fed))
                prefixes.append((shared, shared + p))
                pred.extend(range(start, start + len(fed)))
        else:
            if key is not None:
                first.setdefault(key, start)
            input_ids.extend(s.prompt_ids + fed)
            position_ids.append(pos[..., :p + len(fed)])
            cu.append(start + p + len(fed))
            prefixes.append((0, 0))
            pred.extend(range(start + p - 1, start + p + r - 1))
        seq.extend([s_pos] * r)
        resp_lens.append(r)
    fields = {}
    for name in TOKEN_FIELDS:
        if not indices:  # a dummy carries zeros for the fields its batch's samples carry, so losses match
            if (getattr(samples[0], name) is not None) if samples else name in dummy_fields:
                fields[name] = torch.zeros(1)
            continue
        values = [getattr(s, name) for s in rows]
        if all(v is not None for v in values):
            fields[name] = torch.cat(values).float()
    pad = -cu[-1] % pad_to
    token_mask = None
    if pad or not indices:
        token_mask = torch.arange(cu[-1] + pad) < (cu[-1] if indices else 0)
    if pad:
        input_ids.extend([0] * pad)
        rope_rows = position_ids[0].shape[:-1]
        position_ids.append(torch.arange(pad).expand(*rope_rows, pad))
        cu.append(cu[-1] + pad)
        prefixes.append((0, 0))
    images = [s.mm for s in rows if s.mm is not None]
    extra = {}
    if images:  # image features go to the PROMPT's placeholders; a generated placeholder token is just text
        mask = [torch.cat([torch.tensor(s.prompt_ids) == s.mm.token_id if s.mm is not None
                           else torch.zeros(len(s.prompt_ids), dtype=torch.bool),
                           torch.zeros(s.row_len - len(s.prompt_ids), dtype=torch.bool)]) for s in rows]
        mask.append(torch.zeros(pad, dtype=torch.bool))
        extra = {"pixel_values": torch.cat([m.pixel_values for m in images]),
                 "image_grid_thw": torch.cat([m.image_grid_thw for m in images]), "image_mask": torch.cat(mask)}
    return MicroBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        position_ids=torch.cat(position_ids, dim=-1).long(),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_len=max(b - a for a, b in zip(cu[:-1], cu[1:])),
        pred_index=torch.tensor(pred, dtype=torch.long),
        target_ids=torch.tensor([t for s in rows for t in s.response_ids], dtype=torch.long),
        seq_ids=torch.tensor(seq, dtype=torch.long),
        loss_mask=torch.cat([s.loss_mask for s in rows]),
        indices=list(indices),
        response_lens=resp_lens,
        fields=fields,
        extra=extra,
        prompt_prefixes=torch.tensor(prefixes, dtype=torch.long) if any(a != b for a, b in prefixes) else None,
        token_mask=token_mask,
    )


def build_padded_micro_batch(samples: Sequence[Sample], indices: Sequence[int], positions: Positions | None = None,
                             pad_id: int = 0, dummy_fields: Sequence[str] = ()) -> MicroBatch:
    packed = build_micro_batch(samples, indices, positions, dummy_fields=dummy_fields)
    rows = [samples[i] for i in indices] or [_DUMMY]
    width = packed.max_len
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    # Padding continues each row's positions (causal attention never lets a real token see it).
    pos = torch.zeros(*packed.position_ids.shape[:-1], len(rows), width, dtype=torch.long)
    image_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    lengths = packed.cu_seqlens.diff()
    token_mask = (torch.arange(width) < lengths[:, None]).flatten() & bool(indices)  # a dummy's token: none
    pred, starts = [], packed.cu_seqlens.tolist()
    for row, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        ids[row, :end - start] = packed.input_ids[start:end]
        pos[..., row, :end - start] = packed.position_ids[..., start:end]
        pos[..., row, end - start:] = packed.position_ids[..., end - 1:end] + torch.arange(1, width - (end - start) + 1)
        if "image_mask" in packed.extra:
            image_mask[row, :end - start] = packed.extra["image_mask"][start:end]
        first = row * width + len(rows[row].prompt_ids) - 1
        pred.extend(range(first, first + len(rows[row].response_ids)))
    extra = {**packed.extra, "image_mask": image_mask} if packed.extra else {}
    return dataclasses.replace(packed, input_ids=ids, position_ids=pos, cu_seqlens=None, extra=extra,
                               pred_index=torch.tensor(pred, dtype=torch.long),
                               token_mask=None if bool(token_mask.all()) else token_mask)
