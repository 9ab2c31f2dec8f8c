"""Read a measured machine's decode steps again, when a profile's grid ran faster than the measurement predicts.

`hivekeeper profile` compares each pass of its grid with what the saved measurement predicts (profiling.PaceCheck).
Where every pass ran well faster, the measurement most likely caught a slow moment of the host: on a CPU the
calibration keeps the measured per-byte rate and fits only per-block terms around it (planner/calibration.py), so a
rate that read slow stays slow in every plan. Issue 23, session 23: a run whose grid passes all ran 1.23-1.34x
faster than its quick measurement calibrated 14.9% off, as its uncalibrated prediction (15.0%). Rather than fit
around it, `read_decode_again` reads the decode steps again, now, REREADINGS times (the fp32 spans' streaming rate
and few-row reads, and the packed formats' kernels), and folds the readings into the measurements with the first
one counted as one reading among them: a measurement that was right stays (the median keeps it), one that caught a
slow spell moves to the host's pace now. The caller saves the measurements it returns, and the fit is made against
them. (The prefill passes are not read again: the prefill rate is a curve fitted over passes of several sizes.)
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from hivekeeper.core.machine.measure import (FEW_ROW_COUNTS, BenchmarkSizes, StreamRereads, StreamSpans,
                                             fold_stream_readings, load_average, measure_packed_at, stream_reading,
                                             within_memory)
from hivekeeper.core.machine.measurement import PACKED_KERNEL_KEY, WEIGHT_STREAM_KEY, Measurement

# readings taken now: with the measurement's own reading counted as one more, a slow first reading is outvoted
# (the median of four is the middle two's mean), and one new reading caught by a slow spell cannot set it alone.
# fp32: ~6 s to build the spans, ~0.8 s a reading (this 2-core host, QUICK sizes); packed: ~3.4 s a reading, so
# ~19 s in all
REREADINGS = 3
AFTER_GRID = "taken after `hivekeeper profile`'s grid ran faster than this measurement predicts"


def read_decode_again(measurements: list[Measurement], sizes: BenchmarkSizes,
                      readings: int = REREADINGS) -> list[Measurement]:
    """`measurements` with every decode step they hold read `readings` more times now and folded in: the fp32 spans'
    streaming rate, a block's fixed cost and few-row reads (measure.fold_stream_readings), and the packed formats'
    kernels (their rates, rows and block cost: fold_packed_readings). The measurement is what every plan on this
    machine is made from, whatever model the profile ran: a moment that slowed one of its readings slowed the
    others. Figures the measurement lacks or `sizes` does not read are left as they are."""
    by_key = {m.key for m in measurements}
    if WEIGHT_STREAM_KEY in by_key:
        measurements = read_stream_again(measurements, within_memory(sizes), readings)
    if sizes.packed_hidden is not None and any(key.startswith(PACKED_KERNEL_KEY) for key in by_key):
        measurements = fold_packed_readings(measurements, [measure_packed_at(sizes) for _ in range(readings)])
    return measurements


def read_stream_again(measurements: list[Measurement], sizes: BenchmarkSizes, readings: int) -> list[Measurement]:
    """The fp32 decode spans (at `sizes`) read `readings` times now, folded into `measurements`."""
    spans = StreamSpans.make(sizes.stream_hidden, sizes.stream_bytes, sizes.cache_bytes, sizes.stream_thin)
    later = []
    StreamRereads.in_runtime_threads(lambda: later.extend(
        stream_reading(spans, max(sizes.repeats, sizes.step_repeats), FEW_ROW_COUNTS) for _ in range(readings)))
    return fold_stream_readings(measurements, later, spans.shapes(), AFTER_GRID)


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
