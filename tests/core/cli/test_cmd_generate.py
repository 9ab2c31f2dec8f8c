"""`hivekeeper generate` as a real subprocess: JSON and readable output, plans from the planner or a file, a RAM
budget smaller than the model (peak RSS measured from outside), bad input, and generation through a real swarm."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import place_model
from hivekeeper.core.runtime.model import ModelConfig
from hivekeeper.planner.costmodel import Policy

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
PROMPT = "The old mill stood by the river"


def hivekeeper(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hivekeeper.core.cli.main", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def generate_json(model, *args: str) -> dict:
    proc = hivekeeper("generate", "--model", str(model), "--prompt", PROMPT, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def in_process(monkeypatch, capsys):
    """Run the CLI in this process (one torch import for many runs); returns (exit code, stdout, stderr)."""
    from hivekeeper.core.cli.main import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # keeps `generate` from changing this process's thread count

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_help_says_generate_is_raw_completion_and_chat_applies_the_template(cli):
    """A new user asked a chat model a question with generate and got no answer: --help did not say that generate
    gives the prompt as written (no chat template) and that chat applies the model's template."""
    done = hivekeeper("generate", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # as argparse wraps it
    assert "(raw completion: no chat template)" in text
    assert "The prompt goes to the model as written, with no chat template" in text
    assert "`hivekeeper chat` applies the model's chat template" in text
    assert "--prompt PROMPT the text to continue, given to the model as written (no chat template)" in text
    listing = " ".join(cli("--help").stdout.split())  # the commands' one-line help
    assert "generate generate text once, for scripts and benchmarks (raw completion: no chat template)" in listing


def test_json_output_of_the_real_command(tiny_checkpoint):
    auto = generate_json(tiny_checkpoint, "--max-new-tokens", "12", "--ignore-eos")
    assert auto["plan"]["source"] == "auto" and auto["plan"]["engine"]["blocks"] == {"cpu": 2}
    assert auto["new_tokens"] == 12 and auto["finish_reasons"] == ["length"]
    assert auto["tokens_per_s"] > 0 and 0 < auto["time_to_first_token_s"] < auto["total_s"]
    assert auto["peak_rss_bytes"] >= auto["baseline_rss_bytes"] > 0 and auto["random_weights"] is True


def test_a_plan_file_offloads_and_gives_the_same_greedy_tokens(tiny_checkpoint, tmp_path, in_process):
    common = ["generate", "--model", str(tiny_checkpoint), "--prompt", PROMPT, "--json", "--max-new-tokens", "12",
              "--ignore-eos"]
    code, out, _ = in_process(*common)
    assert code == 0
    auto = json.loads(out)
    # the shape `hivekeeper plan --json` writes: only its "policy" is read
    plan = {"goal": "chat", "policy": {"weight_format": "fp32", "weights": {"gpu": 0, "cpu": 0.5, "disk": 0.5},
                                       "kv_cache": {"gpu": 0, "cpu": 0, "disk": 1}, "micro_batch_size": 1,
                                       "num_micro_batches": 1, "kv_cache_mode": "keep", "prefetch_depth": 1}}
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    code, out, _ = in_process(*common, "--plan", str(plan_file))
    assert code == 0
    offloaded = json.loads(out)
    engine = offloaded["plan"]["engine"]
    assert offloaded["plan"]["source"] == str(plan_file)
    assert engine["blocks"] == {"cpu": 1, "disk": 1} and engine["kv_cache_blocks"] == {"disk": 2}
    assert offloaded["bytes_streamed"] > 0
    assert offloaded["text"] == auto["text"]

    code, out, _ = in_process("generate", "--model", str(tiny_checkpoint), "--prompt", PROMPT, "--json",
                              "--max-new-tokens", "5", "--batch", "3", "--temperature", "1", "--seed", "4",
                              "--ignore-eos")
    batch = json.loads(out)
    assert len(batch["texts"]) == 3 and batch["batch"] == 3 and batch["new_tokens"] == 15


def test_quant_plans_int8_weights_with_the_planner(tiny_checkpoint, in_process):
    pytest.importorskip("bitsandbytes")
    code, out, err = in_process("generate", "--model", str(tiny_checkpoint), "--prompt", PROMPT, "--json",
                                "--max-new-tokens", "4", "--ignore-eos", "--quant", "int8")
    assert code == 0, err
    result = json.loads(out)
    assert result["plan"]["policy"]["weight_format"] == "int8"
    assert result["plan"]["engine"]["quant"] == "int8" and result["new_tokens"] == 4


def test_readable_summary(tiny_checkpoint, in_process):
    code, out, err = in_process("generate", "--model", str(tiny_checkpoint), "--prompt", PROMPT,
                                "--max-new-tokens", "4")
    assert code == 0
    summary = out.split("---\n", 1)[1]
    for part in ("tokens/s", "first token after", "peak RSS", "plan (auto): float32 blocks: 2 RAM"):
        assert part in summary
    assert "RANDOM weights" in err


@pytest.mark.parametrize("args, message", [
    (["--prompt", "word " * 2100], r"--prompt has \d+ tokens; the model's context is 2048 tokens"),
    (["--prompt", "x", "--plan", "/nonexistent/plan.json"], "/nonexistent/plan.json: no such plan file"),
    (["--prompt", "x", "--ram-budget-gb", "0.0001"], r"RAM budget 0\.0001 GB is too small"),
    (["--prompt", "x", "--batch", "0"], "--batch must be an integer from 1"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be a number >= 0"),
    (["--prompt", "x", "--quant", "int8", "--plan", "/nonexistent/plan.json"],
     "--quant int8 goes with --plan auto"),
    (["--prompt", "x", "--quant", "nf4", "--swarm", "--initial-peers", "/ip4/127.0.0.1/tcp/1"],
     "--quant applies to local runs"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_2(tiny_checkpoint, in_process, args, message):
    code, out, err = in_process("generate", "--model", str(tiny_checkpoint), "--json", *args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), err


def test_a_broken_checkpoint_is_one_clear_error(tiny_checkpoint, tmp_path, in_process):
    import shutil

    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_checkpoint, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    code, out, err = in_process("generate", "--model", str(no_tokenizer), "--prompt", "x")
    assert code == 2 and out == "" and f"{no_tokenizer / 'tokenizer.json'}: missing" in err

    other = tmp_path / "other-arch"
    shutil.copytree(tiny_checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    code, out, err = in_process("generate", "--model", str(other), "--prompt", "x")
    assert code == 2 and out == "" and "model_type 'gpt2' is not supported" in err


def test_a_plan_file_with_bad_fields_names_the_file_and_field(tiny_checkpoint, tmp_path, in_process):
    plan_file = tmp_path / "bad.json"
    plan_file.write_text(json.dumps({"policy": {"weights": {"cpu": 0.5, "disk": 0.2}}}))
    code, _, err = in_process("generate", "--model", str(tiny_checkpoint), "--prompt", "x", "--plan", str(plan_file))
    assert code == 2 and f"{plan_file}: field 'weights'" in err and "sum to 1" in err


def test_peak_rss_stays_within_a_ram_budget_of_half_the_model(tmp_path):
    """A ~170 MB model with a budget of half of it. The budget counts what the engine holds (embeddings, head,
    resident blocks, stream buffers, KV cache, activations); the Python + torch runtime measured right before
    loading (baseline_rss_bytes, ~250 MB here) is not part of it. Peak RSS is measured from outside: a wrapper
    process runs the command as its only child and reads RUSAGE_CHILDREN."""
    model = make_demo_checkpoint(tmp_path / "m170", layers=8, hidden=512, intermediate=2048, heads=8, kv_heads=4,
                                 vocab=8192)
    model_bytes = (model / "model.safetensors").stat().st_size
    budget_gb = model_bytes / 2 / 1e9
    wrapper = (
        "import resource, subprocess, sys\n"
        "proc = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=240)\n"
        "sys.stderr.write(proc.stderr)\n"
        "print(proc.stdout.strip())\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
        "sys.exit(proc.returncode)\n"
    )
    command = [sys.executable, "-c", wrapper, sys.executable, "-m", "hivekeeper.core.cli.main", "generate", "--model",
               str(model), "--prompt", PROMPT, "--max-new-tokens", "6", "--ignore-eos", "--json",
               "--ram-budget-gb", f"{budget_gb:.6f}"]
    proc = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report_line, peak_line = proc.stdout.strip().splitlines()
    report, peak = json.loads(report_line), int(peak_line)
    engine = report["plan"]["engine"]
    assert engine["blocks"].get("disk", 0) >= 4  # most blocks cannot stay in RAM
    assert engine["ram_bytes"] <= budget_gb * 1e9
    baseline = report["baseline_rss_bytes"]
    assert peak - baseline <= 1.1 * budget_gb * 1e9, (peak, baseline, budget_gb)
    assert peak < baseline + model_bytes  # the whole model was never in memory

    # the same tokens as with every block in RAM
    import torch

    from hivekeeper.core.runtime.generation import generate
    from hivekeeper.core.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(model)
    with OffloadedModel(model, place_model(ModelConfig.from_folder(model), Policy(weight_format="fp32"),
                                           device="cpu", dtype=torch.float32, batch=1, max_length=64)) as resident:
        expected = generate(resident, tokenizer.encode(PROMPT), max_new_tokens=6, ignore_eos=True, tokenizer=tokenizer)
    assert expected.texts[0] == report["text"]


@pytest.mark.slow
def test_generate_through_a_local_swarm_matches_local(tiny_checkpoint, in_process):
    from hivekeeper.core.swarm.local import LocalSwarm

    code, out, _ = in_process("generate", "--model", str(tiny_checkpoint), "--prompt", PROMPT, "--json",
                              "--max-new-tokens", "8", "--ignore-eos")
    assert code == 0
    local = json.loads(out)
    with LocalSwarm(tiny_checkpoint) as swarm:
        swarm.start("--num-blocks", "2")
        remote = generate_json(tiny_checkpoint, "--max-new-tokens", "8", "--ignore-eos", "--swarm",
                               "--initial-peers", *swarm.initial_peers)
    assert remote["plan"]["source"] == "swarm"
    assert remote["text"] == local["text"]


def test_the_peak_rss_is_the_runs_own_when_a_large_process_starts_it(tiny_checkpoint):
    """getrusage's ru_maxrss keeps the parent's peak across fork and exec: a run started by the app or a test worker
    (2.3 GB) reported that process's memory as its own peak. It is the child's own high-water mark now."""
    import psutil

    held = bytearray(1 << 30)
    held[::4096] = b"\1" * len(range(0, len(held), 4096))  # touched: resident in this (the parent) process
    parent = psutil.Process().memory_info().rss
    assert parent > 1 << 30
    report = generate_json(tiny_checkpoint, "--max-new-tokens", "2")
    del held
    # this process holds 1 GiB more than anything the child loads (torch, the tiny model): the parent's peak was
    # reported within 0.1% of the parent's memory
    assert report["baseline_rss_bytes"] <= report["peak_rss_bytes"] < parent - (1 << 29), \
        (report["peak_rss_bytes"], parent)


def test_a_plan_made_for_another_batch_says_its_prediction_is_not_this_runs(tiny_checkpoint, tmp_path, in_process):
    """Session 22 (a newcomer's run): `generate --plan FILE` of a `plan --batch 4` ran one prompt and printed the
    4-sequence prediction beside the one-sequence run, with no word of it. Now a note says so; a run of the plan's
    batch has none."""
    code, out, _ = in_process("plan", "--model", str(tiny_checkpoint), "--batch", "4", "--json")
    assert code == 0
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(out)
    common = ["generate", "--model", str(tiny_checkpoint), "--prompt", PROMPT, "--max-new-tokens", "2",
              "--plan", str(plan_file)]
    code, out, _ = in_process(*common, "--json")
    side = json.loads(out)["predicted_vs_measured"]
    assert side["note"].startswith("the plan's prediction is for a batch of 4; this run generated 1 sequence together")
    code, out, _ = in_process(*common)
    assert "note: the plan's prediction is for a batch of 4" in out
    code, out, _ = in_process(*common, "--batch", "4", "--json")
    side = json.loads(out)["predicted_vs_measured"]  # (predicted again for this run's tokens: session 25)
    assert side["predicts_this_run"] is True and "batch of" not in side.get("note", "")
