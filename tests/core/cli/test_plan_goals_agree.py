"""`hivekeeper plan`'s words hold for the goal asked. The --reserve-gb hint of a model that fits nowhere was planned as
chat whatever --goal said (a batch of 64 split into micro-batches runs where one chat step of 64 rows does not: no
hint); and a serve plan said "does not fit locally: needs 0.043 GB more memory" of the built-in model whose chat
plan ran here with 21% of its weights on disk (its local run was planned dequantized, the chat plan packed as
`generate` runs it). Through `main()` (the `cli` fixture) with hardware files and explicit sizes."""

from __future__ import annotations

import json
import math
import re

import pytest

from hivekeeper.planner.hardware_catalog import get_hardware, hardware_to_json

HINT = re.compile(r"With --reserve-gb ([\d.]+) \(")
LOCAL = "Running the whole model here instead: "


def plan(cli, *args: str) -> dict:
    done = cli("plan", "--no-measure", "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_reserve_hint_is_the_goal_asked_for(cli, tmp_path):
    spec = hardware_to_json(get_hardware("cpu-generic"))
    spec["cpu"]["ram_gb"] = 1.2  # the default headroom (2 GiB at least) keeps all of it free
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps(spec))
    args = ("--hardware", str(machine), "--goal", "batch", "--batch", "64")
    short = plan(cli, *args)
    assert short["fit"] == "none" and short["policy"] is None
    hint = HINT.search(short["reason"])
    assert hint, short["reason"]
    followed = plan(cli, *args, "--reserve-gb", hint.group(1))
    assert followed["goal"] == "batch" and followed["policy"]["batch_size"] == 64  # the advice holds for this goal
    chat = plan(cli, "--hardware", str(machine), "--batch", "64", "--reserve-gb", hint.group(1))
    assert chat["policy"] is None  # one chat step of 64 rows does not run there: a hint of chat's would be wrong
    # the largest one-digit reserve: a batch plan fills what it is given, and its peak with nothing kept free
    # suggested "--reserve-gb 1e-06" (session 25); one step more keeps too much free
    suggested = float(hint.group(1))
    step = 10.0 ** math.floor(math.log10(suggested))
    assert suggested >= 0.01
    assert plan(cli, *args, "--reserve-gb", f"{suggested + step:g}")["policy"] is None


@pytest.mark.parametrize("ram_gb", ["0.64", "0.5"], ids=["runs-with-disk", "fits-nowhere"])
def test_a_serve_plan_says_what_a_chat_plan_says_of_running_here(cli, ram_gb):
    args = ("--hardware", "cpu-generic", "--ram-gb", ram_gb, "--reserve-gb", "0")
    chat, serve = plan(cli, *args), plan(cli, *args, "--goal", "serve")
    assert serve["goal"] == "serve" and serve["fit"] == chat["fit"]
    assert serve["missing_bytes"] == chat["missing_bytes"]
    assert serve["reason"].endswith(f" {LOCAL}{chat['reason']}"), serve["reason"]
    if ram_gb == "0.64":  # the chat plan runs here, 21% of its weights on disk: the serve plan may not say otherwise
        assert chat["policy"]["weights"]["disk"] > 0.1 and "does not fit" not in serve["reason"]
        assert serve["num_blocks"] > 0 and "q4_1 packed" in serve["reason"]
    else:
        assert serve["reason"].startswith("cannot hold a single block for serving")
        assert f"{LOCAL}does not fit locally: needs " in serve["reason"]
