"""Issue 14 item 9 through the real `hivekeeper plan --json` and `hivekeeper generate --plan FILE`: a plan made for
another model is refused (exit 2, one line naming both models), one made for another machine runs with a warning
(on stderr and in the JSON report), one made here for this model runs silently. The first `generate` of each test is
a real child process; the plans and the other runs go through the same `main()` in this process (the `cli` fixture):
each child costs seconds of imports."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ...child_output import run

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def hivekeeper(*args: str):
    return run([sys.executable, "-m", "hivekeeper.core.cli.main", *args], timeout=300, env=ENV)


def make_plan(cli, tmp_path, name: str, *args: str):
    result = cli("plan", "--json", *args)
    assert result.returncode == 0, result.stderr
    path = tmp_path / f"{name}.json"
    path.write_text(result.stdout)
    return path, json.loads(result.stdout)


def generate(checkpoint, plan_file, cli=hivekeeper):
    return cli("generate", "--model", str(checkpoint), "--prompt", "Hello", "--max-new-tokens", "3",
                      "--ignore-eos", "--json", "--plan", str(plan_file))


def test_a_plan_for_another_model_is_refused(tiny_checkpoint, tmp_path, cli):
    path, doc = make_plan(cli, tmp_path, "70b", "--model", "meta-llama/Llama-2-70b-hf",
                          "--hardware", "cpu-generic", "--quant", "nf4")
    assert doc["policy"]["weight_format"] == "nf4"
    result = generate(tiny_checkpoint, path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and result.stdout == "" and len(lines) == 1, result.stderr
    assert "Llama-2-70b-hf" in lines[0] and tiny_checkpoint.name in lines[0] and str(path) in lines[0]


def test_a_plan_for_another_machine_warns_and_one_made_here_does_not(tiny_checkpoint, tmp_path, cli):
    elsewhere, _ = make_plan(cli, tmp_path, "4090", "--model", str(tiny_checkpoint), "--hardware", "rtx-4090")
    result = generate(tiny_checkpoint, elsewhere)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["new_tokens"] == 3
    assert len(report["plan"]["warnings"]) == 1 and "'rtx-4090'" in report["plan"]["warnings"][0]
    assert "warning:" in result.stderr and "rtx-4090" in result.stderr

    here, doc = make_plan(cli, tmp_path, "here", "--model", str(tiny_checkpoint), "--hardware", "auto")
    assert len(doc["machine_fingerprint"]) == 16
    result = generate(tiny_checkpoint, here, cli)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plan"]["warnings"] == [] and "warning:" not in result.stderr

    # made here with its RAM given otherwise (--ram-gb; a GiB more than it has, so that it fits whatever this host
    # holds in use): still this machine's plan (session 24: --ram-gb 0.62 was "made on another machine")
    from hivekeeper.core.machine.detect import detect_hardware

    more = f"{detect_hardware().cpu.memory_bytes / 1e9 + 1.1:.1f}"
    reshaped, _ = make_plan(cli, tmp_path, "reshaped", "--model", str(tiny_checkpoint), "--hardware", "auto",
                            "--ram-gb", more)
    result = generate(tiny_checkpoint, reshaped, cli)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plan"]["warnings"] == [] and "warning:" not in result.stderr

    doc["machine_fingerprint"] = "0123456789abcdef"  # the same plan, as if made on another machine
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(doc))
    result = generate(tiny_checkpoint, moved, cli)
    assert result.returncode == 0, result.stderr
    warnings = json.loads(result.stdout)["plan"]["warnings"]
    assert len(warnings) == 1 and "another machine" in warnings[0] and "0123456789abcdef" in warnings[0]


@pytest.mark.parametrize("doc", [{"weight_format": "fp32"}, {"goal": "chat", "policy": {"weight_format": "fp32"}}])
def test_a_hand_written_policy_has_nothing_to_check(tiny_checkpoint, tmp_path, doc, cli):
    path = tmp_path / "bare.json"
    path.write_text(json.dumps(doc))
    result = generate(tiny_checkpoint, path, cli)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plan"]["warnings"] == []


@pytest.mark.parametrize("doc, words", [
    ({"a": 1}, "not a plan (unknown field 'a')"),
    ({}, "not a plan (no policy fields)"),
    ({"id": "laptop", "cpu": {"cores": 8}, "gpus": []}, "unknown field 'id', 'cpu', 'gpus'"),  # a hardware JSON
    ({"policy": {"weight_format": "fp32", "micro_batch": 4}}, "unknown field 'micro_batch'"),
    ({"policy": {"batch_size": -3}}, "field 'batch_size' must be an integer from 1"),
    ({"policy": {"micro_batch_size": 2, "num_micro_batches": 2, "batch_size": 3}},
     "field 'batch_size' is 3, but micro_batch_size x num_micro_batches is 4"),
])
def test_a_file_that_is_not_a_plan_is_refused_in_one_line(tiny_checkpoint, tmp_path, doc, words, cli):
    """A new user's `--plan` file that is no plan (a typo'd field, a hardware JSON) ran with every default."""
    path = tmp_path / "notaplan.json"
    path.write_text(json.dumps(doc))
    result = generate(tiny_checkpoint, path, cli)
    assert result.returncode == 2 and words in result.stderr and str(path) in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""
