#!/usr/bin/env bash
# Shared by the per-model wrappers: say what is about to run, dry-run it (layout and memory per GPU), then
# launch it through run.sh.
#   usage: _recipe.sh CONFIG GPUS_PER_NODE [section.key=value ...]
# NPROC overrides the rank count; DRY_RUN=1 stops after the dry run; GPU_MEMORY_GB (default 80) sizes it.
set -euo pipefail
cd "$(dirname "$0")/.."
config=$1 gpus=$2
shift 2
nproc=${NPROC:-$gpus}
echo "recipe: $config on $nproc rank(s)"
sed -n '/^#/!q;p' "$config"  # the config's header: what it is, what it was sized for, how to get the data
python run.py --config "$config" --dry-run --num-gpus "$nproc" --gpu-memory-gb "${GPU_MEMORY_GB:-80}" "$@"
[[ ${DRY_RUN:-0} == 1 ]] && exit 0
# The recipes are GPU runs: run.sh would start these ranks on CPU/gloo where no GPU is (each loading the model).
here=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [[ $here -eq 0 ]]; then
  echo "recipe: this node shows no GPU; the dry run above is what the recipe launches on $nproc GPU(s)" >&2
  exit 2
fi
NPROC=$nproc exec bash run.sh "$config" "$@"
