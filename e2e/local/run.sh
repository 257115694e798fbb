#!/usr/bin/env bash
# The end-to-end suite on the local cluster (no kind, no registry): build or check the cached
# Kubernetes binaries, start a fresh cluster with a node, build the kubestar image into the
# node's dockerd, run e2e/tests, and ALWAYS stop the cluster again (trap on exit, also on a
# failed test or Ctrl-C): every daemon by its recorded PID, every container, every mount.
#
#   e2e/local/run.sh [PYTEST ARGS...]        # or `make e2e`, or `e2e/run.sh local`
#
# Environment: KUBESTAR_CLUSTER_DIR (cluster state, default ~/.cache/kubestar/cluster; its
# docker/ keeps the images between runs, its etcd/ is wiped so every run starts from an
# empty cluster), KUBESTAR_E2E_OUT (output, default runs/e2e-local-TIMESTAMP),
# APISERVER_PORT (6443), PYTHON (the venv's python). Refuses to run when a cluster of that
# DIR is already up: it would stop it at the end.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
K8S_VERSION="${K8S_VERSION:-1.20.2}"
BIN="${KUBESTAR_K8S_BIN:-${KUBESTAR_K8S_CACHE:-$HOME/.cache/kubestar/k8s-$K8S_VERSION}/bin}"
DIR="${KUBESTAR_CLUSTER_DIR:-$HOME/.cache/kubestar/cluster}"
OUT="${KUBESTAR_E2E_OUT:-$ROOT/runs/e2e-local-$(date +%Y%m%d-%H%M%S)}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
APISERVER_PORT="${APISERVER_PORT:-6443}"
MIN_FREE_GIB=10
# trainer.sharedCheckpoints.hostPath: the node is this machine, so a folder of DIR.
SHARED="$DIR/e2e-checkpoints"
export KUBESTAR_CLUSTER_DIR="$DIR" APISERVER_PORT

LOG_TAG=e2e
# shellcheck source=../lib.sh
source "$ROOT/e2e/lib.sh"

if grep -q ': running' <<<"$("$HERE/cluster.sh" status "$DIR" 2>/dev/null || true)"; then
    log "a cluster of $DIR is already running; stop it first (e2e/local/cluster.sh stop $DIR)"
    log "or set KUBESTAR_CLUSTER_DIR to another folder"
    exit 2
fi

# On the host's network the suite's pods listen on fixed ports (the sandbox's 50051-50052 and
# 51051-51052 for metrics, the scheduler's 50061, the tenant pool's 50151...), inside the
# kernel's ephemeral range (32768-60999): a connection made first from this machine (the API
# server's to etcd) can take one, and the pod then crash-loops with "Address already in use".
# They are reserved while the suite runs; the machine's own reservations are put back after.
POD_PORTS=50000-52999
RESERVED=/proc/sys/net/ipv4/ip_local_reserved_ports
machine_reserved=$(cat "$RESERVED")
reserve_pod_ports() { echo "$POD_PORTS${machine_reserved:+,$machine_reserved}" >"$RESERVED"; }

e2e_output
teardown() {
    local rc=0
    step "cluster stop" "$HERE/cluster.sh" stop "$DIR" || rc=1
    echo "$machine_reserved" >"$RESERVED" || rc=1
    # The small volume the full-checkpoint-volume test mounts (unmounted by the test itself
    # unless it was interrupted).
    if mountpoint -q "$DIR/e2e-full-volume"; then umount "$DIR/e2e-full-volume" || rc=1; fi
    rm -rf "$SHARED" "$DIR/e2e-rehearsal" # the rehearsal's volumes (removed by its test)
    return $rc
}
e2e_traps teardown

step "install (binaries)" "$HERE/install.sh"
reserve_pod_ports
# A fresh cluster state (PKI and the node's images stay), then the cluster with its node,
# tried once more if it does not come up (start_cluster, e2e/lib.sh).
export KUBESTAR_WITH_NODE=1
step "cluster start (with node)" start_cluster "$HERE/cluster.sh" "$DIR"
step "image build" "$ROOT/e2e/images/build.sh"
# The suite writes about 10 GiB next to the node's images (checkpoints, container layers and
# logs), and the kubelet evicts the images below 512 MiB free (node.sh): its pods then never
# start, and the suite times out waiting for them. Say so instead.
free_gib=$(($(df -Pk "$DIR" | awk 'NR == 2 {print $4}') / 1024 / 1024))
if ((free_gib < MIN_FREE_GIB)); then
    log "only $free_gib GiB free on the disk of $DIR; the suite needs $MIN_FREE_GIB GiB: free some and run again"
    exit 2
fi
# The image a chart upgrade mid-run moves to: the same content under another tag, so that
# every pod of kubestar's own image is replaced (as by a release) at no build cost.
UPGRADE_IMAGE=kubestar/kubestar:dev-upgrade
step "image tag (upgrade)" env DOCKER_HOST="unix://$DIR/docker.sock" docker tag \
    kubestar/kubestar:dev "$UPGRADE_IMAGE"
rm -rf "$SHARED"
mkdir -p "$SHARED"
chmod 1777 "$SHARED" # the trainer (uid 1000) writes, the engines read

export KUBECONFIG="$DIR/kubeconfig" PATH="$BIN:$PATH"
export KUBESTAR_E2E_OUT="$OUT" KUBESTAR_E2E_CHECKPOINT_HOST_DIR="$SHARED"
export KUBESTAR_E2E_UPGRADE_IMAGE="$UPGRADE_IMAGE"
# One image for everything (engines included), present on the node: IfNotPresent never pulls
# it, and an image that is not there fails at once (dockerd's proxy is a closed local port).
# Host networking: every server binds 127.0.0.1 (see e2e/local/README.md, "Networking").
export KUBESTAR_E2E_HELM_ARGS="\
 --set images.kubestar.repository=kubestar/kubestar --set images.kubestar.tag=dev\
 --set images.engineCpu=kubestar/kubestar:dev --set images.pullPolicy=IfNotPresent\
 --set network.hostNetwork=true --set network.bindAddress=127.0.0.1\
 --set network.apiServerHost=127.0.0.1 --set network.apiServerPort=$APISERVER_PORT\
 --set operator.bindAddress=127.0.0.1 --set operator.resyncSeconds=10\
 --set trainer.sharedCheckpoints.hostPath=$SHARED"
step "suite (pytest e2e/tests)" e2e_suite "$@"
