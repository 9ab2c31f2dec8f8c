"""One micro-benchmark's result, as `hivekeeper measure` saves it in a machine profile.

Kept apart from core/machine/measure.py (which imports torch to run the benchmarks) so that reading a saved profile,
e.g. in the desktop app's process, never imports torch. `value_problem` says which values a measurement can give,
for the reader of saved profiles (core/machine/profile_files.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

# how long `measure --quick` (the first plan's and the app's first measurement) takes, torch's import included: on a
# 2-core VM 43-47 s at load 10-13 (session 12: decode steps 17-22 s, the whole-step bf16 timing 7 s, packed spans
# 3-5 s, the import 11-12 s); quiet 12.1 s (bench lock, load 0.6-2.4: import 3.2 s, decode steps 5.4 s, bf16 step
# 1.7 s); 4.9 s at load 1.6 in session 11, before the whole-step bf16 timing
QUICK_TAKES = "10-50 s"

# the sizes of every measurement the app or a command makes without being told (the Measure button's, `measure`'s,
# the first plan's quick one): "full", "quick" or "tiny" (a few megabytes, the caches ignored: tests and screenshots,
# where only the wiring matters); measure.sizes_from_environment reads it
SIZES_ENV = "HIVEKEEPER_MEASURE_SIZES"
SIZES_CHOICES = ("full", "quick", "tiny")

# keys of measure.measure_decode_blocks's results, also read by profiles (which must not import torch)
WEIGHT_STREAM_KEY = "cpu_weight_stream"
MATMUL_START_KEY = "cpu_matmul_start"  # profiles measured before measure_decode_blocks
BLOCK_OVERHEAD_KEY = "cpu_decode_block_overhead"  # measure.measure_decode_blocks: fixed cost of a block in a step
SMALL_ROWS_READS_KEY = "cpu_small_rows_reads"
ROW_BLOCK_KEY = "cpu_decode_row_block_overhead"  # ... and what a block adds per row beyond the first (issue 23)
# ... and the weight reads of a few-row step through blocks of one width: key ROW_READS_AT_KEY + "<width>x<rows>"
# ("576x4"), one result per span and row count (issue 23, session 16: a 4-row step reads 576-wide blocks fewer times
# than 2048-wide ones)
ROW_READS_AT_KEY = "cpu_small_rows_reads_at_"
# measure.measure_packed_kernels: one result per packed format, key PACKED_KERNEL_KEY + format ("q4_0"), weights/s
PACKED_KERNEL_KEY = "cpu_packed_kernel_"
# ... and with the span's weights in the last-level cache: key PACKED_CACHED_KEY + format, weights/s
PACKED_CACHED_KEY = "cpu_packed_cached_"
# ... and a decode step of a few rows through the streamed span over its one-row step, timed side by side (the
# kernels' time of each, the blocks' fixed cost off): key PACKED_ROWS_KEY + format + "x" + rows ("cpu_packed_rows_
# q4_1x4"), one per row count of hardware.PACKED_ROW_COUNTS, unit "x" (issue 23, session 22: the built-in model's
# 4-row steps took ~1.7 one-row steps, where the planner had taken 4)
PACKED_ROWS_KEY = "cpu_packed_rows_"
# ... and a prefill through such a cached span (the int8 kernels on many rows): key PACKED_PREFILL_KEY + format, in
# row-weight products per second (WEIGHTS_PER_S; 2 FLOPs each)
PACKED_PREFILL_KEY = "cpu_packed_prefill_"
# ... and the fixed cost of a packed block in a decode step, fitted with each format's cached rate to its cached span
# and a narrower span of as many packed bytes, the median of the formats' fits (issue 23: the fp32 spans' cost is no
# packed block's), in seconds (0: below the steps' noise, the rates hold the whole step)
PACKED_BLOCK_KEY = "cpu_block_overhead_packed"
# measure.measure_decode_blocks's prefill passes through the same fp32 spans (the runtime's own prefill path): the
# FLOP/s of their products and the fixed cost of a block in a prefill
PREFILL_FLOPS_KEY = "cpu_prefill_fp32"
PREFILL_BLOCK_KEY = "cpu_prefill_block_overhead"
# ... and (session 16) the fp32 prefill rate by rows at each span's width, fitted to passes at three row counts:
# rate(m) = peak x m / (m + half rows). Key prefix + width ("cpu_prefill_peak_w576"): the peak in FLOP/s, and the
# rows at which the rate is half of it (hardware.PrefillRate)
PREFILL_PEAK_KEY = "cpu_prefill_peak_w"
PREFILL_HALF_ROWS_KEY = "cpu_prefill_half_rows_w"
# measure.measure_half_prefill (with native bf16 math): FLOP/s of a prefill pass through bf16 decoder blocks, the
# runtime's bf16 path (torch's kernels block by block), which bf16 prefills and batches of a CPU plan run at. Issue 22
# (session 14, an AVX512-BF16 host): the bf16 matmul alone read 318 GFLOP/s, the engine's bf16 blocks multiplied at
# ~110, and the batch plan was predicted 2.4x too fast
PREFILL_BF16_KEY = "cpu_prefill_bf16"
WEIGHTS_PER_S = "weights/s"  # its unit
# measure.measure_half_decode's result (a whole bf16 decode step's time / the fp32 step's), read by cpu_dtype to pick a
# CPU's 16-bit dtype. Profiles saved before session 12 hold "cpu_decode_bf16_vs_fp32", a chain of bf16 matmuls alone
# (0.89-0.93x fp32 where whole bf16 steps took ~1.5x): a new key, so that those count as not measured (fp32)
HALF_DECODE_KEY = "cpu_decode_step_bf16_vs_fp32"
# step_overhead.measure_step_overhead: the fixed cost of a decode step outside the blocks and the LM head (embedding,
# sampling, the generation loop), in seconds (issue 23, session 16: the cost model's 1 ms default until then)
STEP_OVERHEAD_KEY = "cpu_decode_step_overhead"
# measure.measure_decode_attention: bytes of KV cache a decode step's attention reads per second (the runtime's own
# decode path over a cache of a few thousand tokens beyond the last-level cache, less the same steps at a short one).
# Until then a step's cache reads were priced at the weights' RAM rate: the built-in model's decode at an 8k-token
# context was predicted ~2x its measured tokens/s (attention read its cache at ~10-15 GB/s beside 42 GB/s of RAM)
ATTENTION_KEY = "cpu_decode_attention_read"


@dataclass
class Measurement:
    """One benchmark's result: the best of its repeats, in `unit`, with how much the repeats disagreed."""

    key: str  # stable name, e.g. "ram_read", "cpu_matmul_fp32_prefill", "disk_read", "gpu0_h2d_pinned"
    label: str  # for people
    value: float  # best (fastest) of the repeats, or their median where `detail` says so (the decode steps' rates)
    unit: str  # "B/s", "FLOP/s", "s" or "bit/s"
    spread: float  # (worst - best) / best over the repeats
    repeats: int
    loadavg: float  # 1-minute load average, the larger of before and after
    detail: str = ""  # shape, size, method (e.g. how the page cache was bypassed)
    samples: list[float] = field(default_factory=list)  # every repeat, in `unit`

    def as_dict(self) -> dict:
        doc = asdict(self)
        doc["value"] = float(f"{self.value:.6g}")
        doc["spread"] = float(f"{self.spread:.4g}")
        doc["loadavg"] = round(self.loadavg, 2)
        doc["samples"] = [float(f"{s:.6g}") for s in self.samples]
        return doc

    @classmethod
    def from_dict(cls, doc: dict) -> "Measurement":
        return cls(key=str(doc["key"]), label=str(doc.get("label", doc["key"])), value=float(doc["value"]),
                   unit=str(doc["unit"]), spread=float(doc.get("spread", 0.0)), repeats=int(doc.get("repeats", 1)),
                   loadavg=float(doc.get("loadavg", 0.0)), detail=str(doc.get("detail", "")),
                   samples=[float(s) for s in doc.get("samples", [])])


def value_problem(value: float, unit: str) -> str:
    """"" where `value` is one a measurement in `unit` gives; else what it must be, for an error naming the field.
    Every measurement is finite and at least 0 (a cost the noise does not resolve is saved as 0, and the readers
    take a rate of 0 as not measured); a ratio of times ("x") is above 0. A newcomer's hand-edited RAM read of -5 B/s
    was read as is and planned with (session 22's -3 bf16 step ratio flipped the 16-bit rule)."""
    if not math.isfinite(value):
        return "must be a finite number"
    if unit == "x":
        return "" if value > 0 else "must be above 0 (a ratio of times)"
    return "" if value >= 0 else f"must be at least 0 (in {unit})"


def measured_load(measurements: list[Measurement]) -> float:
    """The highest 1-minute load average seen while measuring."""
    return max((m.loadavg for m in measurements), default=0.0)


# the words in a figure's detail where `hivekeeper profile` read it again because its grid ran faster than the
# measurement predicts (core/machine/read_again.py, the decode steps and prefill passes); `detect` finds them by them
AFTER_GRID = "taken after `hivekeeper profile`'s grid ran faster than this measurement predicts"


def figures_read_again(measurements: list[Measurement]) -> list[Measurement]:
    """The figures `hivekeeper profile` read again and saved (AFTER_GRID in their detail)."""
    return [m for m in measurements if AFTER_GRID in m.detail]


def busy_words(measurements: list[Measurement], cpus: int) -> str:
    """"" when the machine was quiet enough while measuring; else words saying that the figures are a busy moment's
    (a load average above the CPU count: other programs held the cores, and the profile would plan this machine
    several times too slow until measured again)."""
    load = measured_load(measurements)
    if load <= cpus:
        return ""
    return f"at load {load:.1f} on {cpus} CPUs: busy, measure again when quiet"


# opens the note of a RAM bandwidth source where the planner takes the decode steps' measured reads, above the plain
# read benchmark (profiles.apply_measurements; `detect` says so)
RAISED_RAM_WORDS = "raised to the"
LOAD_ENV = "HIVEKEEPER_LOAD_AVERAGE"  # pins load_now (tests: whether a busy profile is measured again)
# the share of the CPUs other programs may hold before a measurement for it to start quiet (quiet_load). Session 23:
# at "at most the CPU count" a 2-core machine at load 2.0 (others holding both cores) measured again, the
# measurement's own threads took the load to 2.6, and every plan measured again, 36 s each
QUIET_SHARE = 0.5


def quiet_load(cpus: int) -> float:
    """The highest load average before a measurement at which it starts quiet: QUIET_SHARE of the CPUs. Before a
    measurement the load is others' alone; while it runs its own threads add up to the CPU count (busy_words' limit),
    so a measurement started above this would be found busy again."""
    return QUIET_SHARE * cpus


def load_now() -> float:
    """The 1-minute load average now (HIVEKEEPER_LOAD_AVERAGE when set): a measurement started at a load of at most
    quiet_load is a quiet one's. A profile measured busy is measured again at the first such moment (`plan
    --hardware auto`, the app)."""
    import psutil

    pinned = os.environ.get(LOAD_ENV, "").strip()
    return float(pinned) if pinned else psutil.getloadavg()[0]
