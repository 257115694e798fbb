"""The e2e harness's cluster start (start_cluster in e2e/lib.sh), against a stand-in for
e2e/local/cluster.sh that records what it was asked and fails the starts it is told to: a
start that fails is tried once more after a full stop, and each failed try's logs are kept."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Each start appends to calls and writes a log; it fails while `failures` has a line left.
CLUSTER_SH = """#!/usr/bin/env bash
set -u
echo "$1 $(basename "$2") etcd=$([[ -e "$2/etcd" ]] && echo left || echo wiped)" >> "$2/calls"
if [[ "$1" == start ]]; then
    mkdir -p "$2/logs" "$2/etcd"
    echo "kubelet log of start $(grep -c ^start "$2/calls")" > "$2/logs/kubelet.log"
    if [[ -s "$2/failures" ]]; then sed -i 1d "$2/failures"; exit 1; fi
fi
"""


def start_cluster(tmp_path: Path, failures: int) -> tuple[int, list[str], Path]:
    script = tmp_path / "cluster.sh"
    script.write_text(CLUSTER_SH)
    script.chmod(0o755)
    cluster, out = tmp_path / "cluster", tmp_path / "out"
    (cluster / "etcd").mkdir(parents=True)  # a previous run's state
    (cluster / "failures").write_text("x\n" * failures)
    out.mkdir()
    harness = f'LOG_TAG=test; OUT={out}; source {REPO}/e2e/lib.sh; start_cluster "$@"'
    done = subprocess.run(
        ["bash", "-c", harness, "harness", str(script), str(cluster)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, (cluster / "calls").read_text().splitlines(), out


def test_a_start_that_fails_once_is_tried_again_with_its_logs_kept(tmp_path: Path) -> None:
    code, calls, out = start_cluster(tmp_path, failures=1)
    assert code == 0
    # Each start from an empty etcd; the failed one stopped in full before the next.
    assert calls == [
        "start cluster etcd=wiped",
        "stop cluster etcd=left",
        "start cluster etcd=wiped",
    ]
    assert (out / "cluster-start-1" / "kubelet.log").read_text() == "kubelet log of start 1\n"
    assert not (out / "cluster-start-2").exists()


def test_a_start_that_fails_twice_fails_with_both_logs(tmp_path: Path) -> None:
    code, calls, out = start_cluster(tmp_path, failures=2)
    assert code == 1
    assert [call.split()[0] for call in calls] == ["start", "stop", "start", "stop"]
    for attempt in (1, 2):
        kept = (out / f"cluster-start-{attempt}" / "kubelet.log").read_text()
        assert kept == f"kubelet log of start {attempt}\n"


def test_a_start_that_succeeds_is_not_repeated(tmp_path: Path) -> None:
    code, calls, out = start_cluster(tmp_path, failures=0)
    assert code == 0 and calls == ["start cluster etcd=wiped"]
    assert list(out.iterdir()) == []
