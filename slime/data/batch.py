"""Turn a list of samples into one packed micro-batch (no padding) and back.

Layout: the samples' prompt+response tokens are concatenated into one row of T tokens with
position ids reset per sample and `cu_seqlens` marking borders. The padded baseline
(`build_padded_micro_batch`) instead right-pads each sample to the longest into a (B, L) batch;
causal attention never looks right, so real tokens never see the padding and no mask is needed. Per-token training values live on
the N response tokens, in sample order; `pred_index[j]` is the position whose hidden state
predicts response token j (one to its left), `seq_ids[j]` the token's sample within the batch.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from slime.data.sample import Sample


@dataclasses.dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (T,) long packed, or (B, L) padded
    position_ids: torch.Tensor  # same shape, reset per sample
    cu_seqlens: torch.Tensor | None  # (S+1,) int32 when packed
    max_len: int
    pred_index: torch.Tensor  # (N,) long, into the flattened input_ids
    seq_ids: torch.Tensor  # (N,) long in [0, S)
    loss_mask: torch.Tensor  # (N,) float
    indices: list[int]  # the samples' positions in the caller's list
    response_lens: list[int]

    @property
    def num_tokens(self) -> int:
        """Tokens the model processes (padding included)."""
        return int(self.input_ids.numel())

    def token_values(self, per_sample: Sequence[Sequence[float]]) -> torch.Tensor:
        """Concatenate per-sample response-aligned lists into an (N,) float tensor."""
        flat = [float(v) for values in per_sample for v in values]
        return torch.tensor(flat, dtype=torch.float32, device=self.input_ids.device)

    def split(self, values: torch.Tensor) -> list[list[float]]:
        """Inverse of token_values: (N,) -> one list per sample."""
        return [chunk.tolist() for chunk in torch.split(values.detach().float().cpu(), self.response_lens)]

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return MicroBatch(**moved)


def build_micro_batch(samples: Sequence[Sample], indices: Sequence[int]) -> MicroBatch:
    input_ids, position_ids, cu, pred, seq, mask, resp_lens = [], [], [0], [], [], [], []
    for s_pos, i in enumerate(indices):
        s = samples[i]
        tokens = s.prompt_ids + s.response_ids
        start, p, r = cu[-1], len(s.prompt_ids), len(s.response_ids)
        if p == 0:
            raise ValueError(f"sample {i} has an empty prompt; there is no token to predict its first response token")
        input_ids.extend(tokens)
        position_ids.extend(range(len(tokens)))
        cu.append(start + len(tokens))
        pred.extend(range(start + p - 1, start + p + r - 1))
        seq.extend([s_pos] * r)
        mask.extend(s.loss_mask)
        resp_lens.append(r)
    return MicroBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        position_ids=torch.tensor(position_ids, dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_len=max(b - a for a, b in zip(cu[:-1], cu[1:])),
        pred_index=torch.tensor(pred, dtype=torch.long),
        seq_ids=torch.tensor(seq, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        indices=list(indices),
        response_lens=resp_lens,
    )


def build_padded_micro_batch(samples: Sequence[Sample], indices: Sequence[int], pad_id: int = 0) -> MicroBatch:
    packed = build_micro_batch(samples, indices)
    width = packed.max_len
    ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    pred, starts = [], packed.cu_seqlens.tolist()
    for row, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        ids[row, :end - start] = packed.input_ids[start:end]
        s = samples[indices[row]]
        first = row * width + len(s.prompt_ids) - 1
        pred.extend(range(first, first + len(s.response_ids)))
    return dataclasses.replace(packed, input_ids=ids, position_ids=torch.arange(width).expand(len(indices), -1).clone(),
                               cu_seqlens=None, pred_index=torch.tensor(pred, dtype=torch.long))
