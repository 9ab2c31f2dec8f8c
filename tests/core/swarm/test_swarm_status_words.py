"""`hivekeeper swarm status`'s tables in words: the report core/swarm/status.py builds from DHT block records, printed
by the command's own print_tables. Counts of one are singular (session 23: "1 servers")."""

from __future__ import annotations

import pytest

from hivekeeper.core.cli.swarm import print_tables
from hivekeeper.core.swarm.dht import ServerInfo, ServerState
from hivekeeper.core.swarm.status import swarm_status


def records(spans: dict[str, tuple[int, int]], num_blocks: int) -> list[dict]:
    """Per-block DHT records of ONLINE servers, each serving its span [start, end)."""
    infos = {peer: ServerInfo(ServerState.ONLINE, 5.0, start_block=start, end_block=end)
             for peer, (start, end) in spans.items()}
    return [{peer: info for peer, info in infos.items() if info.start_block <= i < info.end_block}
            for i in range(num_blocks)]


@pytest.mark.parametrize("spans, num_blocks, words", [
    ({"peer-one": (0, 1)}, 1, "1 block, 1 server (1 online)"),
    ({"peer-one": (0, 2)}, 2, "2 blocks, 1 server (1 online)"),
    ({"peer-one": (0, 1), "peer-two": (1, 3)}, 3, "3 blocks, 2 servers (2 online)"),
])
def test_the_first_line_counts_in_words(capsys, spans, num_blocks, words):
    print_tables(swarm_status(records(spans, num_blocks), "test-model", {peer: 0.01 for peer in spans}))
    assert capsys.readouterr().out.splitlines()[0] == f"swarm of test-model: {words}"
