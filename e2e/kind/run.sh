#!/usr/bin/env bash
# The end-to-end suite on kind (Kubernetes in Docker), for Linux machines with Docker and
# kind: create a cluster, build the kubestar image into the host's Docker with the CPU
# image's build file (images/build.sh cpu, then e2e/kind/Dockerfile adds the suite's model),
# `kind load` it, run e2e/tests (which `helm install`s the chart), and ALWAYS delete the
# cluster again (trap on exit, also when a test fails or on Ctrl-C).
#
#   e2e/kind/run.sh [PYTEST ARGS...]          # or `make e2e-kind`, or `e2e/run.sh kind`
#
# Needs, each named at once when missing: docker (a running daemon), kind, kubectl, helm,
# prometheus (the suite's own, as on the local cluster) and ip on PATH; root (the route
# below); PIP_EXTRA_INDEX_URL naming an index that serves torch's CPU builds (the `+cpu`
# versions, for images/build.sh cpu); and the project venv (`make setup`).
# Environment: KIND_CLUSTER_NAME (kubestar-e2e), KIND_NODE_IMAGE (kind's default node image
# when empty), KUBESTAR_E2E_KEEP_CLUSTER=1 (leave the cluster for debugging; delete it with
# `kind delete cluster --name kubestar-e2e`), KUBESTAR_E2E_OUT (runs/e2e-kind-TIMESTAMP).
#
# Networking: kind has pod networking, cluster DNS and kube-proxy, so the chart's defaults
# apply (no hostNetwork; children listen on 0.0.0.0 inside their pods). The suite's
# Prometheus runs on this machine and scrapes the pods' addresses (e2e/tests/prometheus.py):
# the node's pod network is routed through the node's container while the suite runs.
# Checkpoints: one folder on the kind node (a hostPath, mode 1777),
# trainer.sharedCheckpoints.hostPath, that every trainer pod writes to and the tests read the
# runs' files from. The engines take each step's weights by broadcast from the trainer (the
# fleets' default weightSync) and mount it only in a fleet with weightSync: volume.
#
# Not exercised on the project's own machines (no Docker there); the same suite runs there on
# the local provider (e2e/local/run.sh), and tests/e2e_harness checks this script's
# arguments and image build file.
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

missing=0
for tool in docker kind kubectl helm prometheus ip; do
    command -v "$tool" >/dev/null || { log "$tool is not on PATH"; missing=1; }
done
[[ -x "$PYTHON" ]] || { log "no venv python at $PYTHON (make setup)"; missing=1; }
[[ -n "${PIP_EXTRA_INDEX_URL:-}" ]] || {
    log "PIP_EXTRA_INDEX_URL names no index of torch's CPU builds (images/build.sh cpu)"
    missing=1
}
((EUID == 0)) || { log "not root: the route to the pods' network needs it"; missing=1; }
((missing == 0)) || exit 2
docker version >/dev/null || { log "no Docker daemon"; exit 2; }
if grep -qx "$CLUSTER" <<<"$(kind get clusters 2>/dev/null || true)"; then
    log "a kind cluster named $CLUSTER exists; delete it or set KIND_CLUSTER_NAME"
    exit 2
fi

e2e_output
KUBECONFIG_FILE="$OUT/kubeconfig"
POD_ROUTE=()
teardown() {
    ((${#POD_ROUTE[@]} == 0)) || ip route del "${POD_ROUTE[@]}" || true
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
# The suite's Prometheus, on this machine, reaches the pods through the node's container.
node_ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' \
    "$CLUSTER-control-plane")
pod_cidr=$(kubectl --kubeconfig "$KUBECONFIG_FILE" get node "$CLUSTER-control-plane" \
    -o jsonpath='{.spec.podCIDR}')
POD_ROUTE=("$pod_cidr" via "$node_ip")
step "route to the pods" ip route replace "${POD_ROUTE[@]}"
# The image: the CPU image's build file, the suite's model on top, then copied onto the node.
step "image build (cpu)" "$ROOT/images/build.sh" cpu
# shellcheck source=../../images/pins.env
KUBESTAR_VERSION=$(source "$ROOT/images/pins.env" && echo "$KUBESTAR_VERSION")
step "image build (suite's model)" docker build -f "$HERE/Dockerfile" \
    --build-arg "BASE_IMAGE=kubestar-cpu:$KUBESTAR_VERSION" -t "$IMAGE" "$HERE"
# The image a chart upgrade mid-run moves to: the same content under another tag.
UPGRADE_IMAGE="${IMAGE%:*}:upgrade"
step "image tag (upgrade)" docker tag "$IMAGE" "$UPGRADE_IMAGE"
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
