"""Write an HF model directory from checkpoint-named tensors (what `from_pretrained` and SGLang read)."""
from __future__ import annotations

import copy
import ctypes
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from slime.utils.fs import fsync_path


EXPORT_MARKER = "slime_export.json"  # written last: the step the export holds


def save_hf_dir(out_dir: str | Path, state: dict[str, torch.Tensor], *, model, extra_savers: Iterable = (),
                max_shard_size: str = "5GB", marker: dict | None = None, config_updates: dict | None = None,
                stop_ids: Iterable[int] = ()) -> Path:
    """Safetensors shards (+ index when several) of `state`, the model's config (with `config_updates`, where
    None removes the key: the trainer's use_cache=False is not the model's) and generation config (`stop_ids`
    added to its eos_token_id: the chat template's end of turn the run trained the model to end with, where it is
    not EOS), and whatever `extra_savers` (tokenizer, processor) write with their own `save_pretrained`."""
    final = Path(out_dir)
    # Written whole beside the folder, then renamed into place: a kill or a full disk mid-way leaves the earlier
    # export (or none) as it was, never a folder of some new shards (or an old shard read with new ones).
    out = final.with_name(f".{final.name}.partial")

    def failed(what: str, e: Exception) -> RuntimeError:
        shutil.rmtree(out, ignore_errors=True)  # what was written so far would hold the space
        free = shutil.disk_usage(final.parent).free / 2**30 if final.parent.exists() else 0.0
        kept = f"{final} is as it was" if final.exists() else f"no earlier export is at {final}"
        return RuntimeError(f"{what} failed: {e}. {free:.2f} GiB free on that file system (a full disk, a quota, a "
                            f"read-only folder?), its partial files removed; {kept}")

    shutil.rmtree(out, ignore_errors=True)
    try:
        out.mkdir(parents=True)
    except OSError as e:
        raise failed(f"creating the HF export's folder {out}", e) from e
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        try:
            save_file({n: state[n].contiguous() for n in names}, str(out / filename), metadata={"format": "pt"})
        except Exception as e:  # safetensors' own error names neither the file nor the free space
            raise failed(f"writing the HF export's {out / filename}", e) from e
    try:
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                     "weight_map": split.tensor_to_filename}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        config = copy.deepcopy(model.config)
        for key, value in (config_updates or {}).items():
            if value is not None:
                setattr(config, key, value)
            elif key in vars(config):
                delattr(config, key)
        config.save_pretrained(out)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            generation = model.generation_config
            if stop_ids:  # HF's generate would run on past the turn end
                generation, eos = copy.deepcopy(generation), generation.eos_token_id
                eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
                generation.eos_token_id = list(dict.fromkeys([*eos, *stop_ids]))
            generation.save_pretrained(out)
        for saver in extra_savers:
            saver.save_pretrained(out)
        if marker is not None:
            (out / EXPORT_MARKER).write_text(json.dumps(marker))
        for f in out.iterdir():  # on disk before the folder takes the export's name (as checkpoints are)
            fsync_path(f)
        fsync_path(out)
    except OSError as e:
        raise failed(f"writing the HF export's config and tokenizer files in {out}", e) from e
    if final.exists() and _exchange(out, final):  # one step: there is always a whole export at `final`
        shutil.rmtree(out)  # the earlier export, now
    else:
        previous = final.with_name(f".{final.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        if final.exists():
            os.replace(final, previous)
        os.replace(out, final)
        shutil.rmtree(previous, ignore_errors=True)
    fsync_path(final.parent)
    return final


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux's renameat2 with RENAME_EXCHANGE); False where the system or the file
    system has no such call."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def exported_step(out_dir: str | Path) -> int | None:
    """The training step a complete export in `out_dir` holds (None: no export of ours there)."""
    try:
        return int(json.loads((Path(out_dir) / EXPORT_MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
