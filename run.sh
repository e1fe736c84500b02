#!/usr/bin/env bash
# Launch a run on every local GPU, or on CPU ranks over gloo when there is no GPU.
#   bash run.sh examples/cpu_tiny_grpo.yaml [section.key=value ...]
# NPROC overrides the rank count (default: number of GPUs, or 2 on CPU).
set -euo pipefail
cd "$(dirname "$0")"
config=${1:?usage: run.sh CONFIG.yaml [section.key=value ...]}
shift

# The CPU demo's model and data are made by data_tools/ on first use (deterministic, no downloads).
if grep -q "data/tiny-random" "$config" && [[ ! -f data/tiny-random/config.json ]]; then
  python data_tools/make_tiny_model.py --out data/tiny-random
fi
if grep -q "data/arith/" "$config" && [[ ! -f data/arith/train.jsonl ]]; then
  python data_tools/make_arithmetic.py --out-dir data/arith --n-train 5000 --n-eval 500 --seed 0
fi

gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [[ $gpus -gt 0 ]]; then
  nproc=${NPROC:-$gpus}
else
  nproc=${NPROC:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
echo "run.sh: $nproc rank(s) on $([[ $gpus -gt 0 ]] && echo GPU || echo CPU/gloo)"
exec deepspeed --num_gpus "$nproc" run.py --config "$config" "$@"
