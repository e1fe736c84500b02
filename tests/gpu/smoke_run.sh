#!/usr/bin/env bash
# GPU smoke run (not part of CI): the tiny GRPO job for 3 steps through run.sh on this node's GPUs (NPROC, 2 by
# default), first on the hf engine, then on a colocated SGLang engine (pip install -e ".[gpu]"), each with an
# evaluation and a checkpoint. What only a multi-GPU launch shows: NCCL and the ranks' devices, bf16, DeepSpeed's
# fused Adam, the actor's offload around the engine. Exit code 0 when both runs end with 0 and log steps 1-3.
#   bash tests/gpu/smoke_run.sh            (ENGINES=hf: the hf engine alone; it runs on CPU ranks too)
set -euo pipefail
cd "$(dirname "$0")/../.."
export NPROC=${NPROC:-2}
out=$(mktemp -d)
for engine in ${ENGINES:-hf sglang}; do
  run_dir=$out/$engine
  echo "== $engine engine on $NPROC GPU(s): $run_dir"
  bash run.sh examples/cpu_tiny_grpo.yaml rollout.engine=$engine log.run_dir="$run_dir" train.num_steps=3 \
    eval.interval=2 eval.max_prompts=64 checkpoint.interval=2 log.plot=false
  python - "$run_dir/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steps = sorted({r["step"] for r in rows if "train/grad_norm" in r})
assert steps == [1, 2, 3], f"steps logged with a gradient: {steps}"
last = [r for r in rows if "train/grad_norm" in r][-1]
print("ok:", {k: last.get(k) for k in ("rollout/reward_mean", "train/grad_norm", "time/step")})
PY
done
echo "smoke runs passed ($out)"
