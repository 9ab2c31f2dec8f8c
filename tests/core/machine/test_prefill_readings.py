"""The fp32 prefill passes read three times over a measurement (issue 23, session 19): a quick measurement whose one
reading of the passes fell in a slow spell of the host priced every prefill 1.4-1.7x slow. Each pass's time is the
median of the readings' medians (PrefillPasses.runs), and run_benchmarks's pool puts the prefill measurements of all
the readings in place of the first's (fold_prefill_readings). Real passes through tiny spans; the seconds are fed."""

from __future__ import annotations

import pytest

from hivekeeper.core.machine import measure
from hivekeeper.core.machine.measure import TINY, PrefillPasses, StreamSpans, prefill_measurements
from hivekeeper.core.machine.measurement import PREFILL_BLOCK_KEY, PREFILL_FLOPS_KEY, PREFILL_PEAK_KEY, Measurement

PEAK, HALF_ROWS, FIXED_S = 50e9, 30.0, 0.2e-3


@pytest.fixture(scope="module")
def passes() -> PrefillPasses:
    spans = StreamSpans.make(TINY.stream_hidden, TINY.stream_bytes, cache_bytes=0, thin=TINY.stream_thin)
    built = spans.prefill_passes()
    assert spans.prefill_passes() is built and len(built.passes) == 2 * len(measure.PREFILL_SEQUENCE_COUNTS)
    return built


def reading(passes: PrefillPasses, factors: list[float]) -> list[list[float]]:
    """Every pass's seconds at PEAK and HALF_ROWS (both widths alike) with FIXED_S a block, each repeat that time x
    its factor."""
    shapes = measure.prefill_runs(passes.passes, [[1.0]] * len(passes.passes), passes.configs, passes.first_blocks)
    return [[(r.flops / PEAK + r.blocks * (2.0 * r.block_weights * HALF_ROWS / PEAK + FIXED_S)) * f for f in factors]
            for r in shapes]


def fits(passes: PrefillPasses, readings: list[list[float]]) -> dict[str, Measurement]:
    passes.readings = [reading(passes, factors) for factors in readings]
    return {m.key: m for m in prefill_measurements(passes.runs(), 1.0, passes.repeats())}


def test_a_reading_in_a_slow_spell_of_the_host_does_not_set_the_rate(passes):
    passes.readings = []
    passes.read(1)  # a real reading (its seconds are replaced below): the passes run
    assert len(passes.readings) == 1 and all(len(s) == 1 and s[0] > 0 for s in passes.readings[0])
    quiet = [1.0, 1.02, 0.98, 1.0, 1.0]
    alone = fits(passes, [quiet])
    assert alone[f"{PREFILL_PEAK_KEY}{TINY.stream_hidden}"].value == pytest.approx(PEAK, rel=0.03)
    assert alone[PREFILL_FLOPS_KEY].repeats == 5  # one reading: each repeat a sample
    slow_first = fits(passes, [[1.6] * 5, [1.0, 1.03, 0.97], [1.0, 0.99, 1.01]])
    for key in (PREFILL_FLOPS_KEY, PREFILL_BLOCK_KEY, f"{PREFILL_PEAK_KEY}{TINY.stream_hidden}"):
        assert slow_first[key].value == pytest.approx(alone[key].value, rel=0.03, abs=1e-6)
    assert slow_first[PREFILL_FLOPS_KEY].repeats == 3  # three readings: each reading's median a sample
    assert "read 3 times over the measurement, 5 + 3 + 3 repeats each" in slow_first[PREFILL_FLOPS_KEY].detail
    # that slow reading alone: every prefill priced 1.6x slow
    slow = fits(passes, [[1.6] * 5])
    assert slow[PREFILL_FLOPS_KEY].value == pytest.approx(alone[PREFILL_FLOPS_KEY].value / 1.6, rel=0.03)


def test_the_pool_puts_every_readings_prefill_figures_in_place_of_the_firsts(passes):
    first = fits(passes, [[1.6] * 5])
    other = Measurement("ram_read", "RAM read", 20e9, "B/s", 0.0, 3, 0.5)
    results = [other, *first.values()]
    assert measure.fold_prefill_readings(results, passes) == results  # one reading: unchanged
    passes.readings = [reading(passes, f) for f in ([1.6] * 5, [1.0] * 3, [1.0] * 3)]
    folded = measure.fold_prefill_readings(results, passes)
    assert [m.key for m in folded] == [m.key for m in results] and folded[0] == other
    pooled = {m.key: m for m in folded}
    assert pooled[PREFILL_FLOPS_KEY].value == pytest.approx(1.6 * first[PREFILL_FLOPS_KEY].value, rel=0.03)
    assert pooled[PREFILL_FLOPS_KEY].loadavg >= first[PREFILL_FLOPS_KEY].loadavg
    assert measure.fold_prefill_readings([other], passes) == [other]  # no prefill figures measured: nothing added
