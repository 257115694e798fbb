"""kubestar's services as local processes: the one local stack of every command and benchmark.

Two factories make a `LocalStack`:

* `LocalStack.for_run`: the same manifests a cluster takes (SandboxPool, RolloutFleet,
  TrainingRun) become one sandbox server (`kubestar sandbox serve`, worker and dispatcher in
  one process), the fleet's vLLM engines (`kubestar.engine.launch`), and the rollout
  scheduler in front of them: what `kubestar train -f` and bench/learning.py start.
* `LocalStack.for_command`: the services a command is not given, from its
  `LocalServiceSettings` (the flags `--engine-python`, `--device`, `--sandbox-executors`,
  `--sandbox-preload`, `--log-dir`): what `kubestar eval`, `kubestar solve`, `kubestar
  evolve` and bench/search_bench.py start.

Everything binds to 127.0.0.1 on free ports and is stopped by PID when the run ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubestar.common.net import free_port, wait_serving
from kubestar.engine.launch import (
    EngineProcess,
    EngineSettings,
    die_with_parent,
    log_tail,
    wait_engines_ready,
)
from kubestar.training.endpoints import Endpoints

if TYPE_CHECKING:
    from kubestar.api.v1alpha1 import RolloutFleet, SandboxPool


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


def engines_serving(model_dir: Path, count: int, **settings: Any) -> list[EngineSettings]:
    """`count` engines serving `model_dir` alike (`settings`: EngineSettings' other fields),
    each on a free port of 127.0.0.1."""
    return [
        EngineSettings(model=str(model_dir), port=free_port(), **settings) for _ in range(count)
    ]


@dataclass(frozen=True)
class LocalServiceSettings:
    """How a command starts the services it is not given, as local processes on 127.0.0.1
    (`LocalStack.for_command`); each field is the flag of the same name."""

    # Python with vLLM for the local engines ("": KUBESTAR_ENGINE_PYTHON, else this one).
    engine_python: str = ""
    device: str = "cpu"  # of the local engines: cpu, cuda or rocm
    sandbox_executors: int = 4  # executors of a local sandbox
    sandbox_preload: tuple[str, ...] = ("numpy", "sympy")  # modules they import once
    # The services' logs ("": a new temporary folder kubestar-COMMAND-*).
    log_dir: str = ""
    max_model_len: int = 4096  # context length of a local engine
    # Local engines; on a GPU they share it, each taking its part of the memory.
    engines: int = 1
    scheduler_policy: str = "kv-aware"  # of a local scheduler

    def logs(self, command: str) -> Path:
        """`log_dir`, or a new temporary folder named after the command."""
        if self.log_dir:
            return Path(self.log_dir)
        return Path(tempfile.mkdtemp(prefix=f"kubestar-{command}-"))


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
        serving: bool = True,
    ) -> LocalStack:
        """What a TrainingRun's SandboxPool and RolloutFleet describe, on CPU. `serving`
        False: the sandbox alone (e.g. for an SFT, which needs no engine)."""
        pool_spec, fleet_spec = pool.spec, fleet.spec
        engine = fleet_spec.engine
        sandbox = LocalSandbox(
            executors=pool_spec.executors_per_pod * max(pool_spec.replicas, 1),
            preload=tuple(pool_spec.preload),
            queue_timeout_seconds=pool_spec.queue_timeout_seconds,
            isolation=pool_spec.isolation != "Disabled",
        )
        if not serving:
            return cls(log_dir, sandbox=sandbox)
        return cls(
            log_dir,
            sandbox=sandbox,
            engines=engines_serving(
                model_dir,
                max(fleet_spec.replicas, 1),
                max_model_len=engine.max_model_len,
                kv_cache_bytes=engine.kv_cache_bytes,
                max_num_seqs=engine.max_num_seqs,
                device="cpu",
                extra_args=list(engine.extra_args),
                python=engine_python,
            ),
            scheduler=LocalScheduler(
                policy=fleet_spec.scheduler.policy,
                poll_interval=fleet_spec.scheduler.metrics_interval_seconds,
                segment_tokens=fleet_spec.scheduler.segment_tokens,
            ),
            weight_sync=fleet_spec.weight_sync,
        )

    @classmethod
    def for_command(
        cls,
        settings: LocalServiceSettings,
        model_dir: Path | None,
        *,
        command: str,
        engines: bool = True,
        scheduler: bool = True,
        sandbox: bool = True,
    ) -> LocalStack:
        """The services a command starts because it was not given them: with `engines`,
        `settings.engines` vLLM engines serving `model_dir` (on a GPU each takes its share
        of the memory) and, with `scheduler` too, a rollout scheduler in front of them; with
        `sandbox`, a sandbox server. A GPU engine may take long to load a big model: the
        engines get 15 minutes to come up, the sandbox 5."""
        local_engines: list[EngineSettings] = []
        if engines:
            if model_dir is None:
                raise ValueError("a local engine needs a model")
            local_engines = engines_serving(
                model_dir,
                settings.engines,
                max_model_len=settings.max_model_len,
                device=settings.device,
                python=settings.engine_python,
                gpu_memory_utilization=round(0.9 / settings.engines, 2),
            )
        return cls(
            settings.logs(command),
            sandbox=LocalSandbox(
                settings.sandbox_executors, settings.sandbox_preload, log_level="warning"
            )
            if sandbox
            else None,
            engines=local_engines,
            scheduler=LocalScheduler(
                settings.scheduler_policy, poll_interval=0.2, segment_tokens=256
            )
            if scheduler and local_engines
            else None,
            engine_timeout=900.0,
            sandbox_timeout=300.0,
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
            raise ServiceFailed(f"{error}\n{log_tail(log)}{self._engines_gone()}") from None

    def _engines_gone(self) -> str:
        """Engines that exited after they were found ready (a scheduler waits for them in
        vain), each with the end of its log."""
        gone = [
            f"\nengine {index} exited with {engine.process.returncode}; see {engine.log_path}"
            f"\n{log_tail(engine.log_path)}"
            for index, engine in enumerate(self.engines)
            if engine.process is not None and engine.process.poll() is not None
        ]
        return "".join(gone)
