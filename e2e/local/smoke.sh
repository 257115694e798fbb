#!/usr/bin/env bash
# Smoke check of the local cluster with a node and the kubestar image:
#   1. a plain pod of kubestar/kubestar:dev (hostNetwork, imagePullPolicy Never, uid 65532)
#      runs `python -c 'import kubestar, vllm; print(1)'` and reaches Succeeded;
#   2. `helm install` of helm/kubestar with the local values (that image, pullPolicy Never,
#      hostNetwork, API server at 127.0.0.1, servers bound to 127.0.0.1): the operator
#      Deployment becomes Available with a real pod, takes its Lease and answers the
#      kubelet's liveness probe; then `helm uninstall`.
#
#   KUBESTAR_WITH_NODE=1 e2e/local/cluster.sh start && e2e/images/build.sh
#   e2e/local/smoke.sh [DIR]        # DIR as for cluster.sh (default ~/.cache/kubestar/cluster)
#
# Leaves the cluster running (and clean: the pod deleted, the release uninstalled).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
K8S_VERSION="${K8S_VERSION:-1.20.2}"
BIN="${KUBESTAR_K8S_BIN:-${KUBESTAR_K8S_CACHE:-$HOME/.cache/kubestar/k8s-$K8S_VERSION}/bin}"
DIR="${1:-${KUBESTAR_CLUSTER_DIR:-$HOME/.cache/kubestar/cluster}}"
IMAGE="${KUBESTAR_IMAGE:-kubestar/kubestar:dev}"
APISERVER_PORT="${APISERVER_PORT:-6443}"
NAMESPACE=kubestar-system
RELEASE=kubestar
export KUBECONFIG="$DIR/kubeconfig"
export PATH="$BIN:$PATH"

log() { printf '[smoke %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
fail() {
    log "FAILED: $*"
    kubectl get pods -A -o wide >&2 || true
    exit 1
}

kubectl get --raw /readyz >/dev/null || fail "no cluster at $DIR"

# --- 1. a plain pod ------------------------------------------------------------------------
pod=smoke-import
kubectl delete pod "$pod" --ignore-not-found --wait=true >/dev/null
started=$SECONDS
kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $pod
spec:
  restartPolicy: Never
  hostNetwork: true
  securityContext: {runAsUser: 65532, runAsGroup: 65532, runAsNonRoot: true}
  containers:
    - name: main
      image: $IMAGE
      imagePullPolicy: Never
      command: ["python", "-c", "import kubestar, vllm; print(1)"]
EOF
deadline=$((SECONDS + 300))
while :; do
    phase="$(kubectl get pod "$pod" -o jsonpath='{.status.phase}')"
    [[ "$phase" == Succeeded ]] && break
    [[ "$phase" == Failed ]] && { kubectl logs "$pod" >&2 || true; fail "pod $pod Failed"; }
    ((SECONDS < deadline)) || fail "pod $pod still $phase after 300 s"
    sleep 0.5
done
output="$(kubectl logs "$pod")"
[[ "$output" == 1 ]] || fail "pod printed: $output"
log "pod $pod Succeeded in $((SECONDS - started)) s (printed: $output)"
kubectl delete pod "$pod" --wait=true >/dev/null

# --- 2. the chart --------------------------------------------------------------------------
helm uninstall "$RELEASE" -n "$NAMESPACE" --wait >/dev/null 2>&1 || true
started=$SECONDS
helm install "$RELEASE" "$ROOT/helm/kubestar" -n "$NAMESPACE" --create-namespace \
    --set images.kubestar.repository="${IMAGE%:*}" --set images.kubestar.tag="${IMAGE##*:}" \
    --set images.pullPolicy=Never \
    --set network.hostNetwork=true \
    --set network.apiServerHost=127.0.0.1 --set network.apiServerPort="$APISERVER_PORT" \
    --set operator.bindAddress=127.0.0.1 \
    --wait --timeout 5m >/dev/null || fail "helm install"
log "helm install --wait: operator Deployment available in $((SECONDS - started)) s"
kubectl -n "$NAMESPACE" get deploy,pods -o wide >&2
deadline=$((SECONDS + 180))
# (A Lease left by an earlier install may still name an old pod: ask the new one's log.)
until kubectl -n "$NAMESPACE" logs "deploy/$RELEASE-operator" 2>/dev/null | grep -q 'became leader'; do
    ((SECONDS < deadline)) || fail "the operator did not become leader"
    sleep 1
done
log "operator became leader (its Lease) $((SECONDS - started)) s after install"
until kubectl -n "$NAMESPACE" logs "deploy/$RELEASE-operator" 2>/dev/null | grep -q kube-probe; do
    ((SECONDS < deadline)) || fail "no liveness probe answered"
    sleep 1
done
restarts="$(kubectl -n "$NAMESPACE" get pods -o jsonpath='{.items[0].status.containerStatuses[0].restartCount}')"
[[ "$restarts" == 0 ]] || fail "operator restarted $restarts times"
log "operator answered the kubelet's liveness probe ($((SECONDS - started)) s after install)"
helm uninstall "$RELEASE" -n "$NAMESPACE" --wait >/dev/null
log "OK"
