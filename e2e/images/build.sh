#!/usr/bin/env bash
# Build the one kubestar image, kubestar/kubestar:dev, with no registry and no Dockerfile, into
# the dockerd of the local node (e2e/local/node.sh). The operator, sandbox, scheduler, trainer
# and the CPU rollout engine all run it.
#
#   e2e/images/build.sh            # build (or skip: same content key) and load into dockerd
#   e2e/images/build.sh --check    # exit 0 if dockerd has the image with the current key
#   e2e/images/build.sh --key      # print the content key and exit
#
# How, in two layers so that a change of the project's code costs seconds, not minutes:
#   1. kubestar/kubestar-base:<base key>: `debootstrap --variant=minbase bookworm` (the
#      runtime libraries Python and the wheels need) into $KUBESTAR_ROOTFS_CACHE
#      (~/.cache/kubestar/rootfs/bookworm-minbase, reused), then ONE tar stream of that root
#      plus the Python the venv was made from (readlink -f $VENV/bin/python: its prefix, less
#      its own site-packages and test suite) at the same absolute path as on this machine,
#      the project venv ($KUBESTAR_VENV, default the checkout's .venv: torch, vLLM's CPU
#      build, Ray, kubestar editable) moved to /opt/kubestar/venv, and the model cache
#      (~/.cache/kubestar/models:
#      SmolLM2-135M-Instruct, prepared first if missing, and the tiny test models) at
#      /opt/kubestar/cache/models with KUBESTAR_CACHE set, so that
#      kubestar.engine.models.resolve_model finds them; `docker import` reads the stream.
#      HOME=/tmp (pods run as non-root uids), Hugging Face offline.
#   2. kubestar/kubestar:dev: FROM that base, the package sources the editable install points
#      at (operator/, services/, training/, protos/ package folders, generated gRPC stubs
#      included) moved to /opt/kubestar/src, with the venv's scripts and editable-install
#      finder rewritten for the new paths, as one small layer, by the classic builder
#      (DOCKER_BUILDKIT=0).
#
# Why moved: the checkout may be anywhere (under /tmp, say), and pods mount an emptyDir over
# /tmp; a venv or sources kept at such a path would vanish in every pod.
#
# Keys: the base key hashes this script, the base root's recipe and the listings (path, size,
# mtime) of the Python prefix, the venv and the models; the image's content key hashes the
# base key and the sources' contents. Labels dev.kubestar.base-key / dev.kubestar.content-key
# carry them; an unchanged key means nothing to do. Older bases and untagged images are
# removed from the node's dockerd after a build.
#
# dockerd: $DOCKER_HOST if set, else the node's socket $KUBESTAR_CLUSTER_DIR/docker.sock
# (default ~/.cache/kubestar/cluster/docker.sock; start it with
# `KUBESTAR_WITH_NODE=1 e2e/local/cluster.sh start`). Needs root (debootstrap).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd -P)"
IMAGE="${KUBESTAR_IMAGE:-kubestar/kubestar:dev}"
# The big layer (Debian root, Python, venv, models), tagged by its own key.
BASE_IMAGE="${KUBESTAR_BASE_IMAGE:-kubestar/kubestar-base}"
ROOTFS="${KUBESTAR_ROOTFS_CACHE:-$HOME/.cache/kubestar/rootfs/bookworm-minbase}"
VENV="$(cd "${KUBESTAR_VENV:-$ROOT/.venv}" && pwd -P)"
MODELS="${KUBESTAR_IMAGE_MODELS:-$HOME/.cache/kubestar/models}"
CLUSTER_DIR="${KUBESTAR_CLUSTER_DIR:-$HOME/.cache/kubestar/cluster}"
export DOCKER_HOST="${DOCKER_HOST:-unix://$CLUSTER_DIR/docker.sock}"
DOCKER_CLI="${DOCKER_CLI:-$(command -v /usr/bin/docker || command -v docker)}"
SUITE=bookworm
# Runtime libraries of CPython and the wheels (ssl, ffi, sqlite, compression, readline, uuid,
# OpenMP, NUMA for vLLM's CPU build), libseccomp for the sandbox's syscall filter,
# certificates, and ps for debugging.
BASE_PACKAGES="libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,zlib1g,libreadline8,libncursesw6,libuuid1,libexpat1,libgdbm6,libnsl2,libtirpc3,libgomp1,libnuma1,libseccomp2,ca-certificates,procps"
BASE_RECIPE="debootstrap-minbase-$SUITE+$BASE_PACKAGES+users-65532-1000+v1"
IMAGE_ROOT=/opt/kubestar # in the image: cache/models, venv, src
IMAGE_VENV="$IMAGE_ROOT/venv"
IMAGE_SRC="$IMAGE_ROOT/src" # the checkout's package folders, at their paths below it

log() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
docker_cli() { env -u DOCKER_CONTEXT "$DOCKER_CLI" "$@"; }

[[ -x "$VENV/bin/python" ]] || { log "no venv at $VENV (make setup)"; exit 2; }
PYTHON_BIN="$(readlink -f "$VENV/bin/python")"
PY_PREFIX="$(dirname "$(dirname "$PYTHON_BIN")")"
PY_VER="$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"

# The package folders of the editable install (empty when kubestar is installed normally).
source_dirs() {
    "$VENV/bin/python" - <<'PY'
import ast, glob, os, sys
site = [p for p in sys.path if p.endswith("site-packages")][0]
for finder in glob.glob(os.path.join(site, "__editable___kubestar_*_finder.py")):
    tree = ast.parse(open(finder).read())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") in ("MAPPING", "NAMESPACES"):
            value = ast.literal_eval(node.value)
            for paths in value.values():
                for path in [paths] if isinstance(paths, str) else paths:
                    if os.path.isdir(path):
                        print(os.path.realpath(path))
PY
}
mapfile -t SOURCES < <(source_dirs | sort -u)
for dir in "${SOURCES[@]}"; do
    [[ "$dir" == "$ROOT"/* ]] || { log "$dir: an editable source outside the checkout $ROOT"; exit 2; }
done

# --- the model cache -------------------------------------------------------------------------
ensure_models() {
    if [[ ! -f "$MODELS/SmolLM2-135M-Instruct/model.safetensors" ]]; then
        log "preparing SmolLM2-135M-Instruct into $MODELS (once)"
        KUBESTAR_CACHE="$(dirname "$MODELS")" "$VENV/bin/python" -c \
            'from kubestar.engine.models import prepare_default_model as p; print(p())'
    fi
}

# --- content keys ----------------------------------------------------------------------------
listing() { # DIR [find args...]: path size mtime of every file and link
    local dir="$1"
    shift
    (cd "$dir" && find . "$@" \( -type f -o -type l \) -printf '%P %s %T@\n' | LC_ALL=C sort)
}

base_key() { # the imported layer: base root, Python, venv, models
    {
        sha256sum "$HERE/build.sh" | cut -d' ' -f1
        echo "$BASE_RECIPE $PY_PREFIX $VENV $IMAGE_VENV"
        listing "$PY_PREFIX" -path "./lib/python$PY_VER/site-packages" -prune -o \
            -path "./lib/python$PY_VER/test" -prune -o -name __pycache__ -prune -o
        # .pyc files come and go as Python runs: they do not change the image's behaviour.
        listing "$VENV" -name __pycache__ -prune -o
        listing "$MODELS" -name '*.tmp-*' -prune -o
        printf '%s\n' "${SOURCES[@]}"
    } | sha256sum | cut -c1-16
}

content_key() { # BASE_KEY: the final image = base + the package sources' contents
    {
        echo "$1 $IMAGE"
        local dir
        for dir in "${SOURCES[@]}"; do
            echo "source $dir"
            (cd "$dir" && find . -name __pycache__ -prune -o -type f -print0 | LC_ALL=C sort -z \
                | xargs -0 -r sha256sum)
        done
    } | sha256sum | cut -c1-16
}

image_label() { # IMAGE LABEL
    docker_cli image inspect "$1" --format "{{ index .Config.Labels \"$2\" }}" 2>/dev/null || true
}

# --- the base root -----------------------------------------------------------------------------
debian_mirror() {
    # The machine's own Debian archive (deb822 or one-line sources), never a built-in address.
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f "$f" ]] || continue
        awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i ~ /debian\/?$/) { print $i; exit } }' "$f"
    done | head -1 | grep . && return 0
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f "$f" ]] || continue
        awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\/.*debian\/?$/) { print $i; exit } }' "$f"
    done | head -1 | grep .
}

unmount_under() { # PATH: debootstrap mounts proc and sys in the target; never rm through them
    local mp
    awk -v r="$1" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo \
        | sort -r | while read -r mp; do umount "$mp" 2>/dev/null || umount -l "$mp"; done
}

ensure_base() {
    if [[ "$(cat "$ROOTFS/.kubestar-recipe" 2>/dev/null)" == "$BASE_RECIPE" ]]; then
        return 0
    fi
    command -v debootstrap >/dev/null || { log "no debootstrap: run e2e/local/install.sh"; exit 2; }
    local mirror started=$SECONDS
    mirror="$(debian_mirror)" || { log "no Debian archive in the apt sources"; exit 2; }
    log "debootstrap --variant=minbase $SUITE into $ROOTFS"
    unmount_under "$ROOTFS.tmp"
    rm -rf "$ROOTFS.tmp"
    mkdir -p "$(dirname "$ROOTFS")"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$ROOTFS.tmp" "$mirror" \
        >"$(dirname "$ROOTFS")/debootstrap.log" 2>&1 \
        || {
            unmount_under "$ROOTFS.tmp"
            log "debootstrap failed"
            tail -20 "$(dirname "$ROOTFS")/debootstrap.log" >&2
            exit 1
        }
    unmount_under "$ROOTFS.tmp"
    (
        cd "$ROOTFS.tmp"
        rm -rf var/cache/apt/archives/*.deb var/lib/apt/lists/* dev/* proc/* sys/* run/*
        # Pods run as non-root uids: 65532 (operator, sandbox) and 1000 (trainer).
        grep -q '^nonroot:' etc/group || echo 'nonroot:x:65532:' >>etc/group
        grep -q '^nonroot:' etc/passwd \
            || echo 'nonroot:x:65532:65532:nonroot:/tmp:/usr/sbin/nologin' >>etc/passwd
        grep -q '^kubestar:' etc/group || echo 'kubestar:x:1000:' >>etc/group
        grep -q '^kubestar:' etc/passwd \
            || echo 'kubestar:x:1000:1000:kubestar:/tmp:/usr/sbin/nologin' >>etc/passwd
        # The host paths below /root must be reachable by those uids.
        chmod 0755 root
    )
    echo "$BASE_RECIPE" >"$ROOTFS.tmp/.kubestar-recipe"
    unmount_under "$ROOTFS"
    rm -rf "$ROOTFS"
    mv "$ROOTFS.tmp" "$ROOTFS"
    log "base root ready in $((SECONDS - started)) s ($(du -sh "$ROOTFS" | cut -f1))"
}

# Parent folders of the host paths, world-readable (the image's /root is 0755 too), and the
# models with world-readable modes (the cache may hold 0600 files).
stage_extras() {
    local dir
    mkdir -p "$ROOTFS$(dirname "$PY_PREFIX")"
    find "$ROOTFS/root" -type d -exec chmod 0755 {} + 2>/dev/null || true
    mkdir -p "$ROOTFS$IMAGE_ROOT/cache"
    rsync -a --delete --exclude '*.tmp-*' --chmod=Da+rx,Fa+r "$MODELS/" \
        "$ROOTFS$IMAGE_ROOT/cache/models/"
}

# --- the two layers ----------------------------------------------------------------------------
import_base() { # KEY: base root + Python + venv + models, one tar stream into `docker import`
    local key="$1" started=$SECONDS
    ensure_base
    stage_extras
    log "importing $BASE_IMAGE:$key: base root + $PY_PREFIX + $VENV (as $IMAGE_VENV) + models"
    # Member names relative to / so that paths in the image equal the paths here.
    tar -c -f - --numeric-owner --anchored \
        -C "$ROOTFS" --exclude ./.kubestar-recipe . \
        -C / \
        --exclude "${PY_PREFIX#/}/lib/python$PY_VER/site-packages" \
        --exclude "${PY_PREFIX#/}/lib/python$PY_VER/test" \
        --transform "s|^${VENV#/}|${IMAGE_VENV#/}|S" \
        "${PY_PREFIX#/}" "${VENV#/}" \
        | docker_cli import \
            --change "ENV PATH=$IMAGE_VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
            --change "ENV VIRTUAL_ENV=$IMAGE_VENV" \
            --change "ENV HOME=/tmp" \
            --change "ENV LANG=C.UTF-8" \
            --change "ENV KUBESTAR_CACHE=$IMAGE_ROOT/cache" \
            --change "ENV HF_HUB_OFFLINE=1" \
            --change "ENV TRANSFORMERS_OFFLINE=1" \
            --change "ENV VLLM_NO_USAGE_STATS=1" \
            --change "ENV DO_NOT_TRACK=1" \
            --change "ENV RAY_USAGE_STATS_ENABLED=0" \
            --change "WORKDIR /tmp" \
            --change 'CMD ["kubestar", "--help"]' \
            --change "LABEL dev.kubestar.base-key=$key" \
            - "$BASE_IMAGE:$key" >/dev/null
    log "imported $BASE_IMAGE:$key in $((SECONDS - started)) s"
}

relocated_files() { # DIR: the venv's scripts and editable finder, rewritten for the image's paths
    local out="$1" file target
    while IFS= read -r file; do
        target="$out$IMAGE_VENV/${file#"$VENV"/}"
        mkdir -p "$(dirname "$target")"
        sed -e "s|$VENV/|$IMAGE_VENV/|g" -e "s|$ROOT/|$IMAGE_SRC/|g" "$file" >"$target"
        chmod --reference="$file" "$target"
    done < <(grep -IlF -e "$VENV/" -e "$ROOT/" "$VENV"/bin/* \
        "$VENV"/lib/python"$PY_VER"/site-packages/__editable__*kubestar* 2>/dev/null)
}

build_sources() { # BASE_KEY KEY: the package sources as one small layer (classic builder)
    local base="$1" key="$2" work
    work="$(mktemp -d)"
    tar -c -f "$work/sources.tar" --numeric-owner --anchored --exclude '*/__pycache__' \
        --transform "s|^${ROOT#/}/|${IMAGE_SRC#/}/|S" -C / "${SOURCES[@]#/}"
    relocated_files "$work/relocated"
    tar -c -f "$work/relocated.tar" --numeric-owner -C "$work/relocated" "${IMAGE_VENV#/}"
    cat >"$work/Dockerfile" <<EOF
FROM $BASE_IMAGE:$base
ADD sources.tar /
ADD relocated.tar /
LABEL dev.kubestar.content-key=$key
EOF
    tar -c -C "$work" Dockerfile sources.tar relocated.tar \
        | DOCKER_BUILDKIT=0 docker_cli build --quiet --tag "$IMAGE" - >/dev/null
    rm -rf "$work"
}

# --- main ----------------------------------------------------------------------------------------
case "${1:-}" in
--key)
    ensure_models
    content_key "$(base_key)"
    exit 0
    ;;
--check)
    ensure_models >/dev/null
    [[ "$(image_label "$IMAGE" dev.kubestar.content-key)" == "$(content_key "$(base_key)")" ]] \
        && exit 0 || exit 1
    ;;
"") ;;
*)
    echo "usage: $0 [--check|--key]" >&2
    exit 2
    ;;
esac

docker_cli version >/dev/null 2>&1 || {
    log "no dockerd at $DOCKER_HOST: start the node (KUBESTAR_WITH_NODE=1 e2e/local/cluster.sh start)"
    exit 2
}
started=$SECONDS
ensure_models
base="$(base_key)"
key="$(content_key "$base")"
if [[ "$(image_label "$IMAGE" dev.kubestar.content-key)" == "$key" ]]; then
    log "$IMAGE is up to date (content key $key)"
    exit 0
fi
[[ "$(image_label "$BASE_IMAGE:$base" dev.kubestar.base-key)" == "$base" ]] || import_base "$base"
build_sources "$base" "$key"
# Older bases and the images they left untagged go: each is gigabytes. (An image a
# container still uses stays.)
for old in $(docker_cli image ls "$BASE_IMAGE" --format '{{.Tag}}'); do
    [[ "$old" == "$base" ]] || docker_cli image rm "$BASE_IMAGE:$old" >/dev/null 2>&1 || true
done
# Dangling images are pruned only in the node's own dockerd, never in a shared Docker (kind).
if [[ "$DOCKER_HOST" == "unix://$CLUSTER_DIR/docker.sock" ]]; then
    docker_cli image prune --force >/dev/null 2>&1 || true
fi
size="$(docker_cli image inspect "$IMAGE" --format '{{.Size}}')"
log "$IMAGE (key $key, base $BASE_IMAGE:$base) ready in $((SECONDS - started)) s, $((size / 1000000)) MB"
