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
# trainer.sharedCheckpoints.hostPath: the node is this machine, so a folder of DIR.
SHARED="$DIR/e2e-checkpoints"
export KUBESTAR_CLUSTER_DIR="$DIR" APISERVER_PORT

log() { printf '[e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if grep -q ': running' <<<"$("$HERE/cluster.sh" status "$DIR" 2>/dev/null || true)"; then
    log "a cluster of $DIR is already running; stop it first (e2e/local/cluster.sh stop $DIR)"
    log "or set KUBESTAR_CLUSTER_DIR to another folder"
    exit 2
fi

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
TIMINGS="$OUT/timings.txt"
: >"$TIMINGS"
started_all=$SECONDS
step() { # NAME COMMAND...: run, time it into timings.txt
    local name="$1" began=$SECONDS rc=0
    shift
    log "$name"
    "$@" || rc=$?
    printf '%-28s %5d s%s\n' "$name" $((SECONDS - began)) "$([[ $rc == 0 ]] || echo "  (exit $rc)")" \
        | tee -a "$TIMINGS" >&2
    return $rc
}

cleaned=0
cleanup() {
    local rc=$?
    ((cleaned)) && return 0
    cleaned=1
    trap - INT TERM
    step "cluster stop" "$HERE/cluster.sh" stop "$DIR" || rc=1
    rm -rf "$SHARED"
    printf '%-28s %5d s\n' "total" $((SECONDS - started_all)) | tee -a "$TIMINGS" >&2
    if [[ "$rc" == 0 ]]; then log "PASSED; output in $OUT"; else log "FAILED ($rc); output in $OUT"; fi
    exit "$rc"
}
# A signal (Ctrl-C, a CI timeout) stops the suite (started in the background, so that the
# trap runs at once instead of after pytest), then the EXIT trap cleans up.
SUITE_PID=""
on_signal() {
    [[ -n "$SUITE_PID" ]] && kill -TERM "$SUITE_PID" 2>/dev/null
    exit "$1"
}
trap cleanup EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM

step "install (binaries)" "$HERE/install.sh"
# A fresh cluster state every run (PKI and the node's images stay).
rm -rf "$DIR/etcd"
step "cluster start (with node)" env KUBESTAR_WITH_NODE=1 "$HERE/cluster.sh" start "$DIR"
step "image build" "$ROOT/e2e/images/build.sh"
rm -rf "$SHARED"
mkdir -p "$SHARED"
chmod 1777 "$SHARED" # the trainer (uid 1000) writes, the engines read

export KUBECONFIG="$DIR/kubeconfig" PATH="$BIN:$PATH"
export KUBESTAR_E2E_OUT="$OUT" KUBESTAR_E2E_CHECKPOINT_HOST_DIR="$SHARED"
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
cd "$ROOT"
suite() {
    "$PYTHON" -m pytest e2e/tests -v -p no:cacheprovider --durations=0 \
        -o junit_family=xunit2 --junitxml="$OUT/junit.xml" "$@" > >(tee "$OUT/pytest.txt") 2>&1 &
    SUITE_PID=$!
    wait "$SUITE_PID"
}
step "suite (pytest e2e/tests)" suite "$@"
