"""The decode steps' streaming rate on a host whose speed swings (issue 14 item 12): the quick and the full
measurement read it five times spread over the measurement and keep the median reading, its block cost with it.
Nothing is timed: the readings are fed in."""

from __future__ import annotations

import pytest

from hivekeeper.core.machine import measure
from hivekeeper.core.machine.measure import (TINY, StreamReading, fold_stream_readings, median_reading,
                                             run_benchmarks)
from hivekeeper.core.machine.measurement import BLOCK_OVERHEAD_KEY, WEIGHT_STREAM_KEY, Measurement


def reading(gbps: float, block_ms: float) -> StreamReading:
    return StreamReading(gbps * 1e9, block_ms * 1e-3, [], [])


def test_the_median_reading_keeps_its_own_block_cost():
    readings = [reading(12.9, 0.12), reading(5.4, 0.25), reading(9.5, 0.15), reading(7.2, 0.23), reading(10.1, 0.2)]
    assert median_reading(readings) == readings[2]  # 9.5 GB/s with its 0.15 ms, not the median block cost (0.2)
    assert median_reading(readings[:4]) == readings[3]  # an even count: the lower middle one, a real reading
    assert median_reading([readings[0]]) == readings[0]
    with pytest.raises(ValueError):
        median_reading([])


def first_reading(gbps: float, block_ms: float) -> list[Measurement]:
    return [Measurement("ram_read", "RAM read", 20e9, "B/s", 0.0, 2, 0.5),
            Measurement(WEIGHT_STREAM_KEY, "decode weight streaming", gbps * 1e9, "B/s", 0.1, 4, 0.5,
                        "one-row decode steps", [gbps * 1e9] * 4),
            Measurement(BLOCK_OVERHEAD_KEY, "fixed cost of a block", block_ms * 1e-3, "s", 0.3, 4, 0.5, "fitted")]


def test_the_profile_keeps_the_median_of_the_first_reading_and_the_later_ones():
    """A lucky first reading (17.4 GB/s, as session 12's quick measurements read 8.8-17.4) no longer sets the plan."""
    later = [reading(9.1, 0.3), reading(10.2, 0.2), reading(8.8, 0.4), reading(11.0, 0.1)]
    folded = {m.key: m for m in fold_stream_readings(first_reading(17.4, 0.05), later)}
    stream, block = folded[WEIGHT_STREAM_KEY], folded[BLOCK_OVERHEAD_KEY]
    assert stream.value == pytest.approx(10.2e9) and block.value == pytest.approx(0.2e-3)
    assert stream.samples == pytest.approx([17.4e9, 9.1e9, 10.2e9, 8.8e9, 11.0e9]) and stream.repeats == 5
    assert stream.spread == pytest.approx((17.4 - 8.8) / 10.2)
    assert "median of 5 readings" in stream.detail and "17.4" in stream.detail and "median of 5" in block.detail
    assert folded["ram_read"] == first_reading(17.4, 0.05)[0]  # the rest untouched


def test_without_later_readings_or_decode_steps_nothing_changes():
    first = first_reading(12.0, 0.1)
    assert fold_stream_readings(first, []) == first
    assert fold_stream_readings(first[:1], [reading(9.0, 0.2)]) == first[:1]


def test_run_benchmarks_reads_the_rate_again_between_its_later_steps(monkeypatch, tmp_path):
    """Four more readings, after the decode steps, between the later steps (the disk here) and at the end; the saved
    rate is their median whatever the first (real) reading was: three of the four fed ones are equal."""
    fed = [reading(7.0, 0.3), reading(7.0, 0.3), reading(30.0, 0.01), reading(7.0, 0.3)]
    monkeypatch.setattr(measure, "stream_reading", lambda spans, repeats: fed.pop(0))
    labels = []
    results = {m.key: m for m in run_benchmarks(TINY, disk_folder=tmp_path, gpu=False,
                                                progress=lambda fraction, label: labels.append(label))}
    assert not fed
    assert results[WEIGHT_STREAM_KEY].value == pytest.approx(7e9)
    assert results[BLOCK_OVERHEAD_KEY].value == pytest.approx(0.3e-3)
    assert len(results[WEIGHT_STREAM_KEY].samples) == 5
    again = [i for i, label in enumerate(labels) if label == "CPU decode streaming, read again"]
    assert len(again) == 4 and again[0] > labels.index("CPU decode steps")
    assert again[0] < labels.index("disk") < again[-1] and labels[again[-1] + 1] == "done"
