"""A tiny verifiable image-text task, drawn with Pillow: what colour is the shape?

    python data_tools/make_vl_task.py --out-dir data/tiny-vl [--n-train 3000] [--n-eval 300] [--seed 0]

Each 56x56 image (4 image tokens for the tiny Qwen2-VL: 2x2 merged 28-pixel tiles) holds one circle,
square or triangle of one of six colours, with jittered hue, size and position on a noisy background.
The answer is the colour's name. Deterministic for a seed; train and eval draw disjoint scenes.

The train split uses the flat form (`prompt` with an `<image>` placeholder, `images`, `label`), the
eval split the chat form (`messages` with an image part), so both schemas run in every job.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {"red": (215, 40, 40), "green": (40, 165, 60), "blue": (45, 80, 215), "yellow": (225, 205, 35),
           "purple": (145, 60, 185), "orange": (240, 135, 30)}
SHAPES = ("circle", "square", "triangle")
SIZE = 56
QUESTION = "What colour is the shape?"


def scene(rng: random.Random) -> tuple:
    colour = rng.choice(sorted(COLOURS))
    shape = rng.choice(SHAPES)
    r = rng.randint(9, 16)
    cx, cy = rng.randint(r, SIZE - r), rng.randint(r, SIZE - r)
    jitter = tuple(rng.randint(-30, 30) for _ in range(3))
    return colour, shape, r, cx, cy, jitter, rng.randint(0, 2**31)


def draw(spec: tuple):
    from PIL import Image, ImageDraw

    colour, shape, r, cx, cy, jitter, noise_seed = spec
    noise = random.Random(noise_seed)
    img = Image.new("RGB", (SIZE, SIZE))
    img.putdata([tuple(noise.randint(150, 230) for _ in range(3)) for _ in range(SIZE * SIZE)])
    fill = tuple(max(0, min(255, c + j)) for c, j in zip(COLOURS[colour], jitter))
    d = ImageDraw.Draw(img)
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "square":
        d.rectangle(box, fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return img


def make_split(n_train: int, n_eval: int, seed: int) -> tuple[list, list]:
    """Disjoint scene specs: eval scenes are drawn first and never repeated in train."""
    rng = random.Random(seed)
    seen, specs = set(), []
    while len(specs) < n_train + n_eval:
        spec = scene(rng)
        key = spec[:6]
        if key not in seen:
            seen.add(key)
            specs.append(spec)
    return specs[n_eval:], specs[:n_eval]


def write(out_dir: str | Path, *, n_train: int = 3000, n_eval: int = 300, seed: int = 0) -> Path:
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    train, evals = make_split(n_train, n_eval, seed)
    for split, specs in (("train", train), ("eval", evals)):
        rows = []
        for k, spec in enumerate(specs):
            name = f"images/{split}_{k:05d}.png"
            draw(spec).save(out / name)
            if split == "train":
                rows.append({"prompt": f"<image>{QUESTION}", "images": [name], "label": spec[0]})
            else:
                rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": name},
                                                                       {"type": "text", "text": QUESTION}]}],
                             "label": spec[0]})
        if rows:
            (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        elif (out / f"{split}.jsonl").exists():  # no eval split asked for: no file (the trainer refuses an empty
            # one), and not an earlier run's, whose scenes this train split now starts with (the eval's are drawn first)
            (out / f"{split}.jsonl").unlink()
            print(f"removed {out / f'{split}.jsonl'} of an earlier run: its scenes are in this train split")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--n-train", type=int, default=3000)
    ap.add_argument("--n-eval", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.n_train < 1 or args.n_eval < 0:
        ap.error(f"--n-train must be >= 1 and --n-eval >= 0 (got {args.n_train} and {args.n_eval})")
    out = write(args.out_dir, n_train=args.n_train, n_eval=args.n_eval, seed=args.seed)
    evals = f", {out}/eval.jsonl ({args.n_eval})" if args.n_eval else " (no eval split)"
    print(f"wrote {out}/train.jsonl ({args.n_train}){evals} and their images")


if __name__ == "__main__":
    main()
