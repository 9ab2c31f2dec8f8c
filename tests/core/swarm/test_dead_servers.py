"""A server killed with SIGKILL (no goodbye: its DHT records stay ONLINE for two update periods) is seen as gone at
once: `hivekeeper swarm status` shows it unreachable and its blocks as a gap, and a new `serve --num-blocks` takes
that gap instead of a span that live servers already cover. Real servers on 127.0.0.1, real commands."""

from __future__ import annotations

import json
import os
import time

import pytest

from hivekeeper.core.child_argv import hivekeeper_command
from hivekeeper.core.swarm.local import LocalSwarm

from ...child_output import run

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

    return make_demo_checkpoint(tmp_path_factory.mktemp("dead") / "dead-servers-demo", layers=6)


def _status(checkpoint, peers) -> tuple[dict, float]:
    started = time.monotonic()
    out = run(hivekeeper_command("swarm", "status", "--model", str(checkpoint), "--initial-peers", *peers, "--json"),
              timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), time.monotonic() - started


def test_a_killed_server_is_unreachable_at_once_and_a_new_server_takes_its_blocks(checkpoint, tmp_path):
    # equal throughputs, records valid for 2 x 60 s, nobody rebalances: only liveness decides where d goes
    common = ("--torch-threads", "1", "--throughput", "10", "--update-period", "60", "--balance-period", "0")
    with LocalSwarm(checkpoint, extra_args=common, log_dir=tmp_path) as swarm:
        a = swarm.start("--block-indices", "0:2", "--public-name", "a")
        b = swarm.start("--block-indices", "2:4", "--public-name", "b")
        c = swarm.start("--block-indices", "4:6", "--public-name", "c")
        before, _ = _status(checkpoint, swarm.initial_peers)
        assert before["gaps"] == [] and {s["state"] for s in before["servers"]} == {"online"}

        b.kill()  # SIGKILL to the server and its p2pd
        killed_at = time.monotonic()
        report, took = _status(checkpoint, swarm.initial_peers)
        seen_after = time.monotonic() - killed_at
        servers = {s["public_name"]: s for s in report["servers"]}
        assert servers["b"]["state"] == "unreachable" and servers["b"]["declared_state"] == "online"
        assert servers["b"]["rtt"] is None and servers["a"]["rtt"] is not None
        assert servers["a"]["state"] == servers["c"]["state"] == "online"
        assert report["gaps"] == [2, 3]
        assert [block["throughput"] for block in report["blocks"]] == [10.0, 10.0, 0.0, 0.0, 10.0, 10.0]
        assert report["blocks"][2]["unreachable"] == [b.peer_id]
        print(f"\n[dead server] unreachable in the first status after the kill: {seen_after:.1f}s "
              f"(the command took {took:.1f}s)")

        d = swarm.start("--num-blocks", "2", "--public-name", "d")
        assert d.blocks == (2, 4)  # the gap; the stale records of b would have made it take 0:2
        after, _ = _status(checkpoint, [*a.maddrs, *c.maddrs])
        assert after["gaps"] == []
        assert {s["public_name"]: s["state"] for s in after["servers"]} == {
            "a": "online", "b": "unreachable", "c": "online", "d": "online"}
