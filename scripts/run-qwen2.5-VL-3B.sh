#!/usr/bin/env bash
# Qwen2.5-VL-3B on geometry3k (image-text GRPO); 8 x 80 GB GPUs.
#   bash scripts/run-qwen2.5-VL-3B.sh [section.key=value ...]      (DRY_RUN=1: only print the layout and memory)
exec bash "$(dirname "$0")/_recipe.sh" examples/gpu_qwen25vl_3b_geo3k.yaml 8 "$@"
