#!/usr/bin/env bash
# The trainer on one GPU in a few minutes, on a machine with PyTorch and transformers and
# nothing else (no vLLM, no network, kubestar not installed): kubestar runs from this
# checkout, and a model of Qwen3's architecture is made on the spot (bench/gpu_check.py).
#
#   bench/gpu_check.sh [--size 0.6b|tiny] [--rows N] [--tokens N] [--steps N] [--out FILE]
#
# kubestar's API models need pydantic; where it is missing, put its wheels (pydantic,
# pydantic-core, annotated-types, typing-inspection) in WHEELS (default .whl/) and they are
# installed into a scratch folder first.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl}"
if ! "$PYTHON" -c 'import pydantic' 2>/dev/null; then
    site="$(mktemp -d)"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" "$WHEELS"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The kubestar namespace from the checkout's folders, as pyproject's package-dir maps them.
export PYTHONPATH="$ROOT/protos:$ROOT/services:$ROOT/training:$ROOT/operator:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" "$ROOT/bench/gpu_check.py" "$@"
