"""Hostile code is contained, and the service keeps serving after each attempt."""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.sandbox.server import ServerConfig
from kubestar.v1 import sandbox_pb2 as pb

from tests.real_parts import IS_ROOT, missing
from tests.sandbox.support import (
    REPO,
    ServerProcess,
    ThreadedServer,
    assert_still_serving,
    executor_config,
    leftover_processes,
    pool_of,
    requires_root,
    scratch_dir,
)

OK = pb.EXECUTION_STATUS_OK
ERROR = pb.EXECUTION_STATUS_ERROR
TIMEOUT = pb.EXECUTION_STATUS_TIMEOUT
MEMORY = pb.EXECUTION_STATUS_MEMORY
OUTPUT_LIMIT = pb.EXECUTION_STATUS_OUTPUT_LIMIT


def executor_pids(server: ThreadedServer) -> list[int | None]:
    """Every zygote process of every executor (preloading and light)."""
    return [process.pid for executor in pool_of(server).executors for process in executor.processes]


def assert_clean(server: ThreadedServer, client: SandboxClient) -> None:
    """Nothing the call started is still running, and a normal call succeeds."""
    assert leftover_processes(pool_of(server)) == []
    assert_still_serving(client)


class TestResourceExhaustion:
    def test_fork_bomb(self, server: ThreadedServer, client: SandboxClient) -> None:
        started = time.monotonic()
        result = client.execute(
            Call(code="import os\nwhile True:\n    os.fork()", timeout_seconds=5)
        )
        assert result.status in (ERROR, TIMEOUT), result
        assert time.monotonic() - started < 15
        assert_clean(server, client)

    def test_fork_bomb_is_capped_by_the_process_limit(
        self, server: ThreadedServer, client: SandboxClient
    ) -> None:
        code = (
            "import os, time\n"
            "forked = 0\n"
            "try:\n"
            "    for _ in range(1000):\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(60)\n"
            "            os._exit(0)\n"
            "        forked += 1\n"
            "except OSError as error:\n"
            "    print('stopped', forked, type(error).__name__, flush=True)\n"
        )
        result = client.execute(Call(code=code, timeout_seconds=5))
        assert result.status == OK, result
        stopped, forked, error = result.stdout.split()
        assert stopped == "stopped"
        assert int(forked) < 32  # --max-processes, the default
        assert error == "BlockingIOError"
        # OK, not TIMEOUT: the call ended with its main process; the sleepers were killed.
        assert_clean(server, client)

    def test_memory_bomb(self, server: ThreadedServer, client: SandboxClient) -> None:
        code = "hog = []\nwhile True:\n    hog.append(' ' * (64 * 1024 * 1024))"
        result = client.execute(Call(code=code, timeout_seconds=10))
        assert result.status == MEMORY, result
        assert_clean(server, client)

    def test_huge_single_allocation(self, server: ThreadedServer, client: SandboxClient) -> None:
        result = client.execute("x = 'a' * (64 * 1024 ** 3)")
        assert result.status == MEMORY, result
        assert_clean(server, client)

    def test_infinite_loop(self, server: ThreadedServer, client: SandboxClient) -> None:
        result = client.execute(Call(code="while True:\n    pass", timeout_seconds=0.5))
        assert result.status == TIMEOUT, result
        assert_clean(server, client)

    def test_background_spinner_is_killed_when_the_call_ends(
        self, server: ThreadedServer, client: SandboxClient
    ) -> None:
        code = "import os\nif os.fork() == 0:\n    while True:\n        pass\nprint('parent exits')"
        result = client.execute(Call(code=code, timeout_seconds=30))
        # The call ends with its main process, though the child still holds stdout.
        assert (result.status, result.stdout) == (OK, "parent exits\n"), result
        assert result.wall_ms < 15_000
        assert_clean(server, client)

    def test_output_flood(self, server: ThreadedServer, client: SandboxClient) -> None:
        code = (
            "import os\nwhile True:\n    os.write(1, b'x' * 65536)\n    os.write(2, b'y' * 65536)"
        )
        result = client.execute(Call(code=code, timeout_seconds=10))
        assert result.status == OUTPUT_LIMIT, result
        assert len(result.stdout) <= 64 * 1024
        assert len(result.stderr) <= 64 * 1024
        assert_clean(server, client)

    def test_open_file_limit(self, server: ThreadedServer, client: SandboxClient) -> None:
        code = (
            "files = []\n"
            "try:\n"
            "    while True:\n"
            "        files.append(open('/dev/null'))\n"
            "except OSError as error:\n"
            "    print(len(files), type(error).__name__)\n"
        )
        result = client.execute(code)
        assert result.status == OK, result
        opened, error = result.stdout.split()
        assert int(opened) < 256
        assert error == "OSError"
        assert_clean(server, client)

    def test_file_size_limit(self, server: ThreadedServer, client: SandboxClient) -> None:
        code = (
            "with open('big.bin', 'wb') as handle:\n"
            "    for _ in range(80):\n"
            "        handle.write(b'x' * 1024 * 1024)\n"
        )
        result = client.execute(Call(code=code, timeout_seconds=20))
        assert result.status == ERROR, result
        assert_clean(server, client)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


def test_network_is_unreachable(
    server: ThreadedServer, client: SandboxClient, listener: socket.socket
) -> None:
    if not pool_of(server).executors[0].isolation.get("network"):
        missing("no network namespace on this machine (unprivileged, no user namespaces)")
    port = listener.getsockname()[1]
    code = (
        "import socket\n"
        f"for port in ({port}, {server.server.port}):\n"
        "    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
        "    sock.settimeout(2)\n"
        "    try:\n"
        "        sock.connect(('127.0.0.1', port))\n"
        "        print('CONNECTED', port)\n"
        "    except OSError as error:\n"
        "        print('blocked', type(error).__name__)\n"
        # The namespace's interfaces (if_nameindex() asks netlink, which calls cannot open).
        "lines = open('/proc/net/dev').read().splitlines()[2:]\n"
        "print(sorted(line.split(':')[0].strip() for line in lines))\n"
    )
    result = client.execute(Call(code=code, timeout_seconds=10))
    assert result.status == OK, result
    assert "CONNECTED" not in result.stdout
    assert result.stdout.count("blocked") == 2
    assert result.stdout.splitlines()[-1] == "['lo']"  # no way out but a loopback
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing ever reached the test's socket
    assert_clean(server, client)


@pytest.fixture(scope="module")
def secret_token() -> str:
    return f"kst-secret-{secrets.token_hex(8)}"


@pytest.fixture(scope="module")
def secret_worker(log_dir: Path, secret_token: str) -> Iterator[ServerProcess]:
    """A worker process whose own environment holds a secret."""
    worker = ServerProcess(log_dir, env={"KUBESTAR_TEST_SECRET": secret_token}, executors=1)
    try:
        yield worker.wait_ready()
    finally:
        worker.stop()


class TestServiceEnvironment:
    def test_environment_is_scrubbed(self, secret_worker: ServerProcess, secret_token: str) -> None:
        with SandboxClient(secret_worker.endpoint, timeout=60) as client:
            result = client.execute("import os\nprint(dict(os.environ))")
            assert result.status == OK, result
            assert "PATH" in result.stdout
            assert secret_token not in result.stdout
            assert "KUBESTAR_TEST_SECRET" not in result.stdout
            assert_still_serving(client)

    @requires_root
    def test_proc_environ_of_the_service_is_out_of_reach(
        self, secret_worker: ServerProcess, secret_token: str
    ) -> None:
        code = (
            "import os\n"
            "def show(path):\n"
            "    try:\n"
            "        with open(path, 'rb') as handle:\n"
            "            print(path, handle.read())\n"
            "    except OSError as error:\n"
            "        print(path, 'DENIED', type(error).__name__)\n"
            f"show('/proc/{secret_worker.pid}/environ')\n"
            "show(f'/proc/{os.getppid()}/environ')\n"
            "for entry in sorted(os.listdir('/proc')):\n"
            "    if entry.isdigit():\n"
            "        show(f'/proc/{entry}/environ')\n"
            "print('pids', sorted(int(e) for e in os.listdir('/proc') if e.isdigit()))\n"
        )
        with SandboxClient(secret_worker.endpoint, timeout=60) as client:
            result = client.execute(code)
            assert result.status == OK, result
            assert secret_token not in result.stdout + result.stderr
            lines = result.stdout.splitlines()
            assert lines[0] == f"/proc/{secret_worker.pid}/environ DENIED FileNotFoundError"
            assert lines[1].endswith("DENIED PermissionError")  # the zygote: another uid
            # A PID namespace: the call sees itself and the zygote (PID 1), not the host.
            pids = [int(pid) for pid in lines[-1].removeprefix("pids [").rstrip("]").split(",")]
            assert 1 in pids
            assert secret_worker.pid not in pids
            assert len(pids) <= 3
            assert_still_serving(client)


def test_the_servers_terminal_is_out_of_reach(log_dir: Path) -> None:
    # Started from an interactive shell, the server has a controlling terminal; a call must
    # not write to it (or read the user's keystrokes from it).
    terminal, device = os.openpty()
    worker = ServerProcess(log_dir, executors=1, terminal=os.ttyname(device))
    os.close(device)
    try:
        with SandboxClient(worker.wait_ready().endpoint, timeout=60) as client:
            result = client.execute(
                "import os\n"
                "try:\n"
                "    os.write(os.open('/dev/tty', os.O_RDWR), b'from the call')\n"
                "except OSError as error:\n"
                "    print('refused', error.strerror)\n"
            )
            assert (result.status, result.stdout) == (OK, "refused No such device or address\n")
        readable, _, _ = select.select([terminal], [], [], 0.2)
        if readable:
            with contextlib.suppress(OSError):  # EIO: no one holds the terminal open
                assert b"from the call" not in os.read(terminal, 4096)
    finally:
        worker.stop()
        os.close(terminal)


@requires_root
def test_root_only_file_is_unreadable(
    server: ThreadedServer, client: SandboxClient, scratch: Path
) -> None:
    token = secrets.token_hex(8)
    secret = scratch / "service-secret.txt"
    secret.write_text(token)
    secret.chmod(0o600)
    result = client.execute(f"print(open({str(secret)!r}).read())")
    assert result.status == ERROR, result
    assert "PermissionError" in result.stderr
    assert token not in result.stdout + result.stderr
    assert_clean(server, client)


@pytest.fixture(scope="module")
def hidden() -> Iterator[Path]:
    path = scratch_dir()
    (path / "dir").mkdir()
    (path / "dir" / "credentials").write_text("hidden-dir-token")
    (path / "file.key").write_text("hidden-file-token")
    for item in (path / "dir", path / "dir" / "credentials", path / "file.key"):
        item.chmod(0o755 if item.is_dir() else 0o644)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def hiding_server(hidden: Path) -> Iterator[ThreadedServer]:
    config = executor_config(hidden_paths=[str(hidden / "dir"), str(hidden / "file.key")])
    threaded = ThreadedServer(
        ServerConfig(listen="127.0.0.1:0", executors=1, executor=config)
    ).start()
    yield threaded
    threaded.stop()


@requires_root
def test_hidden_paths(hiding_server: ThreadedServer, hidden: Path) -> None:
    code = (
        "import os\n"
        f"print(os.listdir({str(hidden / 'dir')!r}))\n"
        f"print(repr(open({str(hidden / 'file.key')!r}).read()))\n"
    )
    with SandboxClient(hiding_server.endpoint, timeout=60) as client:
        result = client.execute(code)
    assert result.status == OK, result
    assert result.stdout == "[]\n''\n"


@requires_root
class TestFilesystem:
    def test_writes_outside_the_call_directory_fail(
        self, server: ThreadedServer, client: SandboxClient, tmp_path: Path
    ) -> None:
        name = f"kubestar-escape-{secrets.token_hex(4)}"
        targets = [REPO / name, Path("/etc") / name, tmp_path / name, Path("/") / name]
        code = (
            f"for path in {[str(t) for t in targets]!r}:\n"
            "    try:\n"
            "        with open(path, 'w') as handle:\n"
            "            handle.write('escaped')\n"
            "        print('WROTE', path)\n"
            "    except OSError as error:\n"
            "        print('denied', type(error).__name__)\n"
        )
        try:
            result = client.execute(code)
            assert result.status == OK, result
            assert "WROTE" not in result.stdout
            assert result.stdout.count("denied") == len(targets)
            for target in targets:
                assert not target.exists()
        finally:
            for target in targets:
                target.unlink(missing_ok=True)
        assert_clean(server, client)

    def test_tmp_is_private_and_emptied_after_each_call(
        self, server: ThreadedServer, client: SandboxClient
    ) -> None:
        name = f"kubestar-marker-{secrets.token_hex(4)}"
        places = ["/tmp", "/var/tmp", "/dev/shm"]
        code = (
            f"for place in {places!r}:\n"
            f"    with open(place + '/{name}', 'w') as handle:\n"
            "        handle.write('x')\n"
            "    print('wrote', place)\n"
        )
        result = client.execute(code)
        assert result.status == OK, result
        assert result.stdout.count("wrote") == 3
        try:
            for place in places:
                assert not (Path(place) / name).exists()  # not on the host
        finally:
            for place in places:
                (Path(place) / name).unlink(missing_ok=True)
        check = f"import os\nprint([os.path.exists(p + '/{name}') for p in {places!r}])"
        for result in client.execute_batch([check] * 4):  # every executor, more than once
            assert (result.status, result.stdout) == (OK, "[False, False, False]\n")

    def test_other_calls_files_are_out_of_reach(
        self, server: ThreadedServer, client: SandboxClient
    ) -> None:
        token = secrets.token_hex(8)
        writer = (
            "import os, time\n"
            f"open('notes.txt', 'w').write('{token}')\n"
            "print(os.getcwd(), flush=True)\n"
            "time.sleep(1.0)\n"
        )
        snooper = (
            "import os, glob, time\n"
            "time.sleep(0.3)\n"
            "found = []\n"
            "for top in ('/tmp', '/var/tmp', '/dev/shm'):\n"
            "    for folder, dirs, names in os.walk(top):\n"
            "        # Read-only mounts are the Python runtime, shown when it lives under /tmp.\n"
            "        dirs[:] = [d for d in dirs\n"
            "                   if not os.statvfs(os.path.join(folder, d)).f_flag & os.ST_RDONLY]\n"
            "        for name in names:\n"
            "            path = os.path.join(folder, name)\n"
            "            try:\n"
            "                found.append((path, open(path).read()))\n"
            "            except OSError as error:\n"
            "                found.append((path, type(error).__name__))\n"
            "print(found)\n"
            "print(glob.glob('/tmp/kubestar-calls/*/*'))\n"
        )
        first, second = client.execute_batch([writer, snooper])
        assert first.status == OK, first
        assert second.status == OK, second
        assert first.executor != second.executor  # they ran at the same time
        assert token not in second.stdout
        workdir = first.stdout.strip()
        later = f"print(open({workdir + '/notes.txt'!r}).read())"
        for result in client.execute_batch([later] * 2):  # on both executors
            assert result.status == ERROR
            assert "FileNotFoundError" in result.stderr
            assert token not in result.stdout
        assert_clean(server, client)


@requires_root
class TestSignals:
    @pytest.mark.parametrize(
        "target", ["os.getppid()", "1", "-1", "0"], ids=["parent", "init", "all", "group"]
    )
    def test_killing_others(
        self, server: ThreadedServer, client: SandboxClient, target: str
    ) -> None:
        before = executor_pids(server)
        code = (
            "import os\n"
            "try:\n"
            f"    os.kill({target}, 9)\n"
            "except OSError as error:\n"
            "    print(type(error).__name__)\n"
            "print('alive')\n"
        )
        results = client.execute_batch([code] * 2)  # on both executors
        for result in results:
            if target == "0":  # its own process group: only itself
                assert result.status == ERROR
                assert result.exit_code == -9
            else:
                assert result.status == OK, result
                assert result.stdout.endswith("alive\n")
        assert executor_pids(server) == before  # no executor died or restarted
        assert_clean(server, client)

    def test_parent_pid_is_the_namespace_init(self, client: SandboxClient) -> None:
        result = client.execute("import os; print(os.getpid() > 1, os.getppid(), os.getuid())")
        assert result.status == OK, result
        above_one, parent, uid = result.stdout.split()
        assert (above_one, parent) == ("True", "1")
        assert int(uid) != 0


def test_background_daemon_is_killed(
    server: ThreadedServer, client: SandboxClient, scratch: Path
) -> None:
    started, late = scratch / "daemon-started", scratch / "daemon-late"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        null = os.open(os.devnull, os.O_RDWR)\n"
        "        for fd in (0, 1, 2):\n"
        "            os.dup2(null, fd)\n"
        f"        open({str(started)!r}, 'w').close()\n"
        "        time.sleep(3.0)\n"
        f"        open({str(late)!r}, 'w').close()\n"
        "        os._exit(0)\n"
        "    os._exit(0)\n"
        "deadline = time.time() + 5\n"
        f"while not os.path.exists({str(started)!r}) and time.time() < deadline:\n"
        "    time.sleep(0.01)\n"
        f"print('daemon started' if os.path.exists({str(started)!r}) else 'no daemon')\n"
    )
    began = time.monotonic()
    result = client.execute(Call(code=code, timeout_seconds=10))
    assert (result.status, result.stdout) == (OK, "daemon started\n"), result
    # Promptly: not after the daemon's 3 s (the call was OK, not TIMEOUT, either).
    assert time.monotonic() - began < 3
    assert started.exists()  # the daemon ran, and could write here...
    assert leftover_processes(pool_of(server)) == []
    time.sleep(max(0.0, began + 3.5 - time.monotonic()))
    assert not late.exists()  # ...but was killed before it wrote its second marker
    assert_clean(server, client)


def test_runs_as_an_unprivileged_uid(client: SandboxClient) -> None:
    result = client.execute("import os; print(os.getuid(), os.geteuid(), os.getgroups())")
    assert result.status == OK, result
    uid, euid, groups = result.stdout.split(maxsplit=2)
    if IS_ROOT:
        assert uid == euid != "0"
        assert groups.strip() == "[]"
