"""Reading hostile DHT values without a network (issue 17 items 2 and 10): what a record may hold, what drops the
record, what drops a field, how far a throughput counts. The same values through real DHT nodes and servers are in
test_dht_records.py."""

from __future__ import annotations

import math

import pytest
from hivemind.utils.timed_storage import TimedStorage

from hivekeeper.core.swarm.dht import (MAX_EXTRA_BYTES, MAX_RPS, ServerInfo, ServerState, block_throughputs,
                                       capped_claims)


@pytest.mark.parametrize("value", [
    (2, math.nan, {}), (2, math.inf, {}), (2, -0.5, {}), (2, "10", {}), (2, True, {}), (2, None, {}),
    ("2", 1.0, {}), (2.5, 1.0, {}), (None, 1.0, {}), (9, 1.0, {}), ([2], 1.0, {}),
    (2, 1.0, {"blob": "x" * (MAX_EXTRA_BYTES + 1)}), (2, 1.0, {"deep": [["y" * 1000] * 20]}),
])
def test_a_record_with_a_bad_state_throughput_or_oversized_extras_is_dropped(value):
    with pytest.raises((ValueError, TypeError)):
        ServerInfo.from_tuple(value)


def test_bad_fields_are_dropped_and_speeds_clamped():
    info = ServerInfo.from_tuple((2, 1e30, {
        "forward_rps": math.nan, "inference_rps": -3.0, "network_rps": 1e40, "start_block": -1, "end_block": 4,
        "cache_tokens_left": -5, "adapters": ("a", 3), "next_pings": {"p": math.inf}, "public_name": "n"}))
    assert info.throughput == MAX_RPS and info.network_rps == MAX_RPS
    assert info.forward_rps is None and info.inference_rps is None and info.start_block is None
    assert info.end_block == 4 and info.cache_tokens_left is None and info.adapters == () and info.next_pings is None
    assert info.public_name == "n"
    offline = ServerInfo.from_tuple((0, 0.0, {}))  # Petals announces OFFLINE with throughput 0
    assert offline.state == ServerState.OFFLINE and offline.throughput == 0.0


def test_a_fake_throughput_counts_for_at_most_ten_times_the_others_median():
    def record(throughput):
        return ServerInfo(ServerState.ONLINE, throughput)

    blocks = [{"a": record(2.0), "b": record(4.0), "fake": record(1e7)}, {"a": record(2.0), "c": record(6.0)}]
    assert capped_claims(blocks) == {"a": 2.0, "b": 4.0, "c": 6.0, "fake": 10 * 4.0}  # the others' median: 4
    assert block_throughputs(blocks) == [2.0 + 4.0 + 40.0, 2.0 + 6.0]
    alone = [{"only": record(1e6)}]
    assert block_throughputs(alone) == [1e6]  # no others: only MAX_RPS bounds it


def test_hivemind_storage_orders_int_and_string_subkeys_with_the_same_expiration():
    import hivekeeper.core.swarm.dht  # noqa: F401 - makes hivemind's heap tolerant (tolerate_mixed_subkeys)

    storage = TimedStorage()
    storage.store("peer", b"x", 1e12)
    storage.store(7, b"y", 1e12)  # raised TypeError ('<' between int and str) before
    storage.store("other", b"z", 1e12)
    assert set(dict(storage.items())) == {"peer", 7, "other"}
