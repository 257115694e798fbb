"""kubectl and helm as a user runs them (subprocesses; `-o json` where output is read), against
whatever cluster KUBECONFIG names. Nothing here talks to the API server any other way."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
Obj = dict[str, Any]


class CommandFailed(RuntimeError):
    def __init__(self, args: Sequence[str], code: int, stdout: str, stderr: str) -> None:
        self.args_ = list(args)
        self.code = code
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"{shlex.join(args)} exited with {code}: {stderr.strip() or stdout}")


@dataclass
class Tools:
    """The kubectl and helm binaries (from PATH unless KUBECTL / HELM say otherwise)."""

    kubectl_bin: str = field(default_factory=lambda: os.environ.get("KUBECTL", "kubectl"))
    helm_bin: str = field(default_factory=lambda: os.environ.get("HELM", "helm"))
    log: Path | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(
        self,
        args: Sequence[str],
        input_text: str | None = None,
        check: bool = True,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        done = subprocess.run(
            list(args),
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        # Successful reads (the polls) are not logged: they would drown the rest.
        quiet = done.returncode == 0 and len(args) > 1 and args[1] in ("get", "logs")
        if self.log is not None and not quiet:
            with self._lock, self.log.open("a") as out:
                out.write(
                    f"{time.strftime('%H:%M:%S')} ({time.monotonic() - started:.1f}s, "
                    f"rc {done.returncode}) {shlex.join(args)}\n"
                )
        if check and done.returncode != 0:
            raise CommandFailed(args, done.returncode, done.stdout, done.stderr)
        return done

    def kubectl_run(
        self, *args: str, input_text: str | None = None, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return self.run([self.kubectl_bin, *args], input_text, check, timeout)

    def kubectl_text(self, *args: str, input_text: str | None = None, timeout: float = 300) -> str:
        return self.kubectl_run(*args, input_text=input_text, timeout=timeout).stdout

    def kubectl_json(self, *args: str) -> Obj:
        result: Obj = json.loads(self.kubectl_text(*args, "-o", "json"))
        return result

    def get(self, kind: str, name: str, namespace: str) -> Obj | None:
        done = self.kubectl_run(
            "get", kind, name, "-n", namespace, "-o", "json", "--ignore-not-found", check=True
        )
        return json.loads(done.stdout) if done.stdout.strip() else None

    def items(self, kind: str, namespace: str, *selectors: str) -> list[Obj]:
        args = ["get", kind, "-n", namespace]
        if selectors:  # one -l: kubectl keeps only the last of several
            args += ["-l", ",".join(selectors)]
        result: list[Obj] = self.kubectl_json(*args).get("items", [])
        return result

    def helm(self, *args: str, timeout: float = 600) -> str:
        return self.run([self.helm_bin, *args], timeout=timeout).stdout


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float,
    interval: float = 1.0,
    describe: Callable[[], str] | None = None,
) -> T:
    """Call probe until it returns something truthy; fail with `what` (and describe())."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = probe()
            if value:
                return value
        except (CommandFailed, subprocess.TimeoutExpired) as error:
            last_error = error
        if time.monotonic() > deadline:
            detail = describe() if describe else ""
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what}"
                + (f"; last error: {last_error}" if last_error else "")
                + (f"\n{detail}" if detail else "")
            )
        time.sleep(interval)


def condition(obj: Obj | None, kind: str) -> Obj | None:
    for item in ((obj or {}).get("status") or {}).get("conditions") or []:
        if item.get("type") == kind:
            found: Obj = item
            return found
    return None


class Watch:
    """A background `kubectl get ... -w` whose output lines go to a file as they come."""

    def __init__(self, tools: Tools, args: Sequence[str], out: Path) -> None:
        self.out = out
        self._file = out.open("w")
        self.process = subprocess.Popen(
            [tools.kubectl_bin, *args],
            stdout=self._file,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def lines(self) -> list[str]:
        if not self._file.closed:
            self._file.flush()
        return self.out.read_text().splitlines()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._file.close()


class Recorder(threading.Thread):
    """Polls an object (`kubectl get -o json`) and keeps every distinct status it saw, with
    the time: the phases a run went through, its steps and metrics."""

    def __init__(
        self, tools: Tools, kind: str, name: str, namespace: str, interval: float = 2.0
    ) -> None:
        super().__init__(daemon=True, name=f"record {kind}/{name}")
        self.tools, self.kind, self.name, self.namespace = tools, kind, name, namespace
        self.interval = interval
        self.started = time.monotonic()
        self.statuses: list[tuple[float, Obj]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                obj = self.tools.get(self.kind, self.name, self.namespace)
            except (CommandFailed, subprocess.TimeoutExpired):
                obj = None
            if obj is not None:
                status = obj.get("status") or {}
                if not self.statuses or self.statuses[-1][1] != status:
                    self.statuses.append((time.monotonic() - self.started, status))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)

    def phases(self) -> list[str]:
        """Distinct phases in the order they were seen (repeats collapsed)."""
        seen: list[str] = []
        for _, status in self.statuses:
            phase = status.get("phase")
            if phase and (not seen or seen[-1] != phase):
                seen.append(phase)
        return seen

    def dump(self, path: Path) -> None:
        path.write_text(
            "\n".join(
                json.dumps({"t": round(t, 1), "status": status}, sort_keys=True)
                for t, status in self.statuses
            )
            + "\n"
        )


def pod_ready(pod: Obj) -> bool:
    """Whether the pod's Ready condition is True: its probes pass, not only its containers run."""
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )
