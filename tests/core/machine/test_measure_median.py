"""Measurements that hold on a host whose speed swings (issue 14 item 12, issue 23, session 11): the decode steps'
rates are the median of repeats timed in turn, with their range recorded in the profile; prefill passes through
the same spans give the runtime's own fp32 prefill rate and a block's fixed cost in a prefill, and a packed span's
prefill the int8 kernels' many-row rate; all three reach the planner. Nothing is timed: the timings are fed in."""

from __future__ import annotations

import pytest

from hivekeeper.core.machine import measure
from hivekeeper.core.machine.measure import fit_bytes_and_blocks, median_and_spread, prefill_measurements
from hivekeeper.core.machine.measurement import (BLOCK_OVERHEAD_KEY, PACKED_PREFILL_KEY, PREFILL_BLOCK_KEY,
                                                 PREFILL_FLOPS_KEY, ROW_BLOCK_KEY, ROW_READS_AT_KEY,
                                                 SMALL_ROWS_READS_KEY,
                                                 WEIGHT_STREAM_KEY,
                                                 WEIGHTS_PER_S, Measurement)
from hivekeeper.core.machine.profiles import apply_measurements
from hivekeeper.planner.calibration import measured_efficiency
from hivekeeper.planner.costmodel import Placement, Policy, Workload, evaluate
from hivekeeper.planner.hardware_catalog import get_hardware, hardware_from_dict, hardware_to_json
from hivekeeper.planner.models import ModelSpec


def test_the_median_of_readings_and_their_range_over_it():
    assert median_and_spread([10.0, 14.0, 12.0]) == (12.0, pytest.approx(4 / 12))
    assert median_and_spread([9.8, 19.8, 11.4, 14.1]) == (pytest.approx(12.75), pytest.approx(10 / 12.75))
    assert median_and_spread([5.0]) == (5.0, 0.0)
    # one lucky instant moves the best reading, not the median
    assert median_and_spread([10.0, 10.5, 11.0, 10.2, 30.0])[0] == 10.5
    with pytest.raises(ValueError):
        median_and_spread([])


def test_the_decode_steps_rate_is_fitted_to_the_median_steps_of_spans_timed_in_turn(monkeypatch):
    """The two spans' steps alternate and the fit takes each span's median step: one disturbed repeat (here the
    fastest, as a quiet instant on a busy host) moves neither the rate nor the block cost, and the range of the
    repeats' rates is the recorded spread."""
    config_wide, wide = measure.decode_span(256, 2 << 20)
    config_narrow, narrow = measure.decode_span(64 * max(1, 256 * 3 // 8 // 64), 2 << 20)
    wide_bytes, narrow_bytes = (sum(p.numel() * 4 for p in s.parameters()) for s in (wide, narrow))
    per_block, bandwidth = fit_bytes_and_blocks((0.010, wide_bytes, config_wide.num_layers),
                                                (0.030, narrow_bytes, config_narrow.num_layers))
    # the 4-row steps: the wide span's weights read 1.8 times, the narrow span's 1.4 times; 8 rows 2.5 and 2.2
    four, eight = ([reads * b / bandwidth + n * per_block
                    for reads, b, n in ((wide_reads, wide_bytes, config_wide.num_layers),
                                        (narrow_reads, narrow_bytes, config_narrow.num_layers))]
                   for wide_reads, narrow_reads in ((1.8, 1.4), (2.5, 2.2)))
    fed = {"steps": [[0.010, 0.012, 0.006, 0.011, 0.010], [0.030, 0.031, 0.029, 0.040, 0.030],
                     [four[0], four[0] * 3, four[0] * 0.9, four[0], four[0]],
                     [four[1] * 1.05, four[1], four[1] * 0.5, four[1], four[1]],
                     [eight[0]] * 5, [eight[1]] * 5],
           "prefill": [[0.50, 0.40, 0.45], [0.90, 1.00, 0.80]]}
    step_calls = []

    def alternating(runs, repeats):
        if repeats == measure.PREFILL_REPEATS:
            return [list(s) for s in fed["prefill"]]
        step_calls.append(len(runs))
        return [list(s) for s in fed["steps"]]

    monkeypatch.setattr(measure, "_alternating_seconds", alternating)
    monkeypatch.setattr(measure, "_timings", lambda fn, repeats, device: [0.020, 0.022, 0.018, 0.020, 0.020])
    results = {m.key: m for m in measure.measure_decode_blocks(256, 2 << 20, repeats=5, cache_bytes=0,
                                                               step_repeats=5)}
    stream = results[WEIGHT_STREAM_KEY]
    assert stream.value == pytest.approx(bandwidth) and results[BLOCK_OVERHEAD_KEY].value == pytest.approx(per_block)
    assert stream.samples and (stream.value, stream.spread) == (pytest.approx(bandwidth),
                                                                pytest.approx(median_and_spread(stream.samples)[1]))
    assert "median" in stream.detail and "in turn" in stream.detail
    # the 4-row steps of both spans, in turn with the one-row ones, on their medians: the reads of each width apart,
    # the wide one's also as the one figure of older profiles; no per-row block cost (it is in each width's reads)
    assert step_calls == [6]
    for width, rows, reads in ((config_wide.hidden_size, 4, 1.8), (config_narrow.hidden_size, 4, 1.4),
                               (config_wide.hidden_size, 8, 2.5), (config_narrow.hidden_size, 8, 2.2)):
        assert results[f"{ROW_READS_AT_KEY}{width}x{rows}"].value == pytest.approx(reads, rel=1e-6)
    assert results[SMALL_ROWS_READS_KEY].value == pytest.approx(1.8, rel=1e-6)
    assert ROW_BLOCK_KEY not in results
    # the prefill passes, fitted on their medians too
    assert results[PREFILL_FLOPS_KEY].unit == "FLOP/s" and results[PREFILL_FLOPS_KEY].value > 0
    assert results[PREFILL_BLOCK_KEY].unit == "s" and "0.45" not in results[PREFILL_FLOPS_KEY].detail


def test_prefill_passes_give_the_rate_and_a_blocks_fixed_cost_from_their_medians():
    """Two passes of the same FLOPs, 2 wide blocks and 16 narrow ones: seconds = FLOPs / rate + blocks x cost."""
    flops, rate, cost = 8e9, 40e9, 5e-3
    wide_s, narrow_s = flops / rate + 2 * cost, flops / rate + 16 * cost
    wide = ([wide_s, wide_s * 0.5, wide_s * 1.02], flops, 2)  # one quiet instant among them
    narrow = ([narrow_s * 1.01, narrow_s, narrow_s * 3], flops, 16)  # and one busy one
    got = {m.key: m for m in prefill_measurements(wide, narrow, load=1.0, spans="test")}
    assert got[PREFILL_FLOPS_KEY].value == pytest.approx(rate, rel=0.03)
    assert got[PREFILL_BLOCK_KEY].value == pytest.approx(cost, rel=0.05)
    # the fastest times alone would have fitted another machine
    fastest_cost, fastest_rate = fit_bytes_and_blocks((min(wide[0]), flops, 2), (min(narrow[0]), flops, 16))
    assert abs(fastest_rate - rate) > 0.3 * rate


def measured(prefill_rate: float | None, prefill_block_s: float | None, packed_prefill: float | None, extra=()):
    records = [Measurement("ram_read", "RAM read", 20e9, "B/s", 0.0, 3, 0.0),
               Measurement("cpu_matmul_fp32_prefill", "fp32 matmul", 9e9, "FLOP/s", 0.0, 3, 0.0),
               Measurement(WEIGHT_STREAM_KEY, "decode weight streaming", 15e9, "B/s", 0.2, 5, 0.0),
               Measurement(BLOCK_OVERHEAD_KEY, "fixed cost of a block", 0.1e-3, "s", 0.0, 5, 0.0),
               Measurement(SMALL_ROWS_READS_KEY, "4-row reads", 2.0, "x", 0.0, 5, 0.0)]
    if prefill_rate is not None:
        records += [Measurement(PREFILL_FLOPS_KEY, "fp32 prefill", prefill_rate, "FLOP/s", 0.1, 3, 0.0,
                                "prefill passes through decoder blocks"),
                    Measurement(PREFILL_BLOCK_KEY, "prefill block", prefill_block_s, "s", 0.0, 3, 0.0)]
    if packed_prefill is not None:
        records.append(Measurement(f"{PACKED_PREFILL_KEY}q4_1", "q4_1 prefill", packed_prefill, WEIGHTS_PER_S,
                                   0.1, 3, 0.0))
    return apply_measurements(get_hardware("cpu-generic"), [*records, *extra], when=1.7e9)


THIN = ModelSpec("thin", "llama", 30, 576, 1536, 9, 3, 64, 49152, True, 8192)
RAM = Placement(gpu=0.0, cpu=1.0, disk=0.0)


def planned_prefill_s(hardware, weight_format: str = "fp32") -> float:
    policy = Policy(weight_format=weight_format, weights=RAM, kv_cache=RAM, activations=RAM)
    return evaluate(THIN, hardware, policy, Workload(prompt_len=96, output_len=2),
                    measured_efficiency(hardware)).prefill_s


def test_the_prefill_passes_set_the_planners_fp32_rate_and_prefill_block_cost():
    without, passes = measured(None, None, None), measured(36e9, 2e-3, None)
    assert without.cpu.flops["fp32"] == 9e9 and passes.cpu.flops["fp32"] == 36e9  # the runtime's path wins
    assert "prefill passes" not in without.cpu.sources["flops"] and "prefill passes" in passes.cpu.sources["flops"]
    assert measured_efficiency(passes).accelerator.prefill_layer_overhead_s == pytest.approx(2e-3)
    assert measured_efficiency(without).accelerator.prefill_layer_overhead_s == pytest.approx(3e-3)  # the default
    assert planned_prefill_s(passes) < planned_prefill_s(without) / 2
    # a hardware file carries the prefill block cost as the saved profile does
    again = hardware_from_dict(hardware_to_json(passes))
    assert again.cpu.decode_streaming.prefill_block_overhead_s == pytest.approx(2e-3)
    assert planned_prefill_s(again) == pytest.approx(planned_prefill_s(passes))


def test_a_packed_spans_prefill_sets_the_packed_prefill_rate():
    slow, fast = measured(36e9, 1e-3, 5e9), measured(36e9, 1e-3, 40e9)
    assert slow.cpu.packed_prefill == {"q4_1": 5e9} and fast.cpu.packed_prefill == {"q4_1": 40e9}
    assert planned_prefill_s(fast, "q4_1") < planned_prefill_s(slow, "q4_1") / 3


def test_a_few_row_steps_reads_are_what_it_takes_beyond_its_blocks_fixed_cost_over_its_one_row_reads():
    """measure.row_reads: 30 blocks of 0.4 ms fixed cost, 400 MB at 20 GB/s (20 ms of reads): a 4-row step of
    42 ms read the weights 1.5 times; one faster than its one-row reads (noise) reads them once, not less."""
    assert measure.row_reads(0.020 * 1.5 + 30 * 0.4e-3, 400e6, 30, 0.4e-3, 20e9) == pytest.approx(1.5)
    assert measure.row_reads(0.015, 400e6, 30, 0.4e-3, 20e9) == 1.0


def test_the_reads_of_each_width_reach_the_plan():
    """The measurement's ROW_READS_AT_KEY results become the profile's per-width table (profiles.decode_streaming)
    and the efficiency the planner prices a model's few-row step with, at the model's width."""
    records = [Measurement(f"{ROW_READS_AT_KEY}2048x4", "4-row reads, 2048 wide", 1.9, "x", 0.0, 5, 0.0),
               Measurement(f"{ROW_READS_AT_KEY}576x4", "4-row reads, 576 wide", 1.4, "x", 0.0, 5, 0.0),
               Measurement(f"{ROW_READS_AT_KEY}576x8", "8-row reads, 576 wide", 2.6, "x", 0.0, 5, 0.0)]
    hardware = measured(36e9, 1e-3, None, records)
    assert hardware.cpu.decode_streaming.row_reads_by_width == ((576, 4, 1.4), (576, 8, 2.6), (2048, 4, 1.9))
    eff = measured_efficiency(hardware).accelerator
    assert (eff.reread_rows_at(576), eff.reread_rows_at(2048)) == (pytest.approx(1.4), pytest.approx(1.9))
    assert eff.reread_rows_at(576, 8) == pytest.approx(2.6)
    assert measured(36e9, 1e-3, None).cpu.decode_streaming.row_reads_by_width == ()  # not measured: none
