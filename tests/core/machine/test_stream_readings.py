"""The decode steps' streaming rate on a host whose speed swings (issue 14 item 12): the quick and the full
measurement read it five times spread over the measurement and keep the fit of each span's median step.
Nothing is timed: the readings are fed in."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hivekeeper.core.machine import measure
from hivekeeper.core.machine.measure import (TINY, StreamReading, fit_bytes_and_blocks, fold_stream_readings,
                                             pooled_reading)
from hivekeeper.core.machine.measurement import BLOCK_OVERHEAD_KEY, WEIGHT_STREAM_KEY, Measurement


def reading(gbps: float, block_ms: float) -> StreamReading:
    return StreamReading(gbps * 1e9, block_ms * 1e-3, [], [])


SHAPES = ((210e6, 17), (210e6, 90))  # the quick measurement's spans here: 17 blocks of 1024, 90 of 384, 210 MB each


def test_readings_are_pooled_by_each_spans_median_step_and_fitted_again():
    """Five readings as one quick measurement read them (session 13, load 6: 15.2, 8.9, 9.5, 10.5, 13.9 GB/s), one of
    them (the second) with a block cost its slow narrow steps blew up: the pooled fit is the fit of the median
    steps, a consistent rate and cost that no single reading's noise sets."""
    readings = [reading(15.2, 0.10), reading(8.9, 0.60), reading(9.5, 0.15), reading(10.5, 0.12), reading(13.9, 0.2)]
    pooled = pooled_reading(readings, SHAPES)
    wide = sorted(210e6 / r.bandwidth + 17 * r.per_block for r in readings)[2]
    narrow = sorted(210e6 / r.bandwidth + 90 * r.per_block for r in readings)[2]
    per_block, rate = fit_bytes_and_blocks((wide, *SHAPES[0]), (narrow, *SHAPES[1]))
    assert (pooled.bandwidth, pooled.per_block) == (pytest.approx(rate), pytest.approx(per_block))
    assert 9.5e9 < pooled.bandwidth < 13.9e9 and 0.1e-3 < pooled.per_block < 0.2e-3
    # readings that agree pool to themselves; one reading is itself
    same = pooled_reading([reading(10.0, 0.2)] * 3, SHAPES)
    assert (same.bandwidth, same.per_block) == (pytest.approx(10e9), pytest.approx(0.2e-3))
    with pytest.raises(ValueError):
        pooled_reading([], SHAPES)


def first_reading(gbps: float, block_ms: float) -> list[Measurement]:
    return [Measurement("ram_read", "RAM read", 20e9, "B/s", 0.0, 2, 0.5),
            Measurement(WEIGHT_STREAM_KEY, "decode weight streaming", gbps * 1e9, "B/s", 0.1, 4, 0.5,
                        "one-row decode steps", [gbps * 1e9] * 4),
            Measurement(BLOCK_OVERHEAD_KEY, "fixed cost of a block", block_ms * 1e-3, "s", 0.3, 4, 0.5, "fitted")]


def test_the_profile_keeps_the_pooled_fit_of_the_first_reading_and_the_later_ones():
    """A lucky first reading (17.4 GB/s, as session 12's quick measurements read 8.8-17.4) no longer sets the plan."""
    later = [reading(9.1, 0.2), reading(10.2, 0.2), reading(8.8, 0.2), reading(11.0, 0.2)]
    folded = {m.key: m for m in fold_stream_readings(first_reading(17.4, 0.2), later, SHAPES)}
    stream, block = folded[WEIGHT_STREAM_KEY], folded[BLOCK_OVERHEAD_KEY]
    assert stream.value == pytest.approx(10.2e9) and block.value == pytest.approx(0.2e-3)
    assert stream.samples == pytest.approx([17.4e9, 9.1e9, 10.2e9, 8.8e9, 11.0e9]) and stream.repeats == 5
    assert stream.spread == pytest.approx((17.4 - 8.8) / 10.2)
    assert "median steps of 5 readings" in stream.detail and "17.4 GB/s" in stream.detail
    assert "median steps of 5" in block.detail
    assert folded["ram_read"] == first_reading(17.4, 0.2)[0]  # the rest untouched


def test_without_later_readings_or_decode_steps_nothing_changes():
    first = first_reading(12.0, 0.1)
    assert fold_stream_readings(first, [], SHAPES) == first
    assert fold_stream_readings(first[:1], [reading(9.0, 0.2)], SHAPES) == first[:1]


def test_plan_hardware_auto_plans_with_the_pooled_readings(monkeypatch, tmp_path, cli):
    """Through the user's command: the first `plan --hardware auto` on a machine never measured measures it (here
    at TINY's sizes, the later readings fed in: four, after the decode steps' own, between the later steps and last
    before the packed spans' second reading, each of which fits its own block cost), saves the median reading in its
    profile, whatever the first (real) one was (three of the four fed are equal, so both spans' median steps are
    theirs), and plans with it (a second plan from the saved profile predicts the same); the lucky reading (30 GB/s)
    would have planned decode about four times faster (with the FLOP/s raised in both, so that the reads decide)."""
    from hivekeeper.core.machine.measurement import PREFILL_FLOPS_KEY
    from hivekeeper.core.machine.profiles import load_profile, save_profile

    fed = [reading(7.0, 0.02), reading(30.0, 0.01), reading(7.0, 0.02), reading(7.0, 0.02)]
    packed_with = []  # the packed spans' arguments (they fit a packed block's cost themselves: none passed in)
    monkeypatch.setattr(measure, "QUICK", replace(TINY, packed_hidden=256))
    few = []  # the rows of the few-row steps each later reading times with its one-row ones
    monkeypatch.setattr(measure, "stream_reading", lambda spans, repeats, rows=(): few.append(rows) or fed.pop(0))
    monkeypatch.setattr(measure, "measure_packed_kernels", lambda *args: packed_with.append(args) or [])
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path))
    (tmp_path / "data").mkdir()
    monkeypatch.setenv("HIVEKEEPER_DATA_DIR", str(tmp_path / "data"))  # a data folder: its disk is measured too
    plan = ("plan", "--model", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--hardware", "auto", "--json")
    first = cli(*plan)
    assert first.returncode == 0 and "measured it quickly" in first.stderr, first.stderr
    steps = [line.split("%", 1)[1].strip() for line in first.stderr.splitlines() if line.strip()[:1].isdigit()]
    again_at = [i for i, step in enumerate(steps) if step == "CPU decode streaming, read again"]
    assert not fed and len(again_at) == 4 and again_at[0] > steps.index("CPU decode steps")
    assert few == [(measure.FEW_ROWS, measure.PACKED_KERNEL_ROWS)] * 4 == [(4, 8)] * 4
    assert steps.index("CPU decode steps") < steps.index("CPU packed-format decode steps") < again_at[0]
    packed_at = [i for i, step in enumerate(steps) if step == "CPU packed-format decode steps, read again"]
    assert again_at[0] < packed_at[0] < steps.index("disk") < again_at[-1] < packed_at[1] and len(packed_at) == 2
    assert steps[-1] == "done" and len(packed_with) == 3 and all(0.02e-3 not in args for args in packed_with)
    # the prefill passes read twice more (session 19), in the middle and right before the pool
    prefill_at = [i for i, step in enumerate(steps) if step == "CPU prefill passes, read again"]
    assert len(prefill_at) == 2 and again_at[0] < prefill_at[0] < steps.index("disk") < prefill_at[1]
    assert prefill_at[1] == again_at[-1] - 1
    (path,) = (tmp_path / "profiles").glob("*.json")
    profile = load_profile(path)
    assert "read 3 times over the measurement" in profile.measurement(PREFILL_FLOPS_KEY).detail
    assert profile.measurement(WEIGHT_STREAM_KEY).value == pytest.approx(7e9)
    assert profile.measurement(BLOCK_OVERHEAD_KEY).value == pytest.approx(0.02e-3)
    again = cli(*plan)
    assert "measured it quickly" not in again.stderr
    assert json.loads(again.stdout)["decode_tokens_per_s"] == json.loads(first.stdout)["decode_tokens_per_s"]

    def decode_with(gbps: float) -> float:
        values = {WEIGHT_STREAM_KEY: gbps * 1e9, PREFILL_FLOPS_KEY: 1e13}
        profile.measurements = [replace(m, value=values.get(m.key, m.value)) for m in profile.measurements]
        save_profile(profile, path)
        return json.loads(cli(*plan).stdout)["decode_tokens_per_s"]

    assert decode_with(30.0) > 3.5 * decode_with(7.0)


def test_a_few_row_steps_reads_are_the_median_of_every_readings():
    """Session 17: each later reading times the few-row steps with its one-row ones, and each width's reads are the
    median of the five readings' (each over the one-row step of its own moment), at least 1; the older profiles' one
    figure follows the wide span's 4-row reads; a key no later reading timed keeps the first reading's."""
    from hivekeeper.core.machine.measurement import ROW_READS_AT_KEY, SMALL_ROWS_READS_KEY

    wide4, thin4, thin8 = (f"{ROW_READS_AT_KEY}{key}" for key in ("2048x4", "576x4", "576x8"))
    reads = [Measurement(SMALL_ROWS_READS_KEY, "4-row reads", 2.0, "x", 0.1, 7, 0.5, "wide span"),
             Measurement(wide4, "4-row reads, 2048 wide", 2.0, "x", 0.1, 7, 0.5, "wide span"),
             Measurement(thin4, "4-row reads, 576 wide", 1.9, "x", 0.1, 7, 0.5, "thin span"),
             Measurement(thin8, "8-row reads, 576 wide", 2.5, "x", 0.1, 7, 0.5, "thin span")]
    later = [replace(reading(9.1, 0.2), reads={wide4: 1.6, thin4: 1.4}), replace(reading(10.2, 0.2), reads={
        wide4: 1.5, thin4: 1.3}), replace(reading(8.8, 0.2), reads={wide4: 1.7, thin4: 0.9}),
        replace(reading(11.0, 0.2), reads={wide4: 1.8, thin4: 0.8})]
    folded = {m.key: m for m in fold_stream_readings(first_reading(17.4, 0.2) + reads, later, SHAPES)}
    assert folded[wide4].value == pytest.approx(1.7) and folded[wide4].samples == [2.0, 1.6, 1.5, 1.7, 1.8]
    assert folded[thin4].value == pytest.approx(1.3) and folded[thin4].spread == pytest.approx((1.9 - 0.8) / 1.3)
    assert folded[SMALL_ROWS_READS_KEY].value == pytest.approx(1.7) and folded[SMALL_ROWS_READS_KEY].repeats == 5
    assert "median of 5 readings" in folded[wide4].detail
    assert folded[thin8] == reads[3]  # no later reading timed it
    low = [replace(reading(10.0, 0.2), reads={thin4: 0.9})] * 4
    assert {m.key: m for m in fold_stream_readings(first_reading(17.4, 0.2) + reads, low, SHAPES)}[thin4].value == 1.0


def test_the_packed_rates_are_the_median_of_three_readings_samples():
    """Session 19: the packed kernels are read early, in the middle and last; each figure is the median of the three
    readings' samples, so one reading in a slow spell of the host (27 G weights/s where the others read 39-40) does
    not set it; a cost stays at least 0; a key only a later reading has is added."""
    from hivekeeper.core.machine.measure import pool_packed

    def rate(value: float, key: str = "cpu_packed_kernel_q4_1") -> Measurement:
        return Measurement(key, "q4_1 kernel", value, "weights/s", 0.0, 9, 1.0, "packed spans", [value] * 9)

    cost = Measurement("cpu_packed_block_overhead", "packed block", 0.05e-3, "s", 0.0, 3, 1.0, "fit",
                       [-0.2e-3, -0.1e-3, 0.05e-3])
    results = [rate(27e9), cost]
    later_cost = replace(cost, samples=[-0.3e-3, -0.2e-3, 0.0])
    assert pool_packed(results, [[rate(40e9), later_cost], [rate(39e9), later_cost, rate(30e9, "cpu_packed_new")]]) == []
    pooled = {m.key: m for m in results}
    assert pooled["cpu_packed_kernel_q4_1"].value == 39e9 and pooled["cpu_packed_kernel_q4_1"].repeats == 27
    assert "read 3 times over the measurement (2.7e+10, 4e+10, 3.9e+10)" in pooled["cpu_packed_kernel_q4_1"].detail
    assert pooled["cpu_packed_block_overhead"].value == 0.0  # the samples' median is below 0
    assert pooled["cpu_packed_new"].value == 30e9 and len(results) == 3
