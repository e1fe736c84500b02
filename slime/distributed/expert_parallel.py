"""Expert parallelism through DeepSpeed AutoEP, and the way its weights leave the trainer.

With `parallel.ep=N` the parallelize step turns on DeepSpeed's `expert_parallel` (AutoEP): at engine
start every MoE block `hf.model.layers.L.mlp` becomes an `AutoEPMoELayer` holding `router.gate.weight`
(E, H) and only this rank's E/N experts, `experts.w1` (gate, (E/N, I, H)), `experts.w3` (up) and
`experts.w2` (down, (E/N, H, I)); ep rank r holds experts r*E/N .. (r+1)*E/N - 1. ZeRO-3 partitions
the experts over the expert-data-parallel group (ranks holding the same experts) and everything else
over the world. DeepSpeed builds the ep groups itself; `ParallelDims.expert_group` hands them out.

Weights out (`expert_units`, `ExpertGather`): a layer's AutoEP tensors travel as one unit; gathered over
ZeRO, then all-gathered over the ep group in ep-rank order, they become the HF model's in-memory
tensors (`mlp.gate.weight`, fused `experts.gate_up_proj` (E, 2I, H) and `experts.down_proj` (E, H, I)),
which the model adapter then names as the checkpoint does (`experts.{e}.gate_proj.weight`, ...).
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.distributed as dist

from slime.rollout.engine import NamedTensors

AUTOEP_PRESETS = {"qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen3_moe", "mixtral": "mixtral"}
"""HF model type -> the DeepSpeed AutoEP preset that covers it (in this DeepSpeed build). DeepSeek-V2/V3 have
presets too, but the model adapters (slime/models/adapters.py) do not map their fused in-memory experts to the
checkpoint's names yet, so they cannot load here at all."""

_AUTOEP_PARAM = re.compile(r"^(?P<layer>.+\.mlp)\.(?P<kind>router\.gate\.weight|experts\.w[123])$")


def num_experts(config) -> int | None:
    """Experts per MoE layer from an HF config (Qwen's num_experts, Mixtral's num_local_experts)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)


def expert_parallel_settings(ep: int, model_type: str, experts: int | None = None) -> dict:
    """DeepSpeed's `expert_parallel` section for parallel.ep (set here only; a JSON that sets it is refused).
    `experts` (per layer), when known, must split evenly over the ep ranks: said before the model loads."""
    if model_type not in AUTOEP_PRESETS:
        raise ValueError(f"parallel.ep={ep} needs a mixture-of-experts model that DeepSpeed AutoEP supports; "
                         f"model type {model_type!r} is not one of {', '.join(sorted(AUTOEP_PRESETS))}")
    if experts and experts % ep:
        fits = [k for k in range(1, experts + 1) if experts % k == 0]
        raise ValueError(f"parallel.ep={ep} does not divide the model's {experts} experts per layer (each ep rank "
                         f"holds the same number); use one of {fits}")
    # The MoE blocks sit under PolicyModel.hf, hence the prefix on the preset's layer pattern.
    # load_balance_coeff must stay null in this DeepSpeed build (slime adds its own aux loss).
    return {"enabled": True, "autoep_size": ep, "preset_model": AUTOEP_PRESETS[model_type],
            "moe_layer_pattern": r"hf\.model\.layers\.\d+\.mlp", "load_balance_coeff": None}


def expert_units(named: Iterable[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Parameters in order, as units gathered together: one per AutoEP layer, one per other parameter."""
    units: list[list] = []
    layers: dict[str, list] = {}
    for name, p in named:
        m = _AUTOEP_PARAM.match(name)
        if m is None:
            units.append([(name, p)])
        elif m["layer"] in layers:
            layers[m["layer"]].append((name, p))
        else:
            layers[m["layer"]] = [(name, p)]
            units.append(layers[m["layer"]])
    return units


# AutoEP's names for modules it keeps but renames (Qwen2-MoE's single shared expert) -> the HF model's.
_AUTOEP_RENAMES = ((".mlp.shared_experts_gate.", ".mlp.shared_expert_gate."), (".mlp.shared_experts.", ".mlp.shared_expert."))


class ExpertGather:
    """Collective over the ep group: AutoEP tensors of a gathered bucket -> the HF in-memory layout.

    `hf_names`: the HF model's parameter names before AutoEP replaced its MoE blocks; a name AutoEP renamed
    is mapped back to it (and one that matches nothing is an error, not a silently dropped weight)."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, hf_names: set[str] | None = None):
        self.group, self.size, self.hf_names = group, size, hf_names

    def _hf_name(self, name: str) -> str:
        if self.hf_names is None or name in self.hf_names:
            return name
        for ours, theirs in _AUTOEP_RENAMES:
            if ours in name and name.replace(ours, theirs) in self.hf_names:
                return name.replace(ours, theirs)
        raise KeyError(f"parameter {name!r} after expert-parallel replacement has no counterpart in the HF model; "
                       "extend slime/distributed/expert_parallel.py")

    def _all_experts(self, local: torch.Tensor) -> torch.Tensor:
        """(E/ep, ...) local experts -> (E, ...) in ep-rank order."""
        if self.size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts)

    def __call__(self, named: NamedTensors) -> NamedTensors:
        out, layers = [], {}
        for name, t in named:
            m = _AUTOEP_PARAM.match(name)
            if m is None:
                out.append((self._hf_name(name), t))
            else:
                layers.setdefault(m["layer"], {})[m["kind"]] = t
        for layer, parts in layers.items():
            assert set(parts) == {"router.gate.weight", "experts.w1", "experts.w2", "experts.w3"}, sorted(parts)
            w1, w2, w3 = (self._all_experts(parts[k]) for k in ("experts.w1", "experts.w2", "experts.w3"))
            out += [(f"{layer}.gate.weight", parts["router.gate.weight"]),
                    (f"{layer}.experts.gate_up_proj", torch.cat([w1, w3], dim=1)),  # (E, 2I, H): gate, then up
                    (f"{layer}.experts.down_proj", w2)]
        return out
