"""`hivekeeper generate` runs what its plan names and predicts this run (session 25): a plan file made with --quant none
runs its float format (the GGUF dequantized, as `plan` says it is held in memory), not the packed blocks it was not
predicted for; a plan file made here for other prompt and output tokens is predicted again for this run's (one made
for another machine says its prediction is not this run's); and a plan made under --ram-budget-gb names the blocks the
engine places in RAM, not one more.

The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) on the suite's fixed machine profile (tests/conftest.py):
no figure depends on this host's speed."""

from __future__ import annotations

import json

from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID

PROMPT = "Once upon a time"


def plan_file(cli, tmp_path, *args: str) -> tuple[str, dict]:
    done = cli("plan", "--model", DEFAULT_MODEL_ID, *args, "--json")
    assert done.returncode == 0, done.stderr
    path = tmp_path / "plan.json"
    path.write_text(done.stdout)
    return str(path), json.loads(done.stdout)


def generate(cli, *args: str, tokens: int = 4) -> dict:
    done = cli("generate", "--model", DEFAULT_MODEL_ID, "--prompt", PROMPT, "--max-new-tokens", str(tokens),
               "--ignore-eos", "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_quant_none_plan_runs_dequantized_and_plan_says_it_is_held_so(cli, tmp_path):
    plan, doc = plan_file(cli, tmp_path, "--quant", "none")
    planned = doc["policy"]["weight_format"]
    assert planned in ("fp32", "bf16")
    # the "in memory" row: the plan's float format, every weight dequantized (not the 96.6 MB of packed Q4_1)
    gguf = doc["gguf"]
    assert "memory_packed" not in gguf and gguf["memory_bytes"] > 2 * gguf["tensor_bytes"]
    human = cli("plan", "--model", DEFAULT_MODEL_ID, "--quant", "none").stdout
    row = next(line for line in human.splitlines() if line.lstrip().startswith("in memory"))
    assert f" as {gguf['memory_format']}, " in row and row.endswith("the runtime dequantizes GGUF weights"), row
    assert "packed" not in row
    ran = generate(cli, "--plan", plan)
    engine = ran["plan"]["engine"]
    assert engine["packed_format"] == "" and engine["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[
        gguf["memory_format"]]
    assert ran["predicted_vs_measured"]["predicts_this_run"] is True
    # the default plan (the GGUF's own q4_1) still runs packed
    packed, _ = plan_file(cli, tmp_path)
    assert generate(cli, "--plan", packed)["plan"]["engine"]["packed_format"] == "q4_1"


def test_a_plan_made_here_for_other_tokens_is_predicted_again_for_this_runs(cli, tmp_path):
    plan, doc = plan_file(cli, tmp_path)  # 512 + 128 tokens
    ran = generate(cli, "--plan", plan)
    side, prompt = ran["predicted_vs_measured"], ran["prompt_tokens"]
    assert side["predicts_this_run"] is True and side["predicted_for_tokens"] == {"prompt_len": prompt,
                                                                                  "output_len": 4}
    assert (f"predicted for this run's {prompt} + 4 tokens by the plan's policy on this machine (the plan's figures, "
            f"for 512 + 128 tokens: throughput {doc['throughput_tokens_per_s']:.3g}, decode "
            f"{doc['decode_tokens_per_s']:.3g} tokens/s)") in side["note"]
    # the figures a plan made for this run's tokens predicts, for the same policy
    _, same = plan_file(cli, tmp_path, "--prompt-len", str(prompt), "--output-len", "4")
    assert same["policy"] == doc["policy"]
    assert side["throughput_tokens_per_s"]["predicted"] == same["throughput_tokens_per_s"] != \
        doc["throughput_tokens_per_s"]


def test_a_plan_for_another_machine_and_other_tokens_says_its_prediction_is_not_this_runs(cli, tmp_path):
    plan, doc = plan_file(cli, tmp_path, "--hardware", "cpu-generic", "--goal", "batch", "--batch", "2")
    ran = generate(cli, "--plan", plan, "--batch", "2")
    side, prompt = ran["predicted_vs_measured"], ran["prompt_tokens"]
    assert side["predicts_this_run"] is False
    assert side["throughput_tokens_per_s"]["predicted"] == doc["throughput_tokens_per_s"]
    assert (f"the plan's prediction is for 512 + 128 tokens; this run was {prompt} + 4 (a plan made with "
            f"--prompt-len {prompt} --output-len 4 predicts this run)") in side["note"]
    again = generate(cli, "--plan", plan, "--batch", "2", tokens=128)  # the tokens alone differ: the prompt's
    assert f"for 512 + 128 tokens; this run was {prompt} + 128 " in again["predicted_vs_measured"]["note"]


def test_a_plan_under_a_ram_budget_names_the_blocks_the_engine_places(cli):
    ran = generate(cli, "--ram-budget-gb", "0.05", tokens=16)
    info, side = ran["plan"], ran["predicted_vs_measured"]
    blocks = info["engine"]["blocks"]
    assert blocks.get("disk") and blocks.get("cpu")  # the budget streams some blocks, holds the others
    assert info["planned_placement"]["blocks"] == blocks
    assert info["policy"]["weights"]["cpu"] == round(blocks["cpu"] / sum(blocks.values()), 4)
    assert side["predicts_this_run"] is True and "placement" not in side
