"""The syscall filter every call runs under, built with libseccomp.

libseccomp is used through ctypes: only its shared library (`libseccomp.so.2`, Debian's
`libseccomp2`) is needed, no headers and no Python binding.

It is an allow-list. A call may make the system calls in ALLOWED: what CPython and the
libraries a maths call uses (numpy, sympy, OpenBLAS's threads, subprocess and multiprocessing,
files, pipes, sockets, select/poll/epoll, futexes, signals, timers, mmap, System V IPC) need,
and what the zygote needs to serve calls after it loaded the filter (fork, setuid/setgid/
setgroups, prctl, chdir, mkdir, chown, kill, wait4, pidfd_open, removing files, the IPC *ctl
calls, setrlimit, writing oom_score_adj, reading /proc). The list is container runtimes'
default profile (what they allow a container that holds no extra capability) minus what a call
has no use for. Every other system call fails with ENOSYS (REFUSED_ERRNO), which is what the
kernel answers for one it lacks: C libraries and CPython then fall back to an older call
(clone3 to clone, faccessat2 to faccessat, close_range to close, ...), as they do under
container runtimes, which answer ENOSYS for system calls newer than their profile. Among them:
sched_setaffinity (where the worker pins each executor to a CPU, a call stays on it),
sched_setscheduler and the other scheduler setters, ioprio_set, mbind and the other memory
policies (OpenBLAS asks mbind for a NUMA preference and goes on without), sethostname and
setdomainname, the clocks' setters (settimeofday, clock_settime, adjtimex), POSIX message
queues (kept across calls: an executor empties only System V objects), kernel AIO, sync and
syncfs (they flush every filesystem of the machine), cachestat (what the page cache holds of
a file: a side channel), vmsplice, tee and membarrier (kernel paths with a history of flaws
that CPython and the maths libraries never take), and any system call newer than this
libseccomp.

Some allowed calls are allowed only with some arguments, the rest answering ENOSYS as well:
personality() only as a query (0xffffffff) or to set plain PER_LINUX (0), not to turn off
address-space randomisation for what the call execs; mknod() only for FIFOs (os.mkfifo);
setpriority() and prlimit64() only on the calling process itself (under a worker not running
as root a call shares its zygote's uid, and could otherwise slow the zygote down or lower its
limits, and so every call after it).

What a call must never do is refused by name, whatever its arguments, with EPERM (DENIED), the
answer container runtimes give for it to a container without the capability: trace or read
other processes (ptrace, process_vm_readv/writev, pidfd_getfd, process_madvise, kcmp), leave
or remake its namespaces and mounts (unshare, setns, mount, umount2, pivot_root, chroot and the
new mount API), reach the kernel's least-tested paths (bpf, perf_event_open, userfaultfd,
io_uring, keyrings, modify_ldt, open_by_handle_at, fanotify) or the machine's controls (kexec,
kernel modules, reboot, swap, syslog, accounting, quotas). socket() and socketpair() of any
family but AF_UNIX, AF_INET and AF_INET6 get EPERM (no netlink, vsock, packet, ... sockets:
the kernel's interfaces a call has no use for), and so do AF_INET and AF_INET6 sockets but TCP
and UDP ones (no SCTP, DCCP, L2TP, raw or ping sockets, whose modules the kernel would load on
demand; TCP and UDP are still cut off by the network namespace). clone() with a namespace
flag gets EPERM too; clone3() is not on the list (ENOSYS): its flags sit in memory that a
filter cannot read, and C libraries fall back to clone() when it is missing, whose flags the
filter does check. A 32-bit or x32 system call from the 64-bit process kills it.

The worker loads the filter into each zygote (isolation.py) just before it becomes the zygote;
every call's process is forked from it and inherits it, so the filter is in force before the
first instruction of a call, at no cost to a call. Loading it into each call's process
instead cost 0.15-0.3 ms of CPU a call (the kernel checks, compiles and caches a filter for
each process that loads one): a quarter of what an executor spends on a light call. The
kernel answers a system call the filter allows whatever its arguments from a per-filter
cache, without running the filter; only the few with argument rules (clone, socket,
prlimit64, ...) and refused ones run it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import operator
import os
from collections.abc import Iterator
from contextlib import contextmanager

LIBRARY = "libseccomp.so.2"

# Every system call not allowed below fails with this: what the kernel answers for a system
# call it lacks, so that C libraries and CPython fall back to an older one (clone3 to clone,
# faccessat2 to faccessat, ...) rather than fail, as under container runtimes' profiles.
REFUSED_ERRNO = errno.ENOSYS

# What a call's processes (and the zygote serving them) may do, whatever the arguments: container
# runtimes' default profile for a container without extra capabilities, minus DENIED and what a
# call has no use for (see the module's docstring). Names this architecture or this libseccomp
# does not know are skipped (refused). Allowed with some arguments only: ALLOWED_WITH_ARGUMENTS.
ALLOWED = (
    # Processes and threads (clone with argument rules, below).
    "fork",
    "vfork",
    "execve",
    "execveat",
    "exit",
    "exit_group",
    "wait4",
    "waitid",
    "kill",
    "tkill",
    "tgkill",
    "pidfd_open",
    "pidfd_send_signal",
    "getpid",
    "getppid",
    "gettid",
    "getpgid",
    "getpgrp",
    "setpgid",
    "getsid",
    "setsid",
    "set_tid_address",
    "set_robust_list",
    "rseq",
    "futex",
    "futex_waitv",
    "futex_wake",
    "futex_wait",
    "futex_requeue",
    "arch_prctl",
    "prctl",
    "restart_syscall",
    # Reading the scheduler's settings (setting them is refused), the CPU and its priority.
    "sched_yield",
    "sched_getaffinity",
    "sched_getparam",
    "sched_getscheduler",
    "sched_getattr",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_rr_get_interval",
    "getpriority",
    "getcpu",
    # Credentials: the zygote drops each call to its uid; without capabilities a call can only
    # give up what it holds.
    "getuid",
    "geteuid",
    "getgid",
    "getegid",
    "getresuid",
    "getresgid",
    "getgroups",
    "setuid",
    "setgid",
    "setgroups",
    "setreuid",
    "setregid",
    "setresuid",
    "setresgid",
    "setfsuid",
    "setfsgid",
    "capget",
    "capset",
    # Signals and timers.
    "rt_sigaction",
    "rt_sigprocmask",
    "rt_sigreturn",
    "rt_sigpending",
    "rt_sigsuspend",
    "rt_sigtimedwait",
    "rt_sigqueueinfo",
    "rt_tgsigqueueinfo",
    "sigaltstack",
    "signalfd",
    "signalfd4",
    "pause",
    "alarm",
    "getitimer",
    "setitimer",
    "timer_create",
    "timer_settime",
    "timer_gettime",
    "timer_getoverrun",
    "timer_delete",
    "timerfd_create",
    "timerfd_settime",
    "timerfd_gettime",
    # Clocks (reading them) and sleeping.
    "clock_gettime",
    "clock_getres",
    "clock_nanosleep",
    "nanosleep",
    "gettimeofday",
    "time",
    "times",
    # Memory.
    "brk",
    "mmap",
    "munmap",
    "mremap",
    "mprotect",
    "madvise",
    "mincore",
    "msync",
    "mlock",
    "mlock2",
    "munlock",
    "mlockall",
    "munlockall",
    "memfd_create",
    "pkey_alloc",
    "pkey_free",
    "pkey_mprotect",
    "map_shadow_stack",
    "mseal",
    "uretprobe",  # the kernel's own return trampoline, when a profiler probes a function
    # Descriptors, files and directories.
    "read",
    "write",
    "readv",
    "writev",
    "pread64",
    "pwrite64",
    "preadv",
    "pwritev",
    "preadv2",
    "pwritev2",
    "open",
    "openat",
    "openat2",
    "creat",
    "close",
    "close_range",
    "lseek",
    "dup",
    "dup2",
    "dup3",
    "fcntl",
    "flock",
    "ioctl",
    "pipe",
    "pipe2",
    "eventfd",
    "eventfd2",
    "stat",
    "fstat",
    "lstat",
    "newfstatat",
    "statx",
    "statfs",
    "fstatfs",
    "access",
    "faccessat",
    "faccessat2",
    "readlink",
    "readlinkat",
    "getdents",
    "getdents64",
    "getcwd",
    "chdir",
    "fchdir",
    "mkdir",
    "mkdirat",
    "rmdir",
    "rename",
    "renameat",
    "renameat2",
    "link",
    "linkat",
    "symlink",
    "symlinkat",
    "unlink",
    "unlinkat",
    "chmod",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "chown",
    "fchown",
    "fchownat",
    "lchown",
    "umask",
    "truncate",
    "ftruncate",
    "fallocate",
    "fsync",
    "fdatasync",
    "sync_file_range",
    "fadvise64",
    "readahead",
    "utime",
    "utimes",
    "utimensat",
    "futimesat",
    "sendfile",
    "copy_file_range",
    "splice",
    "getxattr",
    "lgetxattr",
    "fgetxattr",
    "listxattr",
    "llistxattr",
    "flistxattr",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
    "inotify_init",
    "inotify_init1",
    "inotify_add_watch",
    "inotify_rm_watch",
    # Waiting on descriptors.
    "select",
    "pselect6",
    "poll",
    "ppoll",
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_wait",
    "epoll_pwait",
    "epoll_pwait2",
    # Sockets (socket and socketpair with argument rules, below).
    "bind",
    "listen",
    "accept",
    "accept4",
    "connect",
    "getsockname",
    "getpeername",
    "getsockopt",
    "setsockopt",
    "sendto",
    "recvfrom",
    "sendmsg",
    "recvmsg",
    "sendmmsg",
    "recvmmsg",
    "shutdown",
    # System V IPC, between a call's processes; the zygote removes what a call left (the *ctl
    # calls).
    "shmget",
    "shmat",
    "shmdt",
    "shmctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    # The machine, as a process sees it, and its own limits (prlimit64 with argument rules).
    "uname",
    "sysinfo",
    "getrusage",
    "getrandom",
    "getrlimit",
    "setrlimit",
    # Only ever restrict the caller further.
    "seccomp",
    "landlock_create_ruleset",
    "landlock_add_rule",
    "landlock_restrict_self",
)
# Allowed with some arguments only (see build_call_filter); otherwise REFUSED_ERRNO.
ALLOWED_WITH_ARGUMENTS = (
    "clone",
    "socket",
    "socketpair",
    "personality",
    "mknod",
    "mknodat",
    "setpriority",
    "prlimit64",
)

# What a call must never do: refused by name with EPERM, whatever the arguments, as container
# runtimes answer a container without the capability these need. Not on ALLOWED either.
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
# Of AF_INET and AF_INET6, only TCP and UDP (a call has no network: its loopback is down), not
# the protocols whose modules the kernel would load on demand (SCTP, DCCP, L2TP, ...):
# each type (the low bits of socket()'s second argument; the rest are SOCK_NONBLOCK and
# SOCK_CLOEXEC) with the protocols it may name, 0 being the type's default.
SOCK_TYPE_MASK = 0xF
SOCK_STREAM, SOCK_DGRAM = 1, 2
IPPROTO_TCP, IPPROTO_UDP = 6, 17
INET_PROTOCOLS = {SOCK_STREAM: (0, IPPROTO_TCP), SOCK_DGRAM: (0, IPPROTO_UDP)}
# personality(): the query, and plain PER_LINUX (linux/personality.h); the kernel reads the
# low 32 bits.
PERSONALITY_QUERY = 0xFFFFFFFF
PER_LINUX = 0
PERSONALITY_BITS = 0xFFFFFFFF
# mknod()/mknodat(): FIFOs only (sys/stat.h).
S_IFMT = 0o170000
S_IFIFO = 0o010000
PRIO_PROCESS = 0

# libseccomp's actions, attributes and comparison operators (seccomp.h), and the kernel's.
SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_FLTATR_ACT_BADARCH = 2
SCMP_FLTATR_CTL_OPTIMIZE = 8  # libseccomp 2.5+: 2 lays the rules out as a binary tree
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


def arg_masked(index: int, mask: int, value: int) -> ArgumentComparison:
    """Argument `index` (from 0), masked with `mask`, equals `value`."""
    return ArgumentComparison(index, SCMP_CMP_MASKED_EQ, mask, value)


def arg_is(index: int, value: int) -> ArgumentComparison:
    """Argument `index` (from 0), as a whole 64-bit register, equals `value`."""
    return ArgumentComparison(index, SCMP_CMP_EQ, value, 0)


def arg0_is(value: int) -> ArgumentComparison:
    return arg_is(0, value)


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
    """A filter that allows every system call but the ones refused or, given `refused_errno`,
    refuses every system call with it but the ones allowed (and those refused otherwise)."""

    def __init__(self, refused_errno: int | None = None) -> None:
        self._seccomp = library()
        default = SCMP_ACT_ALLOW if refused_errno is None else scmp_act_errno(refused_errno)
        self._context = self._seccomp.seccomp_init(default)
        if not self._context:
            raise FilterUnavailable("seccomp_init failed")
        self._seccomp.seccomp_attr_set(
            self._context, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS
        )
        # Fewer instructions for the calls the kernel's cache does not answer; an older
        # libseccomp refuses the attribute and keeps its linear layout.
        self._seccomp.seccomp_attr_set(self._context, SCMP_FLTATR_CTL_OPTIMIZE, 2)

    def allow(self, syscall: str, *comparisons: ArgumentComparison) -> None:
        """`syscall` runs (when every comparison holds); skipped where this architecture or
        this libseccomp has no such system call."""
        self._add(syscall, SCMP_ACT_ALLOW, comparisons)

    def refuse(
        self, syscall: str, code: int = errno.EPERM, *comparisons: ArgumentComparison
    ) -> None:
        """`syscall` fails with `code` (when every comparison holds); skipped where this
        architecture has no such system call."""
        self._add(syscall, scmp_act_errno(code), comparisons)

    def _add(self, syscall: str, action: int, comparisons: tuple[ArgumentComparison, ...]) -> None:
        number = syscall_number(syscall)
        if number < 0:
            return
        array = (ArgumentComparison * len(comparisons))(*comparisons)
        result = self._seccomp.seccomp_rule_add_array(
            self._context, action, number, len(comparisons), array
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
def new_filter(refused_errno: int | None = None) -> Iterator[Filter]:
    built = Filter(refused_errno)
    try:
        yield built
    finally:
        built.close()


def build_call_filter(built: Filter) -> None:
    """The rules of the filter calls run under, into a filter made with REFUSED_ERRNO (see the
    module's docstring)."""
    for syscall in ALLOWED:
        built.allow(syscall)
    for syscall in DENIED:
        built.refuse(syscall)
    # clone() without any namespace flag runs; with one, EPERM.
    namespace_flags = functools.reduce(operator.or_, CLONE_NAMESPACE_FLAGS)
    built.allow("clone", arg_masked(0, namespace_flags, 0))
    for flag in CLONE_NAMESPACE_FLAGS:
        built.refuse("clone", errno.EPERM, arg0_has(flag))
    # SOCKET_FAMILIES run; every other family gets EPERM: each value below the highest one,
    # and anything above it (the whole register: upper bits set do not turn a refused family
    # into an allowed one). AF_INET and AF_INET6 only as INET_PROTOCOLS say.
    highest = max(SOCKET_FAMILIES)
    for syscall in ("socket", "socketpair"):
        for family in range(highest + 1):
            if family in (AF_INET, AF_INET6):
                _inet_rules(built, syscall, family)
            elif family in SOCKET_FAMILIES:
                built.allow(syscall, arg0_is(family))
            else:
                built.refuse(syscall, errno.EPERM, arg0_is(family))
        built.refuse(syscall, errno.EPERM, arg0_above(highest))
    for persona in (PERSONALITY_QUERY, PER_LINUX):
        built.allow("personality", arg_masked(0, PERSONALITY_BITS, persona))
    built.allow("mknod", arg_masked(1, S_IFMT, S_IFIFO))
    built.allow("mknodat", arg_masked(2, S_IFMT, S_IFIFO))
    # The calling process only: not its process group or its uid's processes (the zygote
    # among them where calls share its uid), nor another pid.
    built.allow("setpriority", arg_is(0, PRIO_PROCESS), arg_is(1, 0))
    built.allow("prlimit64", arg_is(0, 0))


def _inet_rules(built: Filter, syscall: str, family: int) -> None:
    """`family`'s sockets: the INET_PROTOCOLS run, any other type or protocol gets EPERM (the
    rules are disjoint: one comparison per argument, every value named or bounded)."""
    for kind in range(SOCK_TYPE_MASK + 1):
        of_kind = (arg0_is(family), arg_masked(1, SOCK_TYPE_MASK, kind))
        protocols = INET_PROTOCOLS.get(kind)
        if protocols is None:
            built.refuse(syscall, errno.EPERM, *of_kind)
            continue
        for protocol in range(max(protocols) + 1):
            if protocol in protocols:
                built.allow(syscall, *of_kind, arg_is(2, protocol))
            else:
                built.refuse(syscall, errno.EPERM, *of_kind, arg_is(2, protocol))
        built.refuse(
            syscall, errno.EPERM, *of_kind, ArgumentComparison(2, SCMP_CMP_GT, max(protocols), 0)
        )


def load_call_filter() -> None:
    """Load the calls' filter into this process and check that the kernel enforces it;
    raises FilterUnavailable naming what failed."""
    with new_filter(REFUSED_ERRNO) as built:
        build_call_filter(built)
        built.load()
    check_enforced()


def check_enforced() -> None:
    """This process runs under the calls' filter with no_new_privs: its /proc status says
    so, and refused system calls (with arguments the kernel itself would refuse otherwise: no
    harm if they ran) answer what the filter answers: one DENIED, clone3, and one that is
    refused only for not being on the list."""
    with open("/proc/self/status") as handle:
        status = dict(line.split(":\t", 1) for line in handle.read().splitlines() if ":\t" in line)
    if status.get("NoNewPrivs", "").strip() != "1":
        raise FilterUnavailable("no_new_privs is not set after loading the filter")
    if status.get("Seccomp", "").strip() != "2":
        raise FilterUnavailable("the process is not in seccomp filter mode after loading it")
    libc = ctypes.CDLL(None, use_errno=True)
    for syscall, args, expected in (
        ("setns", (-1, 0), errno.EPERM),
        ("clone3", (0, 0), REFUSED_ERRNO),
        ("sethostname", (0, -1), REFUSED_ERRNO),  # a negative length: EPERM or EINVAL
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
