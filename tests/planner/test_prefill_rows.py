"""Issue 23, session 16: a CPU's fp32 prefill rate by rows and block width (hardware.PrefillRate, measured by
`hivekeeper measure` at two row counts through a thin and a wide span): the cost model prices a prefill of m rows a
product, and a decode micro-batch beyond the kernels' rows, at peak x m / (m + half rows) of the model's width; the
calibration's prefill factors keep their meaning; hardware files carry the rates. Every figure is fed in."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hivekeeper.planner.calibration import ProfilePoint, fit_efficiency, measured_efficiency, predict_points
from hivekeeper.planner.costmodel import PACKED_KERNEL_ROWS, Placement, Policy, Workload, prefill_rate_at, run_terms
from hivekeeper.planner.efficiency import MachineEfficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import DecodeStreaming, PrefillRate
from hivekeeper.planner.hardware_catalog import get_hardware, hardware_from_dict, hardware_to_json
from hivekeeper.planner.models import ModelSpec

THIN = ModelSpec("thin", "llama", 30, 576, 1536, 9, 3, 64, 49152, True, 2048)
WIDE = ModelSpec("wide", "llama", 2, 2048, 5632, 32, 8, 64, 8192, False, 2048)
MIDDLE = ModelSpec("middle", "llama", 16, 1024, 2816, 16, 4, 64, 8192, False, 2048)
RATES = (PrefillRate(576, 120e9, 70.0), PrefillRate(2048, 190e9, 45.0))
RAM = Placement(gpu=0.0, cpu=1.0, disk=0.0)


def measured_cpu(rates: tuple[PrefillRate, ...] = RATES, prefill_block_s: float = 0.2e-3):
    """A CPU as `hivekeeper measure` leaves it: decode steps measured, prefill passes with a block's fixed cost
    `prefill_block_s` and the fp32 rate by rows `rates` (() : a profile from before session 16, one rate)."""
    generic = get_hardware("cpu-generic")
    streaming = DecodeStreaming(0.8, 1.5, 0.0, block_overhead_s=0.3e-3, prefill_block_overhead_s=prefill_block_s,
                                row_block_overhead_s=0.1e-3, prefill_rates=rates)
    cpu = dataclasses.replace(generic.cpu, flops={"fp32": 130e9}, decode_streaming=streaming,
                              sources={**generic.cpu.sources, "flops": "measured: prefill passes"})
    return dataclasses.replace(generic, cpu=cpu)


def prefill_terms(model: ModelSpec, hardware, prompt_len: int, batch: int, eff: MachineEfficiency | None = None):
    policy = Policy("fp32", weights=RAM, kv_cache=RAM, activations=RAM, micro_batch_size=batch)
    return run_terms(model, hardware, policy, Workload(prompt_len=prompt_len, output_len=2),
                     eff or measured_efficiency(hardware))


def rate(entry: PrefillRate, rows: float) -> float:
    return entry.peak_flops * rows / (rows + entry.half_rows)


@pytest.mark.parametrize("model, entry", [(THIN, RATES[0]), (WIDE, RATES[1])], ids=["thin", "wide"])
def test_a_prefills_time_per_flop_follows_its_widths_measured_rate_by_rows(model, entry):
    """16 prompts of 32 tokens (512 rows a product) against one (32 rows): 16 times the FLOPs, at the rate of 512
    rows rather than of 32. With one FLOP rate (a profile before session 16) the time was 16 times, whatever the
    rows: the wide model's 32-row prefills were predicted 0.68x their time, its 384-512-row ones 1.22-1.26x."""
    few, many = (prefill_terms(model, measured_cpu(), 32, b)["prefill"]["blocks_compute_s"] for b in (1, 16))
    assert many / few == pytest.approx(16 * rate(entry, 32) / rate(entry, 512), rel=1e-9)
    assert many / few < 16 * 0.7
    old_few, old_many = (prefill_terms(model, measured_cpu(()), 32, b)["prefill"]["blocks_compute_s"]
                         for b in (1, 16))
    assert old_many / old_few == pytest.approx(16, rel=1e-9)


def test_a_decode_micro_batch_beyond_the_kernels_rows_is_priced_at_the_rate_of_its_rows():
    """A decode step of more rows than the kernels take runs as a prefill of that many rows: 64 rows at the rate of
    64, 16 at that of 16; within the kernels' rows the rate by rows plays no part."""
    def compute_s(hardware, rows: int) -> float:
        return prefill_terms(WIDE, hardware, 8, rows)["decode_step"]["blocks_compute_s"]

    curve, flat = measured_cpu(), measured_cpu(())
    ratio = compute_s(curve, 64) / compute_s(curve, 16)
    # the attention's FLOPs grow with the rows as the products' do: the ratio is the rows' and the rates'
    assert ratio == pytest.approx(4 * rate(RATES[1], 16) / rate(RATES[1], 64), rel=1e-6)
    assert compute_s(flat, 64) / compute_s(flat, 16) == pytest.approx(4, rel=1e-6)
    for rows in (1, 4, PACKED_KERNEL_ROWS):
        assert compute_s(curve, rows) == compute_s(flat, rows)


def test_a_model_is_priced_at_its_own_widths_rate_between_the_measured_ones_on_a_log_scale():
    """The thin model takes the thin span's rate, the wide one the wide span's; a width between them the rates
    interpolated on a log scale of width; one beyond them the nearest one's."""
    assert prefill_rate_at(RATES, 576) == (120e9, 70.0) and prefill_rate_at(RATES, 2048) == (190e9, 45.0)
    assert prefill_rate_at(RATES, 256) == (120e9, 70.0) and prefill_rate_at(RATES, 8192) == (190e9, 45.0)
    t = math.log(1024 / 576) / math.log(2048 / 576)
    peak, half_rows = prefill_rate_at(tuple(reversed(RATES)), 1024)
    assert peak == pytest.approx(120e9 + t * 70e9) and half_rows == pytest.approx(70 - t * 25)
    # a change to the wide span's rate moves the wide and middle models' prefills, not the thin one's
    faster_wide = (RATES[0], PrefillRate(2048, 380e9, 45.0))
    for model, moves in ((THIN, False), (MIDDLE, True), (WIDE, True)):
        before, after = (prefill_terms(model, measured_cpu(r), 96, 1)["prefill"]["blocks_compute_s"]
                         for r in (RATES, faster_wide))
        assert (after < before * 0.99) == moves and after <= before


def profile_of(model: ModelSpec, hardware, truth: MachineEfficiency) -> list[ProfilePoint]:
    """The calibration grid of calibration_accuracy --fast (16 and 96 tokens, batch 1, 2 and 4), its times from the
    cost model with the `truth` factors."""
    shells = [ProfilePoint(p, o, b, prefill_s=1.0, step_s=1.0 if o > 1 else None, runtime_s=1.0)
              for p in (16, 96) for o in (1, 8) for b in (1, 2, 4)]
    resident = Policy("fp32", weights=RAM, kv_cache=RAM, activations=RAM, prefetch_depth=0)
    prefill, step = predict_points(model, hardware, shells, {"resident": resident}, truth)
    return [dataclasses.replace(pt, prefill_s=pre, step_s=st if pt.step_s else None, runtime_s=pre)
            for pt, pre, st in zip(shells, prefill, step)]


def test_the_calibration_fits_the_prefill_as_a_fraction_of_the_rate_by_rows_and_a_blocks_fixed_cost():
    """The prefill factors keep their meaning under the rate by rows: matmul_fraction scales the whole measured
    curve, prefill_layer_overhead_s is a block's cost beyond it. A thin model's profile whose prefills ran at 80%
    of the measured curve with 0.5 ms a block is fitted to that, and the wide model is then predicted right at 32
    and at 1536 rows (rows the profile never ran)."""
    hardware = measured_cpu()
    base = measured_efficiency(hardware)
    acc = dataclasses.replace(base.accelerator, matmul_fraction=0.8, prefill_layer_overhead_s=0.5e-3)
    truth = MachineEfficiency(acc, acc)
    resident = Policy("fp32", weights=RAM, kv_cache=RAM, activations=RAM, prefetch_depth=0)
    fit = fit_efficiency(THIN, hardware, profile_of(THIN, hardware, truth), {"resident": resident}, base)
    got = fit.efficiency.accelerator
    assert got.matmul_fraction == pytest.approx(0.8, rel=0.02)
    assert got.prefill_layer_overhead_s == pytest.approx(0.5e-3, rel=0.05)
    for prompt_len, batch in ((32, 1), (24, 64)):
        want, have = (prefill_terms(WIDE, hardware, prompt_len, batch, eff)["prefill"]["pass_s"]
                      for eff in (truth, fit.efficiency))
        assert have == pytest.approx(want, rel=0.02)


def test_a_hardware_file_carries_the_rates_by_rows_and_older_files_load_without_them():
    hardware = measured_cpu()
    again = hardware_from_dict(hardware_to_json(hardware))
    assert again.cpu.decode_streaming.prefill_rates == RATES
    assert prefill_terms(WIDE, again, 32, 1)["prefill"]["pass_s"] == pytest.approx(
        prefill_terms(WIDE, hardware, 32, 1)["prefill"]["pass_s"], rel=1e-9)
    doc = hardware_to_json(hardware)
    del doc["cpu"]["decode_streaming"]["prefill_rates"]
    assert hardware_from_dict(doc).cpu.decode_streaming.prefill_rates == ()
    assert "prefill_rates" not in hardware_to_json(measured_cpu(()))["cpu"]["decode_streaming"]


@pytest.mark.parametrize("bad, named", [
    ([], "prefill_rates"),
    ([{"hidden": 576, "peak_gflops": 120}], "half_rows"),
    ([{"hidden": 576, "peak_gflops": -1, "half_rows": 40}], "peak_gflops"),
    ([{"hidden": 576, "peak_gflops": 120, "half_rows": 40, "rows": 3}], "rows"),
    ([{"hidden": 576, "peak_gflops": 120, "half_rows": 40}, {"hidden": 576, "peak_gflops": 90, "half_rows": 9}],
     "prefill_rates"),
    ("fast", "prefill_rates"),
])
def test_a_bad_rate_by_rows_is_one_input_error_naming_the_field(bad, named):
    doc = hardware_to_json(measured_cpu())
    doc["cpu"]["decode_streaming"]["prefill_rates"] = bad
    with pytest.raises(InputError, match=named):
        hardware_from_dict(doc)


def test_the_rate_by_rows_prices_fp32_only():
    """bf16 and packed formats keep their own measured rates: the fp32 spans' curve does not reach them."""
    for fmt in ("bf16", "q4_1"):
        policy = Policy(fmt, weights=RAM, kv_cache=RAM, activations=RAM)
        times = [run_terms(WIDE, measured_cpu(r), policy, Workload(prompt_len=96, output_len=2),
                           measured_efficiency(measured_cpu(r)))["prefill"]["blocks_compute_s"] for r in (RATES, ())]
        assert np.isclose(times[0], times[1], rtol=1e-12)
