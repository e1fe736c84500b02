"""The module DeepSpeed wraps: an HF causal LM whose forward returns per-token logprobs.

Logprobs are computed only at response positions and in chunks, so full-vocabulary logits never
exist for the whole micro-batch at once; with grad, each chunk is recomputed in backward
(activation checkpointing) so only one chunk's logits are alive at a time.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt

from slime.models.attention import packed_attention_kwargs


def logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V) fp32, targets (N,) -> logprob of target (N,), entropy (N,)."""
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


class PolicyModel(nn.Module):
    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                pred_index: torch.Tensor, *, max_len: int, temperature: float = 1.0,
                chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids/position_ids (T,) packed; pred_index (N,) positions whose NEXT token is scored.

        Returns logprobs (N,) and entropies (N,) of input_ids[pred_index + 1] at `temperature`.
        """
        out = self.hf.base_model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False,
                                 **packed_attention_kwargs(cu_seqlens, max_len))
        hidden = out.last_hidden_state[0, pred_index]  # (N, H)
        targets = input_ids[pred_index + 1]  # (N,)
        head = self.hf.get_output_embeddings()

        def chunk_fn(h: torch.Tensor, t: torch.Tensor):
            return logprobs_and_entropy(head(h).float() / temperature, t)

        logps, ents = [], []
        for i in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[i:i + chunk_size], targets[i:i + chunk_size]
            if torch.is_grad_enabled():
                lp, ent = ckpt.checkpoint(chunk_fn, h, t, use_reentrant=False)
            else:
                lp, ent = chunk_fn(h, t)
            logps.append(lp)
            ents.append(ent)
        if not logps:  # an empty selection still has to touch the head so ZeRO-3 hooks stay in step
            lp, ent = chunk_fn(hidden, targets)
            return lp, ent
        return torch.cat(logps), torch.cat(ents)
