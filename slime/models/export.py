"""Write an HF model directory from checkpoint-named tensors (what `from_pretrained` and SGLang read)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file


def save_hf_dir(out_dir: str | Path, state: dict[str, torch.Tensor], *, model, extra_savers: Iterable = (),
                max_shard_size: str = "5GB") -> Path:
    """Safetensors shards (+ index when several) of `state`, the model's config and generation config,
    and whatever `extra_savers` (tokenizer, processor) write with their own `save_pretrained`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # an earlier export with other shards would be read instead of (or with) these
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n].contiguous() for n in names}, str(out / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out)
    for saver in extra_savers:
        saver.save_pretrained(out)
    return out
