"""The ban list's rules, without servers (so that the swarm_routing mutation scope tests them in a second): Petals'
defaults (15 s, doubling, at most 600 s), a "busy" answer that skips a server for a while without counting as a
failure nor shortening a ban it already has, and a liar banned for good, which counts as a failure too."""

from __future__ import annotations

import time

import pytest

from hivekeeper.core.swarm.client.routing import BanList


def test_the_default_ban_starts_at_15_seconds_doubles_and_stops_at_600():
    bans = BanList()
    assert [bans.fail("p") for _ in range(7)] == [15.0, 30.0, 60.0, 120.0, 240.0, 480.0, 600.0]
    assert bans.banned("p") and not bans.banned("q")


def test_a_busy_server_is_skipped_for_its_seconds_without_counting_a_failure():
    bans = BanList(base_seconds=10.0)
    assert bans.busy("p") == 2.0 and bans.banned("p")  # two seconds unless told
    assert bans.busy("q", 0.05) == 0.05 and bans.banned("q")
    time.sleep(0.08)
    assert not bans.banned("q")
    assert bans.fail("q") == 10.0  # busy counted nothing: its first failure gets the base ban
    assert bans.busy("q", 0.01) == 0.01  # a short busy keeps the longer ban it had
    time.sleep(0.03)
    assert bans.banned("q")


def test_a_liar_stays_banned_and_counts_as_a_failure_until_it_answers_well():
    bans = BanList(base_seconds=0.01, backoff=3.0)
    bans.fail("liar")
    bans.forever("liar")
    time.sleep(0.03)
    assert bans.banned("liar")
    assert bans.fail("liar") == pytest.approx(0.09)  # its third failure: base x backoff^2
    bans.forever("liar")
    bans.succeed("liar")
    assert not bans.banned("liar") and bans.fail("liar") == pytest.approx(0.01)
