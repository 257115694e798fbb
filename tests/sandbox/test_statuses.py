"""Every status a call can end with, through a real server and real executors."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import pytest
from kubestar.common.net import free_port
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.sandbox.limits import MiB
from kubestar.sandbox.server import ServerConfig
from kubestar.v1 import sandbox_pb2 as pb
from kubestar.v1 import sandbox_pb2_grpc as pb_grpc

from tests.sandbox.support import (
    ThreadedServer,
    assert_still_serving,
    executor_config,
)

OK = pb.EXECUTION_STATUS_OK
ERROR = pb.EXECUTION_STATUS_ERROR
TIMEOUT = pb.EXECUTION_STATUS_TIMEOUT
MEMORY = pb.EXECUTION_STATUS_MEMORY
OUTPUT_LIMIT = pb.EXECUTION_STATUS_OUTPUT_LIMIT
QUEUE_TIMEOUT = pb.EXECUTION_STATUS_QUEUE_TIMEOUT
INTERNAL = pb.EXECUTION_STATUS_INTERNAL
INVALID = pb.EXECUTION_STATUS_INVALID


class TestOk:
    def test_output_exit_code_and_times(self, client: SandboxClient) -> None:
        result = client.execute(
            Call(id="hello", code="import sys\nprint('hi')\nprint('warn', file=sys.stderr)")
        )
        assert result.status == OK
        assert result.id == "hello"
        assert result.exit_code == 0
        assert result.stdout == "hi\n"
        assert result.stderr == "warn\n"
        assert not result.stdout_truncated
        assert not result.stderr_truncated
        assert result.message == ""
        assert result.wall_ms > 0
        assert result.cpu_ms > 0
        assert result.executor.startswith("worker/executor-")
        assert result.attempts == 1

    def test_stdin_is_delivered(self, client: SandboxClient) -> None:
        result = client.execute(
            Call(
                code="import sys\ndata = sys.stdin.read()\nprint(data.upper(), end='')",
                stdin="hello\nwörld\n",
            )
        )
        assert result.status == OK, result
        assert result.stdout == "HELLO\nWÖRLD\n"

    def test_input_reads_lines_of_stdin(self, client: SandboxClient) -> None:
        result = client.execute(
            Call(code="a = int(input()); b = int(input()); print(a + b)", stdin="2\n40\n")
        )
        assert (result.status, result.stdout) == (OK, "42\n")

    def test_no_stdin_reads_end_of_file(self, client: SandboxClient) -> None:
        result = client.execute(Call(code="import sys; print(repr(sys.stdin.read()))"))
        assert (result.status, result.stdout) == (OK, "''\n")

    def test_runs_as_main_script(self, client: SandboxClient) -> None:
        result = client.execute("if __name__ == '__main__':\n    print('main')")
        assert (result.status, result.stdout) == (OK, "main\n")

    def test_unicode_round_trip(self, client: SandboxClient) -> None:
        result = client.execute("print('π ≈ 3.14159 — ✓ 数学')")
        assert (result.status, result.stdout) == (OK, "π ≈ 3.14159 — ✓ 数学\n")

    @pytest.mark.parametrize("code", ["import sys; sys.exit(0)", "import sys; sys.exit()", "pass"])
    def test_clean_exits(self, client: SandboxClient, code: str) -> None:
        result = client.execute(code)
        assert (result.status, result.exit_code) == (OK, 0)

    def test_output_exactly_at_the_limit_is_not_truncated(self, client: SandboxClient) -> None:
        result = client.execute(
            Call(code="import sys; sys.stdout.write('x' * 1000)", output_bytes=1000)
        )
        assert result.status == OK, result
        assert result.stdout == "x" * 1000
        assert not result.stdout_truncated

    def test_call_that_closes_its_output_runs_to_the_end(self, client: SandboxClient) -> None:
        # Regression: the executor used to kill a call as soon as both pipes were closed.
        result = client.execute(
            Call(
                code="import os, time, sys\nos.close(1)\nos.close(2)\ntime.sleep(0.3)\nsys.exit(7)",
                timeout_seconds=5,
            )
        )
        assert (result.status, result.exit_code) == (ERROR, 7), result
        assert result.wall_ms >= 300

    def test_state_does_not_leak_between_calls(self, client: SandboxClient) -> None:
        client.execute("import builtins; builtins.LEAK = 1; LEAK2 = 2")
        for _ in range(2):  # both executors
            result = client.execute("print(hasattr(__builtins__, 'LEAK'), 'LEAK2' in globals())")
            assert result.stdout == "False False\n"


class TestError:
    def test_exception(self, client: SandboxClient) -> None:
        result = client.execute("print('partial')\nraise ValueError('boom')")
        assert result.status == ERROR
        assert result.exit_code == 1
        assert result.stdout == "partial\n"
        assert "Traceback (most recent call last)" in result.stderr
        assert 'File "<tool_call>", line 2' in result.stderr
        assert result.stderr.rstrip().endswith("ValueError: boom")
        assert "zygote" not in result.stderr  # the executor's own frames are not shown
        assert result.message == "exited with code 1"
        assert result.wall_ms > 0
        assert result.cpu_ms > 0

    @pytest.mark.parametrize("code", [3, 1, 255])
    def test_nonzero_sys_exit(self, client: SandboxClient, code: int) -> None:
        result = client.execute(f"import sys; sys.exit({code})")
        assert (result.status, result.exit_code) == (ERROR, code)
        assert result.message == f"exited with code {code}"
        assert result.stderr == ""

    def test_sys_exit_with_message(self, client: SandboxClient) -> None:
        result = client.execute("import sys; sys.exit('bye now')")
        assert (result.status, result.exit_code) == (ERROR, 1)
        assert "bye now" in result.stderr

    def test_os_exit(self, client: SandboxClient) -> None:
        result = client.execute("import os; print('x', flush=True); os._exit(5)")
        assert (result.status, result.exit_code, result.stdout) == (ERROR, 5, "x\n")

    def test_syntax_error(self, client: SandboxClient) -> None:
        result = client.execute("def broken(:\n    pass")
        assert (result.status, result.exit_code) == (ERROR, 1)
        # As `python script.py` shows it: no traceback, no frame of the service.
        assert result.stderr.startswith('  File "<tool_call>", line 1\n'), result.stderr
        assert result.stderr.rstrip().endswith("SyntaxError: invalid syntax"), result.stderr

    def test_killed_by_a_signal(self, client: SandboxClient) -> None:
        result = client.execute("import os; os.kill(os.getpid(), 15)")
        assert (result.status, result.exit_code) == (ERROR, -15)
        assert "SIGTERM" in result.message


class TestTimeout:
    def test_infinite_loop(self, client: SandboxClient) -> None:
        result = client.execute(Call(code="while True:\n    pass", timeout_seconds=1.0))
        assert result.status == TIMEOUT, result
        assert result.exit_code == -9
        assert "1s" in result.message
        assert 1000 <= result.wall_ms < 15_000
        assert result.cpu_ms > 0

    def test_sleep(self, client: SandboxClient) -> None:
        result = client.execute(
            Call(
                code="import time\nprint('before', flush=True)\ntime.sleep(60)\nprint('after')",
                timeout_seconds=0.5,
            )
        )
        assert result.status == TIMEOUT, result
        assert result.stdout == "before\n"  # output up to the timeout is kept
        assert 500 <= result.wall_ms < 15_000
        assert result.cpu_ms < 400  # it slept

    def test_timeout_kills_the_whole_process_group(self, client: SandboxClient) -> None:
        code = (
            "import os, time\n"
            "for _ in range(3):\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(60)\n"
            "time.sleep(60)\n"
        )
        result = client.execute(Call(code=code, timeout_seconds=0.5))
        assert result.status == TIMEOUT
        assert result.wall_ms < 15_000  # not the 60 s its children slept
        assert_still_serving(client)


class TestMemory:
    def test_big_allocation(self, client: SandboxClient) -> None:
        result = client.execute(Call(code="x = bytearray(1024 ** 3)", memory_bytes=128 * MiB))
        assert result.status == MEMORY, result
        assert "memory" in result.message
        assert "MemoryError" in result.stderr
        assert result.exit_code == 1

    def test_growing_allocation(self, client: SandboxClient) -> None:
        code = "chunks = []\nwhile True:\n    chunks.append(bytearray(8 * 1024 * 1024))"
        result = client.execute(Call(code=code, memory_bytes=128 * MiB, timeout_seconds=10))
        assert result.status == MEMORY, result

    def test_under_the_limit_is_fine(self, client: SandboxClient) -> None:
        result = client.execute(
            Call(code="x = bytearray(32 * 1024 * 1024); print(len(x))", memory_bytes=128 * MiB)
        )
        assert (result.status, result.stdout) == (OK, f"{32 * MiB}\n")


class TestOutputLimit:
    def test_stdout_flood(self, client: SandboxClient) -> None:
        result = client.execute(Call(code="print('a' * 10**6)", output_bytes=1000))
        assert result.status == OUTPUT_LIMIT, result
        assert result.stdout == "a" * 1000
        assert result.stdout_truncated
        assert not result.stderr_truncated
        assert "stdout" in result.message
        assert "1000" in result.message

    def test_endless_stdout_ends_quickly(self, client: SandboxClient) -> None:
        result = client.execute(Call(code="while True:\n    print('spam')", timeout_seconds=20))
        assert result.status == OUTPUT_LIMIT, result
        assert len(result.stdout.encode()) == 64 * 1024  # the server's default cap
        assert result.stdout_truncated
        assert result.wall_ms < 10_000

    def test_stderr_flood(self, client: SandboxClient) -> None:
        result = client.execute(
            Call(
                code="import sys\nprint('fine', flush=True)\nsys.stderr.write('e' * 10**6)",
                output_bytes=2000,
            )
        )
        assert result.status == OUTPUT_LIMIT, result
        assert result.stdout == "fine\n"
        assert result.stderr == "e" * 2000
        assert result.stderr_truncated
        assert not result.stdout_truncated
        assert "stderr" in result.message

    def test_after_a_flood_the_server_serves(self, client: SandboxClient) -> None:
        client.execute(Call(code="import os\nwhile True:\n    os.write(1, b'x' * 65536)"))
        assert_still_serving(client)


@pytest.fixture(scope="module")
def busy_server() -> Iterator[ThreadedServer]:
    threaded = ThreadedServer(
        ServerConfig(
            listen="127.0.0.1:0", executors=2, queue_timeout=0.3, executor=executor_config()
        )
    ).start()
    yield threaded
    threaded.stop()


def test_queue_timeout(busy_server: ThreadedServer) -> None:
    with SandboxClient(busy_server.endpoint, timeout=60) as client:
        calls = [Call(code="import time; time.sleep(1.5); print('done')") for _ in range(5)]
        results = client.execute_batch(calls)
        statuses = Counter(result.status for result in results)
        assert statuses == {OK: 2, QUEUE_TIMEOUT: 3}, results
        for result in results:
            if result.status == QUEUE_TIMEOUT:
                assert "0.3s" in result.message
                assert result.exit_code == -1
                assert result.attempts == 0
                assert result.stdout == ""
            else:
                assert result.stdout == "done\n"
        assert_still_serving(client)


@pytest.fixture(scope="module")
def lonely_dispatcher() -> Iterator[ThreadedServer]:
    """A dispatcher whose only worker is a port nobody listens on."""
    threaded = ThreadedServer(
        ServerConfig(
            listen="127.0.0.1:0",
            workers=[f"127.0.0.1:{free_port()}"],
            queue_timeout=0.5,
        )
    ).start()
    yield threaded
    threaded.stop()


def test_internal_when_no_worker_is_reachable(lonely_dispatcher: ThreadedServer) -> None:
    with SandboxClient(lonely_dispatcher.endpoint, timeout=30) as client:
        result = client.execute(Call(id="lost", code="print(1)"))
        assert result.status == INTERNAL, result
        assert result.id == "lost"
        assert "no sandbox worker is reachable" in result.message
        assert result.exit_code == -1
        capacity = client.capacity()
        assert (capacity.capacity, capacity.ready_workers) == (0, 0)
        # Validation happens before dispatch: a bad request is still INVALID, at once.
        invalid = client.execute(Call(code="  "))
        assert invalid.status == INVALID
        assert "code" in invalid.message


class TestInvalid:
    @pytest.mark.parametrize(
        ("call", "words"),
        [
            (Call(code=""), ["code", "empty"]),
            (Call(code="   \n\t  \n"), ["code", "empty"]),
            (Call(code="#" * (MiB + 1)), ["code", f"{MiB + 1} bytes", f"{MiB}"]),
            (Call(code="print(1)\x00"), ["code", "NUL"]),
            (Call(code="print(1)", stdin="x" * (4 * MiB + 1)), ["stdin", f"{4 * MiB + 1}"]),
            (Call(code="print(1)", timeout_seconds=-1.0), ["limits.timeout_seconds", "negative"]),
            (Call(code="print(1)", timeout_seconds=math.nan), ["limits.timeout_seconds", "nan"]),
            (Call(code="print(1)", timeout_seconds=math.inf), ["limits.timeout_seconds", "inf"]),
            (Call(code="print(1)", timeout_seconds=301.0), ["limits.timeout_seconds", "maximum"]),
            (Call(code="print(1)", memory_bytes=-1), ["limits.memory_bytes", "negative"]),
            (Call(code="print(1)", memory_bytes=8193 * MiB), ["limits.memory_bytes", "maximum"]),
            (Call(code="print(1)", output_bytes=-1), ["limits.output_bytes", "negative"]),
            (Call(code="print(1)", output_bytes=17 * MiB), ["limits.output_bytes", "maximum"]),
        ],
        ids=[
            "empty",
            "whitespace",
            "too-big",
            "nul",
            "stdin-too-big",
            "negative-timeout",
            "nan-timeout",
            "inf-timeout",
            "timeout-over-max",
            "negative-memory",
            "memory-over-max",
            "negative-output",
            "output-over-max",
        ],
    )
    def test_rejected_with_the_field_named(
        self, client: SandboxClient, call: Call, words: list[str]
    ) -> None:
        result = client.execute(Call(**{**call.__dict__, "id": "bad"}))
        assert result.status == INVALID, result
        assert result.id == "bad"
        for word in words:
            assert word in result.message
        assert result.exit_code == -1
        assert result.attempts == 0
        assert result.stdout == result.stderr == ""
        assert result.executor == ""

    def test_duplicate_ids_in_a_batch(self, client: SandboxClient) -> None:
        results = client.execute_batch(
            [
                Call(id="a", code="print('a1')"),
                Call(id="b", code="print('b')"),
                Call(id="a", code="print('a2')"),
            ]
        )
        assert [result.id for result in results] == ["a", "b", "a"]
        assert [result.status for result in results] == [INVALID, OK, INVALID]
        assert "'a'" in results[0].message
        assert "more than once" in results[0].message
        assert results[1].stdout == "b\n"

    def test_batch_over_the_maximum(self, client: SandboxClient) -> None:
        results = client.execute_batch(["pass"] * 1025)
        assert len(results) == 1025
        assert {result.status for result in results} == {INVALID}
        assert "executions" in results[0].message
        assert "1024" in results[0].message

    async def test_duplicate_ids_in_a_stream(self, server: ThreadedServer) -> None:
        import grpc

        async def requests() -> object:
            for call_id, code in [("s", "print('first')"), ("s", "print('second')")]:
                yield pb.ExecuteStreamRequest(execution=pb.Execution(id=call_id, code=code))

        async with grpc.aio.insecure_channel(server.endpoint) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            results = [response.result async for response in stub.ExecuteStream(requests())]
        assert sorted(result.status for result in results) == [OK, INVALID]
        invalid = next(result for result in results if result.status == INVALID)
        ran = next(result for result in results if result.status == OK)
        assert "already in use" in invalid.message
        assert ran.stdout == "first\n"

    def test_server_serves_after_invalid_calls(self, client: SandboxClient) -> None:
        assert_still_serving(client)
