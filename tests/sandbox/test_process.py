"""`kubestar sandbox serve|exec` as separate processes: metrics, SIGTERM drain, the CLI."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubestar.common.net import free_port
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.sandbox.server import SERVICE_NAME
from kubestar.v1 import sandbox_pb2 as pb

from tests.sandbox.support import (
    ServerProcess,
    assert_still_serving,
    cli_command,
    process_alive,
)

OK = pb.EXECUTION_STATUS_OK


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(log_dir: Path, metrics_port: int) -> Iterator[ServerProcess]:
    process = ServerProcess(log_dir, "--metrics-port", str(metrics_port), executors=2)
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_endpoint(worker: ServerProcess, metrics_port: int) -> None:
    with SandboxClient(worker.endpoint, timeout=60) as client:
        before = scrape(metrics_port)
        results = client.execute_batch(["print(1)", "print(2)", "raise SystemExit(3)", ""])
        assert [result.status for result in results] == [
            OK,
            OK,
            pb.EXECUTION_STATUS_ERROR,
            pb.EXECUTION_STATUS_INVALID,
        ]
    after = scrape(metrics_port)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew('kubestar_sandbox_results_total{status="ok"}') == 2
    assert grew('kubestar_sandbox_results_total{status="error"}') == 1
    assert grew('kubestar_sandbox_results_total{status="invalid"}') == 1
    assert grew("kubestar_sandbox_call_seconds_count") == 4
    assert after["kubestar_sandbox_capacity"] == 2
    assert after["kubestar_sandbox_in_flight"] == 0
    assert after["kubestar_sandbox_queue_depth"] == 0
    for name in ("kubestar_sandbox_retries_total", "kubestar_sandbox_executor_restarts_total"):
        assert name in after
    assert any(name.startswith("kubestar_sandbox_call_seconds_bucket") for name in after)


def test_health_of_a_worker_process(worker: ServerProcess) -> None:
    with grpc.insecure_channel(worker.endpoint) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_preload_option_decides_what_executors_import(worker: ServerProcess) -> None:
    # Regression: the numpy/sympy warm-up ran (importing both) whatever --preload said.
    with SandboxClient(worker.endpoint, timeout=60) as client:
        result = client.execute("import sys\nprint('glob' in sys.modules, 'numpy' in sys.modules)")
    assert (result.status, result.stdout) == (OK, "True False\n"), result


class TestExecCommand:
    def run_cli(
        self, worker: ServerProcess, *args: str, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cli_command("sandbox", "exec", "--endpoint", worker.endpoint, *args),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def test_file(self, worker: ServerProcess, tmp_path: Path) -> None:
        source = tmp_path / "hello.py"
        source.write_text(
            "import sys\nprint('hello from a file')\nprint('note', file=sys.stderr)\n"
        )
        done = self.run_cli(worker, str(source))
        assert done.returncode == 0, done.stderr
        assert done.stdout == "hello from a file\n"
        assert done.stderr == "note\n"

    def test_code_on_stdin_with_input(self, worker: ServerProcess) -> None:
        done = self.run_cli(
            worker, "--stdin", "abc", "-", stdin="import sys\nprint(sys.stdin.read()[::-1])\n"
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == "cba\n"

    def test_code_on_stdin_by_default(self, worker: ServerProcess) -> None:
        done = self.run_cli(worker, stdin="print(2 ** 10)\n")
        assert (done.returncode, done.stdout) == (0, "1024\n")

    def test_error_exits_1(self, worker: ServerProcess) -> None:
        done = self.run_cli(worker, "-", stdin="print('before')\nraise KeyError('k')\n")
        assert done.returncode == 1
        assert done.stdout == "before\n"
        assert "KeyError: 'k'" in done.stderr
        assert "[error] exited with code 1" in done.stderr

    def test_timeout_option(self, worker: ServerProcess) -> None:
        done = self.run_cli(worker, "--timeout", "0.5", "-", stdin="import time\ntime.sleep(30)\n")
        assert done.returncode == 1
        assert "[timeout]" in done.stderr

    def test_memory_option(self, worker: ServerProcess) -> None:
        done = self.run_cli(worker, "--memory-mb", "64", "-", stdin="x = bytearray(512 << 20)\n")
        assert done.returncode == 1
        assert "[memory]" in done.stderr

    def test_invalid_exits_1(self, worker: ServerProcess) -> None:
        done = self.run_cli(worker, "-", stdin="   \n")
        assert done.returncode == 1
        assert "[invalid] code is empty" in done.stderr

    def test_json(self, worker: ServerProcess) -> None:
        done = self.run_cli(worker, "--json", "-", stdin="print('json out')\n")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["id"] == "cli"
        assert result["status"] == "ok"
        assert result["stdout"] == "json out\n"
        assert result["exit_code"] == 0
        assert result["wall_ms"] > 0
        assert result["attempts"] == 1
        assert re.fullmatch(r"worker/executor-\d(/light)?", result["executor"])

    def test_json_error(self, worker: ServerProcess) -> None:
        done = self.run_cli(worker, "--json", "-", stdin="import sys\nsys.exit(4)\n")
        assert done.returncode == 1
        result = json.loads(done.stdout)
        assert (result["status"], result["exit_code"]) == ("error", 4)
        assert result["message"] == "exited with code 4"

    def test_unreachable_endpoint(self) -> None:
        done = subprocess.run(
            cli_command("sandbox", "exec", "--endpoint", f"127.0.0.1:{free_port()}", "-"),
            input="print(1)\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0
        assert done.stdout == ""

    def test_worker_still_serves(self, worker: ServerProcess) -> None:
        with SandboxClient(worker.endpoint, timeout=60) as client:
            assert_still_serving(client)


def health_status(endpoint: str) -> int:
    with grpc.insecure_channel(endpoint) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
        )
    status: int = response.status
    return status


def test_sigterm_drains_running_calls(log_dir: Path) -> None:
    server = ServerProcess(log_dir, "--drain-seconds", "20", executors=1)
    try:
        server.wait_ready()
        descendants = server._descendants
        slow = Call(id="slow", code="import time\ntime.sleep(1.5)\nprint('finished')")
        with SandboxClient(server.endpoint, timeout=60) as client, ThreadPoolExecutor(1) as bg:
            running = bg.submit(client.execute, slow)
            deadline = time.monotonic() + 10
            while client.capacity().in_flight < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            server.process.send_signal(signal.SIGTERM)
            # While draining: unhealthy, new calls refused, the running call goes on.
            deadline = time.monotonic() + 5
            while health_status(server.endpoint) != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            refused = client.execute("print('too late')")
            assert server.process.poll() is None  # draining, not gone
            assert refused.status == pb.EXECUTION_STATUS_INTERNAL
            assert "shutting down" in refused.message
            result = running.result(timeout=30)
        assert (result.status, result.stdout, result.id) == (OK, "finished\n", "slow")
        assert server.process.wait(timeout=20) == 0
        for pid in descendants:  # its executors went with it
            assert not process_alive(pid)
    finally:
        server.stop()
