"""One policy-engine class in three roles: the trainable actor, the frozen reference, the critic.

Each is an HF model (loaded through its family's adapter) wrapped in `PolicyModel` and handed to the
parallelize step, which returns the DeepSpeed ZeRO engine (stage 3 unless train.ds_config sets 1 or 2).
The forward, the micro-batch loop and gradient accumulation are written once here, so attention,
position-id, multimodal and sequence-parallel changes land in one place.

Loss normalisation is explicit: every micro-batch contributes its additive share of the global
loss (normalisers are global token/sequence counts of the mini-batch); the share is scaled by the
world size because DeepSpeed averages gradients over every rank (with sequence parallelism each sp
peer's gradient is its shard's part of the same loss, so the parts add up). So the gradient does not
depend on how samples were split over ranks, shards and micro-batches.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Callable, Literal

import torch
import torch.distributed as dist
from transformers import AutoConfig
from transformers.modeling_layers import GradientCheckpointingLayer

from slime.config import Config, ModelConfig, TrainConfig
from slime.data.batch import MicroBatch
from slime.data.sample import TOKEN_FIELDS, Sample
from slime.distributed.parallel_dims import ParallelDims
from slime.distributed.expert_parallel import ExpertGather, expert_units
from slime.distributed.parallelize import parallelize
from slime.distributed.ulysses import SequenceShard, check_heads, register_ulysses_attention
from slime.models.attention import resolve_attn_implementation
from slime.models import fused
from slime.models.export import save_hf_dir
from slime.models.adapters import FAMILIES
from slime.models.loading import critic_model, load_model, resolve_dtype
from slime.models.onednn import resolve_cpu_linear, use_onednn_linears
from slime.models.policy import PolicyModel, compile_layers
from slime.rollout.weight_sync import iter_gathered_buckets
from slime.trainer.layout import Layout, MiniBatch, RankBatch, prompts_unshared

logger = logging.getLogger(__name__)

Role = Literal["actor", "reference", "critic"]
LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def lr_lambda(train: TrainConfig, total_steps: int):
    """Linear warmup, then constant or cosine decay to min_lr (as a multiplier of the peak lr). The critic's
    schedule is the same multiplier of algo.critic.lr, over every step (it also trains in its warmup steps)."""
    warmup, floor = train.warmup_steps, train.min_lr / train.lr if train.lr > 0 else 0.0

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if train.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def local_elements(p: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a parameter: the whole tensor, or under ZeRO-3 its partition without the padding
    that rounds the partitions up to equal sizes. DeepSpeed allocates that padding with torch.empty and never
    writes it, so it holds whatever bits were there, NaN included."""
    part = getattr(p, "ds_tensor", None)
    if part is None:
        return p
    start = part.ds_numel * dist.get_rank(group=p.ds_process_group)
    return part.narrow(0, 0, max(0, min(part.ds_numel, p.ds_numel - start)))


def sample_positions(adapter, model, s: Sample) -> torch.Tensor:
    """Position ids of a sample's prompt + response; image features sit on the prompt's placeholders only."""
    ids = torch.tensor(s.prompt_ids + s.response_ids)
    if s.mm is None:
        return adapter.position_ids(model, ids)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:len(s.prompt_ids)] = ids[:len(s.prompt_ids)] == s.mm.token_id
    return adapter.position_ids(model, ids, s.mm.image_grid_thw, mask)


# A long first sample and a short second one: packed after it, the second would attend mostly to it if the
# attention missed the border between them
PROBE = [Sample(prompt_ids=[3, 9, 4, 7, 1, 8, 2, 6, 5, 3, 9, 4, 7, 1, 8, 2, 6, 5, 3, 9, 4, 7, 1, 8],
                response_ids=[5, 2, 8, 6, 4, 9, 3, 7], index=0),
         Sample(prompt_ids=[6, 1], response_ids=[4, 9, 3, 5, 7, 2], index=1)]


@torch.no_grad()
def packing_gap(logprobs: Callable[[list[int]], torch.Tensor]) -> float:
    """The mean gap between the second PROBE sample's logprobs packed after the first (`logprobs([0, 1])`) and
    alone (`logprobs([1])`)."""
    packed = logprobs([0, 1]).float()[len(PROBE[0].response_ids):]
    return float((packed - logprobs([1]).float()).abs().mean())


def actor_steps(cfg: Config) -> int:
    """Loop steps that update the actor, the length of its lr schedule: all but a critic's warmup steps (the
    schedule spanned them all, so its cosine stopped short of min_lr by the warmup's share)."""
    return cfg.train.num_steps - (cfg.algo.critic.warmup_steps if cfg.trains_critic else 0)


def checkpoint_layers(hf) -> None:
    """model.gradient_checkpointing: each decoder layer's activations recomputed in backward. HF checkpoints a
    layer only in training mode, and from_pretrained leaves the model in eval mode, which keeps dropout off (as RL
    wants; nothing here sets train()): the checkpointed layers alone are marked training, not their children, or
    no layer was ever checkpointed. A layer that applies dropout by its own training mode is refused."""
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in hf.modules() if isinstance(m, GradientCheckpointingLayer)]
    dropout = {k: v for k, v in hf.config.get_text_config().to_dict().items()
               if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0}
    reads = sorted({type(m).__name__ for m in layers if "self.training" in inspect.getsource(type(m).forward)})
    if dropout and reads:  # OPT, XGLM, BioGPT: dropout applied in the layer's own forward, by self.training
        raise ValueError(f"model.gradient_checkpointing=true: {', '.join(reads)} applies dropout by its training "
                         f"mode, which checkpointing needs on, and the config sets {dropout}: RL would train on "
                         "random masks. Set those to 0 in the model's config.json, or model.gradient_checkpointing="
                         "false")
    for m in layers:
        m.training = True


class PolicyEngine:
    def __init__(self, role: Role, *, model: ModelConfig, train: TrainConfig, dims: ParallelDims,
                 temperature: float = 1.0, lr: float | None = None, offload_params: bool = False,
                 trained_steps: int | None = None, decay_groups: bool | None = None):
        """`trained_steps`: loop steps in which this role is updated (the lr schedule's length), all by default.
        `decay_groups`: norm gains and biases in an optimizer group without weight decay (default: with decay)."""
        self.role, self.dims, self.train_cfg, self.temperature = role, dims, train, temperature
        self.model_path = model.path
        dtype = resolve_dtype(model.dtype)
        attention = resolve_attn_implementation(model.attn_implementation, dtype)
        shard = None
        if dims.sp > 1:
            text = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code).get_text_config()
            check_heads(text.num_attention_heads, text.num_key_value_heads, dims.sp, model.path)
            shard = SequenceShard(dims.sp_group, dims.sp_rank, dims.sp)
            attention = register_ulysses_attention(attention, shard)
        hf, self.adapter = load_model(model, attn_implementation=attention, dtype=dtype, backbone_only=role == "critic")
        # the model's, written back in its export (None: its config has none; a VL model's text config has it)
        self._use_cache = getattr(hf.config, "use_cache", None)
        hf.config.use_cache = False
        # The fused chains (train.fuse_elementwise) also make the oneDNN linears' weight-gradient transposes.
        fuse_why = "train.compile=true" if train.compile else fused.resolve(train.fuse_elementwise, hf, dims.device)
        if dims.device.type == "cpu":
            kernel = resolve_cpu_linear(model.cpu_linear)
            onednn = kernel == "onednn" and use_onednn_linears(
                hf, transpose=fused.transpose if fuse_why is None else None)
            if role == "actor" and dims.is_main:
                logger.info("model.cpu_linear=%s: fp32 linear layers on CPU run %s", model.cpu_linear,
                            f"oneDNN's kernels ({onednn} layers)" if onednn else "torch's F.linear")
        if role != "reference" and model.gradient_checkpointing:
            checkpoint_layers(hf)
        if train.compile:
            compiled = compile_layers(hf)
            if role == "actor" and dims.is_main:
                logger.info("train.compile: %d decoder layers compiled (the first step pays the compile)", compiled)
        else:
            changed = fused.fuse_elementwise(hf) if fuse_why is None else 0
            if role == "actor" and dims.is_main:
                logger.info("train.fuse_elementwise=%s: %s", train.fuse_elementwise,
                            f"{changed} norm, MLP and attention modules run fused chains" if fuse_why is None else
                            f"off ({fuse_why})")
        module = PolicyModel(hf, head="value" if role == "critic" else "logprobs", adapter=self.adapter, sp=shard)
        self._hf_names = {n for n, _ in hf.named_parameters()}  # before expert parallelism replaces MoE blocks
        total = max(1, train.num_steps if trained_steps is None else trained_steps) * train.num_mini_batches
        self.engine = parallelize(module, dims, train, lr=None if role == "reference" else lr,
                                  lr_lambda=lr_lambda(train, total) if role != "reference" else None,
                                  offload_params=offload_params,
                                  decay_groups=bool(train.weight_decay) if decay_groups is None else decay_groups)
        unshared = prompts_unshared(train, sp=dims.sp, multimodal=self.adapter.multimodal, moe=self.adapter.moe,
                                    attention=attention)
        self.share_prompts = unshared is None
        if role == "actor" and dims.is_main:
            logger.info("shared prompts (train.share_prompts): %s", f"off ({unshared})" if unshared else "on")
        terms = dict(hidden_size=hf.config.get_text_config().hidden_size, patch_cost=self.adapter.patch_cost(hf.config),
                     sp=dims.sp, share_prompts=self.share_prompts)
        if self.adapter.positions != "1d":  # get_rope_index reads only the config: fine on the sharded model
            terms["positions"] = functools.partial(sample_positions, self.adapter, hf)
        self.train_layout, self.nograd_layout = Layout.for_training(train, **terms), Layout.for_nograd(train, **terms)
        self.skipped_steps = self.consecutive_skips = 0
        self.vocab_size = hf.get_input_embeddings().num_embeddings  # an attribute: ZeRO-3 partitions only the weight
        if role == "actor" and train.packing and self.adapter.family not in FAMILIES:
            self.check_packing(model.path, dtype)

    def check_packing(self, path: str, dtype: torch.dtype) -> None:
        """A family without an adapter: two samples packed in one row must score as each does alone. (Every rank
        runs the same forwards, as ZeRO-3 needs.) A family whose attention misses the row's borders trained on
        samples that saw each other, in silence. (Not run for a critic: its value head starts at zero, so its
        values agree whatever the attention sees.)"""
        diff = packing_gap(lambda idx: self.forward(self.nograd_layout.build(PROBE, idx))[0])
        limit = 1e-3 if dtype == torch.float32 else 0.02  # a clean tiny model: 0.0 in both; leaking: 0.04-1
        if self.dims.is_main:
            logger.info("model family %r (no adapter): packed samples score as alone (mean logprob gap %.2g)",
                        self.adapter.family, diff)
        if diff > limit:
            raise ValueError(f"model.path={path}: the {self.adapter.family!r} family scores two samples packed in "
                             f"one row unlike each alone (mean logprob gap {diff:.3g}, more than {limit:g} of "
                             f"{dtype}): its attention does not keep to the row's samples. Set train.packing=false")

    # Builders from the run config: which sub-configs each role reads.
    @classmethod
    def actor(cls, cfg: Config, dims: ParallelDims, decay_groups: bool | None = None) -> "PolicyEngine":
        # RL scores the responses at the temperature they were sampled at; SFT's cross-entropy is the model's own
        # (at rollout.temperature it would fit logits T times too large, and log that as train/loss)
        temperature = 1.0 if cfg.algo.policy_loss == "sft" else cfg.rollout.temperature
        return cls("actor", model=cfg.model, train=cfg.train, dims=dims, temperature=temperature, lr=cfg.train.lr,
                   trained_steps=actor_steps(cfg), decay_groups=decay_groups)

    @classmethod
    def reference(cls, cfg: Config, dims: ParallelDims) -> "PolicyEngine":
        return cls("reference", model=cfg.model, train=cfg.train, dims=dims, temperature=cfg.rollout.temperature,
                   offload_params=cfg.algo.ref_offload)

    @classmethod
    def critic(cls, cfg: Config, dims: ParallelDims, decay_groups: bool | None = None) -> "PolicyEngine":
        return cls("critic", model=critic_model(cfg), train=cfg.train, dims=dims, lr=cfg.algo.critic.lr,
                   decay_groups=decay_groups)

    # -- forward ----------------------------------------------------------------------------------

    def forward(self, mb: MicroBatch):
        """(logprobs (N,), entropies (N,)) for the policy roles, values (N,) for the critic."""
        top = max((int(t.max()) for t in (mb.input_ids, mb.target_ids) if t is not None and t.numel()), default=0)
        if top >= self.vocab_size:  # else an IndexError deep in torch (a response's last token is only a target)
            raise ValueError(f"token id {top} of the samples at positions {mb.indices} on this rank is outside the "
                             f"{self.role}'s vocabulary [0, {self.vocab_size}) ({self.model_path}): ids from another "
                             "tokenizer (a rollout.generate_fn, a custom reward's rewrite, data of another model?)")
        mb = mb.to(self.dims.device)
        return self.engine(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.pred_index, max_len=mb.max_len,
                           temperature=self.temperature, chunk_size=self.train_cfg.logits_chunk_size,
                           target_ids=mb.target_ids, prompt_prefixes=mb.prompt_prefixes, token_mask=mb.token_mask,
                           **mb.extra)

    @torch.no_grad()
    def score(self, batch: RankBatch) -> list[torch.Tensor]:
        """Per-sample response logprobs (policy roles) or values (critic) of this rank's samples, in order."""
        layout = self.nograd_layout
        plan = layout.pack_in_place(batch.lengths_by_rank, batch.prompts_by_rank)[self.dims.dp_rank]
        out: dict[int, torch.Tensor] = {}
        for idx in plan:
            mb = layout.build(batch.samples, idx)
            result = self.forward(mb)
            out.update(zip(mb.indices, mb.split(result if self.role == "critic" else result[0])))
        return [out[i] for i in range(len(batch.samples))]

    # -- training ---------------------------------------------------------------------------------

    def forward_backward(self, batch: RankBatch, mini: MiniBatch, loss_fn: LossFn, *, learns: bool = True
                         ) -> dict[str, torch.Tensor]:
        """Accumulate the gradients of one mini-batch over this rank's micro-batches; local metric sums.

        `loss_fn(mb, *outputs, num_tokens=, num_seqs=)` returns the micro-batch's share of the mini-batch
        loss (global normalisers) and metric sums. The last backward is the accumulation boundary.
        learns=False: the forward and the metrics only, no gradient (every rank alike).
        """
        sums: dict[str, torch.Tensor] = {}
        dummy_fields: list[str] = []
        if not all(batch.lengths_by_rank):  # a rank without samples: its dummies carry the fields the others' do
            carried = self.dims.all_gather_objects([name for name in TOKEN_FIELDS if batch.samples and
                                                    getattr(batch.samples[0], name) is not None])
            dummy_fields = max(carried, key=len)
        for k, idx in enumerate(mini.micro):
            mb = self.train_layout.build(batch.samples, idx, dummy_fields).to(self.dims.device)
            self.engine.set_gradient_accumulation_boundary(k == len(mini.micro) - 1)
            with torch.set_grad_enabled(learns):
                outputs = self.forward(mb)
                loss, metrics = loss_fn(mb, *(outputs if isinstance(outputs, tuple) else (outputs,)),
                                        num_tokens=mini.num_loss_tokens, num_seqs=mini.num_seqs,
                                        num_processed=mini.num_processed)
            if learns:
                # DeepSpeed averages gradients over every rank; each sp peer back-propagates only through its own
                # shard of the (identical) micro-batch loss, so the shares add up over sp and average over dp.
                self.engine.backward(loss * self.dims.dp * self.dims.sp)
            # a dummy's token is not counted, as in the plan's real_token_fraction
            metrics["train_tokens"] = torch.tensor(0.0 if mb.is_dummy else float(mb.num_tokens), device=loss.device)
            metrics["real_tokens"] = torch.tensor(float(sum(batch.samples[i].total_len for i in idx)), device=loss.device)
            for key, value in metrics.items():  # on the device: no host sync per micro-batch
                value = value.detach().float()
                sums[key] = sums[key] + value if key in sums else value
        return sums

    def optimizer_step(self) -> float:
        """Apply the accumulated gradients; the global gradient norm before clipping.

        A non-finite gradient norm (a NaN or inf loss or gradient on any rank: the norm is global) makes
        DeepSpeed skip the update on every rank alike; that is counted here and logged, and
        train.max_skipped_steps such steps in a row stop the run. Parameters that an update made
        non-finite (a learning rate far too high) stop the run at once, before any checkpoint holds them.
        """
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        if not math.isfinite(norm):
            self.skipped_steps += 1
            self.consecutive_skips += 1
            logger.error("skipped the optimizer step (%s %d in a row): the gradient norm is %s. Likely causes: "
                         "non-finite rewards or advantages, a learning rate too high (%s=%g), or logprobs far from "
                         "the rollout's; the weights are unchanged", self.role, self.consecutive_skips, norm,
                         "train.lr" if self.role == "actor" else "algo.critic.lr", self.engine.get_lr()[0])
            if self.consecutive_skips >= self.train_cfg.max_skipped_steps:
                raise RuntimeError(f"{self.consecutive_skips} consecutive optimizer steps of the {self.role} had a "
                                   f"non-finite loss or gradient (train.max_skipped_steps="
                                   f"{self.train_cfg.max_skipped_steps}); stopping. See the errors above for causes")
            return norm
        self.consecutive_skips = 0
        if not self.parameters_finite():
            raise RuntimeError(f"the {self.role}'s parameters are not finite after an optimizer step with a finite "
                               f"gradient norm ({norm:.3g}): the update overflowed (learning rate "
                               f"{self.engine.get_lr()[0]:g}?). Stopping without saving them")
        return norm

    def apply_optim_settings(self, cfg: Config, *, changed: dict) -> None:
        """After a resume: the checkpoint restored the optimizer's and scheduler's states, with the settings it
        was trained with; settings changed since then are applied here (and said so), not silently ignored."""
        mine = {k: v for k, v in changed.items() if k.startswith("train.") or
                (k == "algo.critic.lr" and self.role == "critic")}
        if self.role == "critic":
            mine.pop("train.lr", None)
        lr = cfg.algo.critic.lr if self.role == "critic" else cfg.train.lr
        scheduler, optimizer = self.engine.lr_scheduler, self.engine.optimizer
        if scheduler is not None and "train.num_mini_batches" in changed:
            # The schedule counts optimizer updates (steps x mini-batches): the restored count, in this run's.
            old, new = changed["train.num_mini_batches"]
            scheduler.last_epoch = scheduler.last_epoch * new // old
        # The restored groups hold the rate the old schedule gave its last step; this run's schedule (built from
        # this config: its num_steps, warmup, floor) sets the rate from here on, the next step included.
        factor = scheduler.lr_lambdas[0](scheduler.last_epoch) if scheduler is not None else 1.0
        if scheduler is not None:
            scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
        # Every hyperparameter the optimizer was built with now (the JSON's eps, ...; the restored groups hold the
        # checkpoint's), and the clipping ZeRO-1/2's optimizer restored with them (ZeRO-3's reads the config)
        built = {k: tuple(v) if isinstance(v, list) else v for k, v in (self.engine.optimizer_params() or {}).items()}
        owned = ("lr", "betas", "weight_decay")  # train.*: their changes are in `changed`
        for group in optimizer.param_groups:
            mine.update({f"train.ds_config optimizer.params.{k}": (group[k], v) for k, v in built.items()
                         if k in group and k not in owned and group[k] != v})
            group.update({k: v for k, v in built.items() if k in group})
            group.update(lr=lr * factor, betas=tuple(cfg.train.betas),
                         weight_decay=0.0 if group.get("no_decay") else cfg.train.weight_decay)
        if hasattr(optimizer, "clip_grad"):
            optimizer.clip_grad = cfg.train.grad_clip
        if mine:
            logger.warning("resumed with changed settings, applied to the %s: %s", self.role,
                           ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in mine.items()))

    def parameters_finite(self) -> bool:
        """Every rank's parameter partitions are finite (a collective)."""
        # A finite sum means finite elements (a NaN or inf carries through): one read of the weights, where
        # isfinite().all() makes four passes. A non-finite sum may be an overflow of huge finite values: checked.
        parts = [local_elements(p) for p in self.engine.module.parameters()]
        local = not parts or math.isfinite(float(torch.stack([t.sum().float() for t in parts]).sum())) \
            or all(bool(torch.isfinite(t).all()) for t in parts)
        return self.dims.all_reduce_sum([0.0 if local else 1.0], group=self.dims.world_group)[0] == 0.0

    def train_step(self, batch: RankBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step per mini-batch. Metrics are reduced over dp ONCE for the whole batch:
        loss shares summed per mini-batch, token sums divided by the loss-token count, packing figures."""
        sums: dict[str, torch.Tensor] = {}
        grad_norms = []
        skipped_before = self.skipped_steps
        lrs = []  # the rates the steps use (get_lr after a step gives the next step's)
        for mini in batch.mini_batches:
            # No loss token on any rank (the count is global, so every rank decides alike): the gradient is zero
            # (but a MoE router's aux loss, dropped with it), yet an Adam update would still move the weights by the
            # momentum of earlier steps. Its metrics come from a forward without gradients; the weights, Adam's
            # moments and step count stay as they are; the schedule advances, as it does for a step with tokens.
            learns = mini.num_loss_tokens > 0
            for key, value in self.forward_backward(batch, mini, loss_fn, learns=learns).items():
                sums[key] = sums[key] + value if key in sums else value
            lrs.append(self.engine.get_lr()[0])
            if learns:
                grad_norms.append(self.optimizer_step())
            else:
                grad_norms.append(0.0)
                if self.engine.lr_scheduler is not None:
                    self.engine.lr_scheduler.step()
        router = {k: sums.pop(k) for k in list(sums) if k.startswith("router_")}
        g = self.dims.all_reduce_tensors(sums)
        n_mini = len(batch.mini_batches)
        loss_tokens = g.pop("loss_tokens")
        prefix = "critic" if self.role == "critic" else "train"
        if loss_tokens == 0 and self.dims.rank == 0:
            logger.warning("%s: this step has no token to learn from (every response token has loss mask 0: a "
                           "generate function that masks them all, or only empty responses): the weights and the "
                           "optimizer's state are left as they were",
                           self.role)
        out = {f"{prefix}/grad_norm": sum(grad_norms) / n_mini, f"{prefix}/lr": sum(lrs) / n_mini,
               f"{prefix}/skipped_steps": float(self.skipped_steps - skipped_before)}
        for key in ("loss", "pg_loss", "value_loss"):  # additive shares of each mini-batch's loss
            if key in g:
                out[f"{prefix}/{key}"] = g.pop(key) / n_mini
        tokens, real = g.pop("train_tokens"), g.pop("real_tokens")
        if self.role == "actor":
            out.update({
                "train/tokens": tokens, "train/real_tokens": real,
                "train/micro_batches_per_rank": sum(len(m.micro) for m in batch.mini_batches) / n_mini,
                "train/real_token_fraction": sum(m.stats["real_token_fraction"] for m in batch.mini_batches) / n_mini,
                "train/dp_imbalance": sum(m.stats["dp_imbalance"] for m in batch.mini_batches) / n_mini,
            })
        # the rest are token sums: means over no token are NaN (null in metrics.jsonl, a gap in the plot), not 0
        out.update({f"{prefix}/{k}": v / loss_tokens if loss_tokens else float("nan") for k, v in g.items()})
        if router:
            out.update(self._router_metrics(router, n_mini))
        return out

    def _router_metrics(self, sums: dict[str, torch.Tensor], n_mini: int) -> dict[str, float]:
        """MoE: the aux loss, the routing entropy and tokens per expert (max over mean, averaged over layers).
        Each sp peer routes its own shard, so these reduce over the whole world."""
        counts = sums.pop("router_expert_counts").to(self.dims.comm_device, torch.float64)
        torch.distributed.all_reduce(counts, group=self.dims.world_group)
        g = self.dims.all_reduce_tensors(sums, group=self.dims.world_group)
        imbalance = (counts.max(-1).values / counts.mean(-1).clamp_min(1e-9)).mean()
        return {"train/router_aux_loss": g["router_aux"] / n_mini,
                "train/router_entropy": g["router_entropy_sum"] / max(g["router_entropy_n"], 1.0),
                "train/expert_imbalance": float(imbalance)}

    # -- colocation -------------------------------------------------------------------------------

    def offload(self, *, params: bool = True) -> None:
        """Move DeepSpeed states to host while a colocated engine uses the GPU (no-op on CPU).

        params=False keeps the parameter partitions, which the weight gather for the engine needs.
        """
        if self.dims.device.type != "cuda":
            return
        if include := self.states_on_device(params=params):
            self.engine.offload_states(include=include)
        torch.cuda.empty_cache()

    def states_on_device(self, *, params: bool = True) -> list:
        """The DeepSpeed states offload() moves to host: not those a ZeRO offload config keeps there already
        (DeepSpeed refuses to move states of offloaded parameters, and moves an offloaded optimizer's gradient
        partitions to the GPU when it reloads them)."""
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum as State

        def on_host(offload) -> bool:
            return offload is not None and offload.device != OffloadDeviceEnum.none

        if on_host(self.engine.zero_offload_param()):  # parameters, gradients and optimizer live on host
            return []
        states = [s for s in State if params or s != State.lp_params]
        if on_host(self.engine.zero_offload_optimizer()):  # fp32 weights, Adam's moments, gradient partitions
            states = [s for s in states if s not in (State.optim_states, State.hp_params, State.lp_grads)]
        return states

    def reload(self) -> None:
        if self.dims.device.type == "cuda":
            self.engine.reload_states()

    # -- weights out ------------------------------------------------------------------------------

    def gathered_weight_buckets(self, bucket_mb: float = 64.0):
        """Full checkpoint-named tensors in buckets of `bucket_mb` (collective: call on every rank). Expert-
        parallel layers are gathered over the ep group and named as the HF model's experts first."""
        hf = self.engine.module.hf
        experts = ExpertGather(self.dims.expert_group(), self.dims.ep, self._hf_names)
        return iter_gathered_buckets(expert_units(hf.named_parameters()), bucket_bytes=int(bucket_mb * 2**20),
                                     to_checkpoint=lambda named: self.adapter.to_checkpoint(hf, experts(named)))

    def export_hf(self, out_dir: str, *savers, bucket_mb: float = 64.0, step: int | None = None,
                  stop_ids: tuple[int, ...] = ()) -> None:
        """Write an HF model directory that `from_pretrained` and SGLang load (collective; rank 0 writes).
        `savers`: objects with save_pretrained (tokenizer, processor); `step` is recorded with it; `stop_ids` join
        the generation config's eos_token_id (save_hf_dir)."""
        state = {}
        for bucket in self.gathered_weight_buckets(bucket_mb):
            if self.dims.is_main:
                state.update((name, t.cpu()) for name, t in bucket)
        # rank 0 writes the whole model alone: the others wait outside the collectives' timeout
        self.dims.on_main(f"writing the HF export to {out_dir}", lambda: save_hf_dir(
            out_dir, state, model=self.engine.module.hf, extra_savers=savers, marker=None if step is None else
            {"step": step}, config_updates={"use_cache": self._use_cache}, stop_ids=stop_ids))
