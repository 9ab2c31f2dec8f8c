"""The Plan page's Weight format knob (issue 16 item 3): in the window `hivekeeper app` opens, the built-in GGUF model
(SmolLM2-135M-Instruct, Q4_1) picked from the Local model menu offers its own q4_1 packed, fp32/bf16 dequantized and
auto; moving the knob changes the predicted tokens/s, the bottleneck and the memory at once, to the numbers
`hivekeeper plan --quant X` plans for the same machine. The menu offers only what applies: no packed format on
a GPU machine, bitsandbytes only for a checkpoint on a CUDA GPU."""

from __future__ import annotations

import argparse

import pytest

from hivekeeper.core.cli.plan import add_arguments, build_plan
from hivekeeper.planner.policy import plan_to_dict
from hivekeeper.core.runtime.default_model import default_model_file

MACHINE = "cpu-generic"
COMPARED = ("decode_tokens_per_s", "prefill_tokens_per_s", "runtime_s", "bottleneck", "peak_memory_bytes")


def cli_plan(model: str, quant: str) -> dict:
    """What `hivekeeper plan --model MODEL --hardware MACHINE --quant QUANT --json` plans, with the page's default
    query (512 + 128 tokens): the command's own parser and build_plan, without its GGUF file report (which loads
    torch to count the packed blocks; tests/core/cli/test_plan_packed.py checks that part)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plan, _, _, choice = build_plan(parser.parse_args(["--model", model, "--hardware", MACHINE, "--quant", quant]))
    return {**plan_to_dict(plan), "why": choice.why}


def menu(plan) -> list[str]:
    return [plan.quant_combo.itemData(i) for i in range(plan.quant_combo.count())]


def choose(qtbot, plan, combo, value: str) -> None:
    """Pick `value` in a combo as a click does, and wait for the prediction that follows."""
    count = plan.recomputes
    combo.setCurrentIndex(combo.findData(value))
    qtbot.waitUntil(lambda: plan.recomputes > count, timeout=15_000)


def test_the_weight_format_knob_plans_a_gguf_as_the_cli_does(app_window, qtbot):
    model = default_model_file()
    if model is None:
        pytest.skip("the built-in model is not installed (make test installs it)")
    app_window.show_page("Plan")
    plan = app_window.plan_page
    choose(qtbot, plan, plan.hardware_combo, MACHINE)
    count = plan.recomputes
    plan.folder_button.menu().actions()[0].trigger()  # "Built-in model: smollm2-135m-instruct"
    qtbot.waitUntil(lambda: plan.recomputes > count and plan.settings.model == str(model), timeout=15_000)
    assert menu(plan) == ["auto", "q4_1", "none"]
    assert plan.result.numbers["policy"]["weight_format"] == "q4_1"  # auto: the file's own type, packed
    assert "kept packed" in plan.format_label.text()

    seen = {}
    for quant in ("q4_1", "none"):
        choose(qtbot, plan, plan.quant_combo, quant)
        page, cli = plan.result.numbers, cli_plan(str(model), quant)
        assert page["policy"] == cli["policy"] and page["format_choice"]["why"] == cli["why"]
        for key in COMPARED:
            assert page[key] == (cli[key] if isinstance(cli[key], str) else pytest.approx(cli[key], rel=1e-9)), key
        ram = next(bar for bar in plan.memory_bars.bars if bar.tier == "cpu")
        seen[quant] = (page["policy"]["weight_format"], plan.decode_card.value.text(),
                       plan.bottleneck_card.value.text(), ram.weights, plan.format_label.text())
    packed, dequantized = seen["q4_1"], seen["none"]
    assert (packed[0], dequantized[0]) == ("q4_1", "fp32")
    assert packed[1] != dequantized[1] and packed[2] != dequantized[2]  # the decode card and the bottleneck
    assert packed[3] < 0.5 * dequantized[3]  # 5 bits a weight in the blocks instead of 32
    assert packed[4] != dequantized[4]
    window_settings = app_window.settings.plan
    assert window_settings.quant == "none"

    # a GPU machine runs the GGUF dequantized: no packed choice there, and the q4_1 chosen before becomes auto
    choose(qtbot, plan, plan.quant_combo, "q4_1")
    choose(qtbot, plan, plan.hardware_combo, "rtx-4090")
    assert menu(plan) == ["auto", "none"] and plan.settings.quant == "auto"
    assert plan.result.numbers["policy"]["weight_format"] not in ("q4_1", "int8", "nf4")
    # a checkpoint (not a GGUF) on a CUDA GPU may take bitsandbytes; on a CPU it may not
    plan.use_model("Qwen/Qwen2.5-0.5B")
    qtbot.waitUntil(lambda: menu(plan) == ["auto", "none", "int8", "nf4"], timeout=15_000)
    choose(qtbot, plan, plan.quant_combo, "nf4")
    assert plan.result.numbers["policy"]["weight_format"] == "nf4"
    choose(qtbot, plan, plan.hardware_combo, MACHINE)
    assert menu(plan) == ["auto", "none"] and plan.settings.quant == "auto"
