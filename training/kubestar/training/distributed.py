"""The trainer's world: N processes, one torch.distributed process group, the model sharded.

Each process (rank) holds 1/N of the parameters, gradients and AdamW moments (FSDP2's
`fully_shard` on every decoder layer, then on the root). A forward pass all-gathers one layer
at a time; a backward pass reduce-scatters its gradients, summed over ranks (the loss is
already normalised by the whole step's token count, see `Policy.grpo_step`).

World size 1 is today's trainer: no process group, the plain model on one device.

The environment is torchrun's: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
Backends: gloo on CPU, NCCL (RCCL on ROCm) on GPUs. `local_ranks` starts this machine's (or
pod's) share of a world: this process is its first rank, the others are child processes. A
world over several pods meets at worker 0's rendezvous (`rendezvous_host`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
from kubestar.common import accelerators
from kubestar.training.stopping import FinalFailure

T = TypeVar("T")

# How long a rank waits in a collective. The other ranks wait while rank 0 rolls out a step,
# evaluates or builds SFT examples; a rank that dies is noticed at once (its sockets close).
COLLECTIVE_TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0  # the process's index on its machine: which GPU it uses

    @property
    def main(self) -> bool:
        """Rank 0: drives rollouts, writes weights, checkpoints and status."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.size > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> World:
        return cls(
            rank=int(env.get("RANK", "0")),
            size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", env.get("RANK", "0"))),
        )


SINGLE = World()


@dataclass(frozen=True)
class ShardingConfig:
    # Recompute each decoder layer's activations in the backward pass: memory for compute.
    activation_checkpointing: bool = False


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """What the forward and backward passes compute in for trainer.precision on `device`:
    bf16 (mixed: the master weights, optimizer state and gradient reductions stay fp32) or
    fp32. auto: bf16 on GPUs, fp32 on CPU (CPU kernels gain little from bf16)."""
    if precision == "auto":
        precision = "fp32" if device.type == "cpu" else "bf16"
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if precision not in dtypes:
        raise ValueError(f"trainer.precision: {precision!r} is not auto, bf16 or fp32")
    return dtypes[precision]


class AcceleratorUnavailable(FinalFailure):
    """This rank was given GPUs (or trainer.device cuda) that torch cannot drive: a CPU-only
    torch, one built for the other vendor, or fewer devices than the pod requested. Final:
    a retry would meet the same image and node."""

    reason = accelerators.REASON


def device_for(
    world: World, name: str = "auto", env: Mapping[str, str] | None = None
) -> torch.device:
    """The device of this rank: its local GPU when there are GPUs, else the CPU.

    A pod the operator gave GPUs (`env`'s KUBESTAR_GPUS, default this process's) must see
    them all, whatever `name` says, and auto then means the GPU: a pod that asked for GPUs
    never trains on its CPU. cuda needs a GPU for this rank. Raises AcceleratorUnavailable
    naming what was expected and what torch sees."""
    env = os.environ if env is None else env
    count, resource = accelerators.requested(env)
    expected = ""
    if name == "cuda" and count <= world.local_rank:
        count, resource = world.local_rank + 1, ""
        expected = f"trainer.device is cuda (a GPU for local rank {world.local_rank})"
    if count:
        problem = accelerators.problem(count, resource, accelerators.torch_view(), env, expected)
        if problem:
            raise AcceleratorUnavailable(problem)
    if name == "auto":
        name = "cuda" if count or torch.cuda.is_available() else "cpu"
    if name == "cuda" and world.sharded:
        return torch.device("cuda", world.local_rank)
    return torch.device(name)


def init_world(world: World, device: torch.device) -> None:
    """Join the process group (a no-op at world size 1 or when already joined)."""
    import torch.distributed as dist

    if not world.sharded or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        rank=world.rank,
        world_size=world.size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def close_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(value: float, world: World, device: torch.device, op: str = "sum") -> float:
    """The sum (or max) of one number over every rank; the number itself at world size 1."""
    if not world.sharded:
        return value
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(tensor.item())


def broadcast(value: T, world: World) -> T:
    """Rank 0's `value` on every rank (any picklable object, e.g. a step's trajectories)."""
    if not world.sharded:
        return value
    import torch.distributed as dist

    box: list[Any] = [value if world.main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


def all_gather(value: T, world: World) -> list[T]:
    """Every rank's `value` (any picklable object), in rank order, on every rank."""
    if not world.sharded:
        return [value]
    import torch.distributed as dist

    box: list[Any] = [None] * world.size
    dist.all_gather_object(box, value)
    return box


def barrier(world: World) -> None:
    if world.sharded:
        import torch.distributed as dist

        dist.barrier()


def shard(rows: int, world: World) -> list[int]:
    """This rank's rows of a batch of `rows`: every size-th row from its rank (the counts
    differ by at most one; the loss does not depend on which rank gets which row)."""
    return list(range(world.rank, rows, world.size))


def row_share(rows: int, world: World, rank: int | None = None) -> tuple[int, int]:
    """(first row, row count) of a rank's run of a tensor's `rows`, as FSDP2's Shard(0) deals
    them (torch.chunk: ceil(rows / N) to each rank in turn, the last ones short or empty).
    `rank`: whose (default: this rank's)."""
    share = -(-rows // world.size)
    start = min((world.rank if rank is None else rank) * share, rows)
    return start, max(0, min(share, rows - start))


def shard_model(
    model: torch.nn.Module, world: World, device: torch.device, param_dtype: torch.dtype
) -> None:
    """FSDP2 in place: each decoder layer is one unit (all-gathered for its forward and
    backward, then freed), the root holds the rest (embeddings, final norm, head). The
    shards stay fp32; a unit is gathered (and computes) in `param_dtype`, and gradients are
    reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world.size,))
    precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layer_types = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_types]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers to shard (_no_split_modules)")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=precision)
    fully_shard(model, mesh=mesh, mp_policy=precision)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Gradients are summed over ranks, not averaged: each rank's loss is already
            # divided by the token count of the whole step.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)


def _die_with_parent() -> None:
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def rendezvous_host(host: str, published: Callable[[], str | None], timeout: float = 600.0) -> str:
    """The address of worker 0: `host` when DNS resolves it (a cluster's DNS for the headless
    Service), else what `published()` returns (the address the operator publishes in the
    run's status; the only way when `host` is empty, on clusters without DNS), waiting for
    worker 0's pod to get one."""
    import socket
    import time

    deadline = time.monotonic() + timeout
    delay = 0.5
    while True:
        try:
            if host:
                socket.getaddrinfo(host, None)
                return host
        except socket.gaierror:
            pass
        address = published()
        if address:
            return address
        if time.monotonic() > deadline:
            where = host or "status.rendezvousAddress"
            raise TimeoutError(
                f"no address for the trainer's rendezvous ({where}) in {timeout:.0f} s"
            )
        time.sleep(delay)  # worker 0's pod is not scheduled yet: poll, backing off
        delay = min(delay * 2, 5.0)


@contextmanager
def local_ranks(
    size: int,
    command: Sequence[str],
    log_dir: Path | None,
    first_rank: int = 0,
    processes: int | None = None,
    master: tuple[str, int] | None = None,
) -> Iterator[World]:
    """This machine's `processes` ranks of a world of `size` (all of them by default): this
    process is rank `first_rank`, ranks first_rank+1 .. run `command` with torchrun's
    environment, each logging to log_dir/rank-N.log (or to this process's output when
    log_dir is None). `master`: worker 0's rendezvous (default 127.0.0.1 and a free port,
    for a world on this machine alone). Yields this process's World; on the way out waits for
    the other ranks and stops any still running."""
    processes = size if processes is None else processes
    if size <= 1:
        yield SINGLE
        return
    from kubestar.common.net import free_port

    address, port = master or ("127.0.0.1", free_port())
    shared = {"MASTER_ADDR": address, "MASTER_PORT": str(port), "WORLD_SIZE": str(size)}
    saved = {key: os.environ.get(key) for key in (*shared, "RANK", "LOCAL_RANK")}
    os.environ.update(shared, RANK=str(first_rank), LOCAL_RANK="0")
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    processes_started: list[subprocess.Popen[bytes]] = []
    ranks = range(first_rank + 1, first_rank + processes)
    try:
        for local, rank in enumerate(ranks, start=1):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(local)}
            log = (log_dir / f"rank-{rank}.log").open("wb") if log_dir is not None else None
            with log or contextlib.nullcontext():
                processes_started.append(
                    subprocess.Popen(
                        list(command),
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT if log else None,
                        # A first rank killed outright (OOM, SIGKILL) takes the others with it.
                        preexec_fn=_die_with_parent,
                    )
                )
        yield World(rank=first_rank, size=size, local_rank=0)
        for process in processes_started:
            process.wait(timeout=300)
    finally:
        for process in processes_started:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        close_world()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    started = zip(ranks, processes_started, strict=False)  # fewer when a start failed
    failed = [rank for rank, p in started if p.returncode != 0]
    if failed:
        where = f"; see {log_dir}/rank-N.log" if log_dir is not None else ""
        raise RuntimeError(f"training ranks {failed} failed{where}")
