"""A count in a sentence reads as English: "1 server", "2 servers" (the Swarm page's node said "1 open sessions", the
`swarm` command "1 servers"); one definition for the planner, the commands and the app."""

from __future__ import annotations

from hivekeeper.planner.words import counted


def test_a_count_of_one_is_singular_and_others_plural():
    assert counted(1, "open session") == "1 open session"
    assert [counted(n, "server") for n in (0, 2, 1200)] == ["0 servers", "2 servers", "1,200 servers"]
