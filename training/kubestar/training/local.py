"""kubestar's services as local processes: what `kubestar train -f` and `kubestar eval` start.

The same manifests a cluster takes (SandboxPool, RolloutFleet, TrainingRun) become
(`LocalStack.for_run`): one sandbox server (`kubestar sandbox serve`, worker and dispatcher
in one process), the fleet's vLLM engines (`kubestar.engine.launch`), and the rollout
scheduler in front of them. `kubestar eval` starts only the engine and the sandbox it is not
given. Everything binds to 127.0.0.1 on free ports and is stopped by PID when the run ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kubestar.api.v1alpha1 import RolloutFleet, SandboxPool
from kubestar.common.net import free_port, wait_serving
from kubestar.engine.launch import (
    EngineProcess,
    EngineSettings,
    die_with_parent,
    log_tail,
    wait_engines_ready,
)
from kubestar.training.endpoints import Endpoints


class ServiceFailed(RuntimeError):
    """A local service did not come up; the message ends with the end of its log."""


@dataclass(frozen=True)
class LocalSandbox:
    """A sandbox server: its executors, the modules they import once, and its options."""

    executors: int
    preload: tuple[str, ...]
    # None and "": the server's own defaults.
    queue_timeout_seconds: float | None = None
    log_level: str = ""
    # False only where the pool says isolation: Disabled (development).
    isolation: bool = True

    def serve_args(self, listen: str) -> list[str]:
        args = ["sandbox", "serve", "--listen", listen, "--executors", str(self.executors)]
        args += ["--preload", ",".join(self.preload)]
        if not self.isolation:
            args.append("--no-isolation")
        if self.queue_timeout_seconds is not None:
            args += ["--queue-timeout", str(self.queue_timeout_seconds)]
        if self.log_level:
            args += ["--log-level", self.log_level]
        return args


@dataclass(frozen=True)
class LocalScheduler:
    """A rollout scheduler in front of every engine of the stack."""

    policy: str
    poll_interval: float
    segment_tokens: int

    def serve_args(self, listen: str, engine_urls: Sequence[str]) -> list[str]:
        args = ["scheduler", "serve", "--listen", listen, "--policy", self.policy]
        args += ["--poll-interval", str(self.poll_interval)]
        args += ["--segment-tokens", str(self.segment_tokens)]
        for index, url in enumerate(engine_urls):
            args += ["--engine", f"e{index}={url}"]
        return args


class LocalStack:
    """A sandbox, engines and a scheduler (each optional) as processes of this machine; a
    context manager (`running`) that stops them all."""

    def __init__(
        self,
        log_dir: Path,
        *,
        sandbox: LocalSandbox | None = None,
        engines: Sequence[EngineSettings] = (),
        scheduler: LocalScheduler | None = None,
        engine_timeout: float = 300.0,
        sandbox_timeout: float = 180.0,
        weight_sync: str = "broadcast",
    ) -> None:
        if scheduler is not None and not engines:
            raise ValueError("a local scheduler needs at least one engine")
        self.log_dir = log_dir
        self.sandbox = sandbox
        self.engine_settings = list(engines)
        self.scheduler = scheduler
        self.engine_timeout = engine_timeout
        self.sandbox_timeout = sandbox_timeout
        self.weight_sync = weight_sync  # the fleet's spec.weightSync, which Endpoints carries
        self.engines: list[EngineProcess] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        # Services started and not yet seen serving: (name, endpoint, process).
        self._waits: list[tuple[str, str, subprocess.Popen[bytes]]] = []
        self._stack = contextlib.ExitStack()

    @classmethod
    def for_run(
        cls,
        pool: SandboxPool,
        fleet: RolloutFleet,
        model_dir: Path,
        log_dir: Path,
        engine_python: str = "",
    ) -> LocalStack:
        """What a TrainingRun's SandboxPool and RolloutFleet describe, on CPU."""
        pool_spec, fleet_spec = pool.spec, fleet.spec
        engine = fleet_spec.engine
        return cls(
            log_dir,
            sandbox=LocalSandbox(
                executors=pool_spec.executors_per_pod * max(pool_spec.replicas, 1),
                preload=tuple(pool_spec.preload),
                queue_timeout_seconds=pool_spec.queue_timeout_seconds,
                isolation=pool_spec.isolation != "Disabled",
            ),
            engines=[
                EngineSettings(
                    model=str(model_dir),
                    port=free_port(),
                    max_model_len=engine.max_model_len,
                    kv_cache_bytes=engine.kv_cache_bytes,
                    max_num_seqs=engine.max_num_seqs,
                    device="cpu",
                    extra_args=list(engine.extra_args),
                    python=engine_python,
                )
                for _ in range(max(fleet_spec.replicas, 1))
            ],
            scheduler=LocalScheduler(
                policy=fleet_spec.scheduler.policy,
                poll_interval=fleet_spec.scheduler.metrics_interval_seconds,
                segment_tokens=fleet_spec.scheduler.segment_tokens,
            ),
            weight_sync=fleet_spec.weight_sync,
        )

    def start(self, wait: bool = True) -> Endpoints:
        """Start everything ("" for a service the stack has none of) and, with `wait`, wait
        until it serves. Without it, the caller does what needs no service (a trainer loads
        its model) while they come up, and calls `wait_ready` before it uses them."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        sandbox = scheduler = ""
        if self.sandbox is not None:
            sandbox = f"127.0.0.1:{free_port()}"
            self._waits.append(
                ("sandbox", sandbox, self._spawn("sandbox", self.sandbox.serve_args(sandbox)))
            )
        for index, settings in enumerate(self.engine_settings):
            engine = EngineProcess(settings, log_path=self.log_dir / f"engine-{index}.log")
            self._stack.callback(engine.stop)
            self.engines.append(engine.start(wait=False))
        if self.scheduler is not None:
            # Up before its engines: it probes them until they answer.
            scheduler = f"127.0.0.1:{free_port()}"
            engine_urls = [engine.url for engine in self.engines]
            process = self._spawn("scheduler", self.scheduler.serve_args(scheduler, engine_urls))
            self._waits.append(("scheduler", scheduler, process))
        if wait:
            self.wait_ready()
        return Endpoints(scheduler=scheduler, sandbox=sandbox, weight_sync=self.weight_sync)

    def wait_ready(self) -> None:
        """Until every service serves. Raises ServiceFailed, with the end of its log, for
        the first that exits or does not come up in time."""
        try:
            wait_engines_ready(self.engines, self.engine_timeout)
        except RuntimeError as error:
            raise ServiceFailed(str(error)) from None
        for name, endpoint, process in self._waits:
            timeout = self.sandbox_timeout if name == "sandbox" else 180.0
            self._wait_serving(name, endpoint, process, timeout)
        self._waits.clear()

    def stop(self) -> None:
        for process in reversed(self._processes):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(self._processes):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self._stack.close()
        self._processes.clear()
        self._waits.clear()
        self.engines = []

    @contextlib.contextmanager
    def running(self, wait: bool = True) -> Iterator[Endpoints]:
        try:
            yield self.start(wait)
        finally:
            self.stop()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "kubestar.cli.main", *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self._processes.append(process)
        return process

    def _wait_serving(
        self, name: str, endpoint: str, process: subprocess.Popen[bytes], timeout: float
    ) -> None:
        log = self.log_dir / f"{name}.log"
        try:
            wait_serving(endpoint, process, what=name, timeout=timeout, log=log)
        except (RuntimeError, TimeoutError) as error:
            raise ServiceFailed(f"{error}\n{log_tail(log)}") from None
