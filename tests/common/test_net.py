"""Ports for the services kubestar starts on this machine: below the kernel's ephemeral
range, so that no other process's bind to port 0 takes one before its server binds it."""

from __future__ import annotations

import collections
import socket
from pathlib import Path

import pytest
from kubestar.common import net


def ephemeral_start() -> int:
    return int(net.EPHEMERAL_PORTS.read_text().split()[0])


def test_a_free_port_is_below_the_ephemeral_range_and_binds() -> None:
    ports = {net.free_port() for _ in range(20)}
    assert all(net.SERVER_PORTS.start <= port < ephemeral_start() for port in ports), ports
    assert len(ports) > 1  # chosen at random, not the first free one each time
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_ports_taken_by_port_zero_binds_are_never_chosen() -> None:
    """What a busy machine does between a choice and its bind: processes binding port 0
    get ports of the ephemeral range, which free_port never returns."""
    taken = []
    try:
        for _ in range(200):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            taken.append(sock)
        held = {sock.getsockname()[1] for sock in taken}
        assert not {net.free_port() for _ in range(50)} & held
    finally:
        for sock in taken:
            sock.close()


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stack chooses all its ports before its engines bind theirs."""
    monkeypatch.setattr(
        net, "SERVER_PORTS", range(net.SERVER_PORTS.start, net.SERVER_PORTS.start + 8)
    )
    monkeypatch.setattr(net, "_handed_out", collections.deque(maxlen=1000))
    chosen = [net.free_port() for _ in range(8)]
    assert sorted(chosen) == list(net.SERVER_PORTS)


def test_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", net.SERVER_PORTS.start))
        listener.listen()
        monkeypatch.setattr(
            net, "SERVER_PORTS", range(net.SERVER_PORTS.start, net.SERVER_PORTS.start + 2)
        )
        assert net.free_port() == net.SERVER_PORTS.start + 1


def test_an_ephemeral_range_that_leaves_no_room_falls_back_to_the_kernels_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels = ephemeral_start()  # this machine's range, where the kernel's choice falls
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1024\t65535\n")
    monkeypatch.setattr(net, "EPHEMERAL_PORTS", wide)
    port = net.free_port()
    assert port >= kernels
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
