"""The services of a TrainingRun as local processes: what `kubestar train -f` runs on one machine.

The same manifests a cluster takes (SandboxPool, RolloutFleet, TrainingRun) become: one
sandbox server (`kubestar sandbox serve`, worker and dispatcher in one process), the fleet's
vLLM engines (`EngineProcess`), and the rollout scheduler in front of them. Everything binds
to 127.0.0.1 on free ports and is stopped by PID when the run ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from kubestar.api.v1alpha1 import RolloutFleet, SandboxPool
from kubestar.common.net import free_port, wait_serving
from kubestar.engine.launch import EngineProcess, EngineSettings, die_with_parent
from kubestar.training.session import Endpoints


class LocalStack:
    """Sandbox, engines and scheduler for one run; a context manager that stops them all."""

    def __init__(
        self,
        pool: SandboxPool,
        fleet: RolloutFleet,
        model_dir: Path,
        log_dir: Path,
        engine_python: str = "",
    ) -> None:
        self.pool = pool
        self.fleet = fleet
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.engine_python = engine_python
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.engines: list[EngineProcess] = []

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - lives with the process
        process = subprocess.Popen(
            [sys.executable, "-m", "kubestar.cli.main", *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.processes.append((name, process))
        return process

    def start(self) -> Endpoints:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        pool = self.pool.spec
        sandbox = f"127.0.0.1:{free_port()}"
        sandbox_process = self._spawn(
            "sandbox",
            [
                "sandbox",
                "serve",
                "--listen",
                sandbox,
                "--executors",
                str(pool.executors_per_pod * max(pool.replicas, 1)),
                "--preload",
                ",".join(pool.preload),
                "--queue-timeout",
                str(pool.queue_timeout_seconds),
            ],
        )
        fleet = self.fleet.spec
        for index in range(max(fleet.replicas, 1)):
            settings = EngineSettings(
                model=str(self.model_dir),
                port=free_port(),
                max_model_len=fleet.engine.max_model_len,
                kv_cache_bytes=fleet.engine.kv_cache_bytes,
                max_num_seqs=fleet.engine.max_num_seqs,
                device="cpu",
                extra_args=list(fleet.engine.extra_args),
                python=self.engine_python,
            )
            engine = EngineProcess(settings, log_path=self.log_dir / f"engine-{index}.log")
            self.engines.append(engine.start(wait=False))
        for engine in self.engines:
            engine.wait_ready()
        wait_serving(sandbox, sandbox_process, what="sandbox", log=self.log_dir / "sandbox.log")
        scheduler = f"127.0.0.1:{free_port()}"
        engine_args = [
            arg
            for i, engine in enumerate(self.engines)
            for arg in ("--engine", f"e{i}={engine.url}")
        ]
        scheduler_process = self._spawn(
            "scheduler",
            [
                "scheduler",
                "serve",
                "--listen",
                scheduler,
                "--policy",
                fleet.scheduler.policy,
                "--poll-interval",
                str(fleet.scheduler.metrics_interval_seconds),
                "--segment-tokens",
                str(fleet.scheduler.segment_tokens),
                *engine_args,
            ],
        )
        wait_serving(
            scheduler, scheduler_process, what="scheduler", log=self.log_dir / "scheduler.log"
        )
        return Endpoints(scheduler=scheduler, sandbox=sandbox)

    def stop(self) -> None:
        for _, process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for _, process in reversed(self.processes):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for engine in self.engines:
            engine.stop()
        self.processes.clear()
        self.engines.clear()

    @contextlib.contextmanager
    def running(self) -> Iterator[Endpoints]:
        try:
            yield self.start()
        finally:
            self.stop()
