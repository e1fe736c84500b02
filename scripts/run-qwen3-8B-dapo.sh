#!/usr/bin/env bash
# Qwen3-8B with DAPO settings and TIS on DAPO-Math-17k; 8 x 80 GB GPUs.
#   bash scripts/run-qwen3-8B-dapo.sh [section.key=value ...]      (DRY_RUN=1: only print the layout and memory)
exec bash "$(dirname "$0")/_recipe.sh" examples/gpu_qwen3_8b_dapo.yaml 8 "$@"
