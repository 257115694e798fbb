# shellcheck shell=bash
# The daemons a local cluster runs, known by PID files under $DIR/run (sourced by cluster.sh
# and node.sh; needs DIR).

pid_alive() { # NAME: its recorded PID still runs the binary we started (PIDs get reused)
    local name="$1" pidfile="$DIR/run/$1.pid" pid
    [[ -f "$pidfile" ]] || return 1
    pid="$(cat "$pidfile")"
    [[ -n "$pid" && -d "/proc/$pid" ]] && grep -q "$name" "/proc/$pid/cmdline" 2>/dev/null
}

record_started() { # NAME PID: record PID once it runs NAME (or is gone)
    # A forked child shows this shell's command line until it has exec'd; on a loaded
    # machine that takes a while, and pid_alive would take the daemon for exited.
    local name="$1" pid="$2" i
    for ((i = 0; i < 100; i++)); do
        grep -q "$name" "/proc/$pid/cmdline" 2>/dev/null && break
        [[ -d "/proc/$pid" ]] || break
        sleep 0.1
    done
    echo "$pid" >"$DIR/run/$name.pid"
}
