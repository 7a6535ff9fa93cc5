#!/usr/bin/env bash
# GPU readiness check (not part of CI): on a machine with NVIDIA GPUs, install the GPU stack
# (requirements/gpu.txt: the vLLM CUDA build) and run the tiny targets through the whole
# pipeline on CUDA: vLLM generation/extraction on GPUs, a TP=2 placement group for the Kimi-K2.5
# twin when there are two GPUs, nccl DDP training over every GPU, export/check/evaluate.
# Prints a table of what passed and each stage's throughput. ~10 minutes on one H200.
#   bash scripts/gpu_check.sh [--out DIR] [--targets tiny_cpu tiny_kimi_cpu]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi lists none); this check is for GPU machines" >&2
  exit 2
fi
nvidia-smi -L
t0=$(date +%s)
EAGLE_RAY_DEVICE=gpu bash scripts/setup.sh
echo "gpu_check: GPU stack installed in $(( $(date +%s) - t0 )) s"
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
exec .venv/bin/python scripts/gpu_check.py "$@"
