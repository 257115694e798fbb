"""The executor process, part one: isolate once, then become the zygote.

Started by the worker as `python -m kubestar.sandbox.isolation` with a scrubbed environment
and one end of a socketpair. Isolation is paid once per executor, not per call:

- as root: new network, mount, PID, IPC and UTS namespaces. The zygote becomes PID 1 of its
  namespace, so after a call it can kill every process the call left behind with one
  `kill(-1)`; the call sees only its own processes in /proc, no network interfaces but a down
  loopback, and private empty tmpfs on /tmp, /var/tmp, /dev/shm and over secret paths.
  Each call runs as this executor's own unprivileged uid, so it cannot signal the zygote,
  read the service's environment or files, or touch another executor's calls.
- not root: a user namespace, and inside it the same network, mount, PID, IPC and UTS
  namespaces and private mounts; calls run as the service's uid, which the PID namespace
  keeps from signalling anything outside it.

Then, unless told otherwise, the calls' syscall filter (seccomp.py) is loaded, with
no_new_privs: the zygote and every call forked from it run under it.

Fail closed: when what the configuration asks for cannot be had (a namespace refused, a mount
that fails, no separate uid as root, a filter that cannot be loaded), this stage sends the
worker one line naming what is missing, which system call failed and why, and exits; the
worker then refuses to serve.
`--no-isolation` (development only) asks for nothing.

Then it execs zygote.py, a fresh interpreter that keeps the namespaces, mounts, filter, CPU affinity
and subreaper flag but none of this stage's modules (argparse, ctypes, ...): every call forks
the zygote, and each page of its heap costs the fork, the call's exit and the zygote's own
writes after the fork, so the zygote imports only what it serves with (see zygote.py).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import fcntl
import marshal
import os
import signal
import sys
import termios
from pathlib import Path
from typing import Any, NoReturn

from kubestar.sandbox import seccomp
from kubestar.sandbox.zygote import encode_message

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# The exit code of an executor that could not isolate itself.
ISOLATION_FAILED_EXIT = 3
# What a root executor uses its capabilities for, by capability number (linux/capability.h):
# the namespaces and mounts (CAP_SYS_ADMIN, dropped once they are made: see drop_sys_admin),
# dropping each call to a uid of its own, making the call's directory that uid's, reaching
# into it to empty it, and killing what a call leaves behind.
# A container that runs the worker as root must grant exactly these (see docs/security.md).
ROOT_CAPABILITIES = {
    21: "CAP_SYS_ADMIN",
    7: "CAP_SETUID",
    6: "CAP_SETGID",
    5: "CAP_KILL",
    0: "CAP_CHOWN",
    1: "CAP_DAC_OVERRIDE",
}
# Paths that commonly hold credentials; hidden behind an empty tmpfs when they exist.
# Root's home holds kubeconfigs, cloud and SSH credentials; the others are Kubernetes' and
# Docker's secret mounts. A file is hidden behind /dev/null: Kubernetes' termination log
# (world-writable, and shown in the pool's Ready condition) among them.
SECRET_PATHS = ("/var/run/secrets", "/run/secrets", "/root", "/dev/termination-log")
PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/dev/shm")
# Files, directories and links each private tmpfs holds at most (nr_inodes; the runtime
# shown there and the call directories count too). A tmpfs inode is kernel memory outside
# the tmpfs's size, which by default only half the machine's pages bound: a call that makes
# empty files in a loop gets ENOSPC here. Emptied after each call, so this is per call.
PRIVATE_TMPFS_INODES = 4096
PRIVATE_TMPFS_OPTIONS = f"size=256m,nr_inodes={PRIVATE_TMPFS_INODES},mode=1777"
# The call's fresh /proc shows its own processes, but also files about the host: hidden
# (the kernel's memory, its keyrings, timers and scheduler state, devices) or read-only (the
# kernel's tunables, /proc/sys/kernel/core_pattern among them), as container runtimes mask
# them in a container's /proc.
PROC_HIDDEN = (
    "/proc/kcore",
    "/proc/keys",
    "/proc/key-users",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/sysrq-trigger",
    "/proc/acpi",
    "/proc/asound",
    "/proc/scsi",
)
PROC_READ_ONLY = ("/proc/sys", "/proc/bus", "/proc/fs", "/proc/irq")
# The empty, read-only tmpfs over secret and hidden paths (only the runtime's mount points).
COVER_TMPFS_OPTIONS = "size=64k,nr_inodes=1024,mode=0755"
# Resolved: a symlink on the way (a checkout linked under /tmp) may be covered by a tmpfs.
ZYGOTE_SCRIPT = Path(__file__).resolve().with_name("zygote.py")

_libc = ctypes.CDLL(None, use_errno=True)


def leave_controlling_terminal() -> None:
    """Drop the terminal the server may have been started from.

    Calls stay in the executor's session (a session per call would make each call a
    scheduling group of its own, see zygote.py), so the session must not hand them a
    terminal to read from or write to.
    """
    try:
        tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return  # none
    try:
        fcntl.ioctl(tty, termios.TIOCNOTTY)
    finally:
        os.close(tty)


class IsolationFailed(RuntimeError):
    """What the configuration asks for cannot be had; the message names what is missing,
    which system call failed and why."""


# Why a namespace or mount call fails, by errno: what a person can change.
_WHY = {
    errno.EPERM: "refused by a seccomp profile (container runtimes' default profiles refuse "
    "it without CAP_SYS_ADMIN), a security module, or kernel.unprivileged_userns_clone=0",
    errno.EACCES: "refused by a security module",
    errno.ENOSPC: "a namespace count limit is reached (user.max_user_namespaces and the "
    "like; 0 turns that namespace off)",
    errno.EUSERS: "user namespaces are nested too deeply",
    errno.EINVAL: "the kernel lacks this namespace type",
    errno.ENOMEM: "the kernel is out of memory",
}


# As root, the kernel itself does not refuse: a container without CAP_SYS_ADMIN, or a filter.
_WHY_AS_ROOT = {
    **_WHY,
    errno.EPERM: "CAP_SYS_ADMIN is missing (dropped by the container), or a seccomp profile "
    "or a security module refuses it",
}


def _failure(call: str, code: int, why_by_errno: dict[int, str] = _WHY) -> str:
    """`call` failed with errno `code`, and why, as one phrase."""
    name = errno.errorcode.get(code, str(code))
    why = why_by_errno.get(code)
    return f"{call} failed: {name} ({os.strerror(code)}){': ' + why if why else ''}"


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, _failure(what, code, _WHY_AS_ROOT))


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount({target})",
    )


class Isolation:
    """What this executor achieved; reported to the worker, which logs it."""

    def __init__(self) -> None:
        self.network = False
        self.pid_namespace = False
        self.mount_namespace = False
        self.separate_uid = False
        self.syscall_filter = False
        self.notes: list[str] = []

    def as_dict(self) -> dict[str, Any]:
        return {
            "network": self.network,
            "pid_namespace": self.pid_namespace,
            "mount_namespace": self.mount_namespace,
            "separate_uid": self.separate_uid,
            "syscall_filter": self.syscall_filter,
            "notes": self.notes,
        }


def isolate(uid: int, hidden_paths: list[str]) -> Isolation:
    """Enter namespaces, or raise IsolationFailed. As root this forks: the caller continues
    as PID 1 of a new namespace.

    As root every call must be kept off the network, out of the host's mounts and processes,
    and run as a uid of its own; not as root the same but the uid (a user namespace is what
    lets an unprivileged process make the others).
    """
    isolation = Isolation()
    if os.geteuid() == 0:
        if uid <= 0:
            raise IsolationFailed(
                f"a separate uid for calls: this executor's uid would be {uid} (root); "
                "give a --uid-base above 0"
            )
        missing = missing_root_capabilities()
        if missing:
            raise IsolationFailed(
                f"capabilities {', '.join(missing)}: a worker running as root needs "
                f"{', '.join(ROOT_CAPABILITIES.values())} (its calls run with none); "
                "grant them to the container, or run the worker as non-root (user namespaces)"
            )
        flags = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        if _libc.unshare(flags) != 0:
            call = "unshare(CLONE_NEWNET|CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWIPC|CLONE_NEWUTS)"
            raise IsolationFailed(
                "network, mount, PID, IPC and UTS namespaces: "
                + _failure(call, ctypes.get_errno(), _WHY_AS_ROOT)
            )
        _become_namespace_init()
        isolation.network = True
        isolation.pid_namespace = True
        _setup_mounts(isolation, hidden_paths)
        try:
            drop_sys_admin()
        except OSError as error:
            raise IsolationFailed(f"giving up CAP_SYS_ADMIN: {error.strerror}") from None
        isolation.separate_uid = True
        return isolation

    isolation.notes.append("not root: calls run as the service's uid")
    real_uid, real_gid = os.getuid(), os.getgid()
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        raise IsolationFailed(
            "user and network namespaces (without them calls reach the network): "
            + _failure("unshare(CLONE_NEWUSER|CLONE_NEWNET)", ctypes.get_errno())
        )
    for path, text in (
        ("/proc/self/setgroups", "deny"),
        ("/proc/self/uid_map", f"{real_uid} {real_uid} 1"),
        ("/proc/self/gid_map", f"{real_gid} {real_gid} 1"),
    ):
        try:
            with open(path, "w") as handle:
                handle.write(text)
        except OSError as error:
            raise IsolationFailed(
                f"user namespace: writing {path} failed: {error.strerror}"
            ) from None
    isolation.network = True
    # Inside the user namespace this process holds the capabilities the others need.
    if _libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS) != 0:
        raise IsolationFailed(
            "mount, PID, IPC and UTS namespaces (without them calls see and signal the "
            "service, and reach each other's files): "
            + _failure(
                "unshare(CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWIPC|CLONE_NEWUTS)", ctypes.get_errno()
            )
        )
    _become_namespace_init()
    isolation.pid_namespace = True
    _setup_mounts(isolation, hidden_paths)
    return isolation


CAP_SYS_ADMIN = 21
PR_SET_NO_NEW_PRIVS = 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapabilityHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapabilitySets(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_sys_admin() -> None:
    """Give up CAP_SYS_ADMIN for good once the namespaces and mounts are made: the zygote
    runs on without it (it removes calls' IPC objects as their uid). no_new_privs keeps the
    exec into the zygote from handing it back, as exec otherwise gives root its bounding set
    (which only CAP_SETPCAP, not granted, could shrink)."""
    header = _CapabilityHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    sets = (_CapabilitySets * 2)()  # capabilities 0-31, then 32-63
    _check(_libc.capget(ctypes.byref(header), sets), "capget")
    cleared = ~(1 << CAP_SYS_ADMIN) & 0xFFFFFFFF
    sets[0].effective &= cleared
    sets[0].permitted &= cleared
    sets[0].inheritable &= cleared
    _check(_libc.capset(ctypes.byref(header), sets), "capset (dropping CAP_SYS_ADMIN)")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def missing_root_capabilities() -> list[str]:
    """Names of ROOT_CAPABILITIES this process lacks in its effective set.

    Checked before anything is set up: a container that drops one of them would otherwise
    start an executor that dies on its first call (no CAP_KILL: it cannot clean up after a
    call; no CAP_CHOWN: it cannot hand the call its directory).
    """
    effective = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                effective = int(line.split()[1], 16)
    return [name for bit, name in ROOT_CAPABILITIES.items() if not effective >> bit & 1]


def _become_namespace_init() -> None:
    """Fork after unshare(CLONE_NEWPID): the child is PID 1; the parent only relays its exit."""
    pid = os.fork()
    if pid == 0:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        return
    # The outer process: holds nothing, waits, and mirrors the inner zygote's fate.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _runtime_paths() -> list[str]:
    """Directories the zygote and the calls' Python need (top-most only): the interpreter's
    prefixes, its import path, and this package's folder (zygote.py and the fork server),
    which an editable install loads from outside the import path."""
    candidates = {
        sys.base_prefix,
        sys.prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        str(ZYGOTE_SCRIPT.parent),
        *(p for p in sys.path if p),
    }
    paths = sorted(os.path.realpath(p) for p in candidates if os.path.isdir(p))
    top: list[str] = []
    for path in paths:
        if not any(path == kept or path.startswith(kept + "/") for kept in top):
            top.append(path)
    return top


def _cover(path: str, options: str, read_only: bool) -> None:
    """Mount an empty tmpfs over `path`, keeping the Python runtime inside it visible read-only.

    Hiding root's home (where kubeconfigs and cloud credentials live) or giving calls a private
    /tmp would otherwise also hide an interpreter or virtualenv installed there (pyenv under
    /root, a checkout under /tmp).
    """
    inside = [p for p in _runtime_paths() if p.startswith(path.rstrip("/") + "/")]
    # Hold the runtime directories open: once the tmpfs covers them, /proc/self/fd/N still
    # names them as bind-mount sources.
    handles = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in inside]
    try:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
        for runtime, handle in zip(inside, handles, strict=True):
            os.makedirs(runtime, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{handle}", runtime, None, MS_BIND | MS_REC, None)
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC | _locked_flags(runtime)
            _mount("none", runtime, None, flags, None)
        if read_only:
            _mount("none", path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    finally:
        for handle in handles:
            os.close(handle)


def _locked_flags(path: str) -> int:
    """The flags of the mount at `path` that a remount must keep: in a user namespace the
    kernel refuses to clear nosuid, nodev, noexec or the atime setting of a mount it was
    handed (EPERM)."""
    kept = os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME
    kept |= os.ST_RELATIME
    # The ST_ flags of statvfs have the values of the MS_ flags of mount for these.
    return os.statvfs(path).f_flag & kept


def _runtime_entries(directory: str) -> list[str]:
    """Top-level entries of `directory` that lead to the Python runtime (kept between calls)."""
    prefix = directory.rstrip("/") + "/"
    return sorted(
        {
            prefix + p[len(prefix) :].split("/", 1)[0]
            for p in _runtime_paths()
            if p.startswith(prefix)
        }
    )


def _setup_mounts(isolation: Isolation, hidden_paths: list[str]) -> None:
    try:
        # Nothing mounted here propagates back to the host.
        _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
        isolation.mount_namespace = True
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        _mask_proc()
        for path in PRIVATE_TMPFS:
            if os.path.isdir(path):
                _cover(path, PRIVATE_TMPFS_OPTIONS, read_only=False)
        for path in [*SECRET_PATHS, *hidden_paths]:
            if os.path.isdir(path):
                _cover(path, COVER_TMPFS_OPTIONS, read_only=True)
            elif os.path.isfile(path):
                _mount("/dev/null", path, None, MS_BIND, None)
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        raise IsolationFailed(f"mount namespace: {where}{error.strerror}") from None


def _mask_proc() -> None:
    """PROC_HIDDEN behind /dev/null (files) or an empty read-only tmpfs (directories), and
    PROC_READ_ONLY bind-mounted read-only onto themselves."""
    for path in PROC_HIDDEN:
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=0")
        elif os.path.exists(path):
            _mount("/dev/null", path, None, MS_BIND, None)
    for path in PROC_READ_ONLY:
        if os.path.isdir(path):
            _mount(path, path, None, MS_BIND | MS_REC, None)
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
            _mount(path, path, None, flags, None)


def _refuse(fd: int, error: str) -> NoReturn:
    """The worker reads this instead of the zygote's ready message and refuses to serve."""
    os.write(fd, encode_message({"ready": False, "error": error}))
    sys.exit(ISOLATION_FAILED_EXIT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="control socket file descriptor")
    parser.add_argument("--uid", type=int, default=0, help="unprivileged uid for calls (as root)")
    parser.add_argument("--preload", default="", help="comma-separated modules to pre-import")
    parser.add_argument("--warmup", default="", help="code run once after the imports")
    parser.add_argument("--hide", action="append", default=[], help="extra path to hide")
    parser.add_argument("--no-isolation", action="store_true")
    parser.add_argument(
        "--no-syscall-filter", action="store_true", help="namespaces without the filter"
    )
    parser.add_argument("--max-processes", type=int, default=32)
    parser.add_argument("--max-file-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--max-open-files", type=int, default=256)
    parser.add_argument("--cpu", type=int, default=-1, help="run (with all calls) on this CPU")
    parser.add_argument("--nice", type=int, default=0, help="run (with all calls) this much nicer")
    args = parser.parse_args()
    leave_controlling_terminal()
    if args.nice:
        os.nice(args.nice)
    if args.cpu >= 0:
        with contextlib.suppress(OSError):  # a CPU gone offline: run anywhere
            os.sched_setaffinity(0, {args.cpu})

    if args.no_isolation:
        isolation = Isolation()  # nothing: the worker says so when it starts
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    else:
        try:
            isolation = isolate(args.uid, args.hide)
        except IsolationFailed as error:
            _refuse(args.fd, str(error))
        if not args.no_syscall_filter:
            # Last: everything isolate() did may use what the filter refuses.
            try:
                seccomp.load_call_filter()
            except seccomp.FilterUnavailable as error:
                _refuse(args.fd, f"syscall filter for calls: {error}")
            isolation.syscall_filter = True
    settings: dict[str, Any] = {
        "uid": args.uid,
        "preload": [m for m in args.preload.split(",") if m],
        "warmup": args.warmup,
        "max_processes": args.max_processes,
        "max_file_bytes": args.max_file_bytes,
        "max_open_files": args.max_open_files,
        "isolation": isolation.as_dict(),
        # Emptied after each call except for these (the runtime shown through a private tmpfs).
        "private_tmpfs": {p: _runtime_entries(p) for p in PRIVATE_TMPFS}
        if isolation.mount_namespace
        else {},
    }
    os.set_inheritable(args.fd, True)
    # Without site (and its import hooks) when nothing is preloaded: a smaller zygote. The
    # import path comes from PYTHONPATH either way.
    flags = [] if settings["preload"] else ["-S"]
    os.execv(
        sys.executable,
        [sys.executable, *flags, str(ZYGOTE_SCRIPT), str(args.fd), marshal.dumps(settings).hex()],
    )


if __name__ == "__main__":
    main()
