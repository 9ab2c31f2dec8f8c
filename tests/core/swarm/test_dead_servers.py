"""A server killed with SIGKILL (no goodbye: its DHT records stay ONLINE for two update periods) is seen as gone at
once: `hivekeeper swarm status` shows it unreachable and its blocks as a gap, and a new `serve --num-blocks` takes
that gap instead of a span that live servers already cover. Real servers on 127.0.0.1: the one killed and the new
one are `hivekeeper serve` processes, the status after the kill is the real command; the two servers that only stay
up (a and c) are SwarmServers in this process, and the status before and after runs through main() here."""

from __future__ import annotations

import json
import os
import time

import pytest

from hivekeeper.core.child_argv import hivekeeper_command
from hivekeeper.core.cli.main import main
from hivekeeper.core.swarm.dht import dht_prefix_for
from hivekeeper.core.swarm.local import LocalSwarm

from ...child_output import run
from .client.servers import InProcessServers

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

    return make_demo_checkpoint(tmp_path_factory.mktemp("dead") / "dead-servers-demo", layers=6)


def _status_command(checkpoint, peers) -> tuple[dict, float]:
    """`hivekeeper swarm status --json` as a process: its report, and how long it took."""
    started = time.monotonic()
    out = run(hivekeeper_command("swarm", "status", "--model", str(checkpoint), "--initial-peers", *peers, "--json"),
              timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), time.monotonic() - started


def _status(capsys, checkpoint, peers) -> dict:
    """The same command through main() in this process."""
    capsys.readouterr()
    assert main(["swarm", "status", "--model", str(checkpoint), "--initial-peers", *peers, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_killed_server_is_unreachable_at_once_and_a_new_server_takes_its_blocks(checkpoint, tmp_path, capsys):
    # equal throughputs, records valid for 2 x 60 s, nobody rebalances: only liveness decides where d goes
    common = ("--torch-threads", "1", "--throughput", "10", "--update-period", "60", "--balance-period", "0")
    servers = InProcessServers(checkpoint, dht_prefix_for(str(checkpoint)), update_period=60.0)
    try:
        a = servers.running[servers.start((0, 2), "a", throughput=10.0)][0]
        c = servers.running[servers.start((4, 6), "c", throughput=10.0)][0]
        with LocalSwarm(checkpoint, extra_args=common, log_dir=tmp_path,
                        initial_peers=tuple(servers.initial_peers)) as swarm:
            b = swarm.start("--block-indices", "2:4", "--public-name", "b")
            before = _status(capsys, checkpoint, servers.initial_peers)
            assert before["gaps"] == [] and {s["state"] for s in before["servers"]} == {"online"}
            assert len(before["servers"]) == 3

            b.kill()  # SIGKILL to the server and its p2pd
            killed_at = time.monotonic()
            report, took = _status_command(checkpoint, servers.initial_peers)
            seen_after = time.monotonic() - killed_at
            by_name = {s["public_name"]: s for s in report["servers"]}
            assert by_name["b"]["state"] == "unreachable" and by_name["b"]["declared_state"] == "online"
            assert by_name["b"]["rtt"] is None and by_name["a"]["rtt"] is not None
            assert by_name["a"]["state"] == by_name["c"]["state"] == "online"
            assert report["gaps"] == [2, 3]
            assert [block["throughput"] for block in report["blocks"]] == [10.0, 10.0, 0.0, 0.0, 10.0, 10.0]
            assert report["blocks"][2]["unreachable"] == [b.peer_id]
            with capsys.disabled():
                print(f"\n[dead server] unreachable in the first status after the kill: {seen_after:.1f}s "
                      f"(the command took {took:.1f}s)")

            d = swarm.start("--num-blocks", "2", "--public-name", "d")
            assert d.blocks == (2, 4)  # the gap; the stale records of b would have made it take 0:2
            after = _status(capsys, checkpoint, [*a.maddrs, *c.maddrs])
            assert after["gaps"] == []
            assert {s["public_name"]: s["state"] for s in after["servers"]} == {
                "a": "online", "b": "unreachable", "c": "online", "d": "online"}
    finally:
        servers.close()
