#!/usr/bin/env bash
# A real node for the local cluster of e2e/local/cluster.sh: its own dockerd and a kubelet
# (1.20, which drives Docker through its built-in dockershim), so pods actually run. Usually
# started by `KUBESTAR_WITH_NODE=1 e2e/local/cluster.sh start`; by hand:
#
#   e2e/local/node.sh start  [DIR]   # control plane of DIR must be up (cluster.sh start DIR)
#   e2e/local/node.sh stop   [DIR]   # kubelet, containers, dockerd by recorded PID; unmounts
#   e2e/local/node.sh status [DIR]
#   e2e/local/node.sh docker [DIR] ARGS...   # the docker client on this node's dockerd
#
# Everything lives under DIR (default ~/.cache/kubestar/cluster):
#   docker.sock                 dockerd's only socket (no TCP)
#   docker/                     dockerd --data-root (KUBESTAR_DOCKER_DATA_ROOT overrides; the
#                               images stay there across restarts of the same DIR)
#   run/docker/                 dockerd --exec-root (its pidfile, managed containerd's state)
#   run/dockershim.sock         the kubelet's CRI socket
#   kubelet/                    the kubelet's root dir, config, certificates
#   logs/dockerd.log, logs/kubelet.log
#
# The node: name $NODE_NAME (kubestar-node), address 127.0.0.1; the kubelet's API on
# 127.0.0.1:$KUBELET_PORT (10250, client certificates of the cluster CA, webhook
# authorization) and health on 127.0.0.1:$KUBELET_HEALTHZ_PORT (10248); no read-only port.
# dockerd runs with --bridge=none --iptables=false --ip-masq=false --ip-forward=false: no pod
# networking, so pods must use hostNetwork (see README.md, "Networking"). An image pull can
# never leave the machine: dockerd's HTTP(S) proxy is a closed port on 127.0.0.1, so images
# must be present (imagePullPolicy: Never or IfNotPresent; e2e/images/build.sh loads them).
# Pods go under their own cgroup root (kubestar-<hash of DIR>), removed again on stop.
#
# The kubelet runs with AWS_EC2_METADATA_DISABLED=true (its built-in cloud credential lookup
# must never reach for a metadata address) and with the test-only switches of
# patches/kubelet-*.patch on: the kernel tunables check only warns (host sysctls are left
# alone), negative OOM score adjustments become 0 (this VM does not grant CAP_SYS_RESOURCE),
# and 127.0.0.1 is accepted as the node's IP (so the API server reaches the kubelet for logs
# and exec, and host-network pods get 127.0.0.1 as their IP).
#
# Host paths still used (fixed in 1.20): /var/log/pods and /var/log/containers (our pods'
# links are removed on stop), /var/lib/kubelet/device-plugins/kubelet.sock (removed on stop)
# and /run/containerd/s (containerd's shim sockets; the folder is removed on stop if empty).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
K8S_VERSION="${K8S_VERSION:-1.20.2}"
CACHE="${KUBESTAR_K8S_CACHE:-$HOME/.cache/kubestar/k8s-$K8S_VERSION}"
BIN="${KUBESTAR_K8S_BIN:-$CACHE/bin}"
ACTION="${1:-status}"
DIR="${2:-${KUBESTAR_CLUSTER_DIR:-$HOME/.cache/kubestar/cluster}}"
DIR="$(mkdir -p "$DIR" && cd "$DIR" && pwd)"
# shellcheck source=pids.sh
source "$HERE/pids.sh"
NODE_NAME="${NODE_NAME:-kubestar-node}"
KUBELET_PORT="${KUBELET_PORT:-10250}"
KUBELET_HEALTHZ_PORT="${KUBELET_HEALTHZ_PORT:-10248}"
DOCKER_DATA_ROOT="${KUBESTAR_DOCKER_DATA_ROOT:-$DIR/docker}"
DOCKER_SOCK="$DIR/docker.sock"
DOCKER_EXEC_ROOT="$DIR/run/docker"
# The sandbox image the 1.20 kubelet asks for; a local name only (imported, never pulled).
PAUSE_IMAGE="k8s.gcr.io/pause:3.2"
# Debian's client (20.10) matches the daemon; a newer client on PATH works too.
DOCKER_CLI="${DOCKER_CLI:-$(command -v /usr/bin/docker || command -v docker)}"
CGROUP_ROOT="kubestar-$(printf '%s' "$DIR" | sha256sum | cut -c1-10)"
NODE_READY_TIMEOUT="${NODE_READY_TIMEOUT:-180}"

log() { printf '[node %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

docker_cli() { env -u DOCKER_CONTEXT DOCKER_HOST="unix://$DOCKER_SOCK" "$DOCKER_CLI" "$@"; }
kubectl_admin() { "$BIN/kubectl" --kubeconfig "$DIR/kubeconfig" "$@"; }

stop_pid() { # NAME PID GRACE_SECONDS
    local name="$1" pid="$2" grace="$3" i
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < grace * 10; i++)); do
        [[ -d "/proc/$pid" ]] || break
        sleep 0.1
    done
    if [[ -d "/proc/$pid" ]]; then
        log "$name (pid $pid) did not stop in ${grace}s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
    fi
    log "stopped $name (pid $pid)"
}

stop_one() { # NAME GRACE_SECONDS
    if pid_alive "$1"; then
        stop_pid "$1" "$(cat "$DIR/run/$1.pid")" "$2"
    fi
    rm -f "$DIR/run/$1.pid"
}

# --- dockerd -------------------------------------------------------------------------------
start_dockerd() {
    pid_alive dockerd && return 0
    command -v dockerd >/dev/null || { log "no dockerd: run e2e/local/install.sh"; exit 2; }
    mkdir -p "$DOCKER_DATA_ROOT" "$DOCKER_EXEC_ROOT" "$DIR/logs"
    # Another dockerd of ours on the same data root (KUBESTAR_DOCKER_DATA_ROOT shared between
    # clusters) would corrupt it: refuse.
    local owner="$DOCKER_DATA_ROOT/.kubestar-owner" other
    if [[ -f "$owner" ]]; then
        other="$(cat "$owner")"
        if [[ "$other" != "$DIR" && -f "$other/run/dockerd.pid" ]] \
            && grep -q dockerd "/proc/$(cat "$other/run/dockerd.pid")/cmdline" 2>/dev/null; then
            log "$DOCKER_DATA_ROOT is in use by the dockerd of $other"
            exit 1
        fi
    fi
    echo "$DIR" >"$owner"
    # Its own trust key file (else dockerd 20.10 writes /etc/docker/key.json).
    printf '{"deprecated-key-path": "%s"}\n' "$DIR/run/dockerd-key.json" >"$DIR/run/dockerd.json"
    rm -f "$DOCKER_SOCK"
    # Proxy = a closed local port: a pull fails at once instead of leaving the machine.
    env -u DOCKER_HOST HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 \
        http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 NO_PROXY= no_proxy= \
        dockerd \
        --host "unix://$DOCKER_SOCK" \
        --data-root "$DOCKER_DATA_ROOT" \
        --exec-root "$DOCKER_EXEC_ROOT" \
        --pidfile "$DOCKER_EXEC_ROOT/dockerd.pid" \
        --config-file "$DIR/run/dockerd.json" \
        --bridge=none --iptables=false --ip6tables=false --ip-masq=false --ip-forward=false \
        --oom-score-adjust=0 \
        --exec-opt native.cgroupdriver=cgroupfs \
        --log-driver json-file --log-opt max-size=50m \
        >"$DIR/logs/dockerd.log" 2>&1 &
    record_started dockerd $!
    local deadline=$((SECONDS + 60))
    until docker_cli version >/dev/null 2>&1; do
        if ((SECONDS > deadline)) || ! pid_alive dockerd; then
            log "dockerd did not come up; see $DIR/logs/dockerd.log"
            tail -20 "$DIR/logs/dockerd.log" >&2
            exit 1
        fi
        sleep 0.3
    done
    log "dockerd ready (pid $(cat "$DIR/run/dockerd.pid"), $DOCKER_SOCK, data root $DOCKER_DATA_ROOT)"
}

load_pause() {
    docker_cli image inspect "$PAUSE_IMAGE" >/dev/null 2>&1 && return 0
    [[ -x "$BIN/pause" ]] || { log "no $BIN/pause: run e2e/local/install.sh"; exit 2; }
    local work
    work="$(mktemp -d)"
    install -m 0755 "$BIN/pause" "$work/pause"
    tar -C "$work" -c pause | docker_cli import --change 'ENTRYPOINT ["/pause"]' - "$PAUSE_IMAGE" \
        >/dev/null
    rm -rf "$work"
    log "imported $PAUSE_IMAGE (static pause from the Kubernetes tree)"
}

# --- cgroups -------------------------------------------------------------------------------
cgroup_dirs() { # [all]: every v1 hierarchy's directory for our cgroup root (+ unified: all)
    local d
    for d in /sys/fs/cgroup/*/; do
        [[ -f "$d/cgroup.procs" ]] || continue
        [[ "$d" == /sys/fs/cgroup/unified/ && "${1:-}" != all ]] && continue
        echo "${d%/}/$CGROUP_ROOT"
    done
}

make_cgroup_root() {
    local d parent
    for d in $(cgroup_dirs); do
        mkdir -p "$d"
        parent="$(dirname "$d")"
        # A new cpuset cgroup starts with no CPUs and no memory nodes: inherit the parent's.
        if [[ -f "$d/cpuset.cpus" && -z "$(cat "$d/cpuset.cpus")" ]]; then
            cat "$parent/cpuset.cpus" >"$d/cpuset.cpus"
            cat "$parent/cpuset.mems" >"$d/cpuset.mems"
        fi
    done
}

remove_cgroup_root() {
    local d
    for d in $(cgroup_dirs all); do
        [[ -d "$d" ]] || continue
        # Deepest first; rmdir refuses a cgroup that still has processes.
        find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || true
        [[ -d "$d" ]] && log "cgroup $d not empty; left in place"
    done
    return 0
}

# --- kubelet -------------------------------------------------------------------------------
write_kubelet_config() {
    mkdir -p "$DIR/kubelet/pki" "$DIR/kubelet/volume-plugins" "$DIR/dockershim"
    cat >"$DIR/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $DIR/pki/ca.crt}
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
cgroupRoot: /$CGROUP_ROOT
cgroupsPerQOS: true
enforceNodeAllocatable: [pods]
failSwapOn: false
oomScoreAdj: 0
protectKernelDefaults: false
makeIPTablesUtilChains: false
serializeImagePulls: false
# Relaxed for a VM whose disk is shared with other machines (free space there moves with
# their use): evict only when nearly nothing is left, in absolute terms (1% of a large
# shared disk is gigabytes), and never garbage-collect images (re-importing the kubestar
# image takes minutes).
evictionHard:
  memory.available: 100Mi
  nodefs.available: 512Mi
  nodefs.inodesFree: 1%
  imagefs.available: 512Mi
evictionPressureTransitionPeriod: 30s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
maxPods: 110
clusterDomain: cluster.local
EOF
}

start_kubelet() {
    pid_alive kubelet && return 0
    [[ -f "$DIR/node.kubeconfig" ]] || { log "no $DIR/node.kubeconfig: cluster.sh start first"; exit 2; }
    write_kubelet_config
    make_cgroup_root
    env AWS_EC2_METADATA_DISABLED=true \
        KUBESTAR_KUBELET_KERNEL_TUNABLES_WARN=1 \
        KUBESTAR_KUBELET_CLAMP_OOM_SCORE_ADJ=1 \
        KUBESTAR_KUBELET_ALLOW_LOOPBACK_NODE_IP=1 \
        "$BIN/kubelet" \
        --config "$DIR/kubelet/config.yaml" \
        --kubeconfig "$DIR/node.kubeconfig" \
        --root-dir "$DIR/kubelet" \
        --cert-dir "$DIR/kubelet/pki" \
        --hostname-override "$NODE_NAME" \
        --node-ip 127.0.0.1 \
        --cloud-provider "" \
        --container-runtime docker \
        --docker-endpoint "unix://$DOCKER_SOCK" \
        --docker "unix://$DOCKER_SOCK" \
        --docker-root "$DOCKER_DATA_ROOT" \
        --container-runtime-endpoint "unix://$DIR/run/dockershim.sock" \
        --image-service-endpoint "unix://$DIR/run/dockershim.sock" \
        --experimental-dockershim-root-directory "$DIR/dockershim" \
        --pod-infra-container-image "$PAUSE_IMAGE" \
        --volume-plugin-dir "$DIR/kubelet/volume-plugins" \
        --v 1 \
        >"$DIR/logs/kubelet.log" 2>&1 &
    record_started kubelet $!
}

node_ready() { # [SINCE]: Ready, reported by a kubelet heartbeat at or after SINCE (UTC)
    local got
    got="$(kubectl_admin get node "$NODE_NAME" -o 'jsonpath={range .status.conditions[?(@.type=="Ready")]}{.status} {.lastHeartbeatTime}{end}' 2>/dev/null)"
    [[ "${got%% *}" == True && ! "${got#* }" < "${1:-}" ]]
}

wait_node_ready() {
    local deadline=$((SECONDS + NODE_READY_TIMEOUT)) since="$1"
    until node_ready "$since"; do
        if ((SECONDS > deadline)) || ! pid_alive kubelet; then
            log "node $NODE_NAME not Ready; see $DIR/logs/kubelet.log"
            grep -E '^[EF][0-9]{4}' "$DIR/logs/kubelet.log" | tail -15 >&2 || true
            return 1
        fi
        sleep 0.5
    done
    # The node lifecycle controller lifts the not-ready taint shortly after.
    deadline=$((SECONDS + 60))
    while kubectl_admin get node "$NODE_NAME" -o 'jsonpath={.spec.taints}' 2>/dev/null \
        | grep -q 'node.kubernetes.io/not-ready'; do
        ((SECONDS > deadline)) && { log "node still tainted not-ready"; return 1; }
        sleep 0.5
    done
}

# --- unmount -------------------------------------------------------------------------------
unmount_under() { # PATH: every mount point at or below PATH, deepest first
    local root="$1" mp
    [[ -d "$root" ]] || return 0
    # /proc/self/mountinfo field 5 is the mount point (octal escapes for spaces etc.).
    awk -v r="$root" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo \
        | awk '{ print length($0) " " $0 }' | sort -rn | cut -d' ' -f2- \
        | while read -r mp; do
            mp="$(printf '%b' "$mp")"
            umount "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null \
                || log "could not unmount $mp"
        done
}

# --- pod logs --------------------------------------------------------------------------------
remove_pod_logs() {
    # The 1.20 kubelet keeps pod logs under /var/log/pods and /var/log/containers (fixed paths):
    # symlinks into dockerd's data root. Remove those that point into ours (pods deleted just
    # before a stop are not yet collected); nothing else there is touched.
    local link dir target ours
    for link in /var/log/containers/*.log; do
        [[ -L "$link" ]] || continue
        [[ "$(readlink "$link")" == /var/log/pods/* || "$(readlink "$link")" == "$DOCKER_DATA_ROOT"/* ]] \
            || continue
        target="$(readlink "$link")"
        if [[ "$target" == /var/log/pods/* ]]; then
            target="$(readlink "$target" 2>/dev/null || true)"
            [[ "$target" == "$DOCKER_DATA_ROOT"/* ]] || continue
        fi
        rm -f "$link"
    done
    for dir in /var/log/pods/*/; do
        [[ -d "$dir" ]] || continue
        ours=1
        while IFS= read -r -d '' link; do
            if [[ ! -L "$link" || "$(readlink "$link")" != "$DOCKER_DATA_ROOT"/* ]]; then
                ours=0
                break
            fi
        done < <(find "$dir" -mindepth 2 -maxdepth 2 -print0)
        # Only a folder holding nothing but links into our data root (or empty folders).
        ((ours)) && find "$dir" -mindepth 2 -maxdepth 2 -print -quit | grep -q . \
            && rm -rf "${dir%/}"
    done
    # Pods deleted just before the stop: the kubelet removed their containers' links but not
    # yet their (now empty) folders. Those that appeared while this node ran (not in the
    # listing taken at its start) and hold nothing but empty folders are ours.
    local before="$DIR/run/pod-logs-before"
    if [[ -f "$before" ]]; then
        for dir in /var/log/pods/*/; do
            [[ -d "$dir" ]] || continue
            grep -qxF "$(basename "$dir")" "$before" && continue
            find "$dir" -mindepth 1 ! -type d -print -quit | grep -q . && continue
            rm -rf "${dir%/}"
        done
        rm -f "$before"
    fi
    return 0
}

remove_device_plugin_socket() {
    # The 1.20 kubelet's device-plugin socket has a fixed path. Once no process listens on it
    # (ours has stopped), remove it, the note beside it and the folders if that empties them.
    local dp=/var/lib/kubelet/device-plugins
    [[ -S "$dp/kubelet.sock" ]] || return 0
    ss -xl 2>/dev/null | grep -q "$dp/kubelet.sock" && return 0
    rm -f "$dp/kubelet.sock" "$dp/DEPRECATION"
    rmdir "$dp" /var/lib/kubelet 2>/dev/null || true
}

# --- actions -------------------------------------------------------------------------------
start() {
    "$HERE/install.sh" --check || { log "binaries missing: run e2e/local/install.sh"; exit 2; }
    kubectl_admin get --raw /readyz >/dev/null 2>&1 \
        || { log "the control plane of $DIR is not running (cluster.sh start $DIR)"; exit 2; }
    mkdir -p "$DIR/run" "$DIR/logs"
    local started=$SECONDS since
    since="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    # What /var/log/pods (a fixed path in 1.20) held before this node ran: stop leaves it so.
    [[ -f "$DIR/run/pod-logs-before" ]] || ls -1 /var/log/pods 2>/dev/null >"$DIR/run/pod-logs-before" || true
    start_dockerd
    load_pause
    start_kubelet
    wait_node_ready "$since" || exit 1
    log "node $NODE_NAME Ready in $((SECONDS - started)) s"
}

stop() {
    stop_one kubelet 20
    if pid_alive dockerd; then
        # Only containers of our own dockerd (its own socket): the pods' containers.
        local ids
        ids="$(docker_cli ps -aq 2>/dev/null || true)"
        if [[ -n "$ids" ]]; then
            # shellcheck disable=SC2086
            docker_cli rm -f $ids >/dev/null 2>&1 || true
            log "removed $(wc -w <<<"$ids") container(s)"
        fi
    fi
    # dockerd's managed containerd, in case dockerd cannot stop it (recorded by dockerd).
    local containerd_pid=""
    [[ -f "$DOCKER_EXEC_ROOT/containerd/containerd.pid" ]] \
        && containerd_pid="$(cat "$DOCKER_EXEC_ROOT/containerd/containerd.pid")"
    stop_one dockerd 30
    if [[ -n "$containerd_pid" && -d "/proc/$containerd_pid" ]] \
        && grep -q "$DOCKER_EXEC_ROOT" "/proc/$containerd_pid/cmdline" 2>/dev/null; then
        stop_pid containerd "$containerd_pid" 10
    fi
    unmount_under "$DIR"
    [[ "$DOCKER_DATA_ROOT" == "$DIR"/* ]] || unmount_under "$DOCKER_DATA_ROOT"
    remove_cgroup_root
    remove_pod_logs
    remove_device_plugin_socket
    # containerd's shim sockets live in a fixed folder; drop it if that left it empty.
    rmdir /run/containerd/s /run/containerd 2>/dev/null || true
    rm -f "$DOCKER_SOCK" "$DIR/run/dockershim.sock"
}

status() {
    local name rc=0
    for name in dockerd kubelet; do
        if pid_alive "$name"; then
            echo "$name: running (pid $(cat "$DIR/run/$name.pid"))"
        else
            echo "$name: stopped"
            rc=1
        fi
    done
    if node_ready; then echo "node $NODE_NAME: Ready"; else echo "node $NODE_NAME: not Ready"; fi
    return $rc
}

case "$ACTION" in
start) start ;;
stop) stop ;;
status) status ;;
docker)
    shift 2
    docker_cli "$@"
    ;;
*)
    echo "usage: $0 start|stop|status|docker [DIR] [ARGS...]" >&2
    exit 2
    ;;
esac
