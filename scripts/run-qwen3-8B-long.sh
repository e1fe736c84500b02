#!/usr/bin/env bash
# Qwen3-8B on 28k-token responses with sequence parallelism (sp=4); 8 x 80 GB GPUs.
#   bash scripts/run-qwen3-8B-long.sh [section.key=value ...]      (DRY_RUN=1: only print the layout and memory)
exec bash "$(dirname "$0")/_recipe.sh" examples/gpu_qwen3_8b_long_sp.yaml 8 "$@"
