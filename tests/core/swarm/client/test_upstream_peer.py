"""Our client names each server's upstream peer when it opens the server's session (the previous server of the
chain), so the server takes pushes from that peer only (docs/swarm.md, Limits): checked on two in-process servers
of one tiny checkpoint, a block each, during a session with server-to-server push."""

from __future__ import annotations

import pytest
import torch

from hivekeeper.core.swarm.client.inference import ClientConfig, SwarmClient

from .servers import InProcessServers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
PREFIX = "upstream-test"


def test_each_server_after_the_first_is_told_its_upstream_peer(tiny_checkpoint):
    servers = InProcessServers(tiny_checkpoint, PREFIX)
    try:
        first = servers.start((0, 1), "first")
        second = servers.start((1, 2), "second")
        client = SwarmClient(ClientConfig(initial_peers=tuple(servers.initial_peers), dht_prefix=PREFIX,
                                          num_blocks=2, retry_seconds=20.0))
        try:
            hidden = torch.randn(1, 3, 64)
            with client.inference_session(max_length=8) as session:
                session.step(hidden)
                session.step(hidden[:, :1])  # a plain step on open sessions: pushed from first to second
                handlers = {peer: servers.running[peer][0].handler for peer in (first, second)}
                (opened_first,) = handlers[first].sessions.values()
                (opened_second,) = handlers[second].sessions.values()
                assert opened_second.upstream == first and opened_second.upstream_named
                assert not opened_first.upstream_named  # the client itself opens the chain
        finally:
            client.close()
    finally:
        servers.close()
