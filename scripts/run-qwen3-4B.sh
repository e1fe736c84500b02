#!/usr/bin/env bash
# Qwen3-4B GRPO on GSM8K, SGLang colocated; 8 x 80 GB GPUs.
#   bash scripts/run-qwen3-4B.sh [section.key=value ...]      (DRY_RUN=1: only print the layout and memory)
exec bash "$(dirname "$0")/_recipe.sh" examples/gpu_qwen3_4b_grpo_gsm8k.yaml 8 "$@"
