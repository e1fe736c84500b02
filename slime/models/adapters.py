"""Model adapters: the one place that knows how a model family loads, how its in-memory weights are
named in checkpoints, which position ids it takes and which extra inputs it needs.

transformers 5 keeps some families in memory under other names and shapes than their checkpoints:
Qwen3-MoE fuses each layer's experts into `experts.gate_up_proj` (E, 2I, H) while checkpoints (and
SGLang's `load_weights`) hold `experts.{e}.gate_proj.weight`; Qwen2-VL lives under
`model.language_model.*` but is saved as `model.*` and `visual.*`. Weight sync, HF export and the
hf engine all go through `to_checkpoint`, which uses transformers' own conversion mapping (what
`save_pretrained` uses), so the names we push are the names a checkpoint has. SGLang drops names it
does not know without a word, so every load also checks the adapter's names and shapes against the
checkpoint on disk (`check_checkpoint`) and fails on the first key that does not match.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig, PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from slime.config import ModelConfig

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class ModelAdapter:
    family: str
    """config.model_type."""
    auto_class: Literal["AutoModelForCausalLM", "AutoModelForImageTextToText"] = "AutoModelForCausalLM"
    positions: Literal["1d", "mrope"] = "1d"
    """1-D position ids, or the (3, T) temporal/height/width rows of Qwen-VL's multimodal rope."""
    extra_inputs: tuple[str, ...] = ()
    """Inputs besides token and position ids that the backbone takes (image tensors for VL models)."""
    convert: bool = True
    """Name tensors through transformers' conversion mapping; False keeps in-memory names (unknown families)."""
    moe: bool = False
    """Mixture of experts: the backbone reports router logits (aux loss, expert balance metrics)."""

    @property
    def multimodal(self) -> bool:
        return bool(self.extra_inputs)

    def load(self, cfg: ModelConfig, *, attn_implementation: str, dtype: torch.dtype,
             backbone_only: bool = False) -> PreTrainedModel:
        """The HF model with its LM head, or only its backbone (`AutoModel`: the critic needs no vocabulary)."""
        import transformers

        auto = getattr(transformers, "AutoModel" if backbone_only else self.auto_class)
        if self.multimodal:  # the vision tower attends within each image itself; packing is a text-side concern
            attn_implementation = {"text_config": attn_implementation, "vision_config": "sdpa"}
        model = auto.from_pretrained(cfg.path, gguf_file=cfg.gguf_file, dtype=dtype, trust_remote_code=cfg.trust_remote_code,
                                     attn_implementation=attn_implementation)
        if cfg.gguf_file is None and not backbone_only:  # a backbone's weights never leave the trainer
            self.check_checkpoint(model, cfg.path)
        return model

    # -- inputs -------------------------------------------------------------------------------------

    def position_ids(self, model: PreTrainedModel, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
                     image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Positions of one sample's tokens (L,): (L,) for 1-D rope; (3, L) temporal/height/width rows
        for mrope, from the model's own `get_rope_index` (text tokens get three equal rows). `image_mask`
        (L,) marks the tokens that hold image features (the prompt's placeholders)."""
        if self.positions == "1d":
            return torch.arange(input_ids.numel())
        if image_grid_thw is None:
            return torch.arange(input_ids.numel()).expand(3, -1).clone()
        pos, _ = model.base_model.get_rope_index(input_ids[None], image_mask[None].int(), image_grid_thw=image_grid_thw)
        return pos[:, 0]

    def patch_cost(self, config) -> float:
        """Balancing cost of one image patch, in `packing.default_cost` units at the text hidden size: the
        vision tower's matmuls per patch over the language model's per token (attention ignored)."""
        if not self.multimodal:
            return 0.0
        text, vision = config.get_text_config(), config.vision_config
        width = getattr(vision, "embed_dim", None) or vision.hidden_size  # qwen2_vl names the tower's width embed_dim
        return 12.0 * vision.depth * width ** 2 / (text.num_hidden_layers * text.hidden_size)

    def dummy_image_inputs(self, model: PreTrainedModel, device: torch.device) -> dict[str, torch.Tensor]:
        """The smallest image the vision tower takes (one merged token), for micro-batches without images:
        under ZeRO-3 every rank must call the tower as often as its peers."""
        vc = model.config.vision_config
        merge = vc.spatial_merge_size
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        return {"pixel_values": torch.zeros(merge * merge, dim, device=device, dtype=model.dtype),
                "image_grid_thw": torch.tensor([[1, merge, merge]], device=device)}

    def router_stats(self, model: PreTrainedModel, router_logits: tuple[torch.Tensor, ...],
                     real: torch.Tensor | None = None, sp=None) -> dict[str, torch.Tensor]:
        """From one forward's router logits ((n, E) per MoE layer) and which of the n tokens are real (bool (n,),
        None: all; padding is routed too but counts for nothing): transformers' load-balancing aux loss of the real
        tokens (differentiable), and detached sums for metrics: tokens sent to each expert per layer (L, E) and
        the routing distribution's entropy summed over tokens and layers. Under sequence parallelism (`sp`, this
        rank's SequenceShard) the aux loss and its token count are the whole row's, as at sp=1 (`_row_aux`)."""
        import sys

        config = model.config.get_text_config()
        num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        top_k = config.num_experts_per_tok
        aux_fn = sys.modules[type(model).__module__].load_balancing_loss_func
        if real is not None and not bool(real.all()):
            router_logits = tuple(r[real] for r in router_logits)
        tokens = torch.tensor(float(router_logits[0].shape[0]))
        if sp is not None:
            aux, tokens = _row_aux(router_logits, num_experts, top_k, sp)
        elif router_logits[0].shape[0]:
            aux = aux_fn(router_logits, num_experts, top_k)
        else:  # no real token (a dummy batch): an aux loss of 0 that stays in the graph
            aux = sum(r.sum() for r in router_logits) * 0
        logits = torch.stack([r.float() for r in router_logits])  # (L, n, E)
        probs = logits.detach().softmax(-1)
        chosen = probs.topk(top_k, dim=-1).indices  # (L, n, k)
        counts = torch.zeros(logits.shape[0], num_experts, device=logits.device).scatter_add_(
            1, chosen.flatten(1), torch.ones(chosen.flatten(1).shape, device=logits.device))
        entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1)  # (L, n)
        return {"aux": aux, "tokens": tokens, "peers": sp.size if sp is not None else 1,
                "expert_counts": counts, "entropy_sum": entropy.sum(), "entropy_n": torch.tensor(float(entropy.numel()))}

    def hidden_states(self, model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      extra: dict[str, torch.Tensor], shard: tuple[int, int] | None = None,
                      **attention_kwargs) -> torch.Tensor:
        """The backbone's last hidden states (B, T, H) of a (packed or padded) batch, or (B, end - start, H)
        of the tokens [start, end) when `shard` is given (sequence parallel: the attention function then
        sees the whole row). Image features are merged into the embeddings before the cut.

        Image-text models run the vision tower on EVERY call, on a dummy image when the batch has none
        (its features then enter the graph times zero), so every rank calls every module equally often.
        """
        base = model.base_model
        cut = slice(*shard) if shard is not None else slice(None)
        if not self.multimodal:
            if extra:
                raise ValueError(f"the {self.family} adapter takes no extra inputs, got {sorted(extra)}")
            if self.moe:  # the router logits ride along (MoE aux loss and balance metrics)
                out = base(input_ids=input_ids[..., cut], position_ids=position_ids[..., cut], use_cache=False,
                           output_router_logits=True, **attention_kwargs)
                return out.last_hidden_state, out.router_logits
            return base(input_ids=input_ids[..., cut], position_ids=position_ids[..., cut], use_cache=False,
                        **attention_kwargs).last_hidden_state
        embeds = base.get_input_embeddings()(input_ids)  # (B, T, H)
        images = extra if extra else self.dummy_image_inputs(model, input_ids.device)
        feats = torch.cat(base.get_image_features(images["pixel_values"], images["image_grid_thw"]).pooler_output)
        if extra:
            mask = extra["image_mask"].reshape(input_ids.shape)[..., None].expand_as(embeds)
            if int(mask[..., 0].sum()) != feats.shape[0]:
                raise ValueError(f"{int(mask[..., 0].sum())} image tokens in the batch but {feats.shape[0]} image "
                                 "features from its pixels")
            embeds = embeds.masked_scatter(mask, feats.to(embeds.dtype))
        else:
            embeds = embeds + 0.0 * feats.sum().to(embeds.dtype)
        return base.language_model(inputs_embeds=embeds[:, cut], position_ids=position_ids[..., cut], use_cache=False,
                                   **attention_kwargs).last_hidden_state

    # -- names ----------------------------------------------------------------------------------------

    def to_checkpoint(self, model: PreTrainedModel, named: NamedTensors) -> NamedTensors:
        """In-memory (name, tensor) pairs of `model` -> the checkpoint's (name, tensor) pairs.

        Works on any subset that holds whole parameters (each fused tensor converts on its own).
        """
        if not self.convert or not named:
            return list(named)
        return list(revert_weight_conversion(model, dict(named)).items())

    def load_plan(self, model: PreTrainedModel) -> dict[str, tuple[str, torch.Tensor | None]]:
        """Checkpoint name -> (in-memory parameter, flat positions in it that the tensor fills; None when
        the tensor is the parameter as it is). The inverse of `to_checkpoint`, found by converting each
        parameter's position indices, so any split, chunk or transpose of the conversion is undone exactly.
        """
        plan = {}
        for name, p in model.named_parameters():
            meta = self.to_checkpoint(model, [(name, torch.empty(p.shape, device="meta"))])
            if len(meta) == 1 and meta[0][0] == name and meta[0][1].shape == p.shape:
                plan[name] = (name, None)
                continue
            positions = torch.arange(p.numel()).view(p.shape)
            for ckpt_name, idx in self.to_checkpoint(model, [(name, positions)]):
                plan[ckpt_name] = (name, idx.reshape(-1))
        return plan

    def checkpoint_shapes(self, model: PreTrainedModel) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape for the whole model, computed on the meta device (no copies)."""
        meta = [(name, torch.empty(_full_shape(p), device="meta", dtype=p.dtype))
                for name, p in model.named_parameters()]
        return {name: tuple(t.shape) for name, t in self.to_checkpoint(model, meta)}

    def check_checkpoint(self, model: PreTrainedModel, path: str | Path) -> None:
        """Fail when a tensor we would push or export is not in the checkpoint at `path` with that shape."""
        on_disk = read_checkpoint_shapes(path)
        if on_disk is None:
            logger.info("%s: no safetensors checkpoint to check the %s adapter's names against", path, self.family)
            return
        ours = self.checkpoint_shapes(model)
        for name, shape in sorted(ours.items()):
            if name not in on_disk:
                close = [k for k in on_disk if k.split(".")[-2:] == name.split(".")[-2:]][:1]
                stem = name.rsplit(".", 1)[0]  # an MoE block's experts, fused in memory, one by one on disk
                apart = [k for k in on_disk if k.startswith(f"{stem}.0.")][:1]
                if apart:
                    moe = ", ".join(f for f, kw in FAMILIES.items() if kw.get("moe"))
                    raise ValueError(
                        f"model.path={path}: the {self.family!r} model holds its experts fused in memory ('{name}') "
                        f"where its checkpoint holds them one by one (e.g. {apart[0]!r}), and this family has no "
                        f"adapter that maps the two (slime/models/adapters.py): its weights could not be pushed "
                        f"to an engine or exported. MoE families with one: {moe}")
                fix = ("the names differ: add or fix the family's entry in slime/models/adapters.py" if close else
                       "the checkpoint lacks it: an incomplete export or copy?" +
                       (" A model whose output layer shares the embedding's weights says tie_word_embeddings: true "
                        "in config.json" if "lm_head" in name else ""))
                raise ValueError(
                    f"model.path={path}: weight '{name}' (as the {self.family!r} adapter names it) is not in the "
                    f"checkpoint{f'; the checkpoint has e.g. {close[0]!r}' if close else ''}. Engines would drop it "
                    f"silently; {fix}")
            if tuple(on_disk[name]) != shape:
                raise ValueError(f"model.path={path}: weight '{name}' has shape {list(shape)} in memory after "
                                 f"conversion but {list(on_disk[name])} in the checkpoint (slime/models/adapters.py)")
        extra = sorted(set(on_disk) - set(ours))
        if extra:
            # Tied heads and old rotary buffers are saved by some exporters and are harmless.
            logger.info("%s: %d checkpoint tensors have no in-memory counterpart (e.g. %s)", path, len(extra), extra[0])


def _full_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partition knows its full shape


TEXT = dict(auto_class="AutoModelForCausalLM")
MOE = dict(auto_class="AutoModelForCausalLM", moe=True)
VL = dict(auto_class="AutoModelForImageTextToText", positions="mrope", extra_inputs=("pixel_values", "image_grid_thw"))
FAMILIES: dict[str, dict] = {
    "llama": TEXT, "qwen2": TEXT, "qwen3": TEXT,
    "qwen2_moe": MOE, "qwen3_moe": MOE, "mixtral": MOE,
    "qwen2_vl": VL, "qwen2_5_vl": VL,
}


def get_adapter(model_type: str) -> ModelAdapter:
    """The family's adapter; unknown families get identity names (checked against the checkpoint at load)."""
    if model_type in FAMILIES:
        return ModelAdapter(family=model_type, **FAMILIES[model_type])
    logger.warning("model type %r has no adapter: weights keep their in-memory names (checked against the "
                   "checkpoint at load); known families: %s", model_type, ", ".join(FAMILIES))
    return ModelAdapter(family=model_type, convert=False)


def adapter_for(cfg: ModelConfig) -> ModelAdapter:
    config = AutoConfig.from_pretrained(cfg.path, gguf_file=cfg.gguf_file, trust_remote_code=cfg.trust_remote_code)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    # An image-text family transformers has no causal-LM class for (Qwen3-VL) cannot load as a text model either
    if config.model_type not in FAMILIES | CAUSAL and getattr(config, "vision_config", None) is not None \
            and "AutoModelForCausalLM" not in (getattr(config, "auto_map", None) or {}):  # its own code's class
        supported = ", ".join(f for f, kind in FAMILIES.items() if kind is VL)
        raise ValueError(f"model.path={cfg.path}: the image-text family {config.model_type!r} is not supported (its "
                         f"images, positions and vision weights need an entry in slime/models/adapters.py); "
                         f"image-text families: {supported}")
    return get_adapter(config.model_type)


def read_checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape from the safetensors headers of an HF directory (no tensor is read)."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    shapes = {}
    for file in files:
        with safe_open(str(path / file), "pt") as f:
            shapes.update((k, tuple(f.get_slice(k).get_shape())) for k in f.keys())
    return shapes


def _row_aux(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
             sp) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' load_balancing_loss_func (the per-expert share of top-k choices times the mean routing
    probability, over every layer's real tokens) of the whole sp row, and its real tokens: each shard's sums added
    over the sp group, the probabilities' differentiably. Per shard, the aux loss would balance each shard alone
    (and its gradient would depend on sp)."""
    from slime.distributed.ulysses import sum_shards

    device = router_logits[0].device
    choices = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    for layer in router_logits:
        weights = layer.softmax(-1)
        choices = choices + torch.bincount(weights.topk(top_k, dim=-1).indices.reshape(-1),
                                           minlength=num_experts).float()
        probs = probs + weights.float().sum(0)  # a shard without real tokens adds zeros, still in the graph
    counted = torch.cat([choices, torch.tensor([float(router_logits[0].shape[0])], device=device)])
    torch.distributed.all_reduce(counted, group=sp.group)
    rows = counted[-1] * len(router_logits)
    probs = sum_shards(probs, sp)
    return num_experts * ((counted[:-1] / rows.clamp_min(1)) * (probs / rows.clamp_min(1))).sum(), counted[-1].cpu()
