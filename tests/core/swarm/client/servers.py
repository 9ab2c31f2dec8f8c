"""Swarm servers in the test process, for the tests of issue 17 (records, timeouts, spot checks).

Each is a real SwarmServer with its own p2pd on 127.0.0.1, run on one background loop; `start` can give one server
test-only switches (HIVEKEEPER_TEST_* in core/swarm/server/server.py: a lying record, silent steps, wrong outputs),
which a server reads when it is made. `attack` runs a coroutine on the same loop, for a hostile hivemind peer
(`attacker`: a DHT node of its own, not a server) that writes forged records.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from unittest import mock

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from hivekeeper.core.swarm.protocol import new_event_loop
from hivekeeper.core.swarm.server.server import ServerConfig, SwarmServer


class InProcessServers:
    def __init__(self, checkpoint, prefix: str, update_period: float = 30.0):
        self.checkpoint, self.prefix, self.update_period = checkpoint, prefix, update_period
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-servers", daemon=True)
        self.thread.start()
        self.running: dict[str, tuple[SwarmServer, object]] = {}
        self.events: dict[str, list[dict]] = {}
        self._attacker: DHTNode | None = None

    @property
    def initial_peers(self) -> list[str]:
        return [server.maddrs[0] for server, _ in self.running.values()]

    def start(self, blocks: tuple[int, int], name: str, *, record: dict | None = None, silent: bool = False,
              liar: float = 0.0, liar_after: int = 0, throughput: float = 1.0, pause_watch=None,
              stats_period: float = 0.0, repository: str | None = None) -> str:
        """Start a server of `blocks` and wait until it is online; returns its peer id."""
        online = threading.Event()
        events: list[dict] = []

        def status(event: dict) -> None:
            events.append(event)
            if event["state"] == "online":
                online.set()

        config = ServerConfig(checkpoint=self.checkpoint, dht_prefix=self.prefix,
                              initial_peers=tuple(self.initial_peers), host="127.0.0.1", block_indices=blocks,
                              throughput=throughput, update_period=self.update_period, public_name=name,
                              stats_period=stats_period, repository=repository)
        switches = {"HIVEKEEPER_TEST_RECORD": json.dumps(record or {}), "HIVEKEEPER_TEST_SILENT": "1" if silent else "",
                    "HIVEKEEPER_TEST_LIAR": str(liar) if liar else "", "HIVEKEEPER_TEST_LIAR_AFTER": str(liar_after)}
        with mock.patch.dict(os.environ, switches):
            server = SwarmServer(config, status=status, pause_watch=pause_watch)
        future = asyncio.run_coroutine_threadsafe(server.run(), self.loop)
        if not online.wait(60):
            future.cancel()
            raise AssertionError(f"server did not come online: {future.exception() if future.done() else 'hung'}")
        self.running[server.peer_id] = (server, future)
        self.events[server.peer_id] = events
        return server.peer_id

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def attacker(self) -> DHTNode:
        """A hostile peer: a plain hivemind DHT node in the swarm (not a server)."""
        if self._attacker is None:
            async def create() -> DHTNode:
                p2p = await P2P.create(initial_peers=self.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                return await DHTNode.create(p2p=p2p, initial_peers=self.initial_peers, cache_locally=False)

            self._attacker = self.run(create())
        return self._attacker

    def leave(self, peer_id: str) -> None:
        server, future = self.running.pop(peer_id)
        self.loop.call_soon_threadsafe(server.stop)
        future.result(timeout=30)

    def close(self) -> None:
        """The servers leave first, while every peer they may be talking to still answers (CI, session 21: with the
        attacker's daemon shut down first, a server's announce waited on it past leave's 30 s, and its p2pd was left
        behind for the next tests); then the attacker; then whatever hivemind left running. A server that does not
        leave in time still has the rest closed before the error is raised."""
        failed = None
        for peer_id in list(self.running):
            try:
                self.leave(peer_id)
            except Exception as exc:  # noqa: BLE001 - closed below all the same, then raised
                failed = failed or exc
        if self._attacker is not None:
            self.run(self._attacker.p2p.shutdown())  # its DHT tasks are cancelled with the rest below

        async def cancel_the_rest() -> None:  # hivemind leaves DHT refresh tasks behind
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        self.run(cancel_the_rest(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()
        if failed is not None:
            raise failed
