"""The swarm a node joins when told none: the public Petals swarm's bootstrap peers, or the list that replaces them.

`PUBLIC_BOOTSTRAP_PEERS` are the multiaddrs the Petals project publishes for its public swarm (petals.dev). They are
the default of `hivekeeper serve` without --initial-peers or --new-swarm, and of the app's Swarm page; the user can
edit them (the page's field, "initial-peers" in the node's config file).

`HIVEKEEPER_BOOTSTRAP_PEERS` (multiaddrs separated by spaces or commas) replaces the built-in list wherever it is
used. The test suite and CI set it to loopback addresses, so that nothing run here dials the public peers; and as a
second guard, asking for the built-in list while pytest runs (PYTEST_CURRENT_TEST is set, which child processes
inherit) raises instead of returning it.

A node that cannot reach any bootstrap peer says so in one line (`unreachable_message`) instead of a daemon's log;
`any_reachable` tells within a second or two, with plain TCP connects and without starting a daemon (the app's
Swarm page asks it first, before its watcher loads hivemind and torch).
"""

from __future__ import annotations

import os
import re
import socket
from concurrent.futures import ThreadPoolExecutor

from hivekeeper.planner.errors import InputError

PUBLIC_BOOTSTRAP_PEERS: tuple[str, ...] = (  # published by Petals (petals/constants.py PUBLIC_INITIAL_PEERS)
    "/dns/bootstrap1.petals.dev/tcp/31337/p2p/QmedTaZXmULqwspJXz44SsPZyTNKxhnnFvYRajfH7MGhCY",
    "/dns/bootstrap2.petals.dev/tcp/31338/p2p/QmQGTqmM7NKjV6ggU1ZCap8zWiyKR89RViDXiqehSiCpY5",
    "/dns6/bootstrap1.petals.dev/tcp/31337/p2p/QmedTaZXmULqwspJXz44SsPZyTNKxhnnFvYRajfH7MGhCY",
    "/dns6/bootstrap2.petals.dev/tcp/31338/p2p/QmQGTqmM7NKjV6ggU1ZCap8zWiyKR89RViDXiqehSiCpY5",
)
BOOTSTRAP_ENV = "HIVEKEEPER_BOOTSTRAP_PEERS"  # replaces PUBLIC_BOOTSTRAP_PEERS (tests, CI, a private default swarm)
UNREACHABLE_MARKERS = ("failed to connect to bootstrap peers", "failed to connect to initial peers")


class PublicPeersUnderTest(RuntimeError):
    """The built-in public peers were asked for while pytest runs: a test would dial the public swarm."""


def bootstrap_peers(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The default swarm's peers: HIVEKEEPER_BOOTSTRAP_PEERS when set, else the built-in public ones (never under
    pytest: PublicPeersUnderTest). An empty variable means "no default swarm": the caller must be told peers."""
    env = os.environ if environ is None else environ
    if BOOTSTRAP_ENV in env:
        peers = tuple(word for word in re.split(r"[\s,]+", env[BOOTSTRAP_ENV]) if word)
        if not peers:
            raise InputError(f"{BOOTSTRAP_ENV} is set but empty: give --initial-peers MADDR ... or --new-swarm")
        return peers
    if "PYTEST_CURRENT_TEST" in env:
        raise PublicPeersUnderTest(f"the public Petals peers were asked for under pytest; set {BOOTSTRAP_ENV} "
                                   "(tests/conftest.py does) to loopback addresses")
    return PUBLIC_BOOTSTRAP_PEERS


def is_public(peers) -> bool:
    """Whether these are (some of) the built-in public peers."""
    return any(peer in PUBLIC_BOOTSTRAP_PEERS for peer in peers)


def is_unreachable_error(message: str) -> bool:
    """Whether an error from joining says that no bootstrap peer answered."""
    text = message.lower()
    return any(marker in text for marker in UNREACHABLE_MARKERS)


def unreachable_message(peers) -> str:
    """One line: which peers could not be reached (at most two named)."""
    peers = list(peers)
    named = ", ".join(peers[:2]) + (f" and {len(peers) - 2} more" if len(peers) > 2 else "")
    return f"bootstrap peers unreachable: {named} (check the network, or edit the initial peers)"


def tcp_address(maddr: str) -> tuple[str, int] | None:
    """(host, port) of an /ip4, /ip6, /dns, /dns4 or /dns6 .../tcp/PORT/p2p/ID peer multiaddr; None for any other
    kind (a malformed one is left to the multiaddr check, which names it)."""
    match = re.fullmatch(r"/(ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d+)/p2p/[^/]+", maddr)
    return (match.group(2), int(match.group(3))) if match else None


def any_reachable(peers, timeout: float = 3.0) -> bool:
    """Whether some peer accepts a TCP connection within `timeout` (all tried at once). Peers whose address is not
    plain TCP count as reachable: the daemon decides about them."""
    addresses = [tcp_address(peer) for peer in peers]
    if not addresses or any(address is None for address in addresses):
        return True

    def connects(address: tuple[str, int]) -> bool:
        try:
            with socket.create_connection(address, timeout=timeout):
                return True
        except OSError:
            return False

    with ThreadPoolExecutor(max_workers=min(8, len(addresses))) as pool:
        return any(pool.map(connects, addresses))
