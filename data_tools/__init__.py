"""Command-line tools: dataset converters, synthetic tasks, tiny models, length reports."""
from __future__ import annotations

from pathlib import Path


def is_hf_dir(path: Path) -> bool:
    """A model folder as `save_pretrained` writes one (config, safetensors weights, tokenizer)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) \
        and (path / "tokenizer_config.json").is_file()


def check_replaceable(path: Path, flag: str, *, ours: tuple[str, ...] = ()) -> None:
    """Refuse to delete `path` unless it is absent, empty, a model folder, or holds only the entries named in
    `ours` (what the tool itself writes there): a mistyped --out must not take a user's files with it."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise SystemExit(f"{flag} {path} is a file, not a folder; give a folder to write (it is replaced)")
    entries = sorted(p.name for p in path.iterdir())
    if not entries or is_hf_dir(path) or (ours and set(entries) <= set(ours)):
        return
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    raise SystemExit(f"{flag} {path} holds files this tool did not write ({shown}) and would be replaced: "
                     "give a new or empty folder, or remove it first")
