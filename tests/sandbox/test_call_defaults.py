"""A server's defaults for calls that set no limit of their own (`kubestar sandbox serve
--call-timeout`, `--call-memory-mib`, `--call-max-output-bytes`: what the operator gives a
SandboxPool's workers and dispatcher from spec.limits), on real servers on 127.0.0.1 with
real executors: the HTTP dialects, `kubestar sandbox exec` and gRPC calls with unset limits
get them, a call that sets its own limit gets its own, a dispatcher applies its defaults
whatever its workers' are, and a default over the sandbox's ceiling is refused at start in
one line. Effects are asserted, not timings: a call that sleeps 5 s is reported as timed out
under a 1 s default (the built-in default is 10 s)."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubestar.common.net import free_port
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.sandbox.limits import MiB
from kubestar.v1 import sandbox_pb2 as pb

from tests.sandbox.support import ServerProcess, cli_command

DEFAULTS = ("--call-timeout", "1", "--call-memory-mib", "256", "--call-max-output-bytes", "2048")
# Sleeps past the 1 s default, within the built-in 10 s one.
SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(5)\nprint('woke')"
SHORT = "import time\ntime.sleep(2)\nprint('woke')"
# Past the 256 MiB default, within the built-in 512 MiB (bytes() allocates, writes nothing).
BIG = "block = bytes(384 * 1024 * 1024)\nprint('allocated')"
LOUD = "print('x' * 5000)"
REPO = Path(__file__).resolve().parents[2]
# Without a proxy: every address here is 127.0.0.1.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def post(url: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with _OPENER.open(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


async def long_batch(url: str, submissions: list[dict[str, Any]]) -> Any:
    """What the rStar2-Agent recipe sends to code-judge: aiohttp, JSON."""
    async with (
        aiohttp.ClientSession(trust_env=False) as session,
        session.post(url, json={"type": "batch", "submissions": submissions}) as response,
    ):
        response.raise_for_status()
        return await response.json()


@pytest.fixture(scope="module")
def worker(log_dir: Path) -> Iterator[tuple[ServerProcess, str]]:
    """A worker with small defaults, serving the HTTP dialects; it and its base URL."""
    port = free_port()
    server = ServerProcess(
        log_dir, "--http-listen", f"127.0.0.1:{port}", *DEFAULTS, executors=2
    ).wait_ready()
    yield server, f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="module")
def dispatcher(log_dir: Path) -> Iterator[tuple[ServerProcess, str]]:
    """A dispatcher with small defaults in front of a worker with the built-in ones (10 s,
    512 MiB, 64 KiB): what the dispatcher's calls get is the dispatcher's doing."""
    plain = ServerProcess(log_dir, executors=2).wait_ready()
    port = free_port()
    server = ServerProcess(
        log_dir,
        "--worker",
        plain.endpoint,
        "--http-listen",
        f"127.0.0.1:{port}",
        *DEFAULTS,
        worker=False,
    ).wait_ready()
    yield server, f"http://127.0.0.1:{port}"
    server.stop()
    plain.stop()


def check_http(base: str) -> None:
    run_code = f"{base}/run_code"
    # No run_timeout: the server's 1 s.
    status, answer = post(run_code, {"code": SLEEPER, "language": "python"})
    assert status == 200 and answer["status"] == "Failed", answer
    assert answer["run_result"]["status"] == "TimeLimitExceeded"
    assert answer["run_result"]["stdout"] == "started\n"
    # Its own run_timeout: its own.
    status, answer = post(run_code, {"code": SHORT, "language": "python", "run_timeout": 8})
    assert status == 200 and answer["status"] == "Success", answer
    assert answer["run_result"]["stdout"] == "woke\n"
    # No memory_limit_MB (or -1): the server's 256 MiB; its own 1,024 MB: its own.
    for body in ({}, {"memory_limit_MB": -1}):
        status, answer = post(run_code, {"code": BIG, "language": "python", **body})
        assert status == 200 and answer["status"] == "Failed", answer
        assert "MemoryError" in answer["run_result"]["stderr"]
    status, answer = post(run_code, {"code": BIG, "language": "python", "memory_limit_MB": 1024})
    assert status == 200 and answer["status"] == "Success", answer
    # No output limit in the dialect: the server's 2,048 bytes.
    status, answer = post(run_code, {"code": LOUD, "language": "python"})
    assert answer["status"] == "Failed" and len(answer["run_result"]["stdout"]) <= 2048


async def check_code_judge(base: str) -> None:
    """code-judge sets no limit: every submission gets the server's."""
    results = (
        await long_batch(
            f"{base}/run/long-batch",
            [
                {"type": "python", "solution": SLEEPER},
                {"type": "python", "solution": BIG},
                {"type": "python", "solution": "print(1)"},
            ],
        )
    )["results"]
    timed_out, too_big, fine = results
    assert timed_out["reason"] == "worker_timeout" and timed_out["stdout"] == "started\n"
    assert not too_big["run_success"] and "MemoryError" in too_big["stderr"]
    assert fine["success"] and fine["stdout"] == "1\n"


def check_grpc(endpoint: str) -> None:
    with SandboxClient(endpoint, timeout=60, token="") as client:
        unset = client.execute(Call(code=SLEEPER))
        assert unset.status == pb.EXECUTION_STATUS_TIMEOUT, unset
        assert unset.stdout == "started\n"
        own = client.execute(Call(code=SHORT, timeout_seconds=8))
        assert own.status == pb.EXECUTION_STATUS_OK and own.stdout == "woke\n", own
        assert client.execute(Call(code=BIG)).status == pb.EXECUTION_STATUS_MEMORY
        big = client.execute(Call(code=BIG, memory_bytes=1024 * MiB))
        assert big.status == pb.EXECUTION_STATUS_OK, big
        assert client.execute(Call(code=LOUD)).status == pb.EXECUTION_STATUS_OUTPUT_LIMIT
        loud = client.execute(Call(code=LOUD, output_bytes=65536))
        assert loud.status == pb.EXECUTION_STATUS_OK and len(loud.stdout) == 5001


def test_a_worker_gives_its_defaults_to_http_calls(worker: tuple[ServerProcess, str]) -> None:
    check_http(worker[1])


async def test_a_worker_gives_its_defaults_to_code_judge(
    worker: tuple[ServerProcess, str],
) -> None:
    await check_code_judge(worker[1])


def test_a_worker_gives_its_defaults_to_grpc_calls_that_leave_limits_unset(
    worker: tuple[ServerProcess, str],
) -> None:
    check_grpc(worker[0].endpoint)


def test_sandbox_exec_gets_the_servers_default(worker: tuple[ServerProcess, str]) -> None:
    done = subprocess.run(
        cli_command("sandbox", "exec", "--endpoint", worker[0].endpoint, "-"),
        input=SLEEPER,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
        cwd=REPO,
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout == "started\n"
    assert "timeout" in done.stderr.lower()


def test_a_dispatcher_gives_its_defaults_to_http_calls(
    dispatcher: tuple[ServerProcess, str],
) -> None:
    check_http(dispatcher[1])


async def test_a_dispatcher_gives_its_defaults_to_code_judge(
    dispatcher: tuple[ServerProcess, str],
) -> None:
    await check_code_judge(dispatcher[1])


def test_a_dispatcher_gives_its_defaults_to_grpc_calls_that_leave_limits_unset(
    dispatcher: tuple[ServerProcess, str],
) -> None:
    check_grpc(dispatcher[0].endpoint)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--call-timeout", "301"),
        ("--call-timeout", "0"),
        ("--call-memory-mib", "9000"),
        ("--call-max-output-bytes", str(17 * MiB)),
    ],
)
def test_a_default_over_the_ceiling_is_refused_at_start(
    flag: str, value: str, tmp_path: Path
) -> None:
    log = tmp_path / "termination-log"
    done = subprocess.run(
        cli_command(
            "sandbox",
            "serve",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--no-isolation",
            "--termination-log",
            str(log),
            flag,
            value,
        ),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert flag in line and "maximum" in line, line
    (written,) = log.read_text().strip().splitlines()
    assert flag in written
