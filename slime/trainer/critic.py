"""PPO's critic: the LM backbone with a scalar value head, in its own DeepSpeed ZeRO-3 engine."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn as nn
from transformers import AutoModel

from slime.algorithms.policy_loss import aggregate_loss
from slime.algorithms.value_loss import clipped_value_loss
from slime.config import Config
from slime.data.batch import MicroBatch
from slime.data.sample import Sample
from slime.distributed.ds_config import build_ds_config
from slime.distributed.parallel_dims import ParallelDims
from slime.models.attention import packed_attention_kwargs, resolve_attn_implementation
from slime.models.loading import check_model_path, resolve_dtype
from slime.trainer.engine_utils import accumulate_gradients, init_engine, nograd_layout, per_sample_pass, train_layout


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)  # start from V = 0: the first advantages are the raw returns
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, position_ids, cu_seqlens, pred_index, *, max_len: int) -> torch.Tensor:
        """Values (N,) of the states at pred_index (the state before each response token)."""
        out = self.backbone(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False,
                            **packed_attention_kwargs(cu_seqlens, max_len))
        return self.value_head(out.last_hidden_state[0, pred_index]).squeeze(-1).float()


class Critic:
    def __init__(self, cfg: Config, dims: ParallelDims):
        self.cfg, self.dims = cfg, dims
        model_cfg = dataclasses.replace(cfg.model, path=cfg.algo.critic.path or cfg.model.path)
        check_model_path(model_cfg)
        dtype = resolve_dtype(model_cfg.dtype)
        backbone = AutoModel.from_pretrained(model_cfg.path, gguf_file=model_cfg.gguf_file, dtype=dtype,
                                             attn_implementation=resolve_attn_implementation(model_cfg.attn_implementation))
        model = ValueModel(backbone).to(dtype)
        self.engine = init_engine(model, build_ds_config(cfg, bf16=dtype == torch.bfloat16), lr=cfg.algo.critic.lr)

    def _forward(self, mb: MicroBatch) -> torch.Tensor:
        mb = mb.to(self.dims.device)
        return self.engine(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len)

    def compute_values(self, samples: Sequence[Sample]) -> list[list[float]]:
        return per_sample_pass(self._forward, samples, self.dims, layout=nograd_layout(self.cfg))

    def train(self, samples: Sequence[Sample]) -> dict:
        """One optimizer step on the clipped value loss against the GAE returns."""
        c = self.cfg.algo.critic
        num_tokens = sum(sum(s.loss_mask) for s in samples)

        def loss_fn(mb: MicroBatch):
            rows = [samples[i] for i in mb.indices]
            values = self._forward(mb)
            dev = values.device
            old = mb.token_values([s.values for s in rows]).to(dev)
            returns = mb.token_values([s.returns for s in rows]).to(dev)
            mask, seq_ids = mb.loss_mask.to(dev), mb.seq_ids.to(dev)
            per_token, m = clipped_value_loss(values, old, returns, mask, clip=c.value_clip)
            loss = c.value_loss_coef * aggregate_loss(per_token, mask, seq_ids, mode="token_mean",
                                                      num_tokens=num_tokens, num_seqs=len(samples))
            n_local = float(mask.sum())
            return loss, {"value_loss": loss.item(), "value_clipfrac": float(m["value_clip_frac"]) * n_local,
                          "loss_tokens": n_local}

        sums = accumulate_gradients(self.engine, samples, self.dims, layout=train_layout(self.cfg), loss_fn=loss_fn)
        self.engine.step()
        loss, clip, ntok = self.dims.all_reduce_sum([sums["value_loss"], sums["value_clipfrac"], sums["loss_tokens"]])
        return {"critic/value_loss": loss, "critic/value_clipfrac": clip / max(ntok, 1.0),
                "critic/grad_norm": float(self.engine.get_global_grad_norm() or 0.0)}
