"""`hivekeeper generate --plan FILE` says when its prediction is not this run's: a placement replaced (no GPU here, a
--ram-budget-gb) is named beside the plan's, streamed reads faster than the disk are named as the page cache's, and a
plan file's int8/nf4 for a GGUF is refused naming the file's field, not a --quant the user never typed."""

from __future__ import annotations

import json

import pytest
import torch

from hivekeeper.core.cli.generate import PAGE_CACHE_FACTOR, page_cache_note

PROMPT = "The old mill stood by the river"
# the prediction a `plan --json` carries beside its policy (figures of no particular machine)
PREDICTED = {"throughput_tokens_per_s": 10.0, "decode_tokens_per_s": 12.0, "prefill_tokens_per_s": 100.0,
             "bottleneck": "disk"}


def plan_file(tmp_path, weights: dict, kv_cache: dict) -> str:
    """A plan JSON in the shape `hivekeeper plan --json` writes (no model or machine named: no checks of either)."""
    policy = {"weight_format": "fp32", "weights": weights, "kv_cache": kv_cache, "micro_batch_size": 1,
              "num_micro_batches": 1, "kv_cache_mode": "keep", "prefetch_depth": 1}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"goal": "chat", "policy": policy, **PREDICTED}))
    return str(path)


def generate(cli, model, plan: str, *extra: str):
    return cli("generate", "--model", str(model), "--prompt", PROMPT, "--max-new-tokens", "3", "--ignore-eos",
               "--plan", plan, *extra)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU placement runs as planned where there is a GPU")
def test_a_gpu_plan_on_a_machine_without_one_says_so_first_and_beside_the_prediction(tiny_checkpoint, tmp_path, cli):
    plan = plan_file(tmp_path, {"gpu": 1, "cpu": 0, "disk": 0}, {"gpu": 1, "cpu": 0, "disk": 0})
    done = generate(cli, tiny_checkpoint, plan, "--json")
    assert done.returncode == 0, done.stderr
    assert f"note: {plan} puts weights or KV cache on a GPU, but this machine has none" in done.stderr
    side = json.loads(done.stdout)["predicted_vs_measured"]
    assert side["predicts_this_run"] is False
    assert side["placement"]["planned"] == {"blocks": {"gpu": 2}, "kv_cache_blocks": {"gpu": 2}}
    assert side["placement"]["ran"] == {"blocks": {"cpu": 2}, "kv_cache_blocks": {"cpu": 2}}
    assert side["note"] == ("this run placed blocks: 2 RAM; KV cache blocks: 2 RAM, not the plan's blocks: 2 GPU; "
                            "KV cache blocks: 2 GPU (this machine has no GPU): the predicted figures are the plan's "
                            "placement, not this run's")
    text = generate(cli, tiny_checkpoint, plan).stdout
    assert "predicted (the plan's prediction, not for this run) vs measured tokens/s" in text
    assert "not the plan's blocks: 2 GPU" in text


def test_a_ram_budget_that_moves_blocks_names_both_placements(tiny_checkpoint, tmp_path, cli):
    plan = plan_file(tmp_path, {"gpu": 0, "cpu": 0, "disk": 1}, {"gpu": 0, "cpu": 1, "disk": 0})
    done = generate(cli, tiny_checkpoint, plan, "--json", "--ram-budget-gb", "1")  # room for both blocks
    assert done.returncode == 0, done.stderr
    side = json.loads(done.stdout)["predicted_vs_measured"]
    assert side["placement"]["planned"]["blocks"] == {"disk": 2} and side["placement"]["ran"]["blocks"] == {"cpu": 2}
    assert side["placement"]["why"] == ["--ram-budget-gb 1 puts in RAM the blocks that fit in it, the rest on disk"]
    assert side["predicts_this_run"] is False and "not the plan's blocks: 2 disk" in side["note"]
    same = json.loads(generate(cli, tiny_checkpoint, plan, "--json").stdout)["predicted_vs_measured"]
    assert same["predicts_this_run"] is True and "note" not in same and "placement" not in same


def test_the_page_cache_note_with_fixed_numbers():
    disk = 0.87e9
    note = page_cache_note(1.18e9, disk, dropped_page_cache=False)
    assert note == ("this run streamed weights at 1.18 GB/s, faster than the 0.87 GB/s disk reads this machine's "
                    "plans assume: the reads came (at least partly) from the OS page cache, not the disk; "
                    "--drop-page-cache measures the disk")
    assert page_cache_note(1.18e9, disk, dropped_page_cache=True) is None  # the disk itself was read
    assert page_cache_note(PAGE_CACHE_FACTOR * disk * 0.99, disk, dropped_page_cache=False) is None
    assert page_cache_note(0, disk, dropped_page_cache=False) is None  # nothing streamed
    assert page_cache_note(1.18e9, None, dropped_page_cache=False) is None  # the disk's speed unknown


def test_streaming_faster_than_the_profiled_disk_is_named_the_page_cache(tiny_checkpoint, tmp_path, cli,
                                                                         measured_machine, monkeypatch):
    """The machine's profile says its disk reads 1 kB/s: the tiny model's streamed block comes faster, whatever the
    host's disk, so it came from the page cache; with --drop-page-cache the note is not given."""
    config = tmp_path / "config"
    profile = measured_machine(config)
    doc = json.loads(profile.read_text())
    found = [m for m in doc["measurements"] if m["key"] == "disk_read"]
    assert found, "the suite's profile has a disk read figure"
    for measurement in found:
        measurement["value"], measurement["samples"] = 1e3, [1e3]
    profile.write_text(json.dumps(doc))
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(config))
    plan = plan_file(tmp_path, {"gpu": 0, "cpu": 0.5, "disk": 0.5}, {"gpu": 0, "cpu": 1, "disk": 0})
    done = generate(cli, tiny_checkpoint, plan, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["bytes_streamed"] > 0
    side = report["predicted_vs_measured"]
    assert "from the OS page cache, not the disk; --drop-page-cache measures the disk" in side["note"]
    assert side["predicts_this_run"] is True  # the plan's placement ran
    dropped = json.loads(generate(cli, tiny_checkpoint, plan, "--json", "--drop-page-cache").stdout)
    assert "note" not in dropped["predicted_vs_measured"]


def test_a_plan_files_nf4_for_a_gguf_names_the_file_and_field_not_quant(tmp_path, cli):
    from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID

    plan = tmp_path / "p_nf4.json"  # a bare policy object: read for any model
    plan.write_text(json.dumps({"weight_format": "nf4", "weights": {"gpu": 0, "cpu": 1, "disk": 0}}))
    done = cli("generate", "--model", DEFAULT_MODEL_ID, "--prompt", "Hi", "--max-new-tokens", "2",
               "--plan", str(plan))
    assert done.returncode == 2
    assert f"{plan}: the plan's policy field weight_format is 'nf4', but {DEFAULT_MODEL_ID} is a GGUF" in done.stderr
    assert "--quant" not in done.stderr
