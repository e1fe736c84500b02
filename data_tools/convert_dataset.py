"""Convert public datasets to the project's jsonl schema (prompt or messages, label, metadata; images).

    python data_tools/convert_dataset.py gsm8k       --source openai/gsm8k --split train --out data/gsm8k/train.jsonl
    python data_tools/convert_dataset.py math        --source EleutherAI/hendrycks_math --config algebra --out ...
    python data_tools/convert_dataset.py dapo_math   --source BytedTsinghua-SIA/DAPO-Math-17k --out data/dapo/train.jsonl
    python data_tools/convert_dataset.py geometry3k  --source hiyouga/geometry3k --split train --out data/geo3k/train.jsonl

`--source` is a hub name or a local path (a folder or a .parquet/.json/.jsonl file), read with `datasets`.
Column layouts (the datasets' own):
- gsm8k: question, answer ("... #### 72") -> prompt = question + GSM8K_INSTRUCTION (think step by step, the
  answer after "####"), label = the number after ####;
- math (Hendrycks MATH, MATH-500): problem, solution (with \\boxed{...}), level, type -> prompt = problem +
  " Put the final answer in \\boxed{}.", label = the last boxed answer of the solution;
- dapo_math (DAPO-Math-17k): prompt (chat messages), reward_model.ground_truth, data_source ->
  messages as given, label = ground_truth;
- geometry3k: images (Image feature), problem (with an <image> placeholder), answer -> the flat image form;
  the images are written beside the jsonl, named after it (images/<out name>_<row>_<k>.<format>: a second
  output in the same folder, the test split say, writes images of its own).
Rows whose answer cannot be found, whose messages or images cannot be read, or whose <image> placeholders do not
match their images are skipped and counted by reason (printed at the end), never written; rows that repeat one
already written (DAPO-Math-17k is reported to hold each prompt ~100 times; images compared by their bytes) are
left out and counted. Rows are named by their number in the source, counting from 1; metadata.row is the source
row's index, counting from 0.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime.multimodal.images import ImageError, image_bytes_source as image_source  # noqa: E402

GSM8K_INSTRUCTION = " Let's think step by step and output the final answer after \"####\"."


def load(source: str, split: str, config: str | None = None, *, exclude: Path | None = None):
    """Rows of `source`: a hub dataset, one file, or a local folder (its files of `split`, under `config`'s
    subfolder when given). `exclude`: a file never read (the output, when written into the source folder)."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(source)
    if path.is_file():
        kind = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}.get(path.suffix)
        if kind is None:
            raise SystemExit(f"--source {source}: unsupported file type '{path.suffix}'; give a .parquet, .json or "
                             ".jsonl file, a folder of them, or a hub dataset name")
        return datasets.load_dataset(kind, data_files=str(path), split="train")
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        saved = datasets.load_from_disk(str(path))  # a Dataset (or DatasetDict) written by save_to_disk
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise SystemExit(f"--source {source}: no split '{split}' in this saved dataset; its splits: "
                                 f"{', '.join(saved)} (--split)")
            return saved[split]
        return saved
    if path.is_dir() and not (path / "dataset_info.json").is_file() and not list(path.glob("*.py")):
        files = split_files(path, split, config, exclude)
        if files:
            kind = "parquet" if files[0].suffix == ".parquet" else "json"
            return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    return datasets.load_dataset(source, config, split=split)


def looks_local(source: str) -> bool:
    """A path by its form: ./x, ../x, /x, ~/x, or a data file's suffix (hub names are owner/name)."""
    return source.startswith((".", "/", "~")) or Path(source).suffix in (".parquet", ".json", ".jsonl")


def split_files(folder: Path, split: str, config: str | None, exclude: Path | None) -> list[Path]:
    """The data files of `split` in a local copy of a dataset: those whose name has the split as a whole part
    (train.jsonl, train-00000-of-00001.parquet, gsm8k_train.jsonl; not trainer.jsonl), under `folder/config`
    when a config is given. A folder that holds the split in several subsets (gsm8k's main/ and socratic/) needs
    --config: reading them all would write each question once per subset."""
    root = folder / config if config else folder
    if config and not root.is_dir():
        subsets = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise SystemExit(f"--source {folder} has no subfolder {config!r} for --config {config} (it has: "
                         f"{', '.join(subsets) or 'none'})")
    skip = exclude.resolve() if exclude is not None else None
    files = [p for p in sorted(root.rglob("*")) if p.suffix in (".parquet", ".json", ".jsonl") and p.is_file()
             and split in re.split(r"[-_.]", p.stem) and p.resolve() != skip]
    if config is None:
        subsets = sorted({p.relative_to(root).parts[0] for p in files if len(p.relative_to(root).parts) > 1})
        if len(subsets) > 1 or (subsets and any(len(p.relative_to(root).parts) == 1 for p in files)):
            raise SystemExit(f"--source {folder} holds the {split!r} split in several subsets ({', '.join(subsets)}"
                             f"{' and the top folder' if len(subsets) == 1 else ''}): choose one with --config")
    kinds = {"parquet" if p.suffix == ".parquet" else "json" for p in files}
    if len(kinds) > 1:
        raise SystemExit(f"--source {root} mixes parquet and json files for the {split!r} split "
                         f"({', '.join(str(p.relative_to(root)) for p in files)}): keep one kind, or give one file")
    return files


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced, or of a last \\boxed written
    without braces (`\\boxed 5`: its first word, up to the next space or $; MATH's own reader takes up to the $)."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    for bare in reversed([m.start() for m in re.finditer(r"\\boxed ", text) if m.start() > start]):
        answer = re.split(r"[\s$]", text[bare + len("\\boxed "):].lstrip(), maxsplit=1)[0]
        if answer:  # (an empty trailing "\\boxed " leaves the one before it)
            return answer
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, out = 1, []
    while i < len(text):
        c = text[i]
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return "".join(out).strip()
        out.append(c)
        i += 1
    return None


def gsm8k(row: dict, i: int) -> dict | None:
    if not isinstance(row["answer"], str) or "####" not in row["answer"]:  # null: no usable answer
        return None
    label = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    if not label:
        return None
    if isinstance(row["question"], str) and not row["question"].strip():  # (a null one is an error naming the row)
        raise Skip("with an empty question")  # the instruction alone would be the prompt
    return {"prompt": row["question"].strip() + GSM8K_INSTRUCTION, "label": label,
            "metadata": {"source": "gsm8k", "row": i}}


def math(row: dict, i: int) -> dict | None:
    label = last_boxed(row["solution"]) if isinstance(row["solution"], str) else None
    if not label:
        return None
    if isinstance(row["problem"], str) and not row["problem"].strip():
        raise Skip("with an empty problem")
    return {"prompt": row["problem"].strip() + " Put the final answer in \\boxed{}.", "label": label,
            "metadata": {"source": "math", "row": i, "level": row.get("level"), "type": row.get("type")}}


class Skip(Exception):
    """A row left out and counted under `reason` (a converter returns None for a row without a usable answer)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def dapo_math(row: dict, i: int) -> dict | None:
    truth = (row.get("reward_model") or {}).get("ground_truth")
    messages = row.get("prompt")
    if truth in (None, ""):
        return None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise Skip("messages not in role/content form")  # ShareGPT's from/value, say
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages], "label": str(truth),
            "metadata": {"source": row.get("data_source", "dapo_math"), "row": i}}


PNG_MODES = {"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"}  # what PNG stores; others (CMYK, YCbCr) go to RGB


def image_file(image, i: int, k: int) -> tuple[bytes, str]:
    """(the file's bytes, its suffix) of row i's image k: the Image feature undecoded ({"bytes": raw or base64
    text, "path": ...}), a path, or a decoded PIL image (saved as PNG, in RGB where PNG cannot hold its mode).
    Raises Skip for an image that cannot be read."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, dict) and image.get("bytes") is not None:  # raw, or base64 text as JSON holds it
        try:
            data = image_source(image, Path.cwd(), timeout=0, max_bytes=0).getvalue()  # the trainer's reading
        except ImageError:
            raise Skip("unreadable image") from None
    elif isinstance(image, (dict, str)):  # a path: the feature's {"bytes": None, "path": ...}, or a column of paths
        path = image.get("path") if isinstance(image, dict) else image
        if not path or not Path(path).is_file():
            raise ValueError(f"row {i + 1}: image {k} is the path {path!r}, which is not a file here (relative "
                             "paths are read from the current folder)")
        data = Path(path).read_bytes()
    elif isinstance(image, Image.Image):
        out = io.BytesIO()
        (image if image.mode in PNG_MODES else image.convert("RGB")).save(out, format="PNG")
        return out.getvalue(), ".png"
    else:
        raise Skip("unreadable image")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            kind = (im.format or "png").lower()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise Skip("unreadable image") from None
    return bytes(data), {"jpeg": ".jpg"}.get(kind, f".{kind}")


def geometry3k(row: dict, i: int, *, prefix: str) -> dict | None:
    """The row, with its images as (name, bytes) under "_files" (written by convert() for rows it keeps)."""
    images = row.get("images") or []
    if not images or row.get("answer") in (None, ""):
        return None
    files = []
    for k, image in enumerate(images):
        data, suffix = image_file(image, i, k)
        files.append((f"images/{prefix}_{i:05d}_{k}{suffix}", data))
    problem = row["problem"]
    if "<image>" not in problem:  # no placeholder: the images go first, as the dataset means
        problem = "<image>" * len(files) + problem
    if problem.count("<image>") != len(files):  # the trainer would skip it (and refuse a file of many such)
        raise Skip("placeholders not matching the images")
    return {"prompt": problem, "images": [name for name, _ in files], "label": str(row["answer"]),
            "metadata": {"source": "geometry3k", "row": i}, "_files": files}


CONVERTERS: dict[str, Callable] = {"gsm8k": gsm8k, "math": math, "dapo_math": dapo_math, "geometry3k": geometry3k}


def convert(kind: str, rows: Iterable[dict], out: Path) -> tuple[int, collections.Counter, int]:
    """Write `out` (jsonl); returns (written, skipped rows by reason, duplicates). A row that converts to one
    already written (the hub's DAPO-Math-17k is reported to repeat each prompt ~100 times; images compared by
    their bytes) is left out and counted: a run would otherwise see each prompt many times per epoch. A
    geometry3k row's images are written only where the row is."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fn = CONVERTERS[kind]
    if kind == "geometry3k":
        (out.parent / "images").mkdir(exist_ok=True)
        fn = lambda row, i: geometry3k(row, i, prefix=out.stem)  # noqa: E731
    written = duplicates = 0
    skipped: collections.Counter = collections.Counter()
    examples: dict[str, list[int]] = collections.defaultdict(list)  # the first rows (1-based) of each reason

    def skip(reason: str, i: int) -> None:
        skipped[reason] += 1
        if len(examples[reason]) < 10:
            examples[reason].append(i + 1)

    seen: set[bytes] = set()  # digests of the rows written (without their metadata, which names the source row)
    partial = out.with_name(f".{out.name}.partial")  # renamed into place once whole: no half file left behind
    try:
        with open(partial, "w", encoding="utf-8") as f:
            for i, row in enumerate(rows):
                try:
                    converted = fn(row, i)
                except Skip as e:
                    skip(e.reason, i)
                    continue
                except KeyError as e:
                    raise ValueError(f"row {i + 1} has no column {e}, which the {kind} converter reads; its columns: "
                                     f"{sorted(row)}. Is --source a {kind} dataset?") from None
                except (TypeError, AttributeError) as e:  # a null or a number where the converter reads text
                    types = {k: type(v).__name__ for k, v in row.items()}
                    raise ValueError(f"row {i + 1}: the {kind} converter cannot read it ({type(e).__name__}: {e}); "
                                     f"its columns' types: {types}") from None
                if converted is None:
                    skip("without a usable answer", i)
                    continue
                files = converted.pop("_files", [])
                content = {k: v for k, v in converted.items() if k not in ("metadata", "images")}
                digest = hashlib.blake2b(json.dumps(content, sort_keys=True).encode(), digest_size=16)
                for _, data in files:
                    digest.update(hashlib.blake2b(data, digest_size=16).digest())
                if digest.digest() in seen:
                    duplicates += 1
                    continue
                seen.add(digest.digest())
                for name, data in files:
                    (out.parent / name).write_bytes(data)
                f.write(json.dumps(converted, ensure_ascii=False) + "\n")
                written += 1
        if not written:
            raise ValueError(f"no row of {sum(skipped.values())} was usable ({describe(skipped)}): nothing written "
                             f"to {out}. Is --source a {kind} dataset?")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    for reason, where in sorted(examples.items()):
        print(f"skipped {skipped[reason]} row(s) {reason}: row{'s' if len(where) > 1 else ''} "
              f"{', '.join(map(str, where))}{', ...' if skipped[reason] > len(where) else ''}")
    return written, skipped, duplicates


def describe(skipped: collections.Counter) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())) or "none skipped"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=sorted(CONVERTERS))
    ap.add_argument("--source", required=True, help="hub name or local path")
    ap.add_argument("--split", default="train")
    ap.add_argument("--config", default=None, help="hub dataset config (gsm8k: main; MATH: a subject)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    config = args.config or ("main" if args.kind == "gsm8k" and not Path(args.source).exists() else None)
    source = Path(args.source).resolve()
    if args.out.resolve() == source or (source.is_dir() and args.out.exists() and
                                        args.out.resolve().is_relative_to(source)):
        sys.exit(f"convert_dataset: --out {args.out} is --source itself, or a file in its folder: raw rows would be "
                 "overwritten; write elsewhere")
    if args.out.is_dir():
        sys.exit(f"convert_dataset: --out {args.out} is a folder; name the .jsonl file to write")
    if looks_local(args.source) and not Path(args.source).exists():  # not a hub name: the hub's error would say so
        sys.exit(f"convert_dataset: --source {args.source} does not exist (a local file or folder, by its form; a "
                 "hub dataset is named owner/name)")
    try:
        rows = load(args.source, args.split, config, exclude=args.out)
    except Exception as e:  # noqa: BLE001 -- datasets' errors for a file it cannot parse, a missing split, ...
        cause = e.__cause__ or e.__context__ or e  # datasets wraps a parse error in its own
        sys.exit(f"convert_dataset: could not read --source {args.source} (split {args.split!r}"
                 f"{f', config {config!r}' if config else ''}): {type(e).__name__}: {e}"
                 + (f" ({type(cause).__name__}: {cause})" if cause is not e else ""))
    try:
        written, skipped, duplicates = convert(args.kind, rows, args.out)
    except ValueError as e:
        sys.exit(f"convert_dataset: {args.source}: {e}")
    except OSError as e:  # an --out that cannot be written
        sys.exit(f"convert_dataset: cannot write --out {args.out}: {e}")
    print(f"wrote {written} rows to {args.out}; skipped {sum(skipped.values())} ({describe(skipped)}) and "
          f"{duplicates} repeating a row written before")


if __name__ == "__main__":
    main()
