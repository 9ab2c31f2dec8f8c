"""bench/calibration_accuracy.py's packed row (issue 23, session 16): the default model's steady decode as `generate`
runs it (generate_points: the real engine and tokenizer on a small demo checkpoint here), and the prediction from the
packed kernels' readings of the moment (packed_now: fed-in readings). No timing asserts."""

from __future__ import annotations

import dataclasses
import importlib
import os
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the bench imports its folder's _common, as when run as a script
    packed = os.environ.get("HIVEKEEPER_GGUF_PACKED")  # the bench sets it on import (its fp32 runs)
    try:
        yield importlib.import_module("calibration_accuracy")
    finally:
        sys.path.remove(str(BENCH))
        if packed is None:
            os.environ.pop("HIVEKEEPER_GGUF_PACKED", None)
        else:
            os.environ["HIVEKEEPER_GGUF_PACKED"] = packed


def test_a_point_is_the_median_run_of_generates_steady_decode(bench, tmp_path):
    from hivekeeper.core.runtime.demo_model import DemoSpec, write_demo_checkpoint

    path = tmp_path / "demo"
    write_demo_checkpoint(path, DemoSpec(layers=2, hidden=128, intermediate=256, heads=2, kv_heads=1, vocab=512,
                                         max_position=128))
    points = bench.generate_points(path, (8, 24), new_tokens=6, runs=3)
    assert [pt.prompt_len for pt, _ in points] == [8, 24]
    for point, rates in points:
        assert (point.output_len, point.batch_size, point.repeats, point.placement) == (6, 1, 3, "resident")
        assert len(rates) == 3 and all(r > 0 for r in rates)
        # the median run's mean step (the tokens/s generate reports), not the fastest run
        assert 1.0 / point.step_s == pytest.approx(statistics.median(rates), rel=2e-3)
        assert point.prefill_s > 0 and point.runtime_s > point.prefill_s


def measurement(key: str, value: float):
    from hivekeeper.core.machine.measurement import Measurement

    return Measurement(key, key, value, "weights/s", 0.0, 1, 0.0)


def test_the_prediction_of_the_moment_takes_the_mean_of_the_readings_around_the_runs(bench):
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.measurement import PACKED_BLOCK_KEY, PACKED_KERNEL_KEY

    profile = [measurement("ram_read", 20e9), measurement(f"{PACKED_KERNEL_KEY}q4_1", 20e9),
               measurement(f"{PACKED_KERNEL_KEY}q8_0", 15e9), dataclasses.replace(
                   measurement(PACKED_BLOCK_KEY, 60e-6), unit="s")]
    before = [measurement(f"{PACKED_KERNEL_KEY}q4_1", 30e9), dataclasses.replace(measurement(PACKED_BLOCK_KEY, 40e-6),
                                                                                 unit="s")]
    after = [measurement(f"{PACKED_KERNEL_KEY}q4_1", 34e9), dataclasses.replace(measurement(PACKED_BLOCK_KEY, 50e-6),
                                                                                unit="s")]
    hardware = bench.packed_now(detect_hardware(), profile)(before, after)
    assert hardware.cpu.packed_kernels["q4_1"] == pytest.approx(32e9)
    assert hardware.cpu.packed_kernels["q8_0"] == pytest.approx(15e9)  # not read again: the profile's
    assert hardware.cpu.packed_block_overhead_s == pytest.approx(45e-6)
