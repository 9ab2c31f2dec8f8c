"""Measurements that hold on a host whose speed swings (issue 14 item 12, issue 23, session 11): the decode steps'
rates are the median of repeats timed in turn, with their range recorded in the profile; prefill passes through
the same spans give the runtime's own fp32 prefill rate and a block's fixed cost in a prefill, and a packed span's
prefill the int8 kernels' many-row rate; all three reach the planner. Nothing is timed: the timings are fed in."""

from __future__ import annotations

import pytest

from hivekeeper.core.machine import measure
from hivekeeper.core.machine.measure import fit_bytes_and_blocks, median_and_spread, prefill_measurements
from hivekeeper.core.machine.measurement import (BLOCK_OVERHEAD_KEY, PACKED_PREFILL_KEY, PREFILL_BLOCK_KEY,
                                                 PREFILL_FLOPS_KEY, PREFILL_HALF_ROWS_KEY, PREFILL_PEAK_KEY,
                                                 ROW_BLOCK_KEY, ROW_READS_AT_KEY, SMALL_ROWS_READS_KEY,
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
           "prefill": [[0.30, 0.35, 0.25], [0.65, 0.70, 0.60], [0.50, 0.40, 0.45], [0.90, 1.00, 0.80],
                       [1.10, 1.00, 1.05], [1.90, 2.00, 1.80]]}  # 48, 96 and 288 rows, the wide span's first
    step_calls = []

    def alternating(runs, repeats):
        if repeats == measure.PREFILL_REPEATS:
            return [list(s) for s in fed["prefill"]]
        step_calls.append(len(runs))
        return [list(s) for s in fed["steps"]]

    monkeypatch.setattr(measure, "_alternating_seconds", alternating)
    monkeypatch.setattr(measure, "_timings", lambda fn, repeats, device: [0.020, 0.022, 0.018, 0.020, 0.020])
    results = {m.key: m for m in measure.measure_decode_blocks(256, 2 << 20, repeats=4, cache_bytes=0,
                                                               step_repeats=4)}
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
    # ... at two row counts through both spans: the rate by rows at each width
    widths = (config_narrow.hidden_size, config_wide.hidden_size)
    assert all(results[f"{key}{w}"].value > 0 for key in (PREFILL_PEAK_KEY, PREFILL_HALF_ROWS_KEY) for w in widths)


def passes_of(curve: dict[int, tuple[float, float, int, int]], fixed_s: float, repeats: list[float]):
    """PrefillRun of two widths at every PREFILL_SEQUENCE_COUNTS row count, timed as the rate by rows says: each
    width (peak FLOP/s, half-rate rows, weights a block, blocks) takes FLOPs / peak + blocks x (2 W x half rows /
    peak + fixed_s), each repeat that time x its factor in `repeats`."""
    runs = []
    for sequences in measure.PREFILL_SEQUENCE_COUNTS:
        rows = sequences * measure.PREFILL_TOKENS
        for width, (peak, half_rows, weights, blocks) in curve.items():
            flops = blocks * 2.0 * weights * rows
            seconds = flops / peak + blocks * (2.0 * weights * half_rows / peak + fixed_s)
            runs.append(measure.PrefillRun([seconds * f for f in repeats], flops, blocks, rows, width, weights))
    return runs


def test_prefill_passes_at_two_row_counts_give_each_widths_rate_by_rows_and_a_blocks_fixed_cost():
    """Issue 23, session 16: passes of a wide and a thin span at two row counts each; per width seconds = FLOPs /
    peak + blocks x (2 W x half rows / peak + fixed cost) (the rate peak x rows / (rows + half rows)), from the
    medians of the repeats: one disturbed repeat moves nothing."""
    curve = {576: (120e9, 40.0, 3_500_000, 3), 2048: (190e9, 40.0, 45_000_000, 1)}
    runs = passes_of(curve, 0.4e-3, [1.0, 0.5, 1.01])  # one quiet instant among them
    fixed, fitted = measure.prefill_curve(runs)
    assert fixed == pytest.approx(0.4e-3, rel=1e-6)
    for width, (peak, half_rows, _, _) in curve.items():
        assert fitted[width] == (pytest.approx(peak, rel=1e-6), pytest.approx(half_rows, rel=1e-6))
    got = {m.key: m for m in prefill_measurements(runs, load=1.0)}
    assert got[PREFILL_BLOCK_KEY].value == pytest.approx(0.4e-3, rel=1e-6)
    assert got[f"{PREFILL_PEAK_KEY}576"].value == pytest.approx(120e9, rel=1e-6)
    assert got[f"{PREFILL_HALF_ROWS_KEY}2048"].value == pytest.approx(40.0, rel=1e-6)
    rows = measure.PREFILL_SEQUENCES * measure.PREFILL_TOKENS  # the FLOP/s shown: the wide width's at 96 rows
    assert got[PREFILL_FLOPS_KEY].value == pytest.approx(190e9 * rows / (rows + 40.0), rel=1e-6)
    # the fastest times alone would have fitted another machine
    fastest = [measure.PrefillRun([min(r.seconds)], r.flops, r.blocks, r.rows, r.hidden, r.block_weights)
               for r in runs]
    assert measure.prefill_curve(fastest)[1][2048][0] > 1.5 * 190e9
    # the spread shown is the repeats' range over their median (1.01 - 0.5), whatever the fixed cost fitted
    assert got[PREFILL_FLOPS_KEY].spread == pytest.approx((1 / 0.5 - 1 / 1.01) / 1.0, rel=1e-6)


def test_a_busy_fit_of_a_large_fixed_cost_shows_the_repeats_spread_not_a_runaway_one():
    """Session 22: a busy quick measurement fitted a prefill block's fixed cost near its passes' own time, and the
    shown spread, taken from each repeat less that cost, read 19768669886%. The fitted rate's samples scale with each
    repeat's time over the pass's median."""
    curve = {576: (120e9, 40.0, 3_500_000, 3), 2048: (190e9, 40.0, 45_000_000, 1)}
    runs = passes_of(curve, 0.07, [1.0, 0.9, 1.1])  # a 70 ms fixed cost: most of each pass
    got = {m.key: m for m in prefill_measurements(runs, load=1.0)}
    assert got[PREFILL_BLOCK_KEY].value == pytest.approx(0.07, rel=1e-6)
    assert got[PREFILL_FLOPS_KEY].spread == pytest.approx(1 / 0.9 - 1 / 1.1, rel=1e-6)
    assert max(got[PREFILL_FLOPS_KEY].samples) == pytest.approx(got[PREFILL_FLOPS_KEY].value / 0.9, rel=1e-6)


def test_each_widths_cost_beyond_its_flops_is_kept_whatever_share_the_fixed_cost_takes():
    """Thin blocks multiply slower at the same rows than wide ones (their own peak and half-rate rows). However the
    two widths' intercepts split into a block's fixed cost and half-rate rows, each width's time is kept (what a
    model of that width is priced at): where they leave no room for a fixed cost it is 0, not negative, and each
    width's intercept is its own half-rate rows."""
    for thin_half_rows, some_fixed in ((20.0, False), (90.0, True)):
        curve = {576: (80e9, thin_half_rows, 3_500_000, 3), 2048: (190e9, 40.0, 45_000_000, 1)}
        fixed, fitted = measure.prefill_curve(passes_of(curve, 0.0, [1.0]))
        assert (fixed > 0) == some_fixed and fixed >= 0
        for width, (peak, half_rows, weights, _) in curve.items():
            assert fitted[width][0] == pytest.approx(peak, rel=1e-6)
            assert 2 * weights * fitted[width][1] / peak + fixed == pytest.approx(2 * weights * half_rows / peak,
                                                                                  rel=1e-6)
        if not some_fixed:
            assert fitted[576][1] == pytest.approx(20.0, rel=1e-6) and fitted[2048][1] == pytest.approx(40.0)


def test_passes_noise_makes_unfittable_give_no_intercept_and_their_mean_rate():
    """A larger pass timed no slower than the smaller one, or a negative intercept: no intercept, the mean rate."""
    assert measure.rate_and_intercept([(0.2, 1e9), (0.19, 3e9)], 2) == (pytest.approx(4e9 / 0.39), 0.0)
    assert measure.rate_and_intercept([(0.005, 1e9), (0.025, 3e9)], 1) == (pytest.approx(4e9 / 0.03), 0.0)
    assert measure.rate_and_intercept([(0.03, 1e9), (0.05, 3e9)], 2) == (pytest.approx(1e11), pytest.approx(0.01))


def test_one_pass_at_a_swing_of_the_host_does_not_set_the_line():
    """Session 18: three row counts, the line by Theil-Sen. At 1e11 FLOP/s and 10 ms a block (2 blocks), passes of
    0.5, 1 and 3 GFLOP: the 1-GFLOP pass caught 40% slow leaves the rate and the intercept as they were (a line
    through the two-row-count passes it was fitted from before would have put the intercept at 17 ms and the rate
    at 1.7e11), and a swing of 10% in any one pass moves them by less than 20%."""
    clean = [(0.02 + f / 1e11, f) for f in (0.5e9, 1e9, 3e9)]
    assert measure.rate_and_intercept(clean, 2) == (pytest.approx(1e11), pytest.approx(0.01))
    slow = [clean[0], (clean[1][0] * 1.4, 1e9), clean[2]]
    assert measure.rate_and_intercept(slow, 2) == (pytest.approx(1e11), pytest.approx(0.01))
    two_point = measure.rate_and_intercept([slow[1], slow[2]], 2)
    assert two_point[0] > 1.6e11 and two_point[1] > 0.016
    for i in range(3):
        moved = [(t * 1.1 if j == i else t, f) for j, (t, f) in enumerate(clean)]
        rate, intercept = measure.rate_and_intercept(moved, 2)
        assert 0.8e11 < rate < 1.2e11 and 0.008 < intercept < 0.012


def measured(prefill_rate: float | None, prefill_block_s: float | None, packed_prefill: float | None, extra=(),
             apply: bool = True):
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
    records = [*records, *extra]
    return apply_measurements(get_hardware("cpu-generic"), records, when=1.7e9) if apply else records


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


WIDE = ModelSpec("wide", "llama", 2, 2048, 5632, 32, 8, 64, 8192, False, 8192)


def model_prefill_s(model: ModelSpec, hardware, prompt_len: int, batch: int) -> float:
    policy = Policy(weight_format="fp32", weights=RAM, kv_cache=RAM, activations=RAM, micro_batch_size=batch)
    return evaluate(model, hardware, policy, Workload(prompt_len=prompt_len, output_len=2),
                    measured_efficiency(hardware)).prefill_s


def test_passes_at_two_row_counts_reach_the_planner_and_price_a_third_as_the_machine_runs_it():
    """Issue 23, session 16, the whole way: passes timed as a machine whose rate rises with the rows (the widths'
    own curves, a block 0.3 ms) -> the measurements -> the profile's hardware -> the planner, which prices the thin
    and the wide models at 32 rows and at 1536 (rows no pass ran) as the hardware built from the true curves does.
    The one rate fitted to the 96-row passes alone (before session 16) misses both by more than 10%."""
    curve = {576: (170e9, 45.0, 3_538_944, 3), 2048: (190e9, 48.0, 45_088_768, 1)}
    runs = passes_of(curve, 0.3e-3, [1.0, 1.02, 0.99])
    measured_hw = apply_measurements(get_hardware("cpu-generic"),
                                     measured(None, None, None, apply=False) + prefill_measurements(runs, 1.0),
                                     when=1.7e9)
    rates = measured_hw.cpu.decode_streaming.prefill_rates
    assert [r.hidden for r in rates] == [576, 2048]
    assert [r.peak_flops for r in rates] == [pytest.approx(c[0], rel=1e-6) for c in curve.values()]
    again = hardware_from_dict(hardware_to_json(measured_hw))
    assert again.cpu.decode_streaming.prefill_rates == rates  # and a hardware file carries them
    few = [r for r in runs if r.rows == measure.PREFILL_SEQUENCES * measure.PREFILL_TOKENS]
    per_block, one_rate = fit_bytes_and_blocks(*((r.median_s, r.flops, r.blocks) for r in few))
    old_hw = measured(one_rate, per_block, None)
    for model in (THIN, WIDE):
        old_misses = []
        for prompt_len, batch in ((32, 1), (24, 64)):
            new, old = (model_prefill_s(model, hw, prompt_len, batch) for hw in (again, old_hw))
            truth = model_prefill_s(model, truth_hardware(measured_hw, curve, 0.3e-3), prompt_len, batch)
            assert new == pytest.approx(truth, rel=0.01)
            old_misses.append(abs(old / truth - 1))
        assert min(old_misses) > 0.1


def truth_hardware(hardware, curve: dict, fixed_s: float):
    """`hardware` with the true rates by rows and block cost in place of the measured ones."""
    import dataclasses

    from hivekeeper.planner.hardware import PrefillRate

    streaming = dataclasses.replace(hardware.cpu.decode_streaming, prefill_block_overhead_s=fixed_s,
                                    prefill_rates=tuple(PrefillRate(w, c[0], c[1]) for w, c in curve.items()))
    return dataclasses.replace(hardware, cpu=dataclasses.replace(hardware.cpu, decode_streaming=streaming))
