"""What a call cannot reach outside itself, and what it leaves the kernel to take first: no
other process's memory (the zygote and every call are not dumpable), the OOM killer's first
choice (oom_score_adj 1000), a bounded number of files in its private tmpfs, not the pod's
termination log, and of /proc only its own processes' files and the kernel's read-only.

Workers run as root and as pods run them (a non-root uid in a user namespace,
tests.sandbox.unprivileged); not dumpable and the OOM score hold without isolation too.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.sandbox.isolation import PRIVATE_TMPFS_INODES
from kubestar.v1 import sandbox_pb2 as pb

from tests.sandbox.support import (
    ServerProcess,
    assert_still_serving,
    scratch_dir,
    start_worker,
)

OK = pb.EXECUTION_STATUS_OK

# Opens /proc/PID/mem of its parent (the zygote) and of every other process it sees, for
# writing and for reading, and prints what each attempt got.
OPEN_OTHERS_MEMORY = """
import os
def attempt(pid, flags):
    try:
        fd = os.open(f"/proc/{pid}/mem", flags)
    except FileNotFoundError:
        return "gone"
    except PermissionError:
        return "denied"
    except OSError as error:
        return type(error).__name__
    os.close(fd)
    return "OPENED"
def show(name, pid):
    print(name, pid, attempt(pid, os.O_RDWR), attempt(pid, os.O_RDONLY))
show("parent", os.getppid())
if EVERY_PROCESS:
    for entry in sorted(os.listdir("/proc")):
        if entry.isdigit() and int(entry) != os.getpid():
            show("other", int(entry))
"""


def run(server: ServerProcess, code: str, timeout: float = 30) -> str:
    with SandboxClient(server.endpoint, timeout=60) as client:
        result = client.execute(Call(code=code, timeout_seconds=timeout))
        assert result.status == OK, result
        assert_still_serving(client)  # and the next call runs as before
    return result.stdout


@pytest.fixture(scope="module")
def termination_log() -> Path:
    """The workers' --termination-log, where calls could reach it were it not hidden."""
    return scratch_dir() / "termination-log"


@pytest.fixture(scope="module", params=["root", "non-root"])
def isolated(
    log_dir: Path, termination_log: Path, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    server = start_worker(
        log_dir, str(request.param), "--termination-log", str(termination_log), executors=1
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def unisolated(log_dir: Path) -> Iterator[ServerProcess]:
    server = start_worker(log_dir, "no-isolation", executors=1)
    yield server
    server.stop()


def assert_no_memory_opened(stdout: str) -> None:
    lines = [line.split() for line in stdout.splitlines()]
    assert lines and lines[0][0] == "parent", stdout
    for _name, _pid, for_writing, for_reading in lines:
        assert for_writing in ("denied", "gone"), stdout
        assert for_reading in ("denied", "gone"), stdout


def test_a_call_cannot_open_another_process_memory(isolated: ServerProcess) -> None:
    stdout = run(isolated, OPEN_OTHERS_MEMORY.replace("EVERY_PROCESS", "True"))
    assert_no_memory_opened(stdout)
    # The zygote, PID 1 of the executor's namespace, is there to be tried, and refuses.
    assert stdout.splitlines()[0] == "parent 1 denied denied", stdout


def test_without_isolation_the_zygote_memory_is_out_of_reach(unisolated: ServerProcess) -> None:
    # The worker's other processes are the call's uid's here (development only, see
    # docs/security.md); its zygote is not dumpable all the same.
    stdout = run(unisolated, OPEN_OTHERS_MEMORY.replace("EVERY_PROCESS", "False"))
    assert_no_memory_opened(stdout)
    assert stdout.split()[2] == "denied", stdout


OOM_SCORES = """
import os
print(open("/proc/self/oom_score_adj").read().strip())
print(open(f"/proc/{os.getppid()}/oom_score_adj").read().strip())
"""


def test_calls_are_the_oom_killers_first_choice(isolated: ServerProcess) -> None:
    call, zygote = run(isolated, OOM_SCORES).split()
    assert call == "1000"
    assert int(zygote) < 1000  # the executor is not


def test_calls_are_the_oom_killers_first_choice_without_isolation(
    unisolated: ServerProcess,
) -> None:
    call, zygote = run(unisolated, OOM_SCORES).split()
    assert (call, int(zygote) < 1000) == ("1000", True)


# Makes empty files in DIRECTORY until it cannot (at most three times the bound), and prints
# how many and what stopped it.
MAKE_FILES = f"""
import errno, os
made = 0
stopped = "never"
try:
    while made < {3 * PRIVATE_TMPFS_INODES}:
        os.close(os.open(os.path.join(DIRECTORY, f"f{{made}}"), os.O_CREAT | os.O_WRONLY))
        made += 1
except OSError as error:
    stopped = errno.errorcode[error.errno]
print(made, stopped)
"""


@pytest.mark.parametrize("directory", ["os.getcwd()", "'/dev/shm'"])
def test_files_in_a_private_tmpfs_are_bounded(isolated: ServerProcess, directory: str) -> None:
    code = MAKE_FILES.replace("DIRECTORY", directory)
    for _ in range(2):  # the next call is not left with fewer
        made, stopped = run(isolated, code).split()
        assert stopped == "ENOSPC"
        # What the tmpfs held before the call counts too: its root, the call directories,
        # the runtime's mount points.
        assert PRIVATE_TMPFS_INODES - 64 <= int(made) < PRIVATE_TMPFS_INODES
    assert run(isolated, "import os\nprint(len(os.listdir('/dev/shm')))") == "0\n"


# Leaves in each of TOPS (its working directory, and /tmp where it is the call's own) a tree
# deeper than PATH_MAX whose deepest folder holds a file, symlinks to / and to its parent, a
# folder it locked (mode 0), and is itself read-only.
DEEP_TREE = """
import os
home = os.getcwd()
for top in TOPS:
    os.chdir(top)
    os.mkdir("deep")
    os.chdir("deep")
    for _ in range(300):  # 300 x 20 bytes: past PATH_MAX (4096)
        os.mkdir("d" * 19 + "_")
        os.chdir("d" * 19 + "_")
    open("bottom", "w").write("x")
    os.symlink("/", "to-root")
    os.symlink("..", "up")
    os.mkdir("locked")
    open("locked/inside", "w").write("x")
    os.chmod("locked", 0)
    os.chmod(".", 0o500)
os.chdir(home)
print(len(os.getcwd()) < 4096)
"""
# Without isolation /tmp is the machine's: only the call's own folders are looked at. A call
# with a uid of its own (a root worker) may not list the folder above its own.
LOOK_AROUND = """
import os
try:
    above = sorted(os.listdir(".."))
except PermissionError:
    above = "not listed"
print(sorted(os.listdir(".")), above, TMP)
"""


def test_a_tree_deeper_than_path_max_is_removed_after_the_call(isolated: ServerProcess) -> None:
    """Nothing of it is left for the next call: its working directory and /tmp are as before
    the call, and no copy of the directory was put aside beside it; /tmp's inodes came back
    (a flat run of files reaches the same bound as before)."""
    look = LOOK_AROUND.replace("TMP", 'sorted(os.listdir("/tmp"))')
    before = run(isolated, look)
    assert run(isolated, DEEP_TREE.replace("TOPS", '(home, "/tmp")')) == "True\n"
    assert run(isolated, look) == before
    made, stopped = run(isolated, MAKE_FILES.replace("DIRECTORY", "'/tmp'")).split()
    assert stopped == "ENOSPC" and int(made) >= PRIVATE_TMPFS_INODES - 64, made
    assert run(isolated, look) == before


def test_without_isolation_a_deep_tree_is_removed_too(unisolated: ServerProcess) -> None:
    look = LOOK_AROUND.replace("TMP", '""')
    before = run(unisolated, look)
    assert run(unisolated, DEEP_TREE.replace("TOPS", "(home,)")) == "True\n"
    assert run(unisolated, look) == before


def test_a_call_cannot_forge_the_termination_message(
    isolated: ServerProcess, termination_log: Path
) -> None:
    """The pod's termination log (which the pool's Ready condition shows) is /dev/null to a
    call: what it writes there goes nowhere, and it reads nothing of the worker's."""
    code = (
        f"path = {str(termination_log)!r}\n"
        "open(path, 'w').write('IsolationUnavailable: forged')\n"
        "print(repr(open(path).read()))"
    )
    assert run(isolated, code).strip() == "''"
    assert termination_log.read_text() == ""


# What a call can learn of the host from /proc, and change there.
READ_PROC = """
import os
def read(path):
    try:
        with open(path, "rb") as handle:
            return "read %d bytes" % len(handle.read(4096))
    except OSError as error:
        return type(error).__name__
def write(path):
    try:
        with open(path, "w") as handle:
            handle.write("|/tmp/owned %p")
        return "WROTE"
    except OSError as error:
        return type(error).__name__
print("keys", read("/proc/keys"))
print("timer_list", read("/proc/timer_list"))
print("sched_debug", read("/proc/sched_debug"))
print("core_pattern", write("/proc/sys/kernel/core_pattern"))
print("own_status", read("/proc/self/status"))
# Read-only for every process of the namespace, the root zygote included.
mounts = [line.split() for line in open("/proc/self/mountinfo")]
print("sys_mount", ([m[5] for m in mounts if m[4] == "/proc/sys"] or ["none"])[-1])
"""


def test_proc_shows_the_call_nothing_of_the_host_and_is_read_only(
    isolated: ServerProcess,
) -> None:
    seen = dict(line.split(" ", 1) for line in run(isolated, READ_PROC).splitlines())
    for hidden in ("keys", "timer_list", "sched_debug"):
        assert seen[hidden] in ("read 0 bytes", "FileNotFoundError"), seen
    assert seen["core_pattern"] in ("OSError", "PermissionError"), seen
    assert "ro" in seen["sys_mount"].split(","), seen
    assert seen["own_status"].startswith("read ") and seen["own_status"] != "read 0 bytes"


# Looks through the call's own writable memory (anonymous mappings, heap, stack: where the
# zygote's buffers and its allocator's memory are) for a 64-hex-digit string whose sha256 is
# DIGEST (the string itself is never in this code), and prints how many it found. A call
# cannot open its own /proc/self/mem (it is not dumpable): it reads the memory in place.
IMPORTS = "import ctypes, hashlib, re\n"  # the same in every call: the same zygote
FIND_EARLIER_CODE = (
    IMPORTS
    + """
found = 0
for line in open("/proc/self/maps").read().splitlines():
    fields = line.split()
    name = fields[5] if len(fields) > 5 else ""
    if not fields[1].startswith("rw") or name not in ("", "[heap]", "[stack]"):
        continue
    start, end = (int(part, 16) for part in fields[0].split("-"))
    chunk = ctypes.string_at(start, end - start)
    for run in re.finditer(rb"[0-9a-f]{64,}", chunk):  # every 64 digits of each run
        digits = run.group()
        for at in range(len(digits) - 63):
            found += hashlib.sha256(digits[at : at + 64]).hexdigest() == "DIGEST"
print(found)
"""
)


def test_nothing_of_a_call_is_in_the_next_calls_memory(isolated: ServerProcess) -> None:
    """The next call on the same executor finds nothing of the code before it (a trajectory's
    hidden tests, another run's data): not in the zygote's request buffer, nor anywhere else
    in the memory it inherits. The first call is long and names the string at its end, where
    the shorter calls after it would not overwrite it."""
    secret = secrets.token_hex(32)
    first = IMPORTS + "# padding\n" * 2000 + f"hidden_tests = {secret!r}\nprint(1)"
    assert run(isolated, first).strip() == "1"
    digest = hashlib.sha256(secret.encode()).hexdigest()
    # The search works: it finds the string in a call that holds it.
    holding = f"held = {secret!r}\n" + FIND_EARLIER_CODE.replace("DIGEST", digest)
    assert int(run(isolated, holding)) >= 1
    assert run(isolated, FIND_EARLIER_CODE.replace("DIGEST", digest)).strip() == "0"


def test_the_names_of_a_calls_files_are_not_in_the_next_calls_memory(
    isolated: ServerProcess,
) -> None:
    """The zygote lists what a call left (its working directory, /tmp) to remove it: the
    names it read (a file named after an answer) are not in the memory the next call
    inherits."""
    seed = secrets.token_hex(16)
    secret = hashlib.sha256(seed.encode()).hexdigest()  # the name; only the seed is in code
    made = IMPORTS + (
        "import os\n"
        f"name = hashlib.sha256({seed!r}.encode()).hexdigest()\n"
        "for folder in ('.', '/tmp', 'sub'):\n"
        "    os.makedirs(folder, exist_ok=True)\n"
        "    open(os.path.join(folder, name), 'w').close()\n"
        "print(len(os.listdir('.')))"
    )
    assert run(isolated, made).strip() == "2"
    digest = hashlib.sha256(secret.encode()).hexdigest()
    assert run(isolated, FIND_EARLIER_CODE.replace("DIGEST", digest)).strip() == "0"
