"""The production configuration: numpy and sympy pre-imported and warmed up in each executor,
beside a light zygote for calls that need neither."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace

import pytest
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.sandbox.executor import Executor, ExecutorConfig
from kubestar.sandbox.limits import MiB
from kubestar.sandbox.server import ServerConfig
from kubestar.v1 import sandbox_pb2 as pb

from tests.real_parts import missing, require_modules
from tests.sandbox.support import ThreadedServer, next_uid_base, pool_of

require_modules("numpy", "sympy")


@pytest.fixture(scope="module")
def default_server() -> Iterator[ThreadedServer]:
    config = replace(ExecutorConfig(), uid_base=next_uid_base())  # default preload and warm-up
    threaded = ThreadedServer(
        ServerConfig(listen="127.0.0.1:0", executors=1, executor=config)
    ).start()
    yield threaded
    threaded.stop()


@pytest.fixture
def default_client(default_server: ThreadedServer) -> Iterator[SandboxClient]:
    with SandboxClient(default_server.endpoint, timeout=60) as sandbox:
        yield sandbox


def test_preloaded_modules_work(default_client: SandboxClient) -> None:
    code = (
        "import numpy as np, sympy as sp\n"
        "x = sp.symbols('x')\n"
        "print(sp.solve(x**2 - 5*x + 6, x))\n"
        "print(int(np.arange(10).sum()))\n"
    )
    result = default_client.execute(code)
    assert result.status == pb.EXECUTION_STATUS_OK, result
    assert result.stdout == "[2, 3]\n45\n"


def test_memory_limit_is_on_top_of_the_preloaded_modules(default_client: SandboxClient) -> None:
    fits = default_client.execute(
        Call(
            code="import numpy as np\nprint(np.ones(4 * 1024 * 1024).nbytes)", memory_bytes=64 * MiB
        )
    )
    assert (fits.status, fits.stdout) == (pb.EXECUTION_STATUS_OK, f"{32 * MiB}\n"), fits
    too_big = default_client.execute(
        Call(code="import numpy as np\nx = np.ones(32 * 1024 * 1024)", memory_bytes=64 * MiB)
    )
    assert too_big.status == pb.EXECUTION_STATUS_MEMORY, too_big


def test_calls_go_to_the_light_zygote_unless_they_name_a_preloaded_module(
    default_server: ThreadedServer, default_client: SandboxClient
) -> None:
    plain, numeric, computed = default_client.execute_batch(
        [
            "print(123 * 456)",
            "from sympy import Rational\nprint(Rational(1, 3) + Rational(1, 6))",
            # A computed module name escapes the routing: the light zygote imports it itself.
            "import importlib\nprint(importlib.import_module('sym' + 'py').Integer(7) ** 2)",
        ]
    )
    assert (plain.status, plain.stdout, plain.executor) == (
        pb.EXECUTION_STATUS_OK,
        "56088\n",
        "worker/executor-0/light",
    )
    assert (numeric.stdout, numeric.executor) == ("1/2\n", "worker/executor-0")
    assert (computed.status, computed.stdout) == (pb.EXECUTION_STATUS_OK, "49\n"), computed
    assert computed.executor == "worker/executor-0/light"
    (executor,) = pool_of(default_server).executors
    assert executor.light is not None
    assert executor.light.isolation == executor.zygote.isolation  # the same walls
    if os.geteuid() == 0:  # calls of the two zygotes run as different uids
        assert executor.light.uid == executor.zygote.uid + 1


def test_routing_matches_whole_module_names() -> None:
    executor = Executor(0, ExecutorConfig(preload=("numpy", "sympy.core"), pin_cpus=False))
    assert executor.process_for("import numpy as np").light is False
    assert executor.process_for("from sympy import symbols").light is False
    assert executor.process_for("x = 'sympy'").light is False  # any mention: safe side
    assert executor.process_for("numpyish = 1; print(numpyish)").light is True
    assert executor.process_for("print(sum(range(10)))").light is True
    without = Executor(0, ExecutorConfig(light=False, pin_cpus=False))
    assert without.light is None and without.process_for("print(1)").light is False


def test_the_light_zygote_is_lean(default_client: SandboxClient) -> None:
    # Each module the zygote holds is paid for by every call it forks (see zygote.py).
    result = default_client.execute(
        "import sys\n"
        "heavy = {'argparse', 'ctypes', 'typing', 'site', 'asyncio', 'grpc', 'kubestar'}\n"
        "print(sorted(heavy & set(sys.modules)), sys.flags.no_site)\n"
    )
    assert (result.status, result.stdout) == (pb.EXECUTION_STATUS_OK, "[] 1\n"), result
    assert result.executor == "worker/executor-0/light"


@pytest.mark.parametrize("preload", ["", "import numpy\n"], ids=["light", "preloaded"])
def test_each_call_has_its_own_state(default_client: SandboxClient, preload: str) -> None:
    code = preload + (
        "import os, random, sys\n"
        "print(random.random(), sys.path[0] == os.getcwd(), sys.argv)\n"
        "print(any(p.endswith('kubestar/sandbox') for p in sys.path))\n"
    )
    first, second = default_client.execute_batch([code, code])
    assert first.status == second.status == pb.EXECUTION_STATUS_OK, (first, second)
    draw_1, rest_1 = first.stdout.split(" ", 1)
    draw_2, rest_2 = second.stdout.split(" ", 1)
    assert draw_1 != draw_2  # the random module is reseeded in each forked call
    assert rest_1 == rest_2 == "True ['<tool_call>']\nFalse\n"


@pytest.mark.parametrize("preload", ["", "import numpy\n"], ids=["light", "preloaded"])
def test_each_call_starts_in_an_empty_directory(
    default_client: SandboxClient, preload: str
) -> None:
    # Every call of a zygote runs at the same path, made afresh for it (see _forkserver.c).
    code = preload + (
        "import os, tempfile\n"
        "home = os.environ['HOME']\n"
        "print(os.listdir('.'), home == os.environ['TMPDIR'] == tempfile.gettempdir())\n"
        "print(home == os.getcwd(), os.stat('.').st_mode & 0o777 == 0o700)\n"
        "open('left.txt', 'w').write('x')\n"
        "os.mkdir('locked'); open('locked/inside.txt', 'w').write('x'); os.chmod('locked', 0)\n"
    )
    for result in default_client.execute_batch([code] * 3):  # one executor: one after another
        assert (result.status, result.stdout) == (pb.EXECUTION_STATUS_OK, "[] True\nTrue True\n")


@pytest.mark.parametrize("preload", ["", "import numpy\n"], ids=["light", "preloaded"])
def test_compile_warnings_reach_the_call(default_client: SandboxClient, preload: str) -> None:
    # The call compiles its own code: a warning about it is on the call's stderr.
    result = default_client.execute(preload + "x = 5\nprint(x is 5)\n")
    assert (result.status, result.stdout) == (pb.EXECUTION_STATUS_OK, "True\n"), result
    assert "SyntaxWarning" in result.stderr and '"is" with a literal' in result.stderr


@pytest.mark.parametrize("preload", ["", "import numpy\n"], ids=["light", "preloaded"])
def test_a_call_runs_as_a_script(default_client: SandboxClient, preload: str) -> None:
    # As `python script.py` runs it: `__main__`, the builtins module, and none of the
    # zygote's own compiler flags (zygote.py has `from __future__ import annotations`).
    code = preload + (
        "def f(x: int) -> None: pass\n"
        "print(__name__, type(__builtins__).__name__, f.__annotations__['x'] is int)\n"
    )
    result = default_client.execute(code)
    assert (result.status, result.stdout) == (pb.EXECUTION_STATUS_OK, "__main__ module True\n")


def test_the_preloading_zygote_took_the_free_allocator_blocks(
    default_client: SandboxClient,
) -> None:
    # sys.modules["__main__"] of a call's process is the zygote script (zygote.py); its
    # statistics parser must still understand what this Python's allocator reports.
    code = "import sys\nprint(len(sys.modules['__main__']._TAKEN_BLOCKS) > 0)\n"
    preloaded, light = default_client.execute_batch(["import numpy\n" + code, code])
    assert (preloaded.status, preloaded.stdout) == (pb.EXECUTION_STATUS_OK, "True\n"), preloaded
    assert (light.status, light.stdout) == (pb.EXECUTION_STATUS_OK, "False\n"), light


def _huge_pages_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False


# Where in its own memory a call finds the interpreter's code: "anonymous" once the zygote
# moved it to huge pages (the file's name otherwise), and whether that mapping is huge.
WHERE_IS_THE_INTERPRETERS_CODE = """
import ctypes
address = ctypes.cast(ctypes.pythonapi.PyEval_EvalCode, ctypes.c_void_p).value
inside = False
for line in open("/proc/self/smaps"):
    fields = line.split()
    if "-" in fields[0] and not fields[0].endswith(":"):
        low, high = (int(bound, 16) for bound in fields[0].split("-"))
        inside = low <= address < high
        if inside:
            name = fields[5] if len(fields) > 5 else "anonymous"
    elif inside and fields[0] == "AnonHugePages:":
        print(name, int(fields[1]) >= 2048)
"""


@pytest.mark.parametrize("preload", ["", "import numpy\n"], ids=["light", "preloaded"])
def test_calls_run_the_interpreters_code_from_huge_pages(
    default_client: SandboxClient, preload: str
) -> None:
    if not _huge_pages_enabled():
        missing("transparent huge pages are off (/sys/kernel/mm/transparent_hugepage/enabled)")
    # Copied to huge pages by the zygote, so that no call faults it in again (_forkserver.c).
    result = default_client.execute(preload + WHERE_IS_THE_INTERPRETERS_CODE)
    assert (result.status, result.stdout) == (pb.EXECUTION_STATUS_OK, "anonymous True\n"), result


def test_calls_run_nicer_than_the_server(default_client: SandboxClient) -> None:
    # The server is in this process (ThreadedServer); a CPU-bound call must not starve it.
    result = default_client.execute("import os\nprint(os.nice(0))")
    assert result.stdout == f"{os.nice(0) + ExecutorConfig().nice}\n", result


def test_a_call_leads_its_own_process_group_but_no_session(
    default_client: SandboxClient,
) -> None:
    # Its own group, so that a timeout kills everything it started; no session of its own,
    # which under autogroup scheduling would make each call a scheduling group of its own.
    result = default_client.execute(
        "import os\nprint(os.getpgid(0) == os.getpid(), os.getsid(0) == os.getpid())"
    )
    assert (result.status, result.stdout) == (pb.EXECUTION_STATUS_OK, "True False\n"), result
