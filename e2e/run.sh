#!/usr/bin/env bash
# The end-to-end suite (e2e/tests) on a cluster made by a provider, which is always removed
# again, also when a test fails or the run is interrupted:
#
#   e2e/run.sh [local] [PYTEST ARGS...]   # a local cluster from distribution packages
#                                         # (e2e/local/run.sh; `make e2e`)
#   e2e/run.sh kind [PYTEST ARGS...]      # kind + Docker (e2e/kind/run.sh)
#
# On a cluster you already have: KUBECONFIG=... KUBESTAR_E2E_HELM_ARGS='--set ...' \
#   .venv/bin/python -m pytest e2e/tests   (see e2e/tests/conftest.py for the settings).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
provider="${1:-local}"
case "$provider" in
local | kind)
    shift $(($# > 0 ? 1 : 0))
    exec "$HERE/$provider/run.sh" "$@"
    ;;
-*) exec "$HERE/local/run.sh" "$@" ;;
*)
    echo "usage: $0 [local|kind] [pytest args...]" >&2
    exit 2
    ;;
esac
