"""Read a measured machine's decode steps and prefill passes again, when a profile's grid ran faster than the
measurement predicts.

`hivekeeper profile` compares each pass of its grid with what the saved measurement predicts (profiling.PaceCheck).
Where every pass ran well faster, the measurement most likely caught a slow moment of the host: on a CPU the
calibration keeps the measured per-byte rate and fits only per-block terms around it, and its matmul fraction only
goes down (planner/calibration.py), so figures that read slow stay slow in every plan. Issue 23, session 23: a run
whose grid passes all ran 1.23-1.34x faster than its quick measurement calibrated 14.9% off, as its uncalibrated
prediction (15.0%). Rather than fit around it, `read_measurement_again` reads them again, now, REREADINGS times:
the fp32 spans' one-row and few-row decode steps and prefill passes, and the packed formats' kernels. Each is folded
in with the measurement's own figure counted as one reading among them: a measurement that was right stays (the
median keeps it), one that caught a slow spell moves to the host's pace now. The caller saves the measurements it
returns, and the fit is made against them.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from hivekeeper.core.machine.measure import (FEW_ROW_COUNTS, PREFILL_REREAD_REPEATS, BenchmarkSizes, PrefillPasses,
                                             PrefillRun, StreamRereads, StreamSpans, fold_stream_readings, load_average,
                                             measure_packed_at, prefill_measurements, stream_reading,
                                             within_memory)
from hivekeeper.core.machine.measurement import (AFTER_GRID, PACKED_KERNEL_KEY, PREFILL_BLOCK_KEY,
                                                 PREFILL_HALF_ROWS_KEY, PREFILL_PEAK_KEY, WEIGHT_STREAM_KEY,
                                                 Measurement)

# readings taken now: with the measurement's own reading counted as one more, a slow first reading is outvoted
# (the median of four), and one new reading caught by a slow spell cannot set it alone. This 2-core host, QUICK
# sizes: ~6 s to build the fp32 spans, ~0.8 s a decode reading, ~1.5 s a prefill one, ~3.4 s a packed one (~24 s)
REREADINGS = 3


def read_measurement_again(measurements: list[Measurement], sizes: BenchmarkSizes,
                           readings: int = REREADINGS) -> list[Measurement]:
    """`measurements` with the decode steps and prefill passes they hold read `readings` more times now and folded
    in: the fp32 spans' decode steps (measure.fold_stream_readings) and prefill passes (fold_prefill_again), and the
    packed formats' kernels (fold_packed_readings). The measurement is what every plan on this machine is made from,
    whatever model the profile ran: a moment that slowed one of its readings slowed the others. Figures the
    measurement lacks or `sizes` does not read are left as they are."""
    keys = {m.key for m in measurements}
    if WEIGHT_STREAM_KEY in keys:
        measurements = read_spans_again(measurements, within_memory(sizes), readings)
    if sizes.packed_hidden is not None and any(key.startswith(PACKED_KERNEL_KEY) for key in keys):
        measurements = fold_packed_readings(measurements, [measure_packed_at(sizes) for _ in range(readings)])
    return measurements


def read_spans_again(measurements: list[Measurement], sizes: BenchmarkSizes, readings: int) -> list[Measurement]:
    """The fp32 spans (at `sizes`): their decode steps and prefill passes read `readings` times now, in turn, and
    folded into `measurements`."""
    spans = StreamSpans.make(sizes.stream_hidden, sizes.stream_bytes, sizes.cache_bytes, sizes.stream_thin)
    later = []

    def read() -> None:
        for _ in range(readings):
            later.append(stream_reading(spans, max(sizes.repeats, sizes.step_repeats), FEW_ROW_COUNTS))
            spans.prefill_passes().read(PREFILL_REREAD_REPEATS)

    StreamRereads.in_runtime_threads(read)
    folded = fold_stream_readings(measurements, later, spans.shapes(), AFTER_GRID)
    return fold_prefill_again(folded, spans.prefill_passes())


def fold_prefill_again(measurements: list[Measurement], prefills: PrefillPasses) -> list[Measurement]:
    """`measurements` with their fp32 prefill figures (the rate by rows per width, a block's fixed cost, the rate at
    the measured rows: prefill_measurements) fitted again to every pass's median time over the measurement's own
    reading (each pass's time as its figures give it back: own_pass_seconds) and each of the `prefills`' readings
    (each a reading's median), as measure.fold_stream_readings pools the decode steps; unchanged where the
    measurement lacks the figures of a pass's width or no reading was taken."""
    by_key = {m.key: m for m in measurements}
    runs = prefills.runs() if prefills.readings else []
    own = [own_pass_seconds(by_key, run) for run in runs]
    if not runs or None in own:
        return measurements
    if len(prefills.readings) == 1:  # runs() holds that reading's every repeat: its median is the reading's time
        runs = [replace(run, seconds=[run.median_s]) for run in runs]
    load = load_average()
    again = {m.key: m for m in prefill_measurements(
        [replace(run, seconds=[seconds, *run.seconds]) for run, seconds in zip(runs, own)], load)}
    words = (f"; fitted again to each pass's median over {len(prefills.readings) + 1} readings, the measurement's "
             f"own and {len(prefills.readings)} {AFTER_GRID}")
    return [replace(again[m.key], loadavg=max(m.loadavg, load), detail=again[m.key].detail + words)
            if m.key in again else m for m in measurements]


def own_pass_seconds(by_key: dict[str, Measurement], run: PrefillRun) -> float | None:
    """A prefill pass's time as the measurement's figures give it back (measure.prefill_curve's form): FLOPs / peak
    + blocks x (2 x a block's weights x half-rate rows / peak + a block's fixed cost); None where its width's
    figures are missing."""
    peak, half = (by_key.get(f"{prefix}{run.hidden}") for prefix in (PREFILL_PEAK_KEY, PREFILL_HALF_ROWS_KEY))
    fixed = by_key.get(PREFILL_BLOCK_KEY)
    if peak is None or half is None or fixed is None or peak.value <= 0:
        return None
    return run.flops / peak.value + run.blocks * (2.0 * run.block_weights * half.value / peak.value + fixed.value)


def fold_packed_readings(measurements: list[Measurement], later: list[list[Measurement]]) -> list[Measurement]:
    """`measurements` with each packed-format figure the `later` readings hold set to the median of its value and
    theirs (the measurement's own, already pooled over its readings, counted as one reading); figures they lack
    are kept."""
    again: dict[str, list[float]] = {}
    for reading in later:
        for m in reading:
            again.setdefault(m.key, []).append(m.value)
    return [folded_reading(m, again[m.key]) if m.key in again else m for m in measurements]


def folded_reading(first: Measurement, values: list[float]) -> Measurement:
    """One figure from its measured value and the `values` read now: their median (a cost at least 0)."""
    readings = [first.value, *values]
    median = statistics.median(readings)
    return replace(first, value=max(0.0, median) if first.unit == "s" else median,
                   loadavg=max(first.loadavg, load_average()),
                   detail=f"{first.detail}; the median of {len(readings)} readings, the last {len(values)} "
                          f"{AFTER_GRID} ({', '.join(f'{x:.4g}' for x in readings)})")


class SecondLook:
    """profile_model's `read_again` over a machine's `measurements` (as detected + measured at `when`): each call
    reads them again (read_measurement_again at `sizes`) and returns the spec they give; `kept(calibration)` is the
    measurements to save with the calibration: the new reading where it was fitted against it
    (profiling.second_look adopts it only where the grid agrees with it better), else the measurements as they were."""

    def __init__(self, measurements: list[Measurement], detected, when: float | None, sizes: BenchmarkSizes):
        self.measurements, self.detected, self.when, self.sizes = measurements, detected, when, sizes
        self.read: list[Measurement] | None = None
        self.hardware = None

    def __call__(self):
        from hivekeeper.core.machine.profiles import apply_measurements

        self.read = read_measurement_again(self.measurements, self.sizes)
        self.hardware = apply_measurements(self.detected, self.read, self.when)
        return self.hardware

    def adopted(self, calibration) -> bool:
        from hivekeeper.planner.hardware_catalog import hardware_to_json

        return self.hardware is not None and calibration.hardware == hardware_to_json(self.hardware)

    def kept(self, calibration) -> list[Measurement]:
        return self.read if self.adopted(calibration) else self.measurements
