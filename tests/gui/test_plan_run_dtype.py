"""Issue 22: the Plan page's what-if prediction shows what the engine would run. On a CPU with native bf16 math (flags
pinned: AVX512-BF16, no measured bf16 decode step) the batch goal plans bf16 for micro-batches beyond the native
decode kernels' rows; "Run this plan" over three prompts runs micro-batches of three rows, which the engine computes
in fp32 (the rows rule). The prediction drawn beside the run is then the fp32 one, and the status line says so."""

from __future__ import annotations

from dataclasses import replace

import pytest
from PySide6.QtCore import Qt

from hivekeeper.planner.costmodel import PACKED_KERNEL_ROWS, Workload, evaluate
from hivekeeper.planner.model_catalog import load_model_spec

from hivekeeper.core.runtime.tokenizer import load_tokenizer

BF16_CPU = "sse2 avx avx2 fma avx512f avx512_bf16"  # native bf16 math, as HIVEKEEPER_CPU_FLAGS pins it
PROMPTS = ["The old mill stood by the river", "The new mill stood by the river", "The old barn stood by the river"]
NEW_TOKENS = 3


def test_a_bf16_batch_plan_run_on_three_prompts_is_predicted_in_the_fp32_it_runs_in(cpu_flags, make_window, qtbot,
                                                                                    tmp_path, demo_checkpoint):
    cpu_flags(BF16_CPU)
    window = make_window()
    window.hardware_page.start_detection()  # this machine as the app detects it at start, flags pinned
    page = window.plan_page
    window.show_page("Plan")
    page.goal_combo.setCurrentIndex(page.goal_combo.findData("batch"))
    page.use_model(str(demo_checkpoint))
    qtbot.waitUntil(lambda: page.hardware() is not None and page.result is not None
                    and page.settings.model == str(demo_checkpoint) and page.result.plan.prediction is not None,
                    timeout=60_000)
    policy = page.result.plan.prediction.policy
    assert policy.weight_format == "bf16" and policy.micro_batch_size > PACKED_KERNEL_ROWS  # the plan shown

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    box = page.run_box
    box.prompts_edit.setText(str(prompts))
    box.tokens_spin.setValue(NEW_TOKENS)
    qtbot.mouseClick(box.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: box.report is not None or bool(box.error), timeout=60_000)
    assert not box.error
    report = box.report
    assert report["plan"].startswith("float32 blocks")  # the engine computed the three-row run in fp32
    # the prediction beside it is of that fp32 run: 3 prompts of their length, one micro-batch of 3 rows
    model, hardware = load_model_spec(str(demo_checkpoint)), page.hardware()
    prompt_len = len(load_tokenizer(demo_checkpoint).encode(PROMPTS[0]))
    shaped = replace(policy, micro_batch_size=3, num_micro_batches=1)

    def predicted(weight_format: str) -> float:
        return evaluate(model, hardware, replace(shaped, weight_format=weight_format),
                        Workload(prompt_len, NEW_TOKENS), efficiency=page.efficiency()).throughput_tokens_per_s

    assert predicted("fp32") != pytest.approx(predicted("bf16"), rel=1e-3)  # the two predictions differ here
    assert report["predicted"]["throughput_tokens_per_s"] == pytest.approx(predicted("fp32"), rel=1e-3)
    assert "Computed in fp32, as the engine runs this bf16 plan: its micro-batches multiply 3 rows" \
        in box.status.text()
    qtbot.waitUntil(lambda: box.run_button.isEnabled())
