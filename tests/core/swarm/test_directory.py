"""Issue 20 item 1: the swarm's model list (core/swarm/directory.py): registry entries written by anyone are checked
one by one, each model's row says its coverage and weakest span, and the one-click choice prefers filling a gap."""

from __future__ import annotations

import pytest
from hivemind.utils import ValueWithExpiration

from hivekeeper.core.swarm.dht import ServerInfo, ServerState
from hivekeeper.core.swarm.directory import (MAX_MODELS, RegistryEntry, best_row, model_row, parse_registry,
                                             weakest_span, where_to_help)


def _registry(items: dict) -> ValueWithExpiration:
    return ValueWithExpiration({key: ValueWithExpiration(value, 1e12) for key, value in items.items()}, 1e12)


def test_hostile_registry_entries_drop_only_themselves():
    good = {"num_blocks": 32, "repository": "org/model"}
    entries = parse_registry(_registry({
        "model-hf": good, "bad-count": {"num_blocks": 0, "repository": "x"}, "bool": {"num_blocks": True,
                                                                                  "repository": "x"},
        "huge": {"num_blocks": 10**9, "repository": "x"}, "no-repo": {"num_blocks": 4}, "long": {
            "num_blocks": 4, "repository": "r" * 1000}, "not-a-dict": [1, 2], "bad/prefix": good, 7: good}))
    assert entries == [RegistryEntry("model-hf", "org/model", 32)]
    assert parse_registry(None) == [] and parse_registry(ValueWithExpiration("junk", 1e12)) == []
    flood = parse_registry(_registry({f"m{i:04d}": good for i in range(5 * MAX_MODELS)}))
    assert len(flood) == MAX_MODELS


def test_a_row_names_coverage_and_the_weakest_span_and_help_goes_where_it_adds_most():
    online = ServerInfo(ServerState.ONLINE, 4.0)
    offline = ServerInfo(ServerState.OFFLINE, 100.0)
    blocks = [{"a": online}, {"a": online, "b": ServerInfo(ServerState.ONLINE, 2.0)}, {"c": offline}, {}]
    row = model_row(RegistryEntry("m", "org/m", 4), blocks)
    assert (row["servers"], row["covered_blocks"], row["gaps"]) == (2, 2, [2, 3])
    assert row["weakest"] == {"start": 2, "end": 4, "throughput": 0}
    assert weakest_span([3.0, 1.0, 1.0, 2.0, 1.0]) == {"start": 1, "end": 3, "throughput": 1.0}

    help_gap = where_to_help(row, can_hold=2, rps=1.0)
    assert help_gap["blocks"] == [2, 4]  # the two blocks nobody serves
    covered = model_row(RegistryEntry("n", "org/n", 4), [{"a": online}] * 4)
    help_slow = where_to_help(covered, can_hold=8, rps=4.0)  # more than the model: all of it, throughput doubled
    assert help_slow["blocks"] == [0, 4] and help_slow["gain"] == 2.0
    assert where_to_help(covered, can_hold=0, rps=4.0)["blocks"] is None

    row["help"], covered["help"] = help_gap, help_slow
    unknown = {**covered, "dht_prefix": "u", "help": {"blocks": None, "reason": "cannot size"}}
    assert best_row([covered, unknown, row])["dht_prefix"] == "m"  # a gap filled beats a bottleneck doubled
    assert best_row([unknown]) is None


def test_swarm_models_lists_a_loopback_swarm_and_where_this_machine_helps(tiny_checkpoint, capsys):
    """The CLI twin of the Swarm page's list: a real server of block 0 registers its model; block 1 is the gap."""
    import json

    from hivekeeper.core.cli.main import main

    from .client.servers import InProcessServers

    servers = InProcessServers(tiny_checkpoint, "tiny")
    try:
        servers.start((0, 1), "directory", throughput=3.0, repository=str(tiny_checkpoint))
        (maddr,) = servers.initial_peers
        assert main(["swarm", "models", "--initial-peers", maddr, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert main(["swarm", "models", "--initial-peers", maddr]) == 0
        text = capsys.readouterr().out
    finally:
        servers.close()
    (row,) = report["models"]
    assert (row["dht_prefix"], row["repository"], row["servers"], row["gaps"]) == ("tiny", str(tiny_checkpoint), 1, [1])
    assert row["weakest"] == {"start": 1, "end": 2, "throughput": 0} and report["best"] == "tiny"
    assert row["help"]["blocks"][1] == 2  # whatever fits here, it ends on the gap
    assert "this machine helps most with tiny" in text and "1 of 2" in text


def test_you_could_serve_the_default_model_is_what_serve_plans_packed():
    """Issue 16: the list's "you could serve" for the real default model (a Q4_1 GGUF) is serve's own plan
    (serve.planned_span), both on this machine as detected (the path `swarm models`, the Swarm page and `serve`
    take): the span sized packed, not the unpacked plan the list gave before. (On a CPU whose RAM holds only the
    packed span, the packed plan holds more blocks: tests/planner/test_swarm_packed.py.)"""
    import torch

    from hivekeeper.core.cli.serve import planned_span
    from hivekeeper.core.machine.profiles import detect_or_load_profile
    from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, default_model_file
    from hivekeeper.core.swarm.directory import HelpPlanner
    from hivekeeper.planner.model_catalog import load_model_spec
    from hivekeeper.planner.swarm import default_cache_tokens, plan_server

    hardware, efficiency = detect_or_load_profile()
    if hardware.has_gpu:
        pytest.skip("a machine with a GPU serves unpacked; this test is about a CPU's packed span")
    path = default_model_file()
    spec = load_model_spec(str(path))
    served = planned_span(path, torch.float32, "cpu", "none", default_cache_tokens(spec))
    blocks, rps = HelpPlanner().size(DEFAULT_MODEL_ID)
    assert served.span_words() == f"{served.num_blocks} blocks, q4_1 packed"
    assert (blocks, rps) == (served.num_blocks, served.throughput)
    unpacked = plan_server(spec, hardware, efficiency=efficiency)  # what the list said before
    assert (unpacked.num_blocks, unpacked.throughput) != (blocks, rps)
