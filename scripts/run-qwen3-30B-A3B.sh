#!/usr/bin/env bash
# Qwen3-30B-A3B with expert parallelism (ep=8); 2 nodes x 8 x 80 GB GPUs.
#   bash scripts/run-qwen3-30B-A3B.sh [section.key=value ...]      (DRY_RUN=1: only print the layout and memory)
exec bash "$(dirname "$0")/_recipe.sh" examples/gpu_qwen3_30b_a3b_moe.yaml 16 "$@"
