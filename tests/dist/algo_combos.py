"""Run 2-step GRPO-style jobs for many algorithm configurations in one 2-rank launch.

    torchrun --standalone --nproc_per_node 2 tests/dist/algo_combos.py MODEL DATA OUT_JSON name:override,override ...

Each job is the real loop (`slime.trainer.loop.run`) with its own run directory; rank 0 writes
every job's per-step metrics to OUT_JSON.
"""
import json
import sys
from pathlib import Path

from slime.utils.startup import long_lived_imports

with long_lived_imports():
    from slime.config import load_config
    from slime.trainer.loop import run
    from slime.utils.logging import setup_logging
    from slime.distributed.parallel_dims import leave

BASE = ["rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_response_len=6",
        "rollout.reward.fn=e2e_rewards:digit_fraction", "train.num_steps=2", "train.lr=5e-3",
        "train.max_tokens_per_gpu=64", "checkpoint.save_final=false", "checkpoint.export_hf=false",
        "checkpoint.resume=false", "log.plot=false"]


def main() -> None:
    setup_logging()
    model, data, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    results = {}
    for job in sys.argv[4:]:
        name, _, extra = job.partition(":")
        run_dir = out.parent / name
        overrides = [f"model.path={model}", f"data.path={data}", f"log.run_dir={run_dir}", *BASE,
                     *[o for o in extra.split(",") if o]]
        run(load_config(None, overrides))
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file():
            results[name] = [json.loads(line) for line in metrics.read_text().splitlines()]
    if results:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    leave()
