# The harness e2e/local/run.sh and e2e/kind/run.sh share: timed steps into timings.txt, the
# pytest run of e2e/tests, and a teardown that ALWAYS runs (on exit, on a failed test, on
# Ctrl-C or a CI timeout). Source it after setting ROOT, OUT, PYTHON and LOG_TAG, then:
#
#   e2e_output                  # create OUT, start timings.txt and the clock
#   e2e_traps TEARDOWN          # TEARDOWN (a function) runs once at the end; non-zero fails
#   step NAME COMMAND...        # run and time a step
#   step "suite (...)" e2e_suite [PYTEST ARGS...]
#   start_cluster CLUSTER_SH DIR  # CLUSTER_SH start DIR, tried once more after a full stop
# shellcheck shell=bash

log() { printf '[%s %s] %s\n' "$LOG_TAG" "$(date +%H:%M:%S)" "$*" >&2; }

e2e_output() {
    mkdir -p "$OUT"
    OUT="$(cd "$OUT" && pwd)"
    TIMINGS="$OUT/timings.txt"
    : >"$TIMINGS"
    E2E_STARTED=$SECONDS
}

step() { # NAME COMMAND...: run, time it into timings.txt
    local name="$1" began=$SECONDS rc=0
    shift
    log "$name"
    "$@" || rc=$?
    printf '%-28s %5d s%s\n' "$name" $((SECONDS - began)) "$([[ $rc == 0 ]] || echo "  (exit $rc)")" \
        | tee -a "$TIMINGS" >&2
    return $rc
}

E2E_CLEANED=0
_e2e_cleanup() {
    local rc=$?
    ((E2E_CLEANED)) && return 0
    E2E_CLEANED=1
    trap - INT TERM
    "$E2E_TEARDOWN" || rc=1
    printf '%-28s %5d s\n' "total" $((SECONDS - E2E_STARTED)) | tee -a "$TIMINGS" >&2
    if [[ "$rc" == 0 ]]; then log "PASSED; output in $OUT"; else log "FAILED ($rc); output in $OUT"; fi
    exit "$rc"
}

# A signal stops the suite (started in the background, so that the trap runs at once instead
# of after pytest), then the EXIT trap tears down.
E2E_SUITE_PID=""
_e2e_on_signal() {
    [[ -n "$E2E_SUITE_PID" ]] && kill -TERM "$E2E_SUITE_PID" 2>/dev/null
    exit "$1"
}

e2e_traps() {
    E2E_TEARDOWN="$1"
    trap _e2e_cleanup EXIT
    trap '_e2e_on_signal 130' INT
    trap '_e2e_on_signal 143' TERM
}

e2e_suite() { # [PYTEST ARGS...]: e2e/tests against the KUBECONFIG and helm args exported
    cd "$ROOT"
    # A journey step (the fault run, an upgrade mid-run) takes minutes, more under load: the
    # unit suite's 15-minute limit a test would fail it on a busy machine.
    "$PYTHON" -m pytest e2e/tests -v -p no:cacheprovider --durations=0 --timeout 2700 \
        -o junit_family=xunit2 --junitxml="$OUT/junit.xml" "$@" > >(tee "$OUT/pytest.txt") 2>&1 &
    E2E_SUITE_PID=$!
    wait "$E2E_SUITE_PID"
}

start_cluster() { # CLUSTER_SH DIR: start the cluster of DIR from an empty etcd
    # A start that fails (a daemon that exits at once, a node never Ready) is tried once more
    # after a full stop, each failed try's logs kept in OUT/cluster-start-N: one flake at
    # cluster start must not cost the whole suite.
    local cluster_sh="$1" dir="$2" attempt
    for attempt in 1 2; do
        rm -rf "$dir/etcd"
        if "$cluster_sh" start "$dir"; then return 0; fi
        mkdir -p "$OUT/cluster-start-$attempt"
        cp -r "$dir/logs/." "$OUT/cluster-start-$attempt/" 2>/dev/null || true
        log "cluster start $attempt failed (logs in $OUT/cluster-start-$attempt); stopping it"
        "$cluster_sh" stop "$dir" || true
    done
    return 1
}
