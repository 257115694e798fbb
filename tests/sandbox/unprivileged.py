"""Run a command as a sandbox pod runs it: as a non-root uid, and under a seccomp filter that,
like container runtimes' default profiles, refuses new namespaces.

    python -m tests.sandbox.unprivileged [--uid UID] [--capabilities N,...] \
        [--deny-namespaces] [--deny-seccomp] [--without-libseccomp] -- COMMAND...

--uid: become UID in a new user namespace that maps it to the caller's own uid, so the
command keeps reading what the caller can (an interpreter under /root) but is not root and
holds no capabilities once it execs. --capabilities (as root): keep only these capabilities
(numbers, as in linux/capability.h) in the bounding set and set no_new_privs, so the command
runs as root with exactly them, as a container that drops ALL and adds these runs it.
--deny-namespaces: unshare() and setns() fail with EPERM, clone() with a namespace flag too,
and clone3() with ENOSYS (its flags cannot be filtered; C libraries then fall back to
clone()), as in Docker's and containerd's default
profiles for a container without CAP_SYS_ADMIN. --deny-seccomp: seccomp() and
prctl(PR_SET_SECCOMP) fail with EPERM, so the command cannot load a filter of its own. The
filter is built with libseccomp (kubestar.sandbox.seccomp). --without-libseccomp: in a mount
namespace of its own, libseccomp's shared library is an empty file, as in an image without it.

Exits 2 with one line on stderr when this machine cannot do what was asked.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import sys
from collections.abc import Callable

from kubestar.sandbox import seccomp

CLONE_NEWUSER = seccomp.CLONE_NEWUSER
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24


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


def keep_only(capabilities: set[int]) -> None:
    """Drop every other capability from the bounding set: after exec, root holds these only."""
    with open("/proc/sys/kernel/cap_last_cap") as last:
        every = range(int(last.read()) + 1)
    libc = ctypes.CDLL(None, use_errno=True)
    for number in set(every) - capabilities:
        if libc.prctl(PR_CAPBSET_DROP, number, 0, 0, 0) != 0:
            raise Refused(f"cannot drop capability {number}: {os.strerror(ctypes.get_errno())}")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise Refused(f"cannot set no_new_privs: {os.strerror(ctypes.get_errno())}")


def deny(namespaces: bool, seccomp_filters: bool) -> None:
    try:
        with seccomp.new_filter() as built:
            if namespaces:
                built.refuse("unshare")
                built.refuse("setns")
                built.refuse("clone3", errno.ENOSYS)
                for flag in seccomp.CLONE_NAMESPACE_FLAGS:
                    built.refuse("clone", errno.EPERM, seccomp.arg0_has(flag))
            if seccomp_filters:
                built.refuse("seccomp")
                built.refuse("prctl", errno.EPERM, seccomp.arg0_is(seccomp.PR_SET_SECCOMP))
            built.load()
    except seccomp.FilterUnavailable as error:
        raise Refused(str(error)) from None


def hide_libseccomp() -> None:
    seccomp.library()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libseccomp.so" in line}
    if len(paths) != 1:
        raise Refused(f"cannot tell where libseccomp is loaded from: {sorted(paths)}")
    libc = ctypes.CDLL(None, use_errno=True)
    steps: list[tuple[str, Callable[[], int]]] = [
        ("unshare(CLONE_NEWNS)", lambda: int(libc.unshare(seccomp.CLONE_NEWNS))),
        ("mount(/)", lambda: int(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None))),
        ("bind", lambda: int(libc.mount(b"/dev/null", paths.pop().encode(), None, MS_BIND, None))),
    ]
    for what, step in steps:
        if step() != 0:
            raise Refused(f"cannot hide libseccomp: {what}: {os.strerror(ctypes.get_errno())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--uid", type=int, default=None)
    parser.add_argument("--capabilities", default=None)
    parser.add_argument("--deny-namespaces", action="store_true")
    parser.add_argument("--deny-seccomp", action="store_true")
    parser.add_argument("--without-libseccomp", action="store_true")
    parser.add_argument("command", nargs="+")
    args = parser.parse_args()
    try:
        if args.uid is not None:
            become(args.uid)
        if args.capabilities is not None:
            if os.geteuid() != 0:
                raise Refused("--capabilities needs root")
            keep_only({int(number) for number in args.capabilities.split(",") if number})
        if args.deny_namespaces or args.deny_seccomp:
            deny(args.deny_namespaces, args.deny_seccomp)
        if args.without_libseccomp:
            hide_libseccomp()
    except (Refused, OSError) as error:
        print(f"unprivileged: {error}", file=sys.stderr)
        sys.exit(2)
    os.execvp(args.command[0], args.command)


if __name__ == "__main__":
    main()
