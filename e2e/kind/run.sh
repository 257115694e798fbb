#!/usr/bin/env bash
# The end-to-end suite on kind (Kubernetes in Docker), for machines with Docker and kind:
# create a cluster, build the kubestar image into the host's Docker, `kind load` it, run
# e2e/tests (which `helm install`s the chart), and ALWAYS delete the cluster again (trap on
# exit, also when a test fails or on Ctrl-C).
#
#   e2e/kind/run.sh [PYTEST ARGS...]          # or `e2e/run.sh kind`
#
# Needs: docker (a running daemon), kind, kubectl and helm on PATH, root for the image build
# (e2e/images/build.sh runs debootstrap), and the project venv (`make setup`).
# Environment: KIND_CLUSTER_NAME (kubestar-e2e), KIND_NODE_IMAGE (kind's default node image
# when empty), KUBESTAR_E2E_KEEP_CLUSTER=1 (leave the cluster for debugging; delete it with
# `kind delete cluster --name kubestar-e2e`), KUBESTAR_E2E_OUT (runs/e2e-kind-TIMESTAMP).
#
# Networking: kind has pod networking, cluster DNS and kube-proxy, so the chart's defaults
# apply (no hostNetwork; children listen on 0.0.0.0 inside their pods). Checkpoints: one
# folder on the kind node (a hostPath, mode 1777), trainer.sharedCheckpoints.hostPath, that
# every trainer pod writes to and the tests read the runs' files from. The engines take each
# step's weights by broadcast from the trainer (the fleets' default weightSync) and mount it
# only in a fleet with weightSync: volume.
#
# Not exercised on the project's own machines (no kind, no image registry there); the same
# suite runs there on the local provider (e2e/local/run.sh).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CLUSTER="${KIND_CLUSTER_NAME:-kubestar-e2e}"
IMAGE="${KUBESTAR_IMAGE:-kubestar/kubestar:dev}"
OUT="${KUBESTAR_E2E_OUT:-$ROOT/runs/e2e-kind-$(date +%Y%m%d-%H%M%S)}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
NODE_SHARED=/var/lib/kubestar-e2e/checkpoints

LOG_TAG=e2e-kind
# shellcheck source=../lib.sh
source "$ROOT/e2e/lib.sh"

for tool in docker kind kubectl helm; do
    command -v "$tool" >/dev/null || { log "$tool is not on PATH"; exit 2; }
done
[[ -x "$PYTHON" ]] || { log "no venv python at $PYTHON (make setup)"; exit 2; }
docker version >/dev/null || { log "no Docker daemon"; exit 2; }
if grep -qx "$CLUSTER" <<<"$(kind get clusters 2>/dev/null || true)"; then
    log "a kind cluster named $CLUSTER exists; delete it or set KIND_CLUSTER_NAME"
    exit 2
fi

e2e_output
KUBECONFIG_FILE="$OUT/kubeconfig"
teardown() {
    if [[ "${KUBESTAR_E2E_KEEP_CLUSTER:-0}" == 1 ]]; then
        log "keeping kind cluster $CLUSTER (KUBECONFIG=$KUBECONFIG_FILE)"
    else
        step "kind delete cluster" kind delete cluster --name "$CLUSTER"
    fi
}
e2e_traps teardown

create_args=(--name "$CLUSTER" --kubeconfig "$KUBECONFIG_FILE" --wait 180s)
[[ -n "${KIND_NODE_IMAGE:-}" ]] && create_args+=(--image "$KIND_NODE_IMAGE")
step "kind create cluster" kind create cluster "${create_args[@]}"
# The folder the trainers write checkpoints (and their run files) to.
step "shared checkpoint folder" docker exec "$CLUSTER-control-plane" \
    sh -c "mkdir -p $NODE_SHARED && chmod 1777 $NODE_SHARED"
# The image: built into the host's Docker (the same two-layer build as for the local
# cluster), then copied onto the kind node.
step "image build" env DOCKER_HOST="${DOCKER_HOST:-unix:///var/run/docker.sock}" \
    KUBESTAR_IMAGE="$IMAGE" "$ROOT/e2e/images/build.sh"
# The image a chart upgrade mid-run moves to: the same content under another tag.
UPGRADE_IMAGE="${IMAGE%:*}:upgrade"
step "image tag (upgrade)" env DOCKER_HOST="${DOCKER_HOST:-unix:///var/run/docker.sock}" \
    docker tag "$IMAGE" "$UPGRADE_IMAGE"
step "kind load docker-image" kind load docker-image "$IMAGE" "$UPGRADE_IMAGE" --name "$CLUSTER"

export KUBECONFIG="$KUBECONFIG_FILE" KUBESTAR_E2E_OUT="$OUT"
export KUBESTAR_E2E_UPGRADE_IMAGE="$UPGRADE_IMAGE"
# The image is on the node: IfNotPresent uses it (its tag is not `latest`).
export KUBESTAR_E2E_HELM_ARGS="\
 --set images.kubestar.repository=${IMAGE%:*} --set images.kubestar.tag=${IMAGE##*:}\
 --set images.engineCpu=$IMAGE --set images.pullPolicy=IfNotPresent\
 --set operator.resyncSeconds=10\
 --set trainer.sharedCheckpoints.hostPath=$NODE_SHARED"
step "suite (pytest e2e/tests)" e2e_suite "$@"
