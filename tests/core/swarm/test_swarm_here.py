"""Session 25's swarm defects: the CLI says serve's own measured speed beside the planner's, as the app does (one
reading of serve's cache, core/swarm/server/throughput.measured_block_speed); `swarm models` never recommends a model
whose every block this machine already serves; `swarm status` for a prefix nobody serves names the models the
swarm's registry lists; serve's cache follows a private HIVEKEEPER_DATA_DIR / HIVEKEEPER_CONFIG_DIR.

Through real servers on loopback in this process (tests/core/swarm/client/servers.py) and the real CLI `main()`;
the block is timed for real (a tiny one, under a second), and every figure checked is derived from that timing, so
nothing here depends on this host's speed."""

from __future__ import annotations

import json

import pytest
import torch

from hivekeeper.core.runtime.checkpoint import load_config
from hivekeeper.core.swarm.server.throughput import CACHE_FILE, cache_path, get_block_speed, span_throughput

from .client.servers import InProcessServers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def plan_serve(cli, checkpoint, *extra: str):
    """`hivekeeper plan --goal serve` of the checkpoint on this machine (the suite's fixed profile), checked to pass."""
    result = cli("plan", "--model", str(checkpoint), "--goal", "serve", *extra)
    assert result.returncode == 0, result.stderr
    return result


def test_the_cache_follows_a_private_data_or_config_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HIVEKEEPER_DATA_DIR", str(tmp_path / "data"))
    assert cache_path() == tmp_path / "data" / CACHE_FILE  # the folder of models and caches first
    monkeypatch.delenv("HIVEKEEPER_DATA_DIR")
    assert cache_path() == tmp_path / "config" / CACHE_FILE  # a private config folder: this machine's measurements
    monkeypatch.delenv("HIVEKEEPER_CONFIG_DIR")
    assert cache_path() == tmp_path / "xdg" / "hivekeeper" / CACHE_FILE  # else the user's cache folder


def test_the_cli_says_serves_measurement_and_skips_a_model_this_machine_serves_whole(tiny_checkpoint, tmp_path,
                                                                                      monkeypatch, cli):
    from hivekeeper.core.swarm.directory import HelpPlanner

    monkeypatch.setenv("HIVEKEEPER_DATA_DIR", str(tmp_path / "data"))  # serve's timings: none yet
    before = json.loads(plan_serve(cli, tiny_checkpoint, "--json").stdout)
    assert before["serve_measured"] is None and "planner's estimate" not in plan_serve(cli, tiny_checkpoint).stdout

    # serve's own timing of such a block (what `serve` does at its start), into the private data folder
    speed, cached = get_block_speed(load_config(tiny_checkpoint), "cpu", DTYPES[before["policy"]["weight_format"]],
                                    checkpoint=tiny_checkpoint)
    assert not cached and (tmp_path / "data" / CACHE_FILE).is_file()
    after = json.loads(plan_serve(cli, tiny_checkpoint, "--json").stdout)
    measured = after["serve_measured"]
    assert measured["forward_rps"] == speed.forward_rps and measured["inference_rps"] == speed.inference_rps
    assert measured["throughput"] == pytest.approx(span_throughput(speed, after["num_blocks"], None))
    assert measured["source"] == speed.source_words()
    text = plan_serve(cli, tiny_checkpoint).stdout
    assert "rps (planner's estimate)" in text and f"{speed.source_words()}: serve advertises " in text, text

    servers = InProcessServers(tiny_checkpoint, "tiny")
    try:
        servers.start((0, 1), "first", throughput=3.0, repository=str(tiny_checkpoint))
        (maddr,) = servers.initial_peers
        one = json.loads(cli("swarm", "models", "--initial-peers", maddr, "--json").stdout)
        models_text = cli("swarm", "models", "--initial-peers", maddr).stdout
        nobody = cli("swarm", "status", "--model", str(tiny_checkpoint), "--initial-peers", maddr,
                     "--dht-prefix", "tiny-gguf")
        nobody_json = json.loads(cli("swarm", "status", "--model", str(tiny_checkpoint), "--initial-peers", maddr,
                                     "--dht-prefix", "tiny-gguf", "--json").stdout)
        servers.start((1, 2), "second", throughput=3.0, repository=str(tiny_checkpoint))
        whole = json.loads(cli("swarm", "models", "--initial-peers", maddr, "--json").stdout)
        whole_text = cli("swarm", "models", "--initial-peers", maddr).stdout
    finally:
        servers.close()

    # block 1 is a gap: this machine helps there, at the figure serve measured, with the planner's beside it
    (row,) = one["models"]
    blocks, planner_rps = HelpPlanner().size(str(tiny_checkpoint))
    assert one["best"] == "tiny" and row["help"]["blocks"][1] == 2
    assert row["help"]["rps"] == pytest.approx(span_throughput(speed, min(blocks, 2), None))
    assert row["help"]["source"] == speed.source_words() and row["help"]["planner_rps"] == planner_rps
    assert f"({speed.source_words()}; planner ~{planner_rps:.3g})" in models_text, models_text

    # a prefix nobody serves: the registry's other models, and --dht-prefix
    assert nobody.returncode == 0 and "gaps: blocks 0, 1 have no server" in nobody.stdout
    assert (f"no server found under tiny-gguf; the swarm's registry lists tiny ({tiny_checkpoint}, 2 blocks): "
            f"pass --dht-prefix PREFIX") in nobody.stdout, nobody.stdout
    assert nobody_json["other_models"] == [{"dht_prefix": "tiny", "repository": str(tiny_checkpoint),
                                            "num_blocks": 2}]

    # both blocks served by this machine's own servers: no help offered, never the one-click choice
    (row,) = whole["models"]
    assert whole["best"] is None and row["help"]["blocks"] is None
    assert row["help"]["reason"] == "this machine serves all 2 blocks already"
    assert "helps most" not in whole_text and "this machine serves all 2 blocks already" in whole_text
