"""The weights broadcast's two ends (kubestar.engine.weight_sync) over real TCPStore and gloo
process groups, without vLLM: the trainer's WeightServer and engines in threads of this
process. A real engine loading a broadcast is tested in tests/scheduler/test_vllm.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from kubestar.common.net import free_port
from kubestar.engine.weight_sync import (
    WeightServer,
    _weights_call,
    is_broadcast,
    new_session,
    parse_source,
    receive,
)
from safetensors.torch import save_file


def folder_of(tmp_path: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    """A weights folder of two buckets (files), as the trainer writes it."""
    folder = tmp_path / name
    folder.mkdir()
    names = sorted(tensors)
    half = len(names) // 2
    for index, part in enumerate((names[:half], names[half:]), start=1):
        save_file(
            {k: tensors[k] for k in part}, str(folder / f"model-{index:05d}-of-00002.safetensors")
        )
    return folder


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(33, 8, generator=generator).to(torch.bfloat16),
        "layer.0.norm": torch.randn(7, generator=generator).to(torch.bfloat16),  # odd bytes
        "layer.0.proj": torch.randn(8, 8, generator=generator),  # fp32 after an odd bf16
        "layer.0.steps": torch.arange(3, dtype=torch.int64),
    }


def receive_all(
    source: str, session: str, engine: int, engines: int, version: int, workers: int = 1
) -> list[dict[str, torch.Tensor] | BaseException]:
    """What each worker of one engine received (or the error it raised)."""
    results: list[dict[str, torch.Tensor] | BaseException] = [{} for _ in range(workers)]

    def worker(index: int) -> None:
        try:
            _, tensors = receive(
                source, session, engine, engines, version, index, workers, torch.device("cpu"), 30
            )
            results[index] = {name: tensor.clone() for name, tensor in tensors}
        except BaseException as error:  # handed to the test
            results[index] = error

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_every_worker_of_every_engine_gets_every_tensor_bit_for_bit(tmp_path: Path) -> None:
    sent = weights(1)
    with WeightServer("127.0.0.1", timeout=30) as server:
        server.publish(folder_of(tmp_path, "v3", sent), 3)
        session = new_session()
        got: dict[int, list[dict[str, torch.Tensor] | BaseException]] = {}
        # Two engines in one session: the first with two workers (tensor parallel), the other one.
        threads = [
            threading.Thread(
                target=lambda e=e, w=w: got.__setitem__(
                    e, receive_all(server.source, session, e, 2, 3, w)
                )
            )
            for e, w in ((0, 2), (1, 1))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert server.sessions_served == 1
        # What the session needed is gone from the store (a run pushes every step).
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False)  # type: ignore[attr-defined]
        for name in ("manifest", "engine-0", "engine-1"):
            assert not store.check([f"kubestar/session/{session}/{name}"]), name
    received = [one for engine in sorted(got) for one in got[engine]]
    assert len(received) == 3
    for one in received:
        assert isinstance(one, dict), one
        assert sorted(one) == sorted(sent)
        for name, tensor in sent.items():
            assert one[name].dtype == tensor.dtype and torch.equal(one[name], tensor), name


def test_a_late_engine_gets_the_version_published_last(tmp_path: Path) -> None:
    with WeightServer("127.0.0.1", timeout=30) as server:
        server.publish(folder_of(tmp_path, "v1", weights(1)), 1)
        first = receive_all(server.source, new_session(), 0, 1, 1)
        server.publish(folder_of(tmp_path, "v2", weights(2)), 2)
        late = receive_all(server.source, new_session(), 0, 1, 2)
    assert isinstance(first[0], dict) and isinstance(late[0], dict)
    assert torch.equal(late[0]["embed.weight"], weights(2)["embed.weight"])
    assert not torch.equal(late[0]["embed.weight"], first[0]["embed.weight"])


def test_a_version_the_server_does_not_serve_is_refused_and_serving_goes_on(
    tmp_path: Path,
) -> None:
    with WeightServer("127.0.0.1", timeout=30) as server:
        refused = receive_all(server.source, new_session(), 0, 1, 1)  # nothing published
        server.publish(folder_of(tmp_path, "v4", weights(4)), 4)
        stale = receive_all(server.source, new_session(), 0, 1, 3)
        served = receive_all(server.source, new_session(), 0, 1, 4)
    assert "published no weights yet" in str(refused[0])
    assert "serves weights v4, not v3" in str(stale[0])
    assert isinstance(served[0], dict) and len(served[0]) == 4


def test_sources_and_requests_are_checked() -> None:
    assert is_broadcast("broadcast://10.0.0.5:4000") and not is_broadcast("/weights/v1")
    assert parse_source("broadcast://10.0.0.5:4000") == ("10.0.0.5", 4000)
    for bad in ("broadcast://10.0.0.5", "broadcast://:80", "/weights"):
        with pytest.raises(ValueError, match="broadcast://HOST:PORT"):
            parse_source(bad)
    assert _weights_call({"path": "/w/v1"}) == ("kubestar_load_folder", {"path": "/w/v1"})
    method, arguments = _weights_call(
        {"source": "broadcast://h:1", "session": "s", "engine": 0, "engines": 2, "version": 5}
    )
    assert method == "kubestar_receive_weights" and arguments["engines"] == 2
    with pytest.raises(KeyError):
        _weights_call({"source": "broadcast://h:1"})


def test_an_engine_that_never_joins_fails_its_session_alone(tmp_path: Path) -> None:
    """Engine 1 of a session of two never comes (it died after the scheduler asked it): the
    server gives up after its join timeout, tells engine 0, and serves the next session."""
    with WeightServer("127.0.0.1", timeout=30, join_timeout=1) as server:
        server.publish(folder_of(tmp_path, "v1", weights(1)), 1)
        alone = receive_all(server.source, new_session(), 0, 2, 1)
        after = receive_all(server.source, new_session(), 0, 1, 1)
    assert "not all 2 engines of the session joined in time" in str(alone[0])
    assert isinstance(after[0], dict) and len(after[0]) == 4


def test_a_source_whose_server_is_gone_fails_at_once() -> None:
    """A restore of weights whose trainer has finished: the engine is told so at once, not
    after the store's connection retries (it is paused meanwhile)."""
    gone = f"broadcast://127.0.0.1:{free_port()}"
    (refused,) = receive_all(gone, new_session(), 0, 1, 1)
    assert isinstance(refused, RuntimeError) and "no weight server answers" in str(refused)
