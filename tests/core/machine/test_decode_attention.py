"""The decode attention's cache read rate (measure.measure_decode_attention, session 25): one-row steps through the
runtime's decode path at a long and a short context, the extra K and V bytes over their time difference; the
measurement reaches a profile's hardware (DecodeStreaming.attention_bandwidth), where the planner prices a step's
cache reads at it. The engine's real steps run; no timing asserts."""

from __future__ import annotations

import pytest

from hivekeeper.core.machine.detect import detect_hardware
from hivekeeper.core.machine.measure import (ATTENTION_KEYS, ATTENTION_KV_HEADS, ATTENTION_SHORT, TINY,
                                             attention_span_config, measure_decode_attention, run_benchmarks)
from hivekeeper.core.machine.measurement import ATTENTION_KEY
from hivekeeper.core.machine.profiles import apply_measurements
from hivekeeper.core.runtime.kernels import native_kernels


def test_the_span_holds_the_bytes_asked_or_four_caches():
    per_block = 2 * ATTENTION_KV_HEADS * 64 * 4 * ATTENTION_KEYS
    assert attention_span_config(10 * per_block, 0).num_layers == 10
    assert attention_span_config(per_block, 5 * per_block).num_layers == 20  # beyond 4x the last-level cache
    assert attention_span_config(1, 0).num_layers == 1


def test_the_rate_is_the_extra_bytes_over_the_median_difference():
    native_kernels.attention_bytes(reset=True)
    measured = measure_decode_attention(total_bytes=1, cache_bytes=0, pairs=3)
    assert measured.key == ATTENTION_KEY and measured.unit == "B/s"
    assert measured.repeats == len(measured.samples) == 3
    extra = 2 * ATTENTION_KV_HEADS * 64 * 4 * (ATTENTION_KEYS - ATTENTION_SHORT)  # one block
    assert f"{extra / 1e6:.3g} MB" in measured.detail
    if native_kernels.library() is not None:  # the steps ran the kernels' attention over the long cache
        assert native_kernels.attention_bytes() >= 4 * 2 * ATTENTION_KV_HEADS * 64 * 4 * ATTENTION_KEYS


def test_quick_measurements_carry_it_into_the_hardware():
    measurements = run_benchmarks(TINY, gpu=False)
    rate = next(m for m in measurements if m.key == ATTENTION_KEY)
    hardware = apply_measurements(detect_hardware(), measurements, when=1.7e9)
    assert hardware.cpu.decode_streaming.attention_bandwidth == pytest.approx(rate.value)
