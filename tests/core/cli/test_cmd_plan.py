"""`hivekeeper plan` run as a real subprocess: JSON and human output, files as input, bad input → exit 2. Each
feature has one child process; its variations run the same `main()` in this process (the `cli` fixture), since each
child costs a second or more of start-up on a loaded machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hivekeeper.planner.hardware_catalog import get_hardware, hardware_to_json

REQUIRED = ("goal", "model", "hardware", "policy", "decode_tokens_per_s", "prefill_tokens_per_s",
            "roofline_decode_tokens_per_s", "bottleneck", "min_compute_bound_batch", "peak_memory_bytes", "fit",
            "runtime_s", "energy_j", "cost_usd")
POLICY_KNOBS = ("weight_format", "weights", "kv_cache", "activations", "batch_size", "micro_batch_size",
                "num_micro_batches", "kv_cache_mode", "prefetch_depth", "attention_on_cpu")

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
    "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 1000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def plan(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hivekeeper.core.cli.main", "plan", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_json_has_every_field_and_the_numbers_hang_together():
    result = plan("--model", "meta-llama/Llama-2-13b-hf", "--hardware", "rtx-3090", "--quant", "none",
                  "--prompt-len", "1000", "--output-len", "200", "--price-per-hour", "0.5", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # one object, nothing else on stdout
    assert all(field in data for field in REQUIRED)
    assert all(knob in data["policy"] for knob in POLICY_KNOBS)
    assert data["goal"] == "chat" and data["fit"] == "local" and data["hardware"] == "rtx-3090"
    assert data["policy"]["weight_format"] == "fp16" and 0 < data["policy"]["weights"]["gpu"] < 1
    assert set(data["peak_memory_bytes"]) == {"gpu", "cpu", "disk"}
    assert data["decode_tokens_per_s"] <= data["roofline_decode_tokens_per_s"]
    assert data["bottleneck"] == "host link" and "host→GPU" in data["reason"]
    assert data["runtime_s"] == pytest.approx(data["alpha_s"] + 199 * data["beta_s"], rel=1e-5)
    assert data["cost_usd"] == pytest.approx(0.5 * data["runtime_s"] / 3600, rel=1e-5)
    assert data["context_len"] == 1200


def test_the_format_row_names_the_formats_weighed_and_their_speed(cli):
    """A plan's format against a rule of thumb (nf4 over int8 on a GPU; bf16 on a CPU where fp32 would stream from
    disk, session 22's newcomer) shows what the search weighed: each other format's best, as in the JSON."""
    args = ("plan", "--model", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--hardware", "t4")
    data = json.loads(cli(*args, "--json").stdout)
    others = {o["weight_format"]: o for o in data["other_formats"]}
    assert set(others) == {"fp16", "int8", "nf4"} - {data["policy"]["weight_format"]}
    assert all(0 < o["decode_tokens_per_s"] and o["weights_on_disk"] == 0 for o in others.values())
    row = next(line for line in cli(*args).stdout.splitlines() if line.lstrip().startswith("format"))
    assert "; weighed: " in row and all(f"{name} {o['decode_tokens_per_s']:.3g} tokens/s" in row
                                        for name, o in others.items()), row


def test_serve_json_and_human_table(cli):
    result = cli("plan", "--model", "meta-llama/Llama-2-70b-hf", "--hardware", "rtx-4090", "--goal", "serve", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert all(field in data for field in REQUIRED + ("num_blocks", "block_inference_rps", "block_forward_rps"))
    assert 0 < data["num_blocks"] < 80 and data["block_forward_rps"] > data["block_inference_rps"] > 0
    human = plan("--model", "facebook/opt-30b", "--hardware", "t4-flexgen", "--goal", "batch", "--output-len", "32")
    assert human.returncode == 0, human.stderr
    for row in ("fit", "weights", "KV cache", "batch", "decode", "peak memory", "runtime", "why:"):
        assert row in human.stdout
    assert human.stderr == ""


def test_config_json_and_hardware_json_files(tmp_path, cli):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    hardware_file = tmp_path / "box.json"
    hardware_file.write_text(json.dumps(hardware_to_json(get_hardware("l4"))))
    result = cli("plan", "--model", str(tmp_path / "tiny"), "--hardware", str(hardware_file), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["model"] == "tiny" and data["fit"] == "local"
    assert data["policy"]["weights"]["gpu"] == 1.0


def test_a_model_that_does_not_fit_says_so(cli):
    result = cli("plan", "--model", "meta-llama/Meta-Llama-3.1-405B-Instruct", "--hardware", "cpu-generic",
                  "--ram-gb", "4", "--disk-gb", "50", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["fit"] == "none" and data["missing_bytes"]["total"] > 0 and data["decode_tokens_per_s"] is None


def test_hardware_auto_detects_this_machine():
    result = plan("--model", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--hardware", "auto", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["hardware"] == "detected" and data["fit"] in ("local", "swarm")


BAD_INPUTS = [
    (["--model", "no-such/model", "--hardware", "t4"], "unknown model"),
    (["--model", "facebook/opt-6.7b", "--hardware", "no-such-gpu"], "no-such-gpu"),
    (["--model", "facebook/opt-6.7b", "--hardware", "t4", "--prompt-len", "-5"], "--prompt-len"),
    (["--model", "facebook/opt-6.7b", "--hardware", "t4", "--output-len", "many"], "--output-len"),
    (["--model", "facebook/opt-6.7b", "--hardware", "t4", "--batch", "10000000"], "--batch"),
    (["--model", "facebook/opt-6.7b", "--hardware", "t4", "--prompt-len", "900", "--context", "100"], "context"),
    (["--model", "facebook/opt-6.7b", "--hardware", "t4", "--reserve-gb", "-1"], "--reserve-gb"),
    # beyond the model's own context (2048 for OPT; session 23: 1,000,000 was planned at 37 tokens/s)
    (["--model", "facebook/opt-6.7b", "--hardware", "t4", "--context", "1000000"],
     "a context of 1,000,000 tokens (prompt + output, or the context asked for) is beyond facebook/opt-6.7b's 2,048"),
    (["--model", "facebook/opt-6.7b", "--hardware", "t4", "--prompt-len", "2000", "--output-len", "100"],
     "a context of 2,100 tokens"),
    (["--model", "facebook/opt-6.7b", "--hardware", "t4", "--quant", "fp8"], "--quant"),
    (["--model", "facebook/opt-6.7b", "--hardware", "t4", "--goal", "fastest"], "--goal"),
    (["--model", "facebook/opt-6.7b", "--hardware", "t4", "--price-per-hour", "nan"], "--price-per-hour"),
    # no --model plans the built-in model (test_plan_default_model.py); an empty one is bad input
    (["--model", "", "--hardware", "t4"], "--model"),
]


@pytest.mark.parametrize("args, mentions", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(args, mentions, cli):
    result = plan(*args) if args == BAD_INPUTS[0][0] else cli("plan", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert mentions in lines[0]


def test_malformed_files_are_one_line_and_exit_2(tmp_path, cli):
    broken_config = tmp_path / "config.json"
    broken_config.write_text("{ not json")
    missing_fields = tmp_path / "nofields.json"
    missing_fields.write_text(json.dumps({"model_type": "llama"}))
    broken_hardware = tmp_path / "hw.json"
    broken_hardware.write_text(json.dumps({"id": "x", "gpus": 5}))
    for args, path in ((["--model", str(broken_config), "--hardware", "t4"], broken_config),
                       (["--model", str(missing_fields), "--hardware", "t4"], missing_fields),
                       (["--model", "facebook/opt-6.7b", "--hardware", str(broken_hardware)], broken_hardware)):
        result = plan(*args) if path == broken_config else cli("plan", *args)
        assert result.returncode == 2, result.stdout
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr
        assert path.name in lines[0]
