"""The decode loop's fixed cost per step (core/machine/step_overhead.py, measure.measure_step_overhead): generate() on
a tiny in-memory decoder, each step less its span and head calls; the measurement reaches a profile and the plan
(issue 23, session 16). The engine's real loop runs; no timing asserts."""

from __future__ import annotations

import dataclasses

import pytest

from hivekeeper.core.machine import step_overhead
from hivekeeper.core.machine.detect import detect_hardware
from hivekeeper.core.machine.measure import TINY, measure_step_overhead, run_benchmarks, span_of_config
from hivekeeper.core.machine.measurement import STEP_OVERHEAD_KEY
from hivekeeper.core.machine.profiles import apply_measurements, decode_streaming
from hivekeeper.planner.efficiency import DEFAULTS, default_efficiency


def test_a_step_rest_is_the_step_less_its_span_and_head_calls():
    # the span and head lists start with the prefill's call, which no step holds
    rests = step_overhead.step_rests([10.0, 12.0, 9.0], [50.0, 6.0, 7.0, 5.0], [3.0, 2.0, 2.5, 1.0])
    assert rests == pytest.approx([2.0, 2.5, 3.0])


def test_the_loop_model_runs_generate_and_times_every_call():
    from hivekeeper.core.runtime.model import Embedding

    config, span = span_of_config(step_overhead.loop_config(vocab=512))
    model = step_overhead.loop_model(config, span, Embedding(config).requires_grad_(False), cache_bytes=1 << 16)
    rests = step_overhead.loop_rests(model, steps=10)
    assert len(rests) == 9  # ten tokens: the first comes from the prefill, nine decode steps follow
    assert len(model.span_s) == len(model.head_s) == 10  # the prefill's call and one per step
    assert all(s > 0 for s in model.span_s + model.head_s)


def test_the_measurement_is_the_median_rest_of_its_steps():
    measured = measure_step_overhead(runs=2, steps=9, cache_bytes=1 << 20)
    assert measured.key == STEP_OVERHEAD_KEY and measured.unit == "s"
    assert measured.repeats == len(measured.samples) == 16
    assert min(measured.samples) <= measured.value <= max(measured.samples) and measured.value >= 0


def test_quick_measurements_carry_it_into_the_plan():
    measurements = run_benchmarks(TINY, gpu=False)
    step = next(m for m in measurements if m.key == STEP_OVERHEAD_KEY)
    hardware = apply_measurements(detect_hardware(), measurements, when=1.7e9)
    assert hardware.cpu.decode_streaming.step_overhead_s == pytest.approx(min(0.1, step.value))
    assert default_efficiency(hardware).host.step_overhead_s == pytest.approx(min(0.1, step.value))
    older = [m for m in measurements if m.key != STEP_OVERHEAD_KEY]  # a profile saved before session 16
    assert decode_streaming(older).step_overhead_s is None
    assert default_efficiency(apply_measurements(detect_hardware(), older, when=1.7e9)).host.step_overhead_s \
        == DEFAULTS["cpu"].step_overhead_s
    assert dataclasses.replace(decode_streaming(measurements), step_overhead_s=None) == decode_streaming(older)
