"""`hivekeeper generate --prompts-file`: a file's prompts as one batch, and the plan's predicted tokens/s printed
beside the measured ones. Run in this process (one torch import) on the tiny demo checkpoint."""

from __future__ import annotations

import json

import pytest

from hivekeeper.core.offload.local_plan import predicted_figures

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The old mill stood by the river", "The new mill stood by the river", "The old barn stood by the river"]


@pytest.fixture
def in_process(monkeypatch, capsys):
    """Run the CLI in this process; returns (exit code, stdout, stderr)."""
    from hivekeeper.core.cli.main import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # keeps `generate` from changing this process's thread count

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_a_prompts_file_is_one_batch_with_each_prompts_own_text(tiny_checkpoint, tmp_path, in_process):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n\n")  # blank lines are skipped
    common = ["generate", "--model", str(tiny_checkpoint), "--max-new-tokens", "4", "--ignore-eos", "--json"]
    code, out, err = in_process(*common, "--prompts-file", str(prompts))
    assert code == 0, err
    batch = json.loads(out)
    assert batch["batch"] == 3 and batch["new_tokens"] == 12 and len(batch["texts"]) == 3
    alone = []
    for prompt in PROMPTS:
        code, out, err = in_process(*common, "--prompt", prompt)
        assert code == 0, err
        alone.append(json.loads(out)["text"])
    assert batch["texts"] == alone and len(set(alone)) > 1
    side = batch["predicted_vs_measured"]
    assert batch["plan"]["source"] == "auto" and side["throughput_tokens_per_s"]["predicted"] > 0
    assert side["throughput_tokens_per_s"]["measured"] > 0 and side["decode_tokens_per_s"]["measured"] > 0

    code, out, _ = in_process(*common[:-1], "--prompts-file", str(prompts))  # the summary's last line
    assert code == 0 and "predicted vs measured tokens/s: throughput " in out.splitlines()[-1]


@pytest.mark.parametrize("lines, extra, message", [
    (["The old mill stood by the river", "A"], [], r"must have the same number of tokens; they have \d+ \(line 2\)"),
    (PROMPTS, ["--batch", "2"], "--batch goes with --prompt"),
    ([" ", ""], [], r"needs 1 to 65536 prompts, one per line \(found 0\)"),
])
def test_bad_prompts_files_are_one_clear_error(tiny_checkpoint, tmp_path, in_process, lines, extra, message):
    import re

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines))
    code, _, err = in_process("generate", "--model", str(tiny_checkpoint), "--prompts-file", str(prompts), *extra)
    assert code == 2 and re.search(message, err) and (str(prompts) in err or "--batch" in err)


def test_predicted_figures_come_from_a_plan_document_or_a_prediction_and_not_from_a_bare_policy():
    doc = {"policy": {}, "throughput_tokens_per_s": 12.3456789, "decode_tokens_per_s": 20.0,
           "prefill_tokens_per_s": 300.0, "bottleneck": "disk"}
    assert predicted_figures(doc) == {"throughput_tokens_per_s": 12.3457, "decode_tokens_per_s": 20.0,
                                      "prefill_tokens_per_s": 300.0, "bottleneck": "disk"}
    assert predicted_figures({"weight_format": "fp32"}) is None  # a bare policy predicts nothing
    assert predicted_figures({"policy": None, "throughput_tokens_per_s": None}) is None  # a plan that does not fit
