"""New policy weights into running vLLM engines: read from a folder, or broadcast by the trainer.

Both ends of the protocol live here, importing only the standard library and torch: GPU
engines, whose images have vLLM but not kubestar, import this file from a copy (see
kubestar.operator.build_fleet).

In each engine (vLLM's server started with `--middleware kubestar.engine.weight_sync.WeightRoutes`
and `--worker-extension-cls kubestar.engine.weight_sync.WeightSyncExtension`):

    POST /kubestar/v1/weights  {"path": FOLDER}
                               {"source": "broadcast://HOST:PORT", "session": ID,
                                "engine": I, "engines": N, "version": V, "timeout": S}

pauses generation once the requests in flight finish, has every worker of the engine load the
weights in place (vLLM's `reload_weights`), drops the prefix cache (its KV came from the old
weights) and resumes. It answers {"bytes": ..., "seconds": ...}. No development endpoint of
vLLM is involved.

A broadcast, for one session of N engines (the scheduler gives each its index I):

1. Every worker of every engine connects to the trainer's `WeightServer` (a TCPStore at
   HOST:PORT). Worker 0 of engine I says how many workers the engine has; worker 0 of
   engine 0 also queues the session's request (its N and the version V it wants).
2. The server answers with the session's manifest: the version it serves, the process-group
   backend (NCCL when the trainer and the engines have GPUs, else gloo), and its buckets
   (the bf16 safetensors files of the folder it published; each tensor's name, dtype, shape,
   offset, from the file's header). A version other than V is refused in the manifest, with
   a message.
3. The server (rank 0) and every worker (ranks 1.., engine by engine) make one process group
   for the session; each bucket is one broadcast of its file's data section as it lies on
   disk (no copy in between), and each worker loads a bucket's tensors as it arrives (an
   iterator vLLM's loader consumes: one bucket in memory at a time). Engines that join late
   (a restart, a new replica) get a session of their own.

The server keeps the folder of the version it serves on the trainer's own disk: no volume is
shared with the engines.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: the scheduler imports the constants
    import torch

log = logging.getLogger(__name__)

ROUTE = "/kubestar/v1/weights"
SCHEME = "broadcast://"
DEFAULT_TIMEOUT = 600.0
# How long the server waits for a session's engines to join (a broadcast, once joined, has
# DEFAULT_TIMEOUT): an engine that died after asking holds the next version back no longer.
JOIN_TIMEOUT = 60.0
# The server's wait for the next request (woken by a request, or by `close`'s).
_IDLE = timedelta(days=1)
_REQUESTS = "kubestar/requests"
_REQUEST = "kubestar/request"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def is_broadcast(source: str) -> bool:
    """Whether `source` names a trainer's WeightServer rather than a folder."""
    return source.startswith(SCHEME)


def parse_source(source: str) -> tuple[str, int]:
    """(host, port) of `broadcast://HOST:PORT`; ValueError naming the source when malformed."""
    host, _, port = source.removeprefix(SCHEME).rpartition(":")
    if not is_broadcast(source) or not host or not port.isdigit():
        raise ValueError(f"weights source {source!r} is not broadcast://HOST:PORT")
    return host.strip("[]"), int(port)


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to host:port (its pod IP in a cluster)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # a UDP connect sends nothing
        address: str = probe.getsockname()[0]
        return address


def _key(session: str, name: str) -> str:
    return f"kubestar/session/{session}/{name}"


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weights manifest")
    return dtype


def process_group(
    backend: str, store: Any, rank: int, size: int, address: str, timeout: timedelta
) -> Any:
    """A process group of its own for one session (not torch.distributed's default group,
    which vLLM's workers and the trainer's ranks already use)."""
    import torch.distributed as dist

    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    # Gloo listens on this address only (the pod's, or the loopback on one machine).
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, options)


# --- The trainer's end ------------------------------------------------------------------


class WeightServer:
    """Rank 0 of the trainer: serves the folder of the version it last published to every
    session the engines open, one session at a time, from a thread of its own.

    `host`: the address engines reach it at (and the only one it listens on); port 0 picks a
    free one. `source` is what the scheduler is told (`broadcast://HOST:PORT`)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
        join_timeout: float = JOIN_TIMEOUT,
    ) -> None:
        import torch.distributed as dist

        self.host = host
        self.timeout = timedelta(seconds=timeout)
        self.join_timeout = timedelta(seconds=min(timeout, join_timeout))
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, port))
        listener.listen(128)
        self.port: int = listener.getsockname()[1]
        # The store owns the socket from here (so it listens on `host` alone, and Python
        # never closes it under the store).
        self._store = dist.TCPStore(  # type: ignore[attr-defined]
            host,
            self.port,
            is_master=True,
            wait_for_workers=False,
            timeout=self.timeout,
            master_listen_fd=listener.detach(),
            use_libuv=False,
        )
        self._lock = threading.Lock()  # held while a session is served or a folder published
        self._folder: Path | None = None
        self._version = -1
        self.sessions_served = 0
        self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
        self._thread.start()

    @property
    def source(self) -> str:
        return f"{SCHEME}{self.host}:{self.port}"

    def publish(self, folder: Path, version: int) -> None:
        """From now on, serve `folder` as `version` (after any session under way ends)."""
        with self._lock:
            self._folder, self._version = Path(folder), version

    def close(self) -> None:
        """Stop serving, once the sessions asked for before are done."""
        import torch.distributed as dist

        if self._thread.is_alive():
            # A connection of its own: the serving thread's is not to be shared.
            store = dist.TCPStore(  # type: ignore[attr-defined]
                self.host, self.port, is_master=False, timeout=self.join_timeout
            )
            number = store.add(_REQUESTS, 1)
            store.set(f"{_REQUEST}/{number}", json.dumps({"stop": True}))
            self._thread.join(timeout=30)

    def __enter__(self) -> WeightServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        served = 0
        while True:
            key = f"{_REQUEST}/{served + 1}"
            try:
                self._store.wait([key], _IDLE)
            except Exception:  # the store's timeout: nobody asked for a day; wait again
                continue
            served += 1
            request = json.loads(self._store.get(key))
            self._store.delete_key(key)  # a run pushes every step: the store must not grow
            if request.get("stop"):
                return
            try:
                with self._lock:
                    self._session(request)
                self.sessions_served += 1
            except Exception as error:  # one failed session must not stop serving
                log.warning("weights session %s failed: %s", request.get("session"), error)

    def _manifest(self, wanted: int, device: str) -> dict[str, Any]:
        import torch

        if self._folder is None:
            return {"error": f"the trainer has published no weights yet (asked for v{wanted})"}
        if wanted != self._version:
            return {"error": f"the trainer serves weights v{self._version}, not v{wanted}"}
        buckets = [_bucket(file) for file in sorted(self._folder.glob("*.safetensors"))]
        backend = "nccl" if device == "cuda" and torch.cuda.is_available() else "gloo"
        return {"version": self._version, "backend": backend, "buckets": buckets}

    def _session(self, request: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        session, engines = str(request["session"]), int(request["engines"])
        manifest = self._manifest(int(request["version"]), str(request.get("device", "cpu")))
        try:
            joined = [_key(session, f"engine-{i}") for i in range(engines)]
            self._store.wait(joined, self.join_timeout)
            workers = [int(self._store.get(key)) for key in joined]
        except Exception:  # the store's timeout: tell the engines that came, at once
            manifest = {"error": f"not all {engines} engines of the session joined in time"}
        self._store.set(_key(session, "manifest"), json.dumps(manifest))
        if "error" in manifest:
            return
        device = torch.device("cuda") if manifest["backend"] == "nccl" else torch.device("cpu")
        group = process_group(
            manifest["backend"],
            dist.PrefixStore(_key(session, "group"), self._store),  # type: ignore[attr-defined]
            0,
            1 + sum(workers),
            self.host,
            self.timeout,
        )
        # Every engine read these before it joined the group.
        for key in (*joined, _key(session, "manifest")):
            self._store.delete_key(key)
        assert self._folder is not None
        for bucket in manifest["buckets"]:  # one bucket held at a time
            # The file's data section as it lies on disk: the tensors' bytes, back to back.
            data = _file_bytes(self._folder / bucket["file"])[bucket["start"] :]
            group.broadcast([data.to(device)]).wait()
            del data


def _bucket(file: Path) -> dict[str, Any]:
    """A safetensors file as one broadcast: its data section's size and where it starts in
    the file, and each tensor's name, dtype, shape and offset in the data section."""
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    tensors = []
    for name, entry in header.items():
        first, last = entry["data_offsets"]
        tensors.append(
            [name, _SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"], first, last - first]
        )
    tensors.sort(key=lambda tensor: tensor[3])
    size = max((offset + nbytes for *_, offset, nbytes in tensors), default=0)
    return {"file": file.name, "start": 8 + length, "bytes": size, "tensors": tensors}


def _file_bytes(file: Path) -> torch.Tensor:
    import torch

    return torch.from_file(str(file), size=file.stat().st_size, dtype=torch.uint8)


# safetensors' dtype names as torch's.
_SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


# --- The engine's end -------------------------------------------------------------------


def receive(
    source: str,
    session: str,
    engine: int,
    engines: int,
    version: int,
    worker: int,
    workers: int,
    device: torch.device,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """Join `session` as worker `worker` of `workers` in engine `engine` of `engines`: the
    manifest, and the tensors as they arrive (the iterator must be consumed to the end: the
    other members wait on each broadcast). Raises RuntimeError with the server's refusal."""
    import torch
    import torch.distributed as dist

    host, port = parse_source(source)
    _answering(host, port, source)
    wait = timedelta(seconds=timeout)
    store = dist.TCPStore(host, port, is_master=False, timeout=wait)  # type: ignore[attr-defined]
    if worker == 0:
        store.set(_key(session, f"engine-{engine}"), str(workers))
        if engine == 0:
            number = store.add(_REQUESTS, 1)
            request = {
                "session": session,
                "engines": engines,
                "version": version,
                "device": device.type,
            }
            store.set(f"{_REQUEST}/{number}", json.dumps(request))
    manifest = json.loads(store.get(_key(session, "manifest")))
    if "error" in manifest:
        raise RuntimeError(f"{source}: {manifest['error']}")
    counts = [int(store.get(_key(session, f"engine-{i}"))) for i in range(engines)]
    rank = 1 + sum(counts[:engine]) + worker
    group = process_group(
        manifest["backend"],
        dist.PrefixStore(_key(session, "group"), store),  # type: ignore[attr-defined]
        rank,
        1 + sum(counts),
        local_address(host, port),
        wait,
    )
    buffer_device = device if manifest["backend"] == "nccl" else torch.device("cpu")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in manifest["buckets"]:
            flat = torch.empty(bucket["bytes"], dtype=torch.uint8, device=buffer_device)
            group.broadcast([flat]).wait()
            for name, dtype_name, shape, offset, nbytes in bucket["tensors"]:
                dtype = _dtype(dtype_name)
                piece = flat[offset : offset + nbytes]
                if offset % dtype.itemsize:  # safetensors does not align tensors
                    piece = piece.clone()
                yield name, piece.view(dtype).reshape(shape)

    return manifest, tensors()


def _answering(host: str, port: int, source: str) -> None:
    """Fail at once where no server listens (a finished or restarted trainer's old address),
    rather than after the store's connection retries: the engine is paused meanwhile."""
    try:
        socket.create_connection((host, port), timeout=10).close()
    except OSError as error:
        raise RuntimeError(
            f"{source}: no weight server answers ({error.strerror or error}); the trainer that "
            "served these weights has finished or moved, and its next push brings them"
        ) from None


class WeightSyncExtension:
    """Mixed into vLLM's workers (`--worker-extension-cls`): the methods the route calls on
    every worker of an engine through `collective_rpc`."""

    def kubestar_load_folder(self, path: str) -> int:
        """Load the Hugging Face folder at `path` in place; returns its bytes."""
        self.reload_weights(weights_path=path)  # type: ignore[attr-defined]
        return sum(file.stat().st_size for file in Path(path).glob("*.safetensors"))

    def kubestar_receive_weights(
        self,
        source: str,
        session: str,
        engine: int,
        engines: int,
        version: int,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> int:
        """Receive the session's broadcast and load it in place; returns the bytes received."""
        import torch

        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        manifest, tensors = receive(
            source,
            session,
            engine,
            engines,
            version,
            worker=int(getattr(self, "rank", 0)),
            workers=int(parallel.world_size),
            device=torch.device(getattr(self, "device", "cpu")),
            timeout=timeout,
        )
        self.reload_weights(weights_iterator=tensors)  # type: ignore[attr-defined]
        for _ in tensors:  # whatever the loader left: the group waits on every broadcast
            pass
        return sum(int(bucket["bytes"]) for bucket in manifest["buckets"])


class WeightRoutes:
    """ASGI middleware for vLLM's server (`--middleware`): POST ROUTE loads new weights on
    every worker (see the module's docstring); every other request passes through."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "").rstrip("/") != ROUTE:
            await self.app(scope, receive, send)
            return
        if scope.get("method") != "POST":
            await _answer(send, 405, {"error": f"{ROUTE} takes POST"})
            return
        try:
            body = json.loads(await _body(receive) or b"{}")
            method, arguments = _weights_call(body)
        except (ValueError, TypeError, KeyError) as error:
            await _answer(send, 400, {"error": f"{ROUTE}: {error}"})
            return
        engine = scope["app"].state.engine_client
        started = time.monotonic()
        await engine.pause_generation(mode="wait")
        try:
            loaded = await engine.collective_rpc(method, kwargs=arguments)
            await engine.reset_prefix_cache()
        except Exception as error:  # answered; the engine serves on
            await _answer(send, 500, {"error": f"{ROUTE}: {type(error).__name__}: {error}"})
            return
        finally:
            await engine.resume_generation()
        seconds = time.monotonic() - started
        await _answer(send, 200, {"bytes": int(max(loaded or [0])), "seconds": seconds})


def _weights_call(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The workers' method and its arguments for a request body."""
    if "path" in body:
        return "kubestar_load_folder", {"path": str(body["path"])}
    parse_source(str(body.get("source", "")))
    return "kubestar_receive_weights", {
        "source": str(body["source"]),
        "session": str(body["session"]),
        "engine": int(body["engine"]),
        "engines": int(body["engines"]),
        "version": int(body["version"]),
        "timeout": float(body.get("timeout", DEFAULT_TIMEOUT)),
    }


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _answer(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def new_session() -> str:
    return uuid.uuid4().hex
