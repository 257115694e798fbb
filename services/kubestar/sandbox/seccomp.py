"""The syscall filter every call runs under, built with libseccomp.

libseccomp is used through ctypes: only its shared library (`libseccomp.so.2`, Debian's
`libseccomp2`) is needed, no headers and no Python binding.

What a call may not do, whatever its arguments (EPERM): trace or read other processes
(ptrace, process_vm_readv/writev, pidfd_getfd, process_madvise, kcmp), leave or remake its
namespaces and mounts (unshare, setns, mount, umount2, pivot_root, chroot and the new mount
API), reach the kernel's least-tested paths (bpf, perf_event_open, userfaultfd, io_uring,
keyrings, modify_ldt, open_by_handle_at, fanotify) or the machine's controls (kexec, kernel
modules, reboot, swap, syslog, accounting, quotas). socket() and socketpair() of any family
but AF_UNIX, AF_INET and AF_INET6 get EPERM (no netlink, vsock, packet, ... sockets: the
kernel's interfaces a call has no use for; AF_INET is still cut off by the network
namespace). clone() with a namespace flag gets EPERM too; clone3() gets ENOSYS: its flags sit
in memory that a filter cannot read, and C libraries fall back to clone() when it is missing,
whose flags the filter does check. Everything else is allowed. A 32-bit or x32 system call
from the 64-bit process kills it.

The worker loads the filter into each zygote (isolation.py) just before it becomes the zygote;
every call's process is forked from it and inherits it, so the filter is in force before the
first instruction of a call, at no cost to a call. Loading it into each call's process
instead cost 0.15-0.3 ms of CPU a call (the kernel checks, compiles and caches a filter for
each process that loads one): a quarter of what an executor spends on a light call.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

LIBRARY = "libseccomp.so.2"

# Refused with EPERM, whatever their arguments.
DENIED = (
    # Other processes' memory and descriptors.
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "process_madvise",
    "kcmp",
    # Namespaces and mounts.
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    # The kernel's least-tested paths.
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "modify_ldt",
    "uselib",
    "open_by_handle_at",
    "fanotify_init",
    # The machine's controls.
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "syslog",
    "acct",
    "quotactl",
    "quotactl_fd",
    "vhangup",
)
CLONE_NEWTIME = 0x00000080  # unshare() and clone3() only
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
# The namespace flags clone() takes (its low byte is the exit signal, so not CLONE_NEWTIME).
CLONE_NAMESPACE_FLAGS = (
    CLONE_NEWNS,
    CLONE_NEWCGROUP,
    CLONE_NEWUTS,
    CLONE_NEWIPC,
    CLONE_NEWUSER,
    CLONE_NEWPID,
    CLONE_NEWNET,
)
# The only socket families a call may make (socket() and socketpair(), linux/socket.h).
AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)

# libseccomp's actions, attributes and comparison operators (seccomp.h), and the kernel's.
SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_FLTATR_ACT_BADARCH = 2
SCMP_CMP_EQ = 4
SCMP_CMP_GT = 6
SCMP_CMP_MASKED_EQ = 7
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2


def scmp_act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class FilterUnavailable(RuntimeError):
    """The filter cannot be built or loaded here; the message names what failed and why."""


class ArgumentComparison(ctypes.Structure):
    """libseccomp's struct scmp_arg_cmp: argument `arg` compared by `op` with the data."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def arg0_has(flags: int) -> ArgumentComparison:
    """The first argument has all of `flags` set."""
    return ArgumentComparison(0, SCMP_CMP_MASKED_EQ, flags, flags)


def arg0_is(value: int) -> ArgumentComparison:
    return ArgumentComparison(0, SCMP_CMP_EQ, value, 0)


def arg0_above(value: int) -> ArgumentComparison:
    """The first argument, as a 64-bit register, is greater than `value`."""
    return ArgumentComparison(0, SCMP_CMP_GT, value, 0)


def _describe(code: int) -> str:
    return f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})"


@functools.cache
def library() -> ctypes.CDLL:
    try:
        seccomp = ctypes.CDLL(LIBRARY, use_errno=True)
    except OSError as error:
        raise FilterUnavailable(
            f"{LIBRARY} cannot be loaded ({error}): install libseccomp (libseccomp2)"
        ) from None
    seccomp.seccomp_init.restype = ctypes.c_void_p
    seccomp.seccomp_init.argtypes = [ctypes.c_uint32]
    seccomp.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    seccomp.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(ArgumentComparison),
    ]
    seccomp.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    seccomp.seccomp_release.argtypes = [ctypes.c_void_p]
    return seccomp


def syscall_number(name: str) -> int:
    """The native system call number of `name`, or -1 where this architecture has none."""
    number = library().seccomp_syscall_resolve_name(name.encode())
    return int(number) if number >= 0 else -1


class Filter:
    """A filter that allows every system call but the ones refused."""

    def __init__(self) -> None:
        self._seccomp = library()
        self._context = self._seccomp.seccomp_init(SCMP_ACT_ALLOW)
        if not self._context:
            raise FilterUnavailable("seccomp_init failed")
        self._seccomp.seccomp_attr_set(
            self._context, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS
        )

    def refuse(
        self, syscall: str, code: int = errno.EPERM, *comparisons: ArgumentComparison
    ) -> None:
        """`syscall` fails with `code` (when every comparison holds); skipped where this
        architecture has no such system call."""
        number = syscall_number(syscall)
        if number < 0:
            return
        array = (ArgumentComparison * len(comparisons))(*comparisons)
        result = self._seccomp.seccomp_rule_add_array(
            self._context, scmp_act_errno(code), number, len(comparisons), array
        )
        if result != 0:
            raise FilterUnavailable(f"seccomp_rule_add({syscall}) failed: {_describe(-result)}")

    def export_bpf(self) -> bytes:
        """The filter as the kernel takes it: an array of struct sock_filter."""
        fd = os.memfd_create("seccomp-filter", os.MFD_CLOEXEC)
        try:
            result = self._seccomp.seccomp_export_bpf(self._context, fd)
            if result != 0:
                raise FilterUnavailable(f"seccomp_export_bpf failed: {_describe(-result)}")
            return os.pread(fd, os.lseek(fd, 0, os.SEEK_CUR), 0)
        finally:
            os.close(fd)

    def load(self) -> None:
        """Into this process, after PR_SET_NO_NEW_PRIVS, for good: every process it forks or
        execs inherits the filter. Loaded with prctl rather than libseccomp's seccomp_load,
        which reports some of the kernel's refusals as EFAULT."""
        install(self.export_bpf())

    def close(self) -> None:
        if self._context:
            self._seccomp.seccomp_release(self._context)
            self._context = None


class SockFprog(ctypes.Structure):
    """struct sock_fprog: a classic BPF program, as PR_SET_SECCOMP takes it."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


SOCK_FILTER_BYTES = 8  # struct sock_filter: u16 code, u8 jt, u8 jf, u32 k
# Why the kernel refuses a filter, by errno.
_LOAD_REFUSED = {
    errno.EPERM: "a seccomp filter this worker runs under refuses seccomp()",
    errno.EINVAL: "the kernel lacks seccomp filters (CONFIG_SECCOMP_FILTER)",
    errno.EACCES: "no_new_privs is not set",
    errno.ENOMEM: "the kernel is out of memory, or the process has too many filters",
}


def install(program: bytes) -> None:
    """Set no_new_privs, then load `program` (see Filter.export_bpf) as this process's filter."""
    libc = ctypes.CDLL(None, use_errno=True)
    # prctl(option, arg2, arg3, arg4, arg5): no_new_privs refuses unused arguments but 0.
    ulong = ctypes.c_ulong
    libc.prctl.argtypes = [ctypes.c_int, ulong, ctypes.c_void_p, ulong, ulong]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        raise FilterUnavailable(
            f"prctl(PR_SET_NO_NEW_PRIVS) failed: {_describe(ctypes.get_errno())}"
        )
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // SOCK_FILTER_BYTES, ctypes.cast(buffer, ctypes.c_void_p))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        code = ctypes.get_errno()
        why = _LOAD_REFUSED.get(code)
        raise FilterUnavailable(
            f"prctl(PR_SET_SECCOMP) failed: {_describe(code)}{': ' + why if why else ''}"
        )


@contextmanager
def new_filter() -> Iterator[Filter]:
    built = Filter()
    try:
        yield built
    finally:
        built.close()


def build_call_filter(built: Filter) -> None:
    """The rules of the filter calls run under (see the module's docstring)."""
    for syscall in DENIED:
        built.refuse(syscall)
    built.refuse("clone3", errno.ENOSYS)
    for flag in CLONE_NAMESPACE_FLAGS:
        built.refuse("clone", errno.EPERM, arg0_has(flag))
    # Every family but SOCKET_FAMILIES: each value below the highest one, and anything above
    # it (the whole register: upper bits set do not turn a refused family into an allowed one).
    highest = max(SOCKET_FAMILIES)
    for syscall in ("socket", "socketpair"):
        for family in range(highest):
            if family not in SOCKET_FAMILIES:
                built.refuse(syscall, errno.EPERM, arg0_is(family))
        built.refuse(syscall, errno.EPERM, arg0_above(highest))


def load_call_filter() -> None:
    """Load the calls' filter into this process and check that the kernel enforces it;
    raises FilterUnavailable naming what failed."""
    with new_filter() as built:
        build_call_filter(built)
        built.load()
    check_enforced()


def check_enforced() -> None:
    """This process runs under the calls' filter with no_new_privs: its /proc status says
    so, and two refused system calls (with arguments the kernel itself would refuse
    otherwise: no harm if they ran) answer what the filter answers."""
    with open("/proc/self/status") as handle:
        status = dict(line.split(":\t", 1) for line in handle.read().splitlines() if ":\t" in line)
    if status.get("NoNewPrivs", "").strip() != "1":
        raise FilterUnavailable("no_new_privs is not set after loading the filter")
    if status.get("Seccomp", "").strip() != "2":
        raise FilterUnavailable("the process is not in seccomp filter mode after loading it")
    libc = ctypes.CDLL(None, use_errno=True)
    for syscall, args, expected in (
        ("setns", (-1, 0), errno.EPERM),
        ("clone3", (0, 0), errno.ENOSYS),
    ):
        number = syscall_number(syscall)
        if number < 0:
            continue
        ctypes.set_errno(0)
        result = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
        got = ctypes.get_errno()
        if result != -1 or got != expected:
            answer = _describe(got) if result == -1 else f"success ({result})"
            raise FilterUnavailable(
                f"{syscall}() answered {answer} under the filter, not {_describe(expected)}"
            )
