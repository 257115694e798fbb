#!/usr/bin/env bash
# A local Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager
# (and, with KUBESTAR_WITH_SCHEDULER=1, kube-scheduler), from the binaries e2e/local/install.sh
# cached. Token authentication + RBAC, service-account keys made with openssl. Without a node,
# pods are created but never run. KUBESTAR_WITH_NODE=1 adds one: kube-scheduler, the node
# lifecycle controller, and e2e/local/node.sh (its own dockerd + a kubelet) so pods really run.
#
#   e2e/local/cluster.sh start [DIR]    # prints `export KUBECONFIG=DIR/kubeconfig` when ready
#   e2e/local/cluster.sh stop  [DIR]    # stops what `start` started (the node too), by the
#                                       # PIDs it recorded
#   e2e/local/cluster.sh status [DIR]
#
# DIR defaults to ~/.cache/kubestar/cluster. Ports (all on 127.0.0.1) from the environment:
# APISERVER_PORT (6443), ETCD_PORT (2379), ETCD_PEER_PORT (2380); the node's in node.sh.
# Every daemon is stopped by its recorded PID, never by name. Logs are in DIR/logs.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
K8S_VERSION="${K8S_VERSION:-1.20.2}"
BIN="${KUBESTAR_K8S_BIN:-${KUBESTAR_K8S_CACHE:-$HOME/.cache/kubestar/k8s-$K8S_VERSION}/bin}"
ACTION="${1:-status}"
DIR="${2:-${KUBESTAR_CLUSTER_DIR:-$HOME/.cache/kubestar/cluster}}"
# shellcheck source=pids.sh
source "$HERE/pids.sh"
APISERVER_PORT="${APISERVER_PORT:-6443}"
ETCD_PORT="${ETCD_PORT:-2379}"
ETCD_PEER_PORT="${ETCD_PEER_PORT:-2380}"
SERVICE_CIDR="${SERVICE_CIDR:-10.96.0.0/16}"
SERVICE_IP="${SERVICE_IP:-10.96.0.1}"
ADMIN_TOKEN_FILE="$DIR/pki/admin.token"
WITH_NODE="${KUBESTAR_WITH_NODE:-0}"
NODE_NAME="${NODE_NAME:-kubestar-node}"

log() { printf '[cluster %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

stop_one() {
    local name="$1" pidfile="$DIR/run/$1.pid" pid i
    if pid_alive "$name"; then
        pid="$(cat "$pidfile")"
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 1 50); do
            [[ -d "/proc/$pid" ]] || break
            sleep 0.1
        done
        if [[ -d "/proc/$pid" ]]; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
        log "stopped $name (pid $pid)"
    fi
    rm -f "$pidfile"
}

make_pki() {
    # Each artefact is made only if missing, so a DIR made by an older version gains the new
    # ones (the kubelet client certificate, the node's token) on its next start.
    local pki="$DIR/pki" name
    mkdir -p "$pki"
    (
        cd "$pki"
        if [[ ! -f ca.crt ]]; then
            openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -keyout ca.key -out ca.crt \
                -subj "/CN=kubestar-local-ca" 2>/dev/null
        fi
        if [[ ! -f apiserver.crt ]]; then
            cat >apiserver.cnf <<EOF
[req]
distinguished_name = dn
[dn]
[ext]
subjectAltName = IP:127.0.0.1,IP:$SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
EOF
            openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr \
                -subj "/CN=kube-apiserver" 2>/dev/null
            openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
                -days 3650 -extfile apiserver.cnf -extensions ext -out apiserver.crt 2>/dev/null
        fi
        # The API server's client certificate towards kubelets (logs, exec, port-forward).
        if [[ ! -f apiserver-kubelet-client.crt ]]; then
            printf '[ext]\nkeyUsage = critical,digitalSignature,keyEncipherment\nextendedKeyUsage = clientAuth\n' \
                >client.cnf
            openssl req -newkey rsa:2048 -nodes -keyout apiserver-kubelet-client.key \
                -out apiserver-kubelet-client.csr \
                -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" 2>/dev/null
            openssl x509 -req -in apiserver-kubelet-client.csr -CA ca.crt -CAkey ca.key \
                -CAcreateserial -days 3650 -extfile client.cnf -extensions ext \
                -out apiserver-kubelet-client.crt 2>/dev/null
        fi
        if [[ ! -f sa.key ]]; then
            openssl genrsa -out sa.key 2048 2>/dev/null
            openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
        fi
        # Static tokens: the admin (system:masters), the controller-manager's, the scheduler's
        # and the node's (system:node:NAME in system:nodes, for the Node authorizer) identities.
        for name in admin controller-manager scheduler node; do
            [[ -f "$name.token" ]] || python3 -c 'import secrets; print(secrets.token_hex(16))' \
                >"$name.token"
        done
        {
            echo "$(cat admin.token),admin,admin,system:masters"
            echo "$(cat controller-manager.token),system:kube-controller-manager,kcm"
            echo "$(cat scheduler.token),system:kube-scheduler,ksched"
            echo "$(cat node.token),system:node:$NODE_NAME,node-$NODE_NAME,system:nodes"
        } >tokens.csv.new
        mv tokens.csv.new tokens.csv
        chmod 600 ./*.key ./*.token tokens.csv
    )
}

kubeconfig() { # FILE TOKEN_FILE USER
    local ca
    ca="$(base64 -w0 "$DIR/pki/ca.crt")"
    cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority-data: $ca
users:
- name: $3
  user:
    token: $(cat "$2")
contexts:
- name: local
  context: {cluster: local, user: $3, namespace: default}
current-context: local
EOF
    chmod 600 "$1"
}

wait_ready() {
    local deadline=$((SECONDS + ${1:-60}))
    until curl -sf --cacert "$DIR/pki/ca.crt" -H "Authorization: Bearer $(cat "$ADMIN_TOKEN_FILE")" \
        "https://127.0.0.1:$APISERVER_PORT/readyz" >/dev/null 2>&1; do
        if ((SECONDS > deadline)); then
            log "kube-apiserver not ready; see $DIR/logs/kube-apiserver.log"
            tail -20 "$DIR/logs/kube-apiserver.log" >&2
            return 1
        fi
        pid_alive kube-apiserver || {
            log "kube-apiserver exited; see $DIR/logs/kube-apiserver.log"
            tail -20 "$DIR/logs/kube-apiserver.log" >&2
            return 1
        }
        sleep 0.2
    done
}

start() {
    "$HERE/install.sh" --check || {
        log "binaries missing: run e2e/local/install.sh first"
        exit 2
    }
    command -v curl >/dev/null || { log "curl is needed"; exit 2; }
    mkdir -p "$DIR/run" "$DIR/logs" "$DIR/etcd"
    local started=$SECONDS
    make_pki
    kubeconfig "$DIR/kubeconfig" "$ADMIN_TOKEN_FILE" admin
    kubeconfig "$DIR/controller-manager.kubeconfig" "$DIR/pki/controller-manager.token" kcm
    kubeconfig "$DIR/scheduler.kubeconfig" "$DIR/pki/scheduler.token" ksched
    kubeconfig "$DIR/node.kubeconfig" "$DIR/pki/node.token" "system:node:$NODE_NAME"

    if ! pid_alive etcd; then
        etcd --name default --data-dir "$DIR/etcd" \
            --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
            --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
            --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
            --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
            --initial-cluster "default=http://127.0.0.1:$ETCD_PEER_PORT" \
            --listen-metrics-urls "" --log-level warn \
            >"$DIR/logs/etcd.log" 2>&1 &
        record_started etcd $!
    fi
    if ! pid_alive kube-apiserver; then
        "$BIN/kube-apiserver" \
            --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
            --bind-address 127.0.0.1 --advertise-address 127.0.0.1 \
            --secure-port "$APISERVER_PORT" --insecure-port 0 \
            --tls-cert-file "$DIR/pki/apiserver.crt" --tls-private-key-file "$DIR/pki/apiserver.key" \
            --client-ca-file "$DIR/pki/ca.crt" \
            --token-auth-file "$DIR/pki/tokens.csv" \
            --kubelet-client-certificate "$DIR/pki/apiserver-kubelet-client.crt" \
            --kubelet-client-key "$DIR/pki/apiserver-kubelet-client.key" \
            --kubelet-preferred-address-types InternalIP \
            --authorization-mode Node,RBAC \
            --service-account-key-file "$DIR/pki/sa.pub" \
            --service-account-signing-key-file "$DIR/pki/sa.key" \
            --service-account-issuer https://kubernetes.default.svc \
            --api-audiences https://kubernetes.default.svc \
            --service-cluster-ip-range "$SERVICE_CIDR" \
            --endpoint-reconciler-type none \
            --allow-privileged=true \
            --profiling=false \
            >"$DIR/logs/kube-apiserver.log" 2>&1 &
        record_started kube-apiserver $!
    fi
    wait_ready 90
    log "kube-apiserver ready on 127.0.0.1:$APISERVER_PORT after $((SECONDS - started)) s"
    # With a node, the node lifecycle controller runs too: it lifts the not-ready taint that
    # a new node is registered with (and marks the node NotReady when its kubelet stops).
    local controllers='*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-route,-service'
    [[ "$WITH_NODE" == 1 ]] && controllers='*,-nodeipam,-cloud-node-lifecycle,-route,-service'
    if ! pid_alive kube-controller-manager; then
        "$BIN/kube-controller-manager" \
            --kubeconfig "$DIR/controller-manager.kubeconfig" \
            --bind-address 127.0.0.1 --secure-port 0 --port 0 \
            --service-account-private-key-file "$DIR/pki/sa.key" \
            --root-ca-file "$DIR/pki/ca.crt" \
            --use-service-account-credentials \
            --leader-elect=false \
            --controllers "$controllers" \
            >"$DIR/logs/kube-controller-manager.log" 2>&1 &
        record_started kube-controller-manager $!
    fi
    if [[ "${KUBESTAR_WITH_SCHEDULER:-0}" == 1 || "$WITH_NODE" == 1 ]] \
        && ! pid_alive kube-scheduler; then
        "$BIN/kube-scheduler" --kubeconfig "$DIR/scheduler.kubeconfig" \
            --bind-address 127.0.0.1 --secure-port 0 --port 0 --leader-elect=false \
            >"$DIR/logs/kube-scheduler.log" 2>&1 &
        record_started kube-scheduler $!
    fi
    # The default namespace's service account appears once the controllers run.
    local deadline=$((SECONDS + 60))
    until "$BIN/kubectl" --kubeconfig "$DIR/kubeconfig" get serviceaccount default \
        >/dev/null 2>&1; do
        if ((SECONDS > deadline)); then
            log "controller-manager not working; see $DIR/logs/kube-controller-manager.log"
            tail -20 "$DIR/logs/kube-controller-manager.log" >&2
            exit 1
        fi
        pid_alive kube-controller-manager || {
            log "kube-controller-manager exited"
            tail -20 "$DIR/logs/kube-controller-manager.log" >&2
            exit 1
        }
        sleep 0.3
    done
    log "control plane ready in $((SECONDS - started)) s (kubeconfig: $DIR/kubeconfig)"
    if [[ "$WITH_NODE" == 1 ]]; then
        "$HERE/node.sh" start "$DIR" >/dev/null
        log "control plane and node ready in $((SECONDS - started)) s"
    fi
    echo "export KUBECONFIG=$DIR/kubeconfig PATH=$BIN:\$PATH"
}

stop() {
    # The node first (kubelet, then dockerd and its containers); a no-op if it never ran.
    "$HERE/node.sh" stop "$DIR"
    stop_one kube-scheduler
    stop_one kube-controller-manager
    stop_one kube-apiserver
    stop_one etcd
}

status() {
    local name rc=0
    for name in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet dockerd; do
        if pid_alive "$name"; then
            echo "$name: running (pid $(cat "$DIR/run/$name.pid"))"
        else
            echo "$name: stopped"
            [[ "$name" == kube-scheduler || "$name" == kubelet || "$name" == dockerd ]] || rc=1
        fi
    done
    return $rc
}

case "$ACTION" in
start) start ;;
stop) stop ;;
status) status ;;
*)
    echo "usage: $0 start|stop|status [DIR]" >&2
    exit 2
    ;;
esac
