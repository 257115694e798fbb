"""Every call runs under the syscall filter (kubestar.sandbox.seccomp) with no_new_privs, an
allow-list: what it refuses by name answers EPERM, what is not on the list ENOSYS (clone3,
personality but the query, sched_setaffinity, ioprio_set, ...), the call goes on, and the
worker serves the next call; a maths call's usual work (numpy, sympy, threads, subprocesses,
a multiprocessing pool, sockets, temporary files, sleeping, signals) runs as without it.

Workers run as root and as pods run them (a non-root uid in a user namespace,
tests.sandbox.unprivileged). A worker started with --no-syscall-filter shows what the same
calls get from the kernel alone.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubestar.sandbox import seccomp
from kubestar.sandbox.client import Call, SandboxClient
from kubestar.v1 import sandbox_pb2 as pb

from tests.real_parts import missing, require_modules
from tests.sandbox.support import (
    TEST_PRELOAD,
    ServerProcess,
    assert_still_serving,
    start_worker,
)

PTRACE_ATTACH = 16
NO_SUCH_PID = 2**31 - 1
SIGCHLD = 17
# The system calls the filter must refuse, with arguments the kernel alone would answer
# otherwise (ESRCH, EFAULT, EINVAL, EBADF, ...; kexec and modules: ENOSYS where the kernel
# has neither, EPERM where it does), so that the EPERM seen comes from the filter. Harmless
# if they ran.
PROBES: dict[str, tuple[int, ...]] = {
    "ptrace": (PTRACE_ATTACH, NO_SUCH_PID, 0, 0),
    "mount": (1, 0, 0, 0, 0),  # a bad address
    "umount2": (0, 0x80000000),  # an unknown flag
    "setns": (-1, 0),
    "bpf": (9999, 0, 0),  # no such command
    "perf_event_open": (0, 0, -1, -1, 0xFFFFFFFF),
    "keyctl": (0x7FFFFFFF,),
    "add_key": (0, 0, 0, 0, 0),
    "request_key": (0, 0, 0, 0),
    "io_uring_setup": (1, 0),
    "io_uring_enter": (-1, 0, 0, 0, 0, 0),
    "io_uring_register": (-1, 0, 0, 0),
    "userfaultfd": (0x7FFFFFFF,),
    "kexec_load": (0, 0, 0, 0),
    "kexec_file_load": (-1, -1, 0, 0, 0x7FFFFFFF),
    "init_module": (0, 0, 0),
    "finit_module": (-1, 0, 0x7FFFFFFF),
    "delete_module": (0, 0),
    "process_vm_readv": (0, 0, 0, 0, 0, 1),  # an unknown flag
    "process_vm_writev": (0, 0, 0, 0, 0, 1),
    "clone3": (0, 0),  # too small: EINVAL
    # Last: it succeeds without the filter, and the process is then in a user namespace
    # where its uid has no mapping (clone with CLONE_NEWUSER fails there).
    "unshare": (seccomp.CLONE_NEWUSER,),
}
PER_BSD = 0x0006
ADDR_NO_RANDOMIZE = 0x0040000
IOPRIO_WHO_PROCESS = 1
IOPRIO_IDLE = 3 << 13
# Refused only for not being on the allow-list (ENOSYS; the kernel alone answers otherwise,
# shown with the filter off): label -> system call and arguments. Harmless if they ran: the
# call's own process only, or arguments the kernel refuses.
NOT_ALLOWED_PROBES: dict[str, tuple[str, tuple[int, ...]]] = {
    "personality(PER_BSD)": ("personality", (PER_BSD,)),
    "personality(ADDR_NO_RANDOMIZE)": ("personality", (ADDR_NO_RANDOMIZE,)),
    "sched_setaffinity": ("sched_setaffinity", (0, 8, 0)),  # no mask: EFAULT
    "ioprio_set": ("ioprio_set", (IOPRIO_WHO_PROCESS, 0, IOPRIO_IDLE)),
    "setdomainname": ("setdomainname", (0, -1)),  # a negative length: EPERM or EINVAL
    "personality(query)": ("personality", (seccomp.PERSONALITY_QUERY,)),  # allowed
}
NAMESPACE_FLAGS = {
    "CLONE_NEWNS": seccomp.CLONE_NEWNS,
    "CLONE_NEWCGROUP": seccomp.CLONE_NEWCGROUP,
    "CLONE_NEWUTS": seccomp.CLONE_NEWUTS,
    "CLONE_NEWIPC": seccomp.CLONE_NEWIPC,
    "CLONE_NEWPID": seccomp.CLONE_NEWPID,
    "CLONE_NEWNET": seccomp.CLONE_NEWNET,
}
PRELOAD = (*TEST_PRELOAD, "ctypes", "threading")


def probe_code() -> str:
    """A call that makes each probe and prints `name ERRNO` (or `name ok`), then shows that it
    still runs: a thread (clone3, then clone), a process (posix_spawn: the same) and a fork."""
    try:
        numbers = {name: seccomp.syscall_number(name) for name in [*PROBES, "clone"]}
        not_allowed = {
            label: (seccomp.syscall_number(name), args)
            for label, (name, args) in NOT_ALLOWED_PROBES.items()
        }
    except seccomp.FilterUnavailable as error:
        missing(str(error))
    # clone with CLONE_NEWUSER plus each flag: without the filter the call may make them all.
    clones = {"CLONE_NEWUSER": seccomp.CLONE_NEWUSER} | {
        f"CLONE_NEWUSER|{name}": seccomp.CLONE_NEWUSER | flag
        for name, flag in NAMESPACE_FLAGS.items()
    }
    return f"""
import ctypes, errno, os, threading
libc = ctypes.CDLL(None, use_errno=True)
def answer(result):
    return "ok" if result >= 0 else errno.errorcode[ctypes.get_errno()]
def syscall(number, *args):
    ctypes.set_errno(0)
    return libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
for name, flags in {clones!r}.items():
    pid = syscall({numbers["clone"]}, flags | {SIGCHLD}, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
    print("clone(" + name + ")", answer(pid))
for name, args in {PROBES!r}.items():
    print(name, answer(syscall({numbers!r}[name], *args)))
for label, (number, args) in {not_allowed!r}.items():
    print(label, answer(syscall(number, *args)))
ran = []
thread = threading.Thread(target=ran.append, args=("thread",))
thread.start()
thread.join()
pid = os.posix_spawn("/bin/true", ["true"], {{}})
ran.append("spawned" if os.waitpid(pid, 0)[1] == 0 else "spawn failed")
pid = os.fork()
if pid == 0:
    os._exit(7)
ran.append("forked" if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7 else "fork failed")
print(*ran)
"""


# socket() of each family (with a type the family takes), socketpair() of some, and socket()
# through the raw system call with bits above the 32-bit family set (the kernel reads an int:
# 1 << 32 | AF_NETLINK is a netlink socket to it).
SOCKET_PROBES = """
import ctypes, errno, socket
libc = ctypes.CDLL(None, use_errno=True)
def answer(make):
    try:
        made = make()
    except OSError as error:
        return errno.errorcode[error.errno]
    for one in made if isinstance(made, tuple) else (made,):
        one.close()
    return "ok"
def raw_socket(family, kind, protocol=0):
    ctypes.set_errno(0)
    fd = libc.syscall(
        ctypes.c_long(SOCKET), ctypes.c_long(family), ctypes.c_long(kind), ctypes.c_long(protocol)
    )
    if fd < 0:
        return errno.errorcode[ctypes.get_errno()]
    socket.close(fd)
    return "ok"
flags = socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
for name, family, kind, protocol in [
    ("AF_UNIX", socket.AF_UNIX, socket.SOCK_STREAM, 0),
    ("AF_INET", socket.AF_INET, socket.SOCK_STREAM, 0),
    ("AF_INET_TCP", socket.AF_INET, socket.SOCK_STREAM | flags, socket.IPPROTO_TCP),
    ("AF_INET_UDP", socket.AF_INET, socket.SOCK_DGRAM, 0),
    ("AF_INET6_UDP", socket.AF_INET6, socket.SOCK_DGRAM | flags, socket.IPPROTO_UDP),
    ("AF_INET_SCTP", socket.AF_INET, socket.SOCK_STREAM, 132),
    ("AF_INET6_SCTP", socket.AF_INET6, socket.SOCK_SEQPACKET, 132),
    ("AF_INET_DCCP", socket.AF_INET, 6, 33),
    ("AF_INET_L2TP", socket.AF_INET, socket.SOCK_DGRAM, 115),
    ("AF_INET_PING", socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP),
    ("AF_INET_RAW", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW),
    ("AF_NETLINK", socket.AF_NETLINK, socket.SOCK_RAW, 0),
    ("AF_VSOCK", 40, socket.SOCK_STREAM, 0),
    ("AF_PACKET", socket.AF_PACKET, socket.SOCK_RAW, 0),
    ("AF_ALG", 38, socket.SOCK_SEQPACKET, 0),
    ("AF_UNSPEC", 0, socket.SOCK_STREAM, 0),
]:
    print(name, answer(lambda: socket.socket(family, kind, protocol)))
print("socketpair(AF_UNIX)", answer(lambda: socket.socketpair(socket.AF_UNIX)))
netlink_pair = lambda: socket.socketpair(socket.AF_NETLINK, socket.SOCK_RAW)
print("socketpair(AF_NETLINK)", answer(netlink_pair))
print("raw(AF_UNIX)", raw_socket(socket.AF_UNIX, socket.SOCK_STREAM))
print("raw(1<<32|AF_NETLINK)", raw_socket(1 << 32 | socket.AF_NETLINK, socket.SOCK_RAW))
# The kernel reads an int: 1 << 32 | 132 would be SCTP to it.
print("raw(AF_INET, 1<<32|SCTP)", raw_socket(socket.AF_INET, socket.SOCK_STREAM, 1 << 32 | 132))
"""


def socket_answers(server: ServerProcess) -> dict[str, str]:
    try:
        number = seccomp.syscall_number("socket")
    except seccomp.FilterUnavailable as error:
        missing(str(error))
    with SandboxClient(server.endpoint, timeout=60) as client:
        result = client.execute(SOCKET_PROBES.replace("SOCKET", str(number)))
        assert result.status == pb.EXECUTION_STATUS_OK, result
        assert_still_serving(client)
    return dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())


def test_only_unix_tcp_and_udp_sockets_are_allowed(filtered: ServerProcess) -> None:
    answers = socket_answers(filtered)
    assert answers == {
        "AF_UNIX": "ok",
        "AF_INET": "ok",  # still cut off from the network by the network namespace
        "AF_INET_TCP": "ok",
        "AF_INET_UDP": "ok",
        "AF_INET6_UDP": "ok",
        # No protocol whose module the kernel would load on demand, no raw or ping socket.
        "AF_INET_SCTP": "EPERM",
        "AF_INET6_SCTP": "EPERM",
        "AF_INET_DCCP": "EPERM",
        "AF_INET_L2TP": "EPERM",
        "AF_INET_PING": "EPERM",
        "AF_INET_RAW": "EPERM",
        "raw(AF_INET, 1<<32|SCTP)": "EPERM",
        "AF_NETLINK": "EPERM",
        "AF_VSOCK": "EPERM",
        "AF_PACKET": "EPERM",
        "AF_ALG": "EPERM",
        "AF_UNSPEC": "EPERM",
        "socketpair(AF_UNIX)": "ok",
        "socketpair(AF_NETLINK)": "EPERM",
        "raw(AF_UNIX)": "ok",
        "raw(1<<32|AF_NETLINK)": "EPERM",
    }


def run_probes(server: ServerProcess) -> dict[str, str]:
    with SandboxClient(server.endpoint, timeout=60) as client:
        result = client.execute(Call(code=probe_code(), timeout_seconds=30))
        assert result.status == pb.EXECUTION_STATUS_OK, result
        *answers, ran = result.stdout.splitlines()
        # Refused, not killed: the call went on, and the worker serves the next call.
        assert ran == "thread spawned forked", result
        assert_still_serving(client)
    return dict(answer.rsplit(" ", 1) for answer in answers)


@pytest.fixture(scope="module", params=["root", "non-root"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def filtered(log_dir: Path, mode: str) -> Iterator[ServerProcess]:
    server = start_worker(log_dir, mode, preload=PRELOAD)
    yield server
    server.stop()


def test_the_allow_list_leaves_out_what_no_call_needs() -> None:
    allowed = {*seccomp.ALLOWED, *seccomp.ALLOWED_WITH_ARGUMENTS}
    assert not allowed & set(seccomp.DENIED)
    knobs = {
        "clone3",
        "sched_setaffinity",
        "sched_setscheduler",
        "sched_setattr",
        "ioprio_set",
        "sethostname",
        "setdomainname",
        "settimeofday",
        "clock_settime",
        "adjtimex",
        "mbind",
        "set_mempolicy",
        "mq_open",
        "io_setup",
        "sync",
        "syncfs",
        "cachestat",
        "vmsplice",
        "tee",
        "membarrier",
    }
    assert not allowed & knobs


def test_every_call_runs_under_the_filter_with_no_new_privs(filtered: ServerProcess) -> None:
    code = "print(open('/proc/self/status').read())"
    with SandboxClient(filtered.endpoint, timeout=60) as client:
        results = client.execute_batch([code, f"import ctypes\n{code}"] * 2)  # both zygotes
    for result in results:
        assert result.status == pb.EXECUTION_STATUS_OK, result
        status = dict(line.split(":\t", 1) for line in result.stdout.splitlines() if ":\t" in line)
        assert status["NoNewPrivs"] == "1", result.stdout
        assert status["Seccomp"] == "2", result.stdout  # filter mode
        assert int(status["Seccomp_filters"]) >= 1, result.stdout


def test_refused_system_calls_fail_and_the_call_goes_on(filtered: ServerProcess) -> None:
    answers = run_probes(filtered)
    refused = errno.errorcode[seccomp.REFUSED_ERRNO]
    assert refused == "ENOSYS"
    expected = {name: "EPERM" for name in PROBES} | {"clone3": refused}
    expected |= {label: refused for label in NOT_ALLOWED_PROBES} | {"personality(query)": "ok"}
    expected |= {
        f"clone(CLONE_NEWUSER{'|' + n if n else ''})": "EPERM" for n in ["", *NAMESPACE_FLAGS]
    }
    assert answers == expected
    assert 'syscall_filter": true' in filtered.log()


def test_without_the_filter_the_kernel_answers(log_dir: Path, mode: str) -> None:
    """--no-syscall-filter: the same calls make namespaces and get the kernel's own errors."""
    server = start_worker(log_dir, mode, "--no-syscall-filter", preload=PRELOAD)
    try:
        answers = run_probes(server)
        sockets = socket_answers(server)
        log = server.log()
    finally:
        server.stop()
    assert answers["unshare"] == "ok"
    assert {answers[f"clone(CLONE_NEWUSER|{name})"] for name in NAMESPACE_FLAGS} == {"ok"}
    assert answers["clone3"] == errno.errorcode[errno.EINVAL]
    assert answers["setns"] == "EBADF"
    assert answers["ptrace"] == "ESRCH"
    assert answers["mount"] == "EFAULT"
    assert answers["personality(PER_BSD)"] == "ok"
    assert answers["personality(ADDR_NO_RANDOMIZE)"] == "ok"
    assert answers["sched_setaffinity"] == "EFAULT"
    assert answers["ioprio_set"] == "ok"
    assert answers["setdomainname"] in ("EPERM", "EINVAL")
    # Netlink needs no privilege: the kernel makes it, here with the filter off.
    assert (sockets["AF_NETLINK"], sockets["raw(1<<32|AF_NETLINK)"]) == ("ok", "ok")
    assert sockets["AF_VSOCK"] != "EPERM"  # EAFNOSUPPORT where the kernel lacks vsock
    assert "the syscall filter is off (--no-syscall-filter)" in log


# A maths call's usual work, each step printing `name result`; os.sched_setaffinity is the one
# thing it asks that the filter refuses.
WORKLOAD = r"""
import errno, multiprocessing, os, signal, socket, subprocess, sys, tempfile, threading, time
import numpy as np
import sympy as sp

def outcome(action):
    try:
        action()
    except OSError as error:
        return errno.errorcode[error.errno]
    return "ran"

matrix = np.arange(1.0, 10.0).reshape(3, 3) + np.eye(3)
ones = np.ones((200, 200))
print("numpy", round(float(np.linalg.det(matrix))), float((ones @ ones)[0, 0]))
x = sp.symbols("x")
print("sympy", sp.solve(x**2 - 5 * x + 6, x))
seen = []
threads = [threading.Thread(target=seen.append, args=(n,)) for n in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("threads", sorted(seen))
child = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
print("subprocess", child.returncode, child.stdout.strip())
with multiprocessing.Pool(2) as pool:
    print("pool", pool.map(abs, [-1, -2, 3]))
left, right = socket.socketpair(socket.AF_UNIX)
left.sendall(b"ping")
print("socketpair", right.recv(4).decode())
with tempfile.TemporaryDirectory() as directory:
    with open(os.path.join(directory, "data"), "w") as handle:
        handle.write("1")
    os.mkfifo(os.path.join(directory, "fifo"))
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(directory, "socket"))
    listener.listen()
    dialer = socket.socket(socket.AF_UNIX)
    dialer.connect(os.path.join(directory, "socket"))
    accepted, _ = listener.accept()
    dialer.sendall(b"x")
    print("unix_socket", accepted.recv(1).decode())
    print("tempfile", sorted(os.listdir(directory)))
started = time.monotonic()
time.sleep(0.05)
print("sleep", time.monotonic() - started >= 0.05)
caught = []
signal.signal(signal.SIGALRM, lambda number, frame: caught.append("SIGALRM"))
signal.signal(signal.SIGUSR1, lambda number, frame: caught.append("SIGUSR1"))
signal.setitimer(signal.ITIMER_REAL, 0.01)
while not caught:
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGUSR1)
print("signals", caught)
print("nice", outcome(lambda: os.nice(0)))
print("sched_setaffinity", outcome(lambda: os.sched_setaffinity(0, os.sched_getaffinity(0))))
"""


def test_a_maths_calls_usual_work_runs_under_the_filter(filtered: ServerProcess) -> None:
    require_modules("numpy", "sympy")
    with SandboxClient(filtered.endpoint, timeout=120) as client:
        result = client.execute(Call(code=WORKLOAD, timeout_seconds=90))
        assert result.status == pb.EXECUTION_STATUS_OK, result
        assert_still_serving(client)
    answers = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert answers == {
        "numpy": "-2 200.0",
        "sympy": "[2, 3]",
        "threads": "[0, 1, 2, 3]",
        "subprocess": "0 42",
        "pool": "[1, 2, 3]",
        "socketpair": "ping",
        "unix_socket": "x",
        "tempfile": "['data', 'fifo', 'socket']",
        "sleep": "True",
        "signals": "['SIGALRM', 'SIGUSR1']",
        "nice": "ran",  # setpriority on itself
        "sched_setaffinity": errno.errorcode[seccomp.REFUSED_ERRNO],
    }, result
