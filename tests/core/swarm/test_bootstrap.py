"""Issue 20 item 1: `serve` without --initial-peers joins the default swarm, whose built-in peers are the public
Petals swarm's. Nothing run here may dial them: under pytest HIVEKEEPER_BOOTSTRAP_PEERS (set by tests/conftest.py)
replaces them, and asking for the built-in list anyway raises. A default swarm nobody answers from is one line."""

from __future__ import annotations

import os
import time

import pytest

from hivekeeper.core.child_argv import hivekeeper_command
from hivekeeper.core.swarm.bootstrap import (BOOTSTRAP_ENV, PUBLIC_BOOTSTRAP_PEERS, PublicPeersUnderTest,
                                             bootstrap_peers, is_public)
from hivekeeper.planner.errors import InputError

from ...child_output import run


def test_the_built_in_public_peers_are_never_used_under_pytest(monkeypatch):
    peers = bootstrap_peers()
    assert peers and not is_public(peers), f"{BOOTSTRAP_ENV} must replace the public peers under pytest"
    assert all(peer.startswith("/ip4/127.0.0.1/") for peer in peers)  # loopback only
    monkeypatch.delenv(BOOTSTRAP_ENV)
    with pytest.raises(PublicPeersUnderTest, match=BOOTSTRAP_ENV):  # the second guard: the variable forgotten
        bootstrap_peers()


def test_the_variable_replaces_the_built_in_list_and_outside_tests_the_public_swarm_is_the_default():
    assert bootstrap_peers({BOOTSTRAP_ENV: "/ip4/127.0.0.1/tcp/5/p2p/A, /ip4/127.0.0.1/tcp/6/p2p/B"}) == (
        "/ip4/127.0.0.1/tcp/5/p2p/A", "/ip4/127.0.0.1/tcp/6/p2p/B")
    assert bootstrap_peers({}) == PUBLIC_BOOTSTRAP_PEERS  # a plain environment: no dialing here, just the list
    assert all("/p2p/" in peer and "petals.dev" in peer for peer in PUBLIC_BOOTSTRAP_PEERS)
    with pytest.raises(InputError, match="empty"):
        bootstrap_peers({BOOTSTRAP_ENV: " "})


def test_serve_without_peers_joins_the_default_swarm_and_says_in_one_line_that_nobody_answers(tiny_checkpoint):
    started = time.monotonic()
    out = run(hivekeeper_command("serve", "--model", str(tiny_checkpoint), "--host", "127.0.0.1",
                                 "--block-indices", "0:1", "--throughput", "1"), timeout=120, env=dict(os.environ))
    took = time.monotonic() - started
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert lines[-1].endswith("check the network, or edit the initial peers)") and len(lines) <= 2, out.stderr
    assert "bootstrap peers unreachable: " + os.environ[BOOTSTRAP_ENV] in lines[-1]
    assert took < 30, took  # a TCP connect tells at once, before torch loads (busy machine: Python starts slowly)


def test_reachability_is_told_by_plain_tcp_within_a_second():
    import socket

    from hivekeeper.core.swarm.bootstrap import any_reachable, tcp_address

    assert tcp_address("/dns/bootstrap1.petals.dev/tcp/31337/p2p/Qm") == ("bootstrap1.petals.dev", 31337)
    assert tcp_address("/ip4/127.0.0.1/udp/5/quic") is None
    assert tcp_address("/ip4/127.0.0.1/tcp/1") is None  # no peer id: the multiaddr check names it
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        started = time.monotonic()
        assert any_reachable([os.environ[BOOTSTRAP_ENV], f"/ip4/127.0.0.1/tcp/{port}/p2p/X"])
    assert not any_reachable([os.environ[BOOTSTRAP_ENV]])
    assert any_reachable(["/ip4/127.0.0.1/udp/1/quic/p2p/X"])  # not plain TCP: left to the daemon
    assert time.monotonic() - started < 5


def test_swarm_status_without_peers_reads_the_default_swarm(tiny_checkpoint, capsys):
    from hivekeeper.core.cli.main import main

    assert main(["swarm", "status", "--model", str(tiny_checkpoint)]) == 2
    err = capsys.readouterr().err.strip()
    assert "bootstrap peers unreachable: " + os.environ[BOOTSTRAP_ENV] in err and len(err.splitlines()) == 1
