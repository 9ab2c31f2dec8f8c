"""bench/calibration_accuracy.py's packed row (issue 23, sessions 16 and 18): the default model's steady decode as
`generate` runs it, in a process of its own (packed_runs_in_child: the real child, engine and tokenizer on a small demo
checkpoint here), and the prediction from the packed kernels' readings of the moment (packed_now: fed-in readings).
No timing asserts."""

from __future__ import annotations

import dataclasses
import statistics

import pytest


def test_the_packed_runs_are_the_median_run_of_generates_steady_decode_in_a_process_of_their_own(
        calibration_bench, tmp_path):
    from hivekeeper.core.runtime.demo_model import DemoSpec, write_demo_checkpoint

    path = tmp_path / "demo"
    write_demo_checkpoint(path, DemoSpec(layers=2, hidden=128, intermediate=256, heads=2, kv_heads=1, vocab=512,
                                         max_position=128))
    done = calibration_bench.packed_runs_in_child(path, (8, 24), runs=3, read_now=False)  # the real child
    assert [pt.prompt_len for pt, _ in done["points"]] == [8, 24] and done["before"] == done["after"] == []
    for point, rates in done["points"]:
        assert (point.output_len, point.batch_size, point.repeats, point.placement) == (
            calibration_bench.PACKED_NEW_TOKENS, 1, 3, "resident")
        assert len(rates) == 3 and all(r > 0 for r in rates)
        # the median run's mean step (the tokens/s generate reports), not the fastest run
        assert 1.0 / point.step_s == pytest.approx(statistics.median(rates), rel=2e-3)
        assert point.prefill_s > 0 and point.runtime_s > point.prefill_s


def test_a_failing_child_says_what_it_printed(calibration_bench, tmp_path):
    with pytest.raises(SystemExit, match="packed-runs-of") as failed:
        calibration_bench.packed_runs_in_child(tmp_path / "no-such-model", (8, 24), runs=1, read_now=False)
    assert "no-such-model" in str(failed.value)


def measurement(key: str, value: float):
    from hivekeeper.core.machine.measurement import Measurement

    return Measurement(key, key, value, "weights/s", 0.0, 1, 0.0)


def test_the_prediction_of_the_moment_takes_the_mean_of_the_readings_around_the_runs(calibration_bench):
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.measurement import PACKED_BLOCK_KEY, PACKED_KERNEL_KEY

    profile = [measurement("ram_read", 20e9), measurement(f"{PACKED_KERNEL_KEY}q4_1", 20e9),
               measurement(f"{PACKED_KERNEL_KEY}q8_0", 15e9), dataclasses.replace(
                   measurement(PACKED_BLOCK_KEY, 60e-6), unit="s")]
    before = [measurement(f"{PACKED_KERNEL_KEY}q4_1", 30e9), dataclasses.replace(measurement(PACKED_BLOCK_KEY, 40e-6),
                                                                                 unit="s")]
    after = [measurement(f"{PACKED_KERNEL_KEY}q4_1", 34e9), dataclasses.replace(measurement(PACKED_BLOCK_KEY, 50e-6),
                                                                                unit="s")]
    hardware = calibration_bench.packed_now(detect_hardware(), profile)(before, after)
    assert hardware.cpu.packed_kernels["q4_1"] == pytest.approx(32e9)
    later = [measurement(f"{PACKED_KERNEL_KEY}q4_1", 26e9)]  # a second round's reading: the mean of all three
    assert calibration_bench.packed_now(detect_hardware(), profile)(before, after, later).cpu.packed_kernels[
        "q4_1"] == pytest.approx(30e9)
    assert hardware.cpu.packed_kernels["q8_0"] == pytest.approx(15e9)  # not read again: the profile's
    assert hardware.cpu.packed_block_overhead_s == pytest.approx(45e-6)


def test_the_packed_row_pools_its_rounds(calibration_bench):
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.runtime.default_model import resolve_default_model
    from hivekeeper.planner.calibration import ProfilePoint, measured_efficiency
    from hivekeeper.planner.model_catalog import load_model_spec

    path = resolve_default_model()
    hardware = detect_hardware()

    def one_round(step_s: float, rates: list) -> dict:
        return {"points": [(ProfilePoint(32, 64, 1, 0.1, step_s, 0.1 + 63 * step_s, repeats=3), rates)],
                "before": [], "after": []}

    row = calibration_bench.packed_default_decode(path, load_model_spec(str(path)),
                                                  [one_round(1 / 150, [140.0, 150.0, 160.0]),
                                                   one_round(1 / 100, [90.0, 100.0, 110.0])],
                                                  {"uncalibrated": (hardware, measured_efficiency(hardware))})
    assert row["format"] == "q4_1" and row["rounds"] == 2
    assert row["runs_tokens_per_s"] == {32: [140.0, 150.0, 160.0, 90.0, 100.0, 110.0]}
    assert row["measured"] == pytest.approx(1 / ((1 / 150 + 1 / 100) / 2), abs=0.01)  # the mean step of the rounds
    assert row["uncalibrated_ratio"] == pytest.approx(row["uncalibrated"] / row["measured"], abs=1e-3)
    assert calibration_bench.packed_default_decode(path, None, [], {}) == {}  # no rounds: no row


def test_no_packed_rounds_no_row_whatever_the_model(calibration_bench, tmp_path):
    """--quick runs no packed row, and its thin model is a demo checkpoint, no GGUF: no row, no error."""
    from hivekeeper.core.runtime.demo_model import DemoSpec, write_demo_checkpoint

    path = tmp_path / "demo"
    write_demo_checkpoint(path, DemoSpec(layers=1, hidden=64, intermediate=128, heads=2, kv_heads=1, vocab=300,
                                         max_position=64))
    assert calibration_bench.packed_default_decode(path, None, [], {}) == {}
