"""The client's side of a server's "server busy" answer (issue 17 item 6): the server is skipped for a few seconds
so that the next route avoids it at once, and the answer does not count as a failure (its next ban does not grow).
"""

from __future__ import annotations

import time

from hivekeeper.core.swarm.client.routing import BanList
from hivekeeper.core.swarm.protocol import ServerBusy, is_busy


def test_a_busy_server_is_skipped_briefly_without_a_failure():
    bans = BanList(base_seconds=15.0)
    assert is_busy(ServerBusy("16 sessions open (limit 16)"))
    assert bans.busy("peer", seconds=0.2) == 0.2 and bans.banned("peer")
    time.sleep(0.25)
    assert not bans.banned("peer")
    assert bans.fail("peer") == 15.0  # the first real failure still gets the base ban, not a doubled one
    bans.busy("peer", seconds=0.2)  # a busy answer during a longer ban does not shorten it
    assert bans.banned("peer") and bans.fail("peer") == 30.0
