"""Issue 14 items 6 and 7 through the real `hivekeeper plan`: the bottleneck names the slowest stage as it is
(bitsandbytes' CPU dequantization, not RAM bandwidth), a very slow plan and one that streams most of the model
from disk come with warnings, and the batch goal's numbers say what they cover (the run, the batch, one query).
The first plan is a real child process; the others run the same `main()` in this process (the `cli` fixture): each
child costs seconds of start-up on a loaded machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hivekeeper.planner.policy import MOSTLY_ON_DISK, SLOW_QUERY_S


def plan(*args: str, cli=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`hivekeeper plan ARGS` through `cli` (in this process) when given, else as a child process."""
    if cli is not None:
        return cli("plan", *args)
    return subprocess.run([sys.executable, "-m", "hivekeeper.core.cli.main", "plan", *args], capture_output=True,
                          text=True, timeout=timeout)


def plan_json(*args: str, cli=None) -> dict:
    result = plan(*args, "--json", cli=cli)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_cpu_nf4_is_bound_by_dequantization_and_warned_about(cli):
    data = plan_json("--model", "mistralai/Mixtral-8x7B-v0.1", "--hardware", "cpu-generic", "--quant", "nf4")
    assert data["policy"]["weight_format"] == "nf4"
    assert data["bottleneck"] == "cpu dequantization"
    assert data["reason"].startswith("CPU 4-bit dequantization (bitsandbytes)")
    assert "RAM bandwidth" not in data["reason"]
    assert data["decode_tokens_per_s"] < data["roofline_decode_tokens_per_s"] / 10  # what makes it the limit
    assert data["runtime_s"] > SLOW_QUERY_S
    assert len(data["warnings"]) == 1 and data["warnings"][0].startswith("very slow")
    assert f"{data['runtime_s'] / 60:.3g} minutes" in data["warnings"][0]
    human = plan("--model", "mistralai/Mixtral-8x7B-v0.1", "--hardware", "cpu-generic", "--quant", "nf4", cli=cli)
    assert "\nwarning: very slow" in human.stdout and "why: CPU 4-bit dequantization" in human.stdout


def test_int8_on_a_cpu_is_8_bit_dequantization_and_16_bit_stays_ram_bandwidth(cli):
    int8 = plan_json("--model", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--hardware", "cpu-generic", "--quant", "int8",
                     cli=cli)
    assert int8["bottleneck"] == "cpu dequantization" and "CPU 8-bit dequantization" in int8["reason"]
    plain = plan_json("--model", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--hardware", "cpu-generic", "--quant", "none",
                      cli=cli)
    assert plain["bottleneck"] == "ram bandwidth" and "RAM bandwidth" in plain["reason"]
    assert plain["warnings"] == []  # a fast plan warns of nothing


def test_nf4_on_a_gpu_is_not_called_cpu_dequantization(cli):
    data = plan_json("--model", "meta-llama/Llama-2-13b-hf", "--hardware", "rtx-4090", "--quant", "nf4", cli=cli)
    assert data["bottleneck"] != "cpu dequantization" and "dequantization (bitsandbytes)" not in data["reason"]


@pytest.mark.parametrize("goal", ["batch"])
def test_a_plan_streaming_most_weights_from_disk_says_so(goal, tmp_path, cli):
    data = plan_json("--model", "meta-llama/Meta-Llama-3.1-8B-Instruct", "--hardware", "cpu-generic", "--ram-gb",
                     "16", "--goal", goal, cli=cli)
    disk = data["policy"]["weights"]["disk"]
    assert disk > MOSTLY_ON_DISK
    assert any(w.startswith(f"streams {100 * disk:.0f}% of the weights from disk") for w in data["warnings"])


def test_the_batch_goal_labels_what_each_number_covers(cli):
    args = ("--model", "meta-llama/Meta-Llama-3.1-8B-Instruct", "--hardware", "cpu-generic", "--ram-gb", "16",
            "--goal", "batch")  # fp32 (no 16-bit math: what the engine runs), which needs more than 8 GB
    data = plan_json(*args, cli=cli)
    batch = data["policy"]["batch_size"]
    assert batch > 1
    text = plan(*args, cli=cli).stdout
    row = next(line for line in text.splitlines() if line.strip().startswith("runtime"))
    assert "runtime of the batch" in row and f"for {batch} queries" in row and "per query on average" in row
    per_query = data["runtime_s"] / batch
    assert f"({per_query:,.0f} s per query" in row or f"({per_query:.3g} s per query" in row
    assert "runtime per query" not in text
    assert "J per query (one query's share of the batch's)" in text
    fit = next(line for line in text.splitlines() if line.strip().startswith("fit"))
    assert f"streaming {100 * data['policy']['weights']['disk']:.0f}% of the weights from disk" in fit
    chat = plan("--model", "meta-llama/Meta-Llama-3.1-8B-Instruct", "--hardware", "rtx-4090", cli=cli).stdout
    assert "runtime per query" in chat and "streaming" not in chat
