"""Run a command as a sandbox pod runs it: as a non-root uid, and under a seccomp filter that,
like container runtimes' default profiles, refuses new namespaces.

    python -m tests.sandbox.unprivileged [--uid UID] [--deny-namespaces] -- COMMAND...

--uid: become UID in a new user namespace that maps it to the caller's own uid, so the
command keeps reading what the caller can (an interpreter under /root) but is not root and
holds no capabilities once it execs. --deny-namespaces: unshare() and setns() fail with
EPERM, clone() with a namespace flag too, and clone3() with ENOSYS (its flags cannot be
filtered; C libraries then fall back to clone()), as in Docker's and containerd's default
profiles for a container without CAP_SYS_ADMIN. The filter is built with libseccomp.

Exits 2 with one line on stderr when this machine cannot do what was asked.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import os
import sys

CLONE_NEWUSER = 0x10000000
NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    CLONE_NEWUSER,
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7


def scmp_act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class ArgumentComparison(ctypes.Structure):
    """libseccomp's struct scmp_arg_cmp."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class Refused(Exception):
    """This machine cannot set up what was asked."""


def become(uid: int) -> None:
    outer_uid, outer_gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER) != 0:
        raise Refused(f"cannot make a user namespace: {os.strerror(ctypes.get_errno())}")
    for path, text in (
        ("/proc/self/setgroups", "deny"),
        ("/proc/self/uid_map", f"{uid} {outer_uid} 1"),
        ("/proc/self/gid_map", f"{uid} {outer_gid} 1"),
    ):
        with open(path, "w") as handle:
            handle.write(text)


def deny_namespaces() -> None:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        raise Refused("libseccomp is not installed")
    seccomp = ctypes.CDLL(name)
    seccomp.seccomp_init.restype = ctypes.c_void_p
    seccomp.seccomp_init.argtypes = [ctypes.c_uint32]
    seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    seccomp.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(ArgumentComparison),
    ]
    seccomp.seccomp_load.argtypes = [ctypes.c_void_p]
    seccomp.seccomp_release.argtypes = [ctypes.c_void_p]
    context = seccomp.seccomp_init(SCMP_ACT_ALLOW)
    if not context:
        raise Refused("seccomp_init failed")

    def rule(action: int, syscall: str, *comparisons: ArgumentComparison) -> None:
        number = seccomp.seccomp_syscall_resolve_name(syscall.encode())
        array = (ArgumentComparison * len(comparisons))(*comparisons)
        result = seccomp.seccomp_rule_add_array(context, action, number, len(comparisons), array)
        if result != 0:
            raise Refused(f"seccomp_rule_add({syscall}) failed: {os.strerror(-result)}")

    try:
        rule(scmp_act_errno(errno.EPERM), "unshare")
        rule(scmp_act_errno(errno.EPERM), "setns")
        rule(scmp_act_errno(errno.ENOSYS), "clone3")
        for flag in NAMESPACE_FLAGS:
            rule(
                scmp_act_errno(errno.EPERM),
                "clone",
                ArgumentComparison(0, SCMP_CMP_MASKED_EQ, flag, flag),
            )
        # libseccomp sets no_new_privs first, as an unprivileged process must.
        result = seccomp.seccomp_load(context)
        if result != 0:
            raise Refused(f"seccomp_load failed: {os.strerror(-result)}")
    finally:
        seccomp.seccomp_release(context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--uid", type=int, default=None)
    parser.add_argument("--deny-namespaces", action="store_true")
    parser.add_argument("command", nargs="+")
    args = parser.parse_args()
    try:
        if args.uid is not None:
            become(args.uid)
        if args.deny_namespaces:
            deny_namespaces()
    except (Refused, OSError) as error:
        print(f"unprivileged: {error}", file=sys.stderr)
        sys.exit(2)
    os.execvp(args.command[0], args.command)


if __name__ == "__main__":
    main()
