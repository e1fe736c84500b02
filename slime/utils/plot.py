"""Plot a run's metrics.jsonl: one panel per metric over steps, written as a PNG.

    python -m slime.utils.plot runs/cpu_tiny_grpo/metrics.jsonl [--out metrics.png]
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_KEYS = ["rollout/reward_mean", "eval/accuracy", "eval/reward_mean", "rollout/response_len", "train/loss",
                "train/entropy"]


def plot_metrics(metrics_path: str | Path, out_path: str | Path, keys: list[str] = DEFAULT_KEYS) -> Path | None:
    """Write the PNG; panels only for keys that appear in the file. Returns the path (None if nothing to plot)."""
    # A Figure of its own, not pyplot: no global backend switch in the caller's process (a notebook keeps its
    # own), no figure registry to close, a little less to import at the end of every run.
    from matplotlib.figure import Figure

    rows = []
    for n, line in enumerate(Path(metrics_path).read_text(errors="replace").splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:  # a torn line (a run killed mid-write, a full disk): the others still plot
            logger.warning("%s:%d: not a JSON record; left out of the plot", metrics_path, n)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
    # null: not finite (a skipped step, say), plotted as NaN: the line breaks there and a red band marks it,
    # where leaving it out drew the line straight across
    series = {k: [(r["step"], float("nan") if r[k] is None else r[k]) for r in rows if k in r] for k in keys}
    series = {k: v for k, v in series.items() if any(y == y for _, y in v)}
    if not series:
        return None
    fig = Figure(figsize=(7, 2.2 * len(series)))
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)
    for ax, (key, points) in zip(axes[:, 0], series.items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", markersize=3)
        for x, y in points:
            if y != y:
                ax.axvline(x, color="red", alpha=0.3)
        ax.set_ylabel(key.split("/")[-1])
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("training step")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    return Path(out_path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", help="metrics.jsonl of a run")
    ap.add_argument("--out", help="output PNG (default: metrics.png beside the jsonl)")
    args = ap.parse_args()
    out = plot_metrics(args.metrics, args.out or Path(args.metrics).with_name("metrics.png"))
    print(out or "nothing to plot")


if __name__ == "__main__":
    main()
