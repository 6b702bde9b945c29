"""``launcher.free_port``: a rendezvous port outside the range the kernel hands to outgoing
connections, free when returned."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from megatron.canzona.runtime.launcher import LOWEST_PORT, free_port

pytestmark = pytest.mark.quick


def test_ports_are_free_and_below_the_ephemeral_range() -> None:
    lowest_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(LOWEST_PORT <= port < lowest_ephemeral for port in ports), ports
    assert len(set(ports)) > 1, ports  # drawn at random, not the same one every time
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", ports[0]))
        listener.listen()
        taken = {free_port() for _ in range(200)}  # a bound port is skipped
        assert ports[0] not in taken
