"""Per-peer and server-wide quotas: how much of a server one peer (or all of them) may hold at once.

Without them 16 sessions from one peer locked everyone else out and 20 concurrent 8 MiB forwards took 530 MB. A
request over a quota is refused at once with `ServerBusy` (its text starts "server busy:"), so the client tries
another server instead of waiting: an honest answer is cheaper for both sides than a slow one. Bytes are charged as
a request's parts arrive, before they are decoded or queued, and returned when the request ends.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

from hivekeeper.core.swarm.protocol import ServerBusy


@dataclass
class QuotaLimits:
    sessions_per_peer: int  # inference sessions one peer may hold
    requests_per_peer: int  # forward/backward requests of one peer in flight (read, queued or running)
    bytes_per_peer: int  # request bytes of one peer's forward/backward requests in flight
    bytes_in_flight: int  # request bytes of all peers' forward/backward requests in flight


class Quotas:
    """Counts what each peer holds; every `session`/`request` context returns its share when it exits."""

    def __init__(self, limits: QuotaLimits):
        self.limits = limits
        self.sessions: Counter = Counter()
        self.requests: Counter = Counter()
        self.bytes: Counter = Counter()
        self.total_bytes = 0
        self.refused = 0  # busy answers given, for rpc_info's diagnostics

    def _refuse(self, reason: str) -> ServerBusy:
        self.refused += 1
        return ServerBusy(reason)

    @contextlib.contextmanager
    def session(self, peer: str) -> Iterator[None]:
        if self.sessions[peer] >= self.limits.sessions_per_peer:
            raise self._refuse(f"this peer already holds {self.sessions[peer]} inference sessions here "
                               f"(limit {self.limits.sessions_per_peer} per peer)")
        self.sessions[peer] += 1
        try:
            yield
        finally:
            _decrement(self.sessions, peer)

    @contextlib.contextmanager
    def request(self, peer: str) -> Iterator["Charge"]:
        """One forward/backward request of `peer`; charge its bytes on the yielded Charge as they arrive."""
        if self.requests[peer] >= self.limits.requests_per_peer:
            raise self._refuse(f"this peer already has {self.requests[peer]} forward/backward requests in flight "
                               f"(limit {self.limits.requests_per_peer} per peer)")
        self.requests[peer] += 1
        charge = Charge(self, peer)
        try:
            yield charge
        finally:
            _decrement(self.requests, peer)
            charge.release()

    def _add_bytes(self, peer: str, nbytes: int) -> None:
        if self.bytes[peer] + nbytes > self.limits.bytes_per_peer:
            raise self._refuse(f"this peer's requests in flight would hold {self.bytes[peer] + nbytes} bytes "
                               f"(limit {self.limits.bytes_per_peer} per peer)")
        if self.total_bytes + nbytes > self.limits.bytes_in_flight:
            raise self._refuse(f"requests in flight would hold {self.total_bytes + nbytes} bytes "
                               f"(limit {self.limits.bytes_in_flight} for all peers)")
        self.bytes[peer] += nbytes
        self.total_bytes += nbytes


class Charge:
    """The bytes one request holds against its peer's and the server's quotas."""

    def __init__(self, quotas: Quotas, peer: str):
        self.quotas, self.peer, self.nbytes = quotas, peer, 0

    def add(self, nbytes: int) -> None:
        self.quotas._add_bytes(self.peer, nbytes)
        self.nbytes += nbytes

    def release(self) -> None:
        quotas = self.quotas
        quotas.total_bytes -= self.nbytes
        quotas.bytes[self.peer] -= self.nbytes
        if quotas.bytes[self.peer] <= 0:
            del quotas.bytes[self.peer]
        self.nbytes = 0


def _decrement(counter: Counter, key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
