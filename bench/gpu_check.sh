#!/usr/bin/env bash
# The trainer on one GPU against its targets in a few minutes, on a machine with PyTorch and
# transformers and nothing else (no vLLM, no network, kubestar not installed): kubestar runs
# from this checkout, and models of Qwen3's architecture are made on the spot
# (bench/gpu_check.py says what it measures and the pass bars).
#
#   bench/gpu_check.sh [--sizes 0.6b,1.7b,4b] [--rows N] [--tokens N] [--steps N] [--out FILE]
#   bench/gpu_check.sh --cpu --sizes tiny --rows 3 --tokens 96 --steps 1   # dry run, no GPU
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
# The kubestar namespace from the checkout's folders, as pyproject's package-dir maps them.
export PYTHONPATH="$ROOT/protos:$ROOT/services:$ROOT/training:$ROOT/operator:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" "$ROOT/bench/gpu_check.py" "$@"
