"""Micro-benchmarks of this machine: RAM and device bandwidth, matmul FLOP/s, decode weight streaming, bf16 against
fp32 at decode (which 16-bit plans follow), host<->device copies, disk reads, peers.

Every benchmark repeats its timing and keeps the fastest run (the least disturbed by other processes) together with
the spread of the repeats and the 1-minute load average, so a noisy measurement shows itself. `run_benchmarks`
runs them all and calls `progress(fraction, label)` between steps (a terminal bar or a GUI).

The plain functions (memory_read_bandwidth, matmul_flops, host_device_bandwidth, disk_bandwidth) return the best
rate only; the measure_* functions return a `Measurement` with the repeats.
"""

from __future__ import annotations

import math
import os
import socket
import socketserver
import statistics
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Callable, TextIO

import numpy as np
import torch

from hivekeeper.planner.costmodel import PACKED_KERNEL_ROWS
from hivekeeper.planner.efficiency import REREAD_ROWS
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import PACKED_ROW_COUNTS, rate_at_rows

from hivekeeper.core.machine import step_overhead
from hivekeeper.core.machine.cpu_features import has_half_math, last_level_cache_bytes
from hivekeeper.core.machine.measurement import (  # torch-free, so that saved profiles load without torch
    ATTENTION_KEY, BLOCK_OVERHEAD_KEY, HALF_DECODE_KEY, MATMUL_START_KEY, PACKED_BLOCK_KEY, PACKED_CACHED_KEY,
    PACKED_KERNEL_KEY, PACKED_PREFILL_KEY, PACKED_ROWS_KEY, PREFILL_BF16_KEY, PREFILL_BLOCK_KEY, PREFILL_FLOPS_KEY,
    PREFILL_HALF_ROWS_KEY, PREFILL_PEAK_KEY, ROW_READS_AT_KEY, SIZES_CHOICES, SIZES_ENV, SMALL_ROWS_READS_KEY,
    STEP_OVERHEAD_KEY, WEIGHT_STREAM_KEY, WEIGHTS_PER_S, Measurement)
from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.kernels.cpu_matmul import (linear, physical_cores, store_for_decode, torch_threads,
                                                        use_blas_threads)

Progress = Callable[[float, str], None]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _silent(fraction: float, label: str) -> None:
    pass


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timings(fn: Callable[[], None], repeats: int, device: torch.device) -> list[float]:
    """Seconds of each of `repeats` runs of fn, after one warm-up run (first-touch page faults, kernel choice)."""
    fn()
    _synchronize(device)
    seconds = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def _counted_timings(fn: Callable[[], None], repeats: int, target_s: float = 0.02) -> tuple[int, list[float]]:
    """(calls per timing, seconds per call of each of `repeats` timings): fn repeated inside each timing so that one
    timing lasts about target_s."""
    device = torch.device("cpu")
    count = _inner_count(fn, device, target_s)

    def many() -> None:
        for _ in range(count):
            fn()

    return count, [s / count for s in _timings(many, repeats, device)]


def _inner_count(fn: Callable[[], None], device: torch.device, target_s: float = 0.02, most: int = 1000) -> int:
    """How many calls of fn make one timing of about target_s (at least 1): short calls are repeated inside a
    timing so that timer resolution and call overhead do not dominate."""
    fn()
    _synchronize(device)
    start = time.perf_counter()
    fn()
    _synchronize(device)
    single = time.perf_counter() - start
    return max(1, min(most, int(target_s / max(single, 1e-7))))


def _best_seconds(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    return min(_timings(fn, repeats, device))


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def _rate_measurement(key: str, label: str, unit: str, amount: float, seconds: list[float], load_before: float,
                      detail: str) -> Measurement:
    """A rate (amount per second) from timed repeats: best = amount / fastest time."""
    rates = [amount / s for s in seconds]
    best = max(rates)
    return Measurement(key, label, best, unit, (best - min(rates)) / best if best > 0 else 0.0, len(rates),
                       max(load_before, load_average()), detail, rates)


def median_and_spread(samples: list[float]) -> tuple[float, float]:
    """(median, (largest - smallest) / median) of repeated readings of one quantity (0 spread for one reading).

    The machine's own speed moves between repeats (this project's 2-core VM: its memory bandwidth ±35% minute to
    minute at load ~1), so a measurement the planner predicts from keeps the median of repeats spread over the
    measurement, not the fastest (one lucky instant), and records how far they ranged."""
    if not samples:
        raise ValueError("no readings")
    median = statistics.median(samples)
    return median, (max(samples) - min(samples)) / median if median > 0 else 0.0


def _median_rate_measurement(key: str, label: str, unit: str, amount: float, seconds: list[float],
                             load_before: float, detail: str) -> Measurement:
    """A rate (amount per second) from repeats timed in turn with other runs: value = the median repeat's rate,
    spread = the rates' range over it (median_and_spread)."""
    rates = [amount / s for s in seconds]
    median, spread = median_and_spread(rates)
    return Measurement(key, label, median, unit, spread, len(rates), max(load_before, load_average()),
                       f"{detail}; the median of {len(rates)} repeats", rates)


# ---- RAM and device memory ------------------------------------------------------------------------------------------
def memory_read_bandwidth(device: str | torch.device = "cpu", size_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Read bandwidth of a device's memory in bytes/s: a reduction over a buffer far larger than the caches."""
    return measure_memory_read(device, size_bytes, repeats).value


def measure_memory_read(device: str | torch.device = "cpu", size_bytes: int = 512 << 20,
                        repeats: int = 5) -> Measurement:
    device = torch.device(device)
    load = load_average()
    buffer = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    # on the CPU every core reads (inference may keep torch on one thread while the matmuls use them all)
    with torch_threads(physical_cores() if device.type == "cpu" else torch.get_num_threads()):
        seconds = _timings(lambda: buffer.sum(), repeats, device)
    key = "ram_read" if device.type == "cpu" else f"gpu{device.index or 0}_memory_read"
    label = "RAM read bandwidth" if device.type == "cpu" else "GPU memory read bandwidth"
    return _rate_measurement(key, label, "B/s", size_bytes, seconds, load,
                             f"sum of a {size_bytes / 2**20:.0f} MiB fp32 buffer, {physical_cores()} threads"
                             if device.type == "cpu" else f"sum of a {size_bytes / 2**20:.0f} MiB fp32 buffer")


# ---- matmuls --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MatmulShape:
    """A matmul [m, k] @ [k, n]; decode multiplies a few rows by a weight matrix, prefill many."""

    m: int
    k: int
    n: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def matmul_flops(shape: MatmulShape, dtype: str = "fp32", device: str | torch.device = "cpu",
                 repeats: int = 5) -> float:
    """Achieved FLOP/s of one matmul shape in a dtype on a device."""
    return measure_matmul(shape, dtype, device, repeats).value


def measure_matmul(shape: MatmulShape, dtype: str = "fp32", device: str | torch.device = "cpu", repeats: int = 5,
                   phase: str = "prefill") -> Measurement:
    """Achieved FLOP/s of [m, k] @ [k, n] in a dtype (weights laid out as nn.Linear keeps them: [n, k]), through
    the kernel the runtime uses (cpu_matmul.linear)."""
    if dtype not in _DTYPES:
        raise InputError(f"matmul dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    device = torch.device(device)
    load = load_average()
    torch_dtype = _DTYPES[dtype]
    x = torch.randn(shape.m, shape.k, dtype=torch_dtype, device=device)
    weight = torch.randn(shape.n, shape.k, dtype=torch_dtype, device=device)

    def once() -> None:
        linear(x, weight)

    # Small matmuls finish in microseconds: repeat inside one timing so timer resolution does not dominate.
    inner = _inner_count(once, device)

    def run() -> None:
        for _ in range(inner):
            once()

    seconds = _timings(run, repeats, device)
    where = "cpu" if device.type == "cpu" else f"gpu{device.index or 0}"
    weight_bytes = shape.k * shape.n * weight.element_size()
    detail = f"[{shape.m}, {shape.k}] x [{shape.k}, {shape.n}] {dtype}"
    if phase == "decode":
        rate = weight_bytes * inner / min(seconds)
        detail += f", reads {weight_bytes / 2**20:.0f} MiB of weights: {rate / 1e9:.3g} GB/s"
    return _rate_measurement(f"{where}_matmul_{dtype}_{phase}", f"{dtype} matmul, {phase} shape", "FLOP/s",
                             shape.flops * inner, seconds, load, detail)


def _layer_chain(hidden: int, total_bytes: int) -> list[torch.Tensor]:
    """Distinct fp32 matrices shaped like decoder layers of width `hidden` (fused q/k/v with 4:1 grouped KV, o,
    fused gate/up, down; MLP 2.75x wide), repeated to about `total_bytes`, stored as the runtime stores them (tall
    ones as cpu_matmul.store_for_decode does)."""
    inter = int(hidden * 2.75) // 64 * 64
    layer = [(hidden + hidden // 2, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    layer_bytes = sum(o * i for o, i in layer) * 4
    weights = [torch.randn(o, i) for _ in range(max(1, total_bytes // layer_bytes)) for o, i in layer]
    for weight in weights:
        store_for_decode(weight)
    return weights


def _chain(weights: list[torch.Tensor], rows: int) -> Callable[[], None]:
    """`rows` rows (inputs in the weights' dtype) multiplied by every matrix in turn (a small op after each, as a
    block has), through the runtime's kernel."""
    inputs = {w.shape[1]: torch.randn(rows, 1, w.shape[1], dtype=w.dtype) for w in weights}  # one new token per row

    def chain() -> None:
        with torch.inference_mode():
            for weight in weights:
                linear(inputs[weight.shape[1]], weight).add_(1.0)

    return chain


def _chain_seconds(weights: list[torch.Tensor], rows: int, repeats: int) -> list[float]:
    """Seconds of each repeat of _chain(weights, rows)."""
    return _timings(_chain(weights, rows), repeats, torch.device("cpu"))


def measure_weight_streaming(hidden: int = 2048, total_bytes: int = 384 << 20, repeats: int = 5) -> list[Measurement]:
    """How decode reads weights on the CPU, from chains of distinct layer-shaped fp32 matrices (far beyond the
    caches) multiplied in turn by one row, through the runtime's kernel:

    - cpu_weight_stream: the bytes/s of that streaming, and cpu_matmul_start: a fixed start-up time per matmul.
      One large matrix streams at about the RAM bandwidth, but each multiply starts cold (and a small op between
      two idles the memory), which costs small models most. A chain of width `hidden` and one 3/8 as wide (many
      more, smaller matrices for the same bytes) give time = bytes / bandwidth + matmuls x start-up.
    - cpu_small_rows_reads: the chain's time with 4 rows over its time with one (small-row GEMM kernels read the
      weights several times).
    """
    load = load_average()
    wide, narrow = _layer_chain(hidden, total_bytes), _layer_chain(max(64, hidden * 3 // 8), total_bytes)
    runs = {}
    for name, weights, rows in (("wide", wide, 1), ("narrow", narrow, 1), ("wide4", wide, 4)):
        seconds = _chain_seconds(weights, rows, repeats)
        runs[name] = (min(seconds), seconds, sum(w.numel() * 4 for w in weights), len(weights))
    # time = bytes / bandwidth + matmuls * start-up, from the two one-row chains' best times
    (t1, s1, b1, n1), (t2, _, b2, n2) = runs["wide"], runs["narrow"]
    start_up = max(0.0, (t2 - t1 * b2 / b1) / (n2 - n1 * b2 / b1)) if n2 * b1 != n1 * b2 else 0.0
    bandwidth = b1 / max(t1 - n1 * start_up, 1e-9)
    if bandwidth <= 0 or start_up * n1 >= t1:  # noise made the split meaningless: streaming alone explains it
        start_up, bandwidth = 0.0, b1 / t1
    rates = [b1 / s for s in s1]
    load = max(load, load_average())
    chains = (f"{n1} matrices of width {hidden} ({b1 / 2**20:.0f} MiB) {b1 / t1 / 1e9:.3g} GB/s, "
              f"{n2} of width {max(64, hidden * 3 // 8)} ({b2 / 2**20:.0f} MiB) {b2 / t2 / 1e9:.3g} GB/s")
    t4, s4, _, _ = runs["wide4"]
    return [
        Measurement(WEIGHT_STREAM_KEY, "decode weight streaming", bandwidth, "B/s",
                    (max(rates) - min(rates)) / max(rates), len(s1), load,
                    f"one-row matmuls over chains of layer-shaped fp32 matrices: {chains}; bandwidth and start-up "
                    "fitted to both", [b1 / (s - n1 * start_up) for s in s1 if s > n1 * start_up]),
        Measurement(MATMUL_START_KEY, "start-up time of one decode matmul", start_up, "s", 0.0, len(s1), load,
                    f"fitted to the two chains: {chains}"),
        Measurement(SMALL_ROWS_READS_KEY, "weight reads of a 4-row matmul", t4 / t1, "x",
                    (max(s4) - min(s4)) / min(s4), len(s4), load,
                    f"the width-{hidden} chain with 4 rows takes {t4 / t1:.2f}x its one-row time"),
    ]


def decode_span(hidden: int, total_bytes: int):
    """(config, span) of random fp32 decoder blocks of width `hidden` (head 64, 4:1 grouped KV, MLP 2.75x wide)
    repeated to about `total_bytes` (decode_span_config): span_of_config's."""
    return span_of_config(decode_span_config(hidden, total_bytes))


def span_of_config(config):
    """(config, span) of random fp32 decoder blocks shaped as `config`, laid out as checkpoint.load_span lays out a
    loaded model (tall matrices as cpu_matmul.store_for_decode stores them, every weight packed in reading order),
    so a step through it takes the runtime's decode path."""
    from hivekeeper.core.runtime.kernels.cpu_matmul import pack_in_order, store_linears_for_decode
    from hivekeeper.core.runtime.model import Span

    blocks = config.num_layers
    with torch.device("meta"):
        span = Span(config, 0, blocks)
    span = span.to_empty(device="cpu").requires_grad_(False)
    with torch.no_grad():
        span.rotary = type(span.rotary)(config)
        for block in span.blocks:
            block.rotary = span.rotary
            store_linears_for_decode(block)
        # laid out first, filled in place after: the weights are written once, in their packed buffer (session 17:
        # filled, then copied into it, 384 MiB spans took ~1.7 s each to make on this 2-core host)
        pack_in_order(list(span.blocks))
        with torch_threads(physical_cores()):
            for name, param in span.named_parameters():
                if name.endswith("layernorm.weight"):
                    param.fill_(1.0)
                else:
                    param.uniform_(-(param.shape[-1] ** -0.5), param.shape[-1] ** -0.5)
    return config, span


def decode_span_config(hidden: int, total_bytes: int):
    """The ModelConfig of decode_span(hidden, total_bytes), nothing allocated: blocks of width `hidden` (heads of
    64, grouped_kv_heads, MLP 2.75x wide), as many as make about `total_bytes` of fp32 weights (at least one)."""
    from hivekeeper.core.runtime.model import ModelConfig

    heads = max(1, hidden // 64)
    inter = max(64, int(hidden * 2.75) // 64 * 64)
    probe = ModelConfig("llama", 256, hidden, inter, 1, heads, grouped_kv_heads(heads), hidden // heads,
                        max_position_embeddings=DECODE_SPAN_POSITIONS)
    return replace(probe, num_layers=max(1, round(total_bytes / (probe.block_param_count() * 4))))


def grouped_kv_heads(heads: int) -> int:
    """A decode span's KV heads beside `heads` query heads: about a quarter of them (4:1 grouped KV), a divisor of
    `heads` (attention needs it): the divisor up to a third of them nearest a quarter, the larger on a tie (9 heads,
    SmolLM2's 576 wide: 3; 12: 3; 32: 8)."""
    divisors = [d for d in range(1, max(1, heads // 3) + 1) if heads % d == 0]
    return min(divisors, key=lambda d: (abs(d - heads / 4), -d))


DECODE_SPAN_POSITIONS = 64  # a short context: the step is the weights' reads, not attention
# the thin decode span's width (thin_width): a small model's blocks (SmolLM2-135M's 576), where the wide one is a 1B
# model's (2048): the two bracket the models a CPU runs, and the fit to them prices the widths between
STREAM_THIN = 576
# a step takes milliseconds: at least this many timings of each, so that on a shared machine the fastest (the one
# least disturbed) is found even with --quick's 2 repeats
STEP_REPEATS = 7
# bf16 against fp32 decode steps (measure_half_decode): a thin model's blocks (the demo's 768, SmolLM2's 576) and a
# wide one's (a 1B model's 2048), where torch's per-block work and halved bytes weigh differently
HALF_THIN, HALF_WIDE = 768, 2048


def decode_steps(config, span, rows: int, dtype: torch.dtype = torch.float32) -> Callable[[], None]:
    """One decode step of `rows` sequences through the span (Span.forward: the C kernels for one row where they
    are built, numpy for several; torch block by block for a bf16 span), at position 8 of a zeroed cache (in
    `dtype`, the span's) each time."""
    from hivekeeper.core.runtime.model import KVCache

    cache = KVCache.allocate(config, config.num_layers, rows, DECODE_SPAN_POSITIONS, dtype)
    cache.k.zero_()
    cache.v.zero_()
    hidden = torch.randn(rows, 1, config.hidden_size) * 0.1

    def step() -> None:
        cache.length = 8
        with torch.inference_mode():
            span(hidden, cache)

    return step


def measure_decode_blocks(hidden: int = 2048, total_bytes: int = 384 << 20, repeats: int = 5,
                          cache_bytes: int | None = None, step_repeats: int = STEP_REPEATS,
                          spans: "StreamSpans | None" = None, thin: int = STREAM_THIN) -> list[Measurement]:
    """How a decode step runs here, through the runtime's own decode path (Span.forward: the native kernels'
    whole-span step where they are built, numpy's otherwise), on two spans of random decoder blocks, each larger
    than twice the last-level cache (read from /sys) and than `total_bytes`: one `hidden` wide (few large blocks),
    one thin_width(hidden, thin) wide (many small blocks, like SmolLM2's 30 blocks of 576). Fitting time = bytes /
    bandwidth + blocks x fixed cost to the two one-row steps gives:

    - cpu_weight_stream: the bytes/s decode reads weights from RAM at;
    - cpu_decode_block_overhead: the fixed cost of one block in a step (its small ops, the kernels' thread pool
      handing work out and waiting, caches cold after each matrix), which thin many-layer models pay most;
    - cpu_small_rows_reads_at_<width>x<rows>: how many times a step of 4 and of 8 rows (the kernels' most) reads
      the weights of blocks of each span's width (row_reads), and cpu_small_rows_reads: the wide span's 4-row
      figure (older profiles' one figure for every width).

    spans: the two spans, already built for these sizes (run_benchmarks reads the streaming rate again on them).
    """
    previous_threads = torch.get_num_threads()
    use_blas_threads()  # the runtime's thread layout (its decode path depends on it)
    try:
        return _decode_block_measurements(hidden, total_bytes, max(repeats, step_repeats),
                                          last_level_cache_bytes() if cache_bytes is None else cache_bytes,
                                          spans or StreamSpans.make(hidden, total_bytes, cache_bytes, thin))
    finally:
        torch.set_num_threads(previous_threads)


def _decode_block_measurements(hidden: int, total_bytes: int, repeats: int, cache_bytes: int,
                               spans: "StreamSpans") -> list[Measurement]:
    load = load_average()
    (wide_config, wide), (narrow_config, narrow) = (spans.wide_config, spans.wide), (spans.narrow_config, spans.narrow)
    narrow_hidden = narrow_config.hidden_size
    b1, b2 = (sum(p.numel() * 4 for p in span.parameters()) for span in (wide, narrow))
    n1, n2 = wide_config.num_layers, narrow_config.num_layers
    # the two spans' one-row and few-row steps (FEW_ROWS and the kernels' most, PACKED_KERNEL_ROWS) in turn (a, b, c,
    # ..., a, b, ...): the steps of each repeat see the same moment, so the few-row steps' ratio to the one-row ones
    # is not a swing of the host's between them (session 16: timed apart, the 576-wide span's 4-row ratio read 1.63
    # where in turn it read 1.34-1.39 four times)
    row_counts = (1, *FEW_ROW_COUNTS)
    timed = _alternating_seconds([decode_steps(config, span, rows) for rows in row_counts
                                  for config, span in ((wide_config, wide), (narrow_config, narrow))], repeats)
    s1, s2 = timed[:2]
    # prefill passes through both spans at every PREFILL_SEQUENCE_COUNTS row count, all in turn: the rate by rows
    # at each width (run_benchmarks reads them again later: StreamRereads.read_prefill)
    prefills = spans.prefill_passes()
    prefills.read(PREFILL_REPEATS)
    (m1, _), (m2, _) = median_and_spread(s1), median_and_spread(s2)
    per_block, bandwidth = fit_bytes_and_blocks((m1, b1, n1), (m2, b2, n2))
    load = max(load, load_average())
    spans = (f"{n1} blocks of width {hidden} ({b1 / 2**20:.0f} MiB) {m1 * 1e3:.3g} ms, {n2} of "
             f"width {narrow_hidden} ({b2 / 2**20:.0f} MiB) {m2 * 1e3:.3g} ms (medians), "
             f"last-level cache {cache_bytes / 2**20:.0f} MiB, through {decode_path_name()}")
    stream_rates = [b1 / max(s - n1 * per_block, 1e-9) for s in s1]
    few = [few_row_reads(seconds, rows, width, nbytes, blocks, (per_block, bandwidth), load, spans)
           for rows, pair in zip(row_counts[1:], (timed[2:4], timed[4:6]))
           for seconds, width, nbytes, blocks in zip(pair, (hidden, narrow_hidden), (b1, b2), (n1, n2))]
    return [
        Measurement(WEIGHT_STREAM_KEY, "decode weight streaming", bandwidth, "B/s",
                    median_and_spread(stream_rates)[1], len(s1), load,
                    f"one-row decode steps of random decoder blocks: {spans}; bandwidth and per-block cost fitted "
                    f"to both spans' median steps ({len(s1)} repeats timed in turn)", stream_rates),
        block_overhead(per_block, (s1, b1, n1), (s2, b2, n2), load, f"fitted to the two spans: {spans}"),
        replace(few[0], key=SMALL_ROWS_READS_KEY, label="weight reads of a 4-row decode step",
                detail=f"{few[0].detail} (older profiles' one figure for every width; per width and rows: "
                       f"{ROW_READS_AT_KEY}<width>x<rows>)"),
        *few,
        *prefill_measurements(prefills.runs(), load, prefills.repeats()),
    ]


FEW_ROWS = REREAD_ROWS  # the rows of the few-row decode steps measured (the native kernels take up to 8)
FEW_ROW_COUNTS = (FEW_ROWS, PACKED_KERNEL_ROWS)  # every few-row step a reading times: 4 rows and the kernels' most


def few_row_reads(seconds: list[float], rows: int, width: int, nbytes: int, blocks: int,
                  one_row: tuple[float, float], load: float, spans: str) -> Measurement:
    """The ROW_READS_AT_KEY measurement of one span's `rows`-row steps (every repeat's `seconds`): row_reads of
    their median by the one-row fit (a block's fixed cost, bytes/s)."""
    median, spread = median_and_spread(seconds)
    return Measurement(f"{ROW_READS_AT_KEY}{width}x{rows}", f"weight reads of a {rows}-row decode step, blocks "
                       f"{width} wide", row_reads(median, nbytes, blocks, *one_row), "x", spread, len(seconds), load,
                       f"the {rows}-row step of {blocks} blocks of width {width} {median * 1e3:.3g} ms (median), less "
                       f"the blocks' fixed cost, over its one-row reads at the fitted rate: {spans}")


def row_reads(seconds: float, nbytes: float, blocks: int, per_block: float, bandwidth: float) -> float:
    """How many times a few-row step through a span (its median `seconds`, `nbytes` of weights in `blocks` blocks)
    reads its weights, by the one-row fit (a block's fixed cost `per_block`, the rate `bandwidth`): what the
    step takes beyond its blocks' one-row fixed cost, over its one-row reads; at least 1. Issue 23 (session 16): a
    4-row step through 576-wide blocks took 1.4-1.6x the one-row step, through 2048-wide ones 1.7-2.2x (the four
    rows' inputs stay in the L1 cache beside a narrow matrix's weight row, not beside a wide one's), so each width
    has its reads and the cost model takes a model's by its width; the per-row work of a block (norms, rotary,
    attention) is in its width's reads."""
    return max(1.0, (seconds - blocks * per_block) * bandwidth / nbytes)


# A prefill pass: PREFILL_SEQUENCES prompts of PREFILL_TOKENS tokens (rows per product: their product) through the
# first blocks of a span holding about PREFILL_WEIGHTS weights (compute-bound: it needs no span beyond the caches),
# timed PREFILL_REPEATS times in turn with the other span's. Session 17: with 3, a quick measurement at a swing of the
# host fitted the 576-wide rate's half-rate rows at 152 (48-58 otherwise) and the 2048-wide one flat, and priced
# SmolLM2's 32-row prefill 1.53x slow; a median of 5 costs ~0.6 s more (~0.3 s a repeat on this 2-core host)
PREFILL_SEQUENCES, PREFILL_TOKENS, PREFILL_WEIGHTS, PREFILL_REPEATS = 2, 48, 12_000_000, 5
PREFILL_REREAD_REPEATS = 3  # each later reading of the passes (PrefillPasses: two more, ~1.5 s each here)
# the fp32 spans' prefill passes run at three row counts (these many prompts of PREFILL_TOKENS: 48, 96 and 288 rows),
# which give the rate by rows (prefill_curve). Issue 23, session 16: a 2048-wide block multiplied at ~80 GFLOP/s over
# 32 rows, ~135 over 96, ~180 over 384-512 (BLAS packs a weight once a call whatever its rows), a 576-wide one at ~70,
# ~115 and ~130-145; the one rate of 96-row passes priced the wide model's 32-row prefills 0.68x their time and its
# 384-512-row ones 1.22-1.26x. Session 18: at two row counts (96, 288) one pass at a swing of the host set the line: a
# quick measurement put a 576-wide block's cost beyond its FLOPs at 7.5 ms (a 32-row pass of one takes ~3.5) and
# SmolLM2's 32-row prefill 1.45x slow; a third count nearer the prompts people type, and a line robust to one bad
# point (line_of_passes), cost ~0.3 s
PREFILL_SEQUENCE_COUNTS = (1, PREFILL_SEQUENCES, 6)


def block_weights(block) -> int:
    """Matrix weights of one decoder block (its four linears, fp32 or packed)."""
    return sum(getattr(getattr(block, parent), child).in_features * getattr(getattr(block, parent), child).out_features
               for parent, child in PACKED_LINEARS)


def prefill_pass(config, span, dtype: torch.dtype = torch.float32,
                 sequences: int = PREFILL_SEQUENCES) -> tuple[Callable[[], None], float, int]:
    """(a prefill through the span's first blocks, its FLOPs, its blocks): `sequences` prompts of PREFILL_TOKENS
    tokens from position 0 through the runtime's prefill path (Span.forward, block by block: the products of many rows
    on OpenBLAS for fp32, on the int8 kernels for packed linears, torch's for bf16), the inputs and cache in `dtype`
    (the span's)."""
    from hivekeeper.core.runtime.model import KVCache, Span

    per_block = block_weights(span.blocks[0])
    blocks = max(1, min(len(span.blocks), round(PREFILL_WEIGHTS / per_block)))
    part = Span(replace(config, num_layers=blocks), 0, blocks, list(span.blocks[:blocks]))
    cache = KVCache.allocate(config, blocks, sequences, DECODE_SPAN_POSITIONS, dtype)
    hidden = (torch.randn(sequences, PREFILL_TOKENS, config.hidden_size) * 0.1).to(dtype)
    rows = sequences * PREFILL_TOKENS
    attention = 4.0 * config.hidden_size * PREFILL_TOKENS * (PREFILL_TOKENS + 1) / 2 * sequences
    flops = blocks * (2.0 * rows * per_block + attention)

    def run() -> None:
        cache.length = 0
        with torch.inference_mode():
            part(hidden, cache)

    return run, flops, blocks


@dataclass(frozen=True)
class PrefillRun:
    """Prefill passes of one span at one row count: seconds of each repeat, FLOPs of a pass, blocks, rows a product,
    the blocks' width and matrix weights a block."""

    seconds: list[float]
    flops: float
    blocks: int
    rows: int
    hidden: int
    block_weights: int

    @property
    def median_s(self) -> float:
        return median_and_spread(self.seconds)[0]


def prefill_runs(passes: list[tuple[Callable[[], None], float, int]], seconds: list[list[float]], configs: tuple,
                 first_blocks: tuple) -> list[PrefillRun]:
    """The timed passes (prefill_pass's, in PREFILL_SEQUENCE_COUNTS order, each over the spans of `configs`) as
    PrefillRun, the fewer rows first for each span."""
    runs = []
    for i, ((_, flops, blocks), times) in enumerate(zip(passes, seconds)):
        config, block = configs[i % len(configs)], first_blocks[i % len(configs)]
        runs.append(PrefillRun(times, flops, blocks, PREFILL_SEQUENCE_COUNTS[i // len(configs)] * PREFILL_TOKENS,
                               config.hidden_size, block_weights(block)))
    return runs


class PrefillPasses:
    """The prefill passes through the two stream spans (prefill_pass at every PREFILL_SEQUENCE_COUNTS row count,
    each over the wide span and then the narrow one), built once and read (timed in turn) once or more. Issue 23,
    session 19: one reading lasts ~2 s, and a quick measurement whose one reading fell in a slow spell of the host
    (every pass 1.4-1.9x its usual time, the rest of the run at the usual speed) priced every prefill 1.4-1.7x slow,
    which the calibration, whose matmul fraction only goes down, could not undo; another read one pass (2048 wide,
    288 rows) 1.3x slow and fitted that width flat. run_benchmarks reads them again in the middle and at the end of
    the measurement (StreamRereads.read_prefill), and each pass's time is the median of the readings' medians."""

    def __init__(self, configs: tuple, spans: tuple):
        self.configs = configs
        self.first_blocks = tuple(span.blocks[0] for span in spans)
        self.passes = [prefill_pass(config, span, sequences=sequences) for sequences in PREFILL_SEQUENCE_COUNTS
                       for config, span in zip(configs, spans)]
        self.readings: list[list[list[float]]] = []  # per reading, each pass's seconds of every repeat

    def read(self, repeats: int) -> None:
        """One reading: every pass `repeats` times in turn (after one warm-up each)."""
        self.readings.append(_alternating_seconds([run for run, _, _ in self.passes], repeats))

    def repeats(self) -> tuple[int, ...]:
        """The repeats of each reading."""
        return tuple(len(reading[0]) for reading in self.readings)

    def runs(self) -> list[PrefillRun]:
        """The passes as PrefillRun: with one reading, each repeat's seconds; with more, each reading's median
        (their median is the pass's time: one reading at a slow spell of the host does not set it)."""
        if len(self.readings) == 1:
            seconds = self.readings[0]
        else:
            seconds = [[statistics.median(reading[i]) for reading in self.readings] for i in range(len(self.passes))]
        return prefill_runs(self.passes, seconds, self.configs, self.first_blocks)


def rate_and_intercept(passes: list[tuple[float, float]], blocks: int) -> tuple[float, float]:
    """(FLOP/s, seconds a block) with seconds = FLOPs / rate + blocks x intercept, fitted to passes (seconds, FLOPs)
    of the same blocks at several row counts (line_of_passes); where noise makes the split meaningless (no slope, or
    a negative intercept), no intercept and the passes' mean rate."""
    line = line_of_passes(passes)
    if line is not None:
        slope, at_zero = line
        if at_zero >= 0:
            return 1.0 / slope, at_zero / blocks
    return sum(f for _, f in passes) / sum(t for t, _ in passes), 0.0


def line_of_passes(passes: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(seconds per FLOP, seconds at no FLOPs) of the line through passes (seconds, FLOPs) by Theil-Sen: the median
    of the slopes between every two passes, then the median of each pass's time less its FLOPs at that slope, so one
    pass at a swing of the host does not set it (with two passes: the line through both). None where the slope is
    not positive."""
    slopes = [(t2 - t1) / (f2 - f1) for i, (t1, f1) in enumerate(passes) for t2, f2 in passes[i + 1:] if f2 != f1]
    slope = statistics.median(slopes) if slopes else 0.0
    if slope <= 0:
        return None
    return slope, statistics.median(t - f * slope for t, f in passes)


def prefill_curve(runs: list[PrefillRun]) -> tuple[float, dict[int, tuple[float, float]]]:
    """(a block's fixed cost in a prefill, {width: (peak FLOP/s, half-rate rows)}) from passes of two spans of
    different widths at several row counts each (PREFILL_SEQUENCE_COUNTS): per width, seconds = FLOPs / peak +
    blocks x intercept (rate_and_intercept); the intercept of a block of W weights is 2 W x half rows / peak + the
    fixed cost, the half-rate rows taken alike at both widths to split the two (the fixed cost kept from 0 to the
    smaller intercept, the rest each width's own half-rate rows)."""
    by_width: dict[int, list[PrefillRun]] = {}
    for run in runs:
        by_width.setdefault(run.hidden, []).append(run)
    fits = {}
    for width, passes in by_width.items():
        rate, intercept = rate_and_intercept([(r.median_s, r.flops) for r in passes], passes[0].blocks)
        fits[width] = (rate, intercept, 2.0 * passes[0].block_weights / rate)  # the last: seconds a row a block at peak
    widths = sorted(fits)
    thin, wide = fits[widths[0]], fits[widths[-1]]
    shared = (wide[1] - thin[1]) / (wide[2] - thin[2]) if wide[2] != thin[2] else 0.0
    fixed = min(max(0.0, thin[1] - thin[2] * shared), thin[1], wide[1])
    return fixed, {width: (rate, (intercept - fixed) / per_row) for width, (rate, intercept, per_row) in fits.items()}


def prefill_measurements(runs: list[PrefillRun], load: float, readings: tuple[int, ...] = ()) -> list[Measurement]:
    """The fp32 prefill rate by rows at each span's width (PREFILL_PEAK_KEY, PREFILL_HALF_ROWS_KEY: prefill_curve),
    a block's fixed cost in a prefill (PREFILL_BLOCK_KEY), and the widest span's rate at PREFILL_SEQUENCES x
    PREFILL_TOKENS rows (PREFILL_FLOPS_KEY: the CPU's fp32 FLOP/s the planner shows and prices other than by rows),
    from the passes' median times. `readings`: the repeats of each reading the runs' seconds come from, where
    there were several (PrefillPasses.runs: each second a reading's median), for the detail."""
    fixed, curve = prefill_curve(runs)
    timed = (f"{len(runs[0].seconds)} repeats each" if len(readings) < 2 else
             f"read {len(readings)} times over the measurement, {' + '.join(map(str, readings))} repeats each; each "
             "pass the median of the readings' medians")
    widths = sorted(curve)
    shown = [r for r in runs if r.hidden == widths[-1] and r.rows == PREFILL_SEQUENCES * PREFILL_TOKENS]
    detail = (f"prefill passes of {', '.join(str(n * PREFILL_TOKENS) for n in PREFILL_SEQUENCE_COUNTS)} rows "
              f"({PREFILL_TOKENS}-token prompts) through random fp32 blocks of widths "
              f"{' and '.join(map(str, widths))}, in turn ({timed}): "
              + ", ".join(f"{r.blocks} x {r.hidden} at {r.rows} rows {r.median_s * 1e3:.3g} ms" for r in runs)
              + " (medians), through the runtime's prefill path")
    peak, half_rows = curve[widths[-1]]
    rows = PREFILL_SEQUENCES * PREFILL_TOKENS
    rate = rate_at_rows(peak, half_rows, rows)
    # each repeat's reading: the fitted rate scaled by the pass's median over that repeat (the fixed cost taken off
    # each repeat instead made a near-zero divisor of a busy run's fit: "spread 19768669886%", session 22)
    samples = [rate * r.median_s / s for r in shown for s in r.seconds if s > 0]
    found = [Measurement(PREFILL_FLOPS_KEY, "fp32 prefill through decoder blocks", rate, "FLOP/s",
                         median_and_spread(samples)[1] if samples else 0.0, len(samples), load,
                         f"the width-{widths[-1]} rate at {rows} rows; {detail}", samples),
             Measurement(PREFILL_BLOCK_KEY, "fixed cost of a block in a prefill", fixed, "s", 0.0,
                         len(runs[0].seconds), load, f"fitted with the rates by rows: {detail}")]
    for width in widths:
        peak, half_rows = curve[width]
        found += [Measurement(f"{PREFILL_PEAK_KEY}{width}", f"fp32 prefill peak, width {width}", peak, "FLOP/s", 0.0,
                              len(runs[0].seconds), load, f"rate = peak x rows / (rows + half rows); {detail}"),
                  Measurement(f"{PREFILL_HALF_ROWS_KEY}{width}", f"fp32 prefill half-rate rows, width {width}",
                              half_rows, "rows", 0.0, len(runs[0].seconds), load,
                              f"rate = peak x rows / (rows + half rows); {detail}")]
    return found


def block_overhead(per_block: float, wide: tuple[list[float], float, int], narrow: tuple[list[float], float, int],
                   load: float, detail: str) -> Measurement:
    """The fixed cost of a block as measured: `per_block` (fit_bytes_and_blocks's, of the fastest steps: 0 where
    the fit fell below the noise), with its spread measured, not assumed: the fit of each pair of repeats (the
    fastest wide step with the fastest narrow one, the second with the second, ...) is a sample, and the spread is
    their range over the fastest pair's fit. Each run is (seconds of every repeat, bytes, blocks)."""
    (s1, b1, n1), (s2, b2, n2) = wide, narrow
    fits = [block_fit((a, b1, n1), (b, b2, n2)) for a, b in zip(sorted(s1), sorted(s2))]
    spread = (max(fits) - min(fits)) / abs(fits[0]) if fits and fits[0] else 0.0
    if per_block <= 0 and fits:
        detail += (f"; the fit came out at {fits[0] * 1e3:.3g} ms, which the noise of the steps does not resolve: "
                   "not measured, plans take 0")
    return Measurement(BLOCK_OVERHEAD_KEY, "fixed cost of a block in a decode step", per_block, "s", spread,
                       len(fits), load, detail, fits)


def block_fit(a: tuple[float, float, int], b: tuple[float, float, int]) -> float:
    """Seconds per block with seconds = bytes / bandwidth + blocks x per-block for two runs (seconds, bytes,
    blocks), as solved, whatever its sign (0 where the two runs cannot separate the terms)."""
    (t1, b1, n1), (t2, b2, n2) = a, b
    determinant = n2 * b1 - n1 * b2
    return (t2 * b1 - t1 * b2) / determinant if determinant else 0.0


def fit_bytes_and_blocks(a: tuple[float, float, int], b: tuple[float, float, int]) -> tuple[float, float]:
    """(seconds per block, bytes/s) with seconds = bytes / bandwidth + blocks x per-block for two runs
    (seconds, bytes, blocks). Where noise makes the split meaningless (a negative cost, or a cost that explains
    a whole run), the per-block cost is 0 and the bandwidth is the faster run's bytes/s."""
    (t1, b1, n1), (t2, b2, n2) = a, b
    per_block = block_fit(a, b)
    if per_block <= 0 or per_block * n1 >= t1 * 0.9 or per_block * n2 >= t2 * 0.9:
        return 0.0, max(b1 / t1, b2 / t2)
    return per_block, b1 / (t1 - n1 * per_block)


def decode_path_name() -> str:
    """What runs a one-row fp32 decode step here: the native kernels (which build) or numpy."""
    return f"the native kernels ({native_kernels.status()})" if native_kernels.library() is not None else "numpy"


def stream_span_configs(hidden: int, total_bytes: int, cache_bytes: int | None = None, thin: int = STREAM_THIN):
    """(config of the wide span, config of the thin one) that StreamSpans.make builds: widths `hidden` and
    thin_width(hidden, thin), each of about `total_bytes` and of at least twice the last-level cache (a block more
    where whole blocks fall short of it: a 2048-wide block is 172 MiB)."""
    beyond = 2 * (last_level_cache_bytes() if cache_bytes is None else cache_bytes)
    configs = []
    for width in (hidden, thin_width(hidden, thin)):
        config = decode_span_config(width, max(total_bytes, beyond))
        blocks = max(config.num_layers, -(-beyond // (config.block_param_count() * 4)))
        configs.append(replace(config, num_layers=blocks))
    return tuple(configs)


@dataclass
class StreamSpans:
    """The two spans of random fp32 decoder blocks the decode steps' streaming rate is read from (measure_decode_blocks's:
    one `hidden` wide, one thin_width(hidden, thin) wide, each beyond twice the last-level cache), built once and read
    many times."""

    wide_config: object
    wide: torch.nn.Module
    narrow_config: object
    narrow: torch.nn.Module
    prefills: "PrefillPasses | None" = field(default=None, repr=False, compare=False)

    @classmethod
    def make(cls, hidden: int, total_bytes: int, cache_bytes: int | None = None,
             thin: int = STREAM_THIN) -> "StreamSpans":
        (wide_config, wide), (narrow_config, narrow) = (
            span_of_config(config) for config in stream_span_configs(hidden, total_bytes, cache_bytes, thin))
        return cls(wide_config, wide, narrow_config, narrow)

    def prefill_passes(self) -> PrefillPasses:
        """The prefill passes through the two spans (built at the first call, then the same)."""
        if self.prefills is None:
            self.prefills = PrefillPasses((self.wide_config, self.narrow_config), (self.wide, self.narrow))
        return self.prefills

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((bytes, blocks) of the wide span, the same of the narrow one)."""
        return tuple((sum(p.numel() * 4 for p in span.parameters()), config.num_layers)
                     for config, span in ((self.wide_config, self.wide), (self.narrow_config, self.narrow)))


@dataclass(frozen=True)
class StreamReading:
    """One reading of the streaming rate: bytes/s and a block's fixed cost fitted to the two spans' median one-row
    steps (fit_bytes_and_blocks), with every step's seconds; and, where few-row steps were timed with them, each
    span's few-row reads by that fit (ROW_READS_AT_KEY<width>x<rows> -> row_reads: the same moment's ratio)."""

    bandwidth: float
    per_block: float
    wide_s: list[float]
    narrow_s: list[float]
    reads: dict[str, float] = field(default_factory=dict)


def stream_reading(spans: StreamSpans, repeats: int, few_rows: tuple[int, ...] = ()) -> StreamReading:
    """The decode steps' streaming rate now: `repeats` one-row steps of each span timed in turn (after one warm-up
    each), fitted on their medians; with `few_rows`, steps of those many rows through both spans timed in the same
    loop, and their reads by that fit. Runs in the thread layout set (the runtime's: cpu_matmul.use_blas_threads)."""
    shapes = spans.shapes()
    configs = ((spans.wide_config, spans.wide), (spans.narrow_config, spans.narrow))
    timed = _alternating_seconds([decode_steps(config, span, rows) for rows in (1, *few_rows)
                                  for config, span in configs], repeats)
    (b1, n1), (b2, n2) = shapes
    s1, s2 = timed[:2]
    per_block, bandwidth = fit_bytes_and_blocks((statistics.median(s1), b1, n1), (statistics.median(s2), b2, n2))
    reads = {f"{ROW_READS_AT_KEY}{config.hidden_size}x{rows}": row_reads(statistics.median(seconds), nbytes, blocks,
                                                                           per_block, bandwidth)
             for rows, pair in zip(few_rows, zip(timed[2::2], timed[3::2]))
             for seconds, (config, _), (nbytes, blocks) in zip(pair, configs, shapes)}
    return StreamReading(bandwidth, per_block, s1, s2, reads)


# run_benchmarks reads the decode steps' streaming rate four more times after measure_decode_blocks's reading, spread
# over the rest of the measurement (after the decode steps, the bf16 step, the disk, and last before the packed spans),
# and the profile keeps their pooled fit (fold_stream_readings). One reading lasts a fraction of a second, and this VM's
# rate moved 5.4-12.9 GB/s between readings seconds apart (bench/stream_vs_decode.py, load 2.5-3.8): one is a moment's.
class StreamRereads:
    """The later readings of the decode steps' streaming rate during run_benchmarks, on measure_decode_blocks's spans
    (built at the first call of built()) and dropped by pool()."""

    def __init__(self, sizes: "BenchmarkSizes"):
        self.sizes, self.spans, self.readings = sizes, None, []

    def built(self) -> StreamSpans:
        """The spans (built at the first call): measure_decode_blocks's, then every later reading's."""
        if self.spans is None:
            self.spans = StreamSpans.make(self.sizes.stream_hidden, self.sizes.stream_bytes, self.sizes.cache_bytes,
                                          self.sizes.stream_thin)
        return self.spans

    def read(self) -> list[Measurement]:
        """One more reading (kept in self.readings; no measurement of its own: fold_stream_readings)."""
        sizes = self.sizes
        self.in_runtime_threads(lambda: self.readings.append(
            stream_reading(self.built(), max(sizes.repeats, sizes.step_repeats), FEW_ROW_COUNTS)))
        return []

    def read_prefill(self) -> list[Measurement]:
        """One more reading of the prefill passes through the spans (PREFILL_REREAD_REPEATS in turn); no measurement
        of its own (pool folds them)."""
        self.in_runtime_threads(lambda: self.built().prefill_passes().read(PREFILL_REREAD_REPEATS))
        return []

    @staticmethod
    def in_runtime_threads(read: Callable[[], None]) -> None:
        """read() in the runtime's thread layout, as measure_decode_blocks reads it in; torch's threads restored."""
        previous_threads = torch.get_num_threads()
        use_blas_threads()
        try:
            read()
        finally:
            torch.set_num_threads(previous_threads)

    def pool(self, results: list[Measurement]) -> list[Measurement]:
        """The last reading, then `results` (in place) with the pooled fit of all of them (fold_stream_readings) in
        place of measure_decode_blocks's, and its prefill measurements from every reading of the passes
        (fold_prefill_readings), and the spans dropped; no measurement of its own."""
        self.read()
        results[:] = fold_prefill_readings(fold_stream_readings(results, self.readings, self.built().shapes()),
                                           self.built().prefill_passes())
        self.spans = None
        return []


def fold_prefill_readings(results: list[Measurement], prefills: PrefillPasses) -> list[Measurement]:
    """`results` with the prefill measurements (prefill_measurements' keys) made again from every reading of the
    passes (PrefillPasses.runs: each pass the median of the readings' medians), in place of the first reading's;
    unchanged with one reading or without the first's measurements."""
    if len(prefills.readings) < 2 or not any(m.key == PREFILL_BLOCK_KEY for m in results):
        return results
    again = {m.key: m for m in prefill_measurements(prefills.runs(), load_average(), prefills.repeats())}
    return [replace(again[m.key], loadavg=max(m.loadavg, again[m.key].loadavg)) if m.key in again else m
            for m in results]


def step_seconds(reading: StreamReading, shape: tuple[int, int]) -> float:
    """A one-row step through a span of (bytes, blocks) as a reading's fit gives it back: bytes / rate + blocks x
    a block's fixed cost."""
    nbytes, blocks = shape
    return nbytes / reading.bandwidth + blocks * reading.per_block


def pooled_reading(readings: list[StreamReading], shapes: tuple[tuple[int, int], tuple[int, int]]) -> StreamReading:
    """One reading from several: each span's median step over them (each reading's step as its fit gives it back),
    fitted again (fit_bytes_and_blocks). The rate and a block's cost stay one consistent fit, robust to a reading
    whose wide or narrow steps caught a fast or a slow moment (either moves both terms of its own fit)."""
    if not readings:
        raise ValueError("no readings")
    wide, narrow = shapes
    wide_s, narrow_s = ([step_seconds(r, shape) for r in readings] for shape in (wide, narrow))
    per_block, bandwidth = fit_bytes_and_blocks((statistics.median(wide_s), *wide), (statistics.median(narrow_s), *narrow))
    return StreamReading(bandwidth, per_block, wide_s, narrow_s)


SPREAD_MOMENTS = "spread over the measurement"  # when fold_stream_readings's later readings were taken (its default)


def fold_stream_readings(results: list[Measurement], later: list[StreamReading],
                         shapes: tuple[tuple[int, int], tuple[int, int]],
                         moments: str = SPREAD_MOMENTS) -> list[Measurement]:
    """`results` with the decode steps' streaming rate (WEIGHT_STREAM_KEY) and a block's fixed cost
    (BLOCK_OVERHEAD_KEY) pooled from measure_decode_blocks's reading and the `later` ones (pooled_reading, on the
    spans' (bytes, blocks) `shapes`); the rate's samples are then the readings' rates, its spread their range over
    their median; a few-row step's reads are the median of every reading's (pooled_reads). `moments`: when the later
    readings were taken, for the details. Unchanged without later readings or without the decode steps'
    measurements."""
    by_key = {m.key: m for m in results}
    stream, block = by_key.get(WEIGHT_STREAM_KEY), by_key.get(BLOCK_OVERHEAD_KEY)
    if not later or stream is None or block is None:
        return results
    readings = [StreamReading(stream.value, block.value, [], []), *later]
    pooled = pooled_reading(readings, shapes)
    rates = [r.bandwidth for r in readings]
    listed = ", ".join(f"{r.bandwidth / 1e9:.3g} GB/s {r.per_block * 1e3:.2g} ms" for r in readings)
    words = f"; fitted again to the median steps of {len(rates)} readings {moments} ({listed})"
    folded = {WEIGHT_STREAM_KEY: replace(stream, value=pooled.bandwidth, spread=median_and_spread(rates)[1],
                                         repeats=len(rates), samples=rates, loadavg=max(stream.loadavg, load_average()),
                                         detail=stream.detail + words),
              BLOCK_OVERHEAD_KEY: replace(block, value=pooled.per_block, detail=block.detail + words)}
    folded.update({m.key: pooled_reads(m, later, moments) for m in results if m.key.startswith(ROW_READS_AT_KEY)})
    four = [key for key in folded if key.startswith(ROW_READS_AT_KEY) and key.endswith(f"x{FEW_ROWS}")]
    if four and SMALL_ROWS_READS_KEY in by_key:  # older profiles' one figure: the wide span's 4-row reads
        wide = max(four, key=lambda key: int(key[len(ROW_READS_AT_KEY):].split("x")[0]))
        folded[SMALL_ROWS_READS_KEY] = replace(by_key[SMALL_ROWS_READS_KEY], value=folded[wide].value,
                                               spread=folded[wide].spread, samples=folded[wide].samples,
                                               repeats=folded[wide].repeats)
    return [folded.get(m.key, m) for m in results]


def pooled_reads(reads: Measurement, later: list[StreamReading], moments: str = SPREAD_MOMENTS) -> Measurement:
    """A few-row step's reads (row_reads: over its own reading's one-row fit) as the median of the first reading's
    and every later reading's of the same key, at least 1; unchanged where no later reading timed it. Session 17:
    one reading's few-row steps at a moment of the host put the 576-wide span's 4-row reads at 1.18-1.89 between
    quick measurements; a ratio to the one-row step of the same seconds, read five times over the measurement, is
    the machine's typical one, which the cost model prices at the pooled rate."""
    samples = [reads.value, *(r.reads[reads.key] for r in later if reads.key in r.reads)]
    if len(samples) == 1:
        return reads
    return replace(reads, value=max(1.0, statistics.median(samples)), spread=median_and_spread(samples)[1],
                   repeats=len(samples), samples=samples,
                   detail=f"{reads.detail}; the median of {len(samples)} readings {moments} "
                          f"({', '.join(f'{x:.3g}' for x in samples)})")


def _alternating_seconds(runs: list[Callable[[], None]], repeats: int) -> list[list[float]]:
    """Seconds of each run per repeat, timed in turn (a, b, a, b, ...) after one warm-up each, so that a busy spell
    on a shared machine hits all of them."""
    for run in runs:
        run()  # first touch of the pages, kernel choice
    seconds: list[list[float]] = [[] for _ in runs]
    for _ in range(max(1, repeats)):
        for run, times in zip(runs, seconds):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return seconds


# ---- the packed formats' kernels -----------------------------------------------------------------------------------
# the packed spans' steps take milliseconds: at least this many repeats each, so that their median spans more of the
# host's swings than a fraction of a second (a busy check: two quick measurements a minute apart read the cached q4_1
# rate at 4.9 and 16.2 G weights/s with 4 repeats each)
PACKED_STEP_REPEATS = 9
PACKED_HIDDEN = 768  # the packed spans' width: a thin model's blocks (SmolLM2's are 576 wide, a 7B model's 4096)
PACKED_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))
# what a cached packed rate holds besides its weights' products (PACKED_CACHED_KEY; said with the rate and under the
# `measure` table): a step through the span costs a start and an end whatever its blocks, which the blocks' fitted
# cost does not take out (the two spans it is fitted to pay it alike); a third of a 32 MiB L3 holds 2-3 blocks of 768,
# the streamed spans 27-51 of 576 (QUICK, session 25: q8_0 0.72 ms a step cached, 19 G weights/s; 31 streamed)
CACHED_RATE_CAVEAT = ("what a step costs once, whatever its blocks (the call into the span, its start and end), "
                      "stays in this rate: over so few blocks it weighs far more than over the streamed span's many, "
                      "so the rate can read below the streamed one")


def random_packed_matrix(fmt: str, outs: int, cols: int, seed: int = 0, out: np.ndarray | None = None):
    """A QuantizedMatrix of random codes with small fp16 scales (and mins): made in milliseconds, where quantizing
    fp32 weights of this size takes a second; the kernels' speed does not depend on the values. `out` (uint8, the
    packed size): the blocks are written there (a span's one buffer) and filled with one byte rather than random
    ones, which is faster still."""
    from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedMatrix
    from hivekeeper.core.runtime.quant.blocks import BLOCK_WEIGHTS, format_named

    block = format_named(fmt)
    shape = (outs, cols // BLOCK_WEIGHTS, block.block_bytes)
    if out is None:
        blocks = np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)
    else:
        blocks = out.reshape(shape)
        blocks.fill(0x5A)
    scales = 2 if fmt == "q8_0" or fmt == "q4_0" else 4  # fp16 d (and Q4_1's fp16 min m) lead each block
    blocks[:, :, :scales] = np.frombuffer(np.full(scales // 2, 0.01, dtype=np.float16).tobytes(), dtype=np.uint8)
    return QuantizedMatrix(block, blocks.reshape(outs, -1), outs, cols)


def packed_span(fmt: str, hidden: int, total_bytes: int, arena: np.ndarray | None = None):
    """(config, span, weights) of random decoder blocks of width `hidden` shaped as decode_span's, whose four
    linears are `fmt`-packed (QuantizedLinear, as a GGUF's blocks load) in one buffer in reading order, repeated to
    about `total_bytes` of packed weights: a step through it is a packed model's decode step (the native kernels'
    whole-span call), caches cold between blocks once the span exceeds the last-level cache. `arena` (uint8): the
    buffer to lay them in, from its start, as many whole blocks as reach `total_bytes` (it must hold them:
    packed_arena), so that spans of several formats timed in turn share one buffer (their values do not matter)."""
    from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear
    from hivekeeper.core.runtime.model import Span
    from hivekeeper.core.runtime.quant.blocks import BLOCK_WEIGHTS, format_named

    probe = packed_block_config(hidden)
    bytes_per_weight = format_named(fmt).block_bytes / BLOCK_WEIGHTS
    per_block = probe.block_param_count() * bytes_per_weight
    blocks = max(1, round(total_bytes / per_block) if arena is None else math.ceil(total_bytes / per_block))
    config = replace(probe, num_layers=blocks)
    with torch.device("meta"):
        span = Span(config, 0, blocks)
    shapes = [(getattr(getattr(block, parent), child), parent, child) for block in span.blocks
              for parent, child in PACKED_LINEARS]  # still on "meta": their fp32 weights are never allocated
    sizes = [int(layer.out_features * layer.in_features * bytes_per_weight) for layer, _, _ in shapes]
    arena, offset = np.empty(sum(sizes), dtype=np.uint8) if arena is None else arena[:sum(sizes)], 0
    for (layer, parent, child), size, block in zip(shapes, sizes, [b for b in span.blocks for _ in PACKED_LINEARS]):
        matrix = random_packed_matrix(fmt, layer.out_features, layer.in_features, out=arena[offset:offset + size])
        setattr(getattr(block, parent), child, QuantizedLinear(matrix))
        offset += size
    for block in span.blocks:
        block.input_layernorm.to_empty(device="cpu")
        block.post_attention_layernorm.to_empty(device="cpu")
    span.requires_grad_(False)
    with torch.no_grad():
        for name, param in span.named_parameters():
            param.fill_(1.0 if name.endswith("layernorm.weight") else 0.0)
        span.rotary = type(span.rotary)(config)
        for block in span.blocks:
            block.rotary = span.rotary
    weights = sum(layer.out_features * layer.in_features for layer, _, _ in shapes)
    return config, span, weights


def packed_block_config(hidden: int):
    """A one-block ModelConfig of the packed spans' shape at width `hidden`: the fp32 spans' (decode_span_config:
    heads of 64, grouped_kv_heads of them K/V heads, an MLP 2.75x as wide; SmolLM2's 576 -> 9 heads, 3 K/V, 1536)."""
    return decode_span_config(hidden, 0)


def packed_arena(hidden: int, total_bytes: int) -> np.ndarray:
    """One uint8 buffer that holds a packed_span of any format of `total_bytes` at width `hidden` (whole blocks: one
    block of the widest format more), for the streamed spans of the three formats to share: they are timed in turn
    and each reads all of its bytes, so the caches are as cold for each as with a buffer of its own, at a third of
    the memory."""
    from hivekeeper.core.runtime.quant.blocks import FORMATS

    widest = max(format_bytes(name) for name in FORMATS)
    return np.empty(int(total_bytes + packed_block_config(hidden).block_param_count() * widest) + 64, dtype=np.uint8)


def measure_packed_kernels(repeats: int = 5, hidden: int = PACKED_HIDDEN, total_bytes: int = 384 << 20,
                           cache_bytes: int | None = None, streamed: bool = True,
                           step_repeats: int = STEP_REPEATS, stream_hidden: int = STREAM_THIN) -> list[Measurement]:
    """Weights/s of each packed format (GGUF Q8_0/Q4_0/Q4_1) in a decode step as a packed model takes it, and the
    fixed cost of a packed block beside it: one-row steps through spans of random packed blocks (packed_span), on
    the runtime's own decode path (the native kernels' whole-span step, or numpy's dequantized products where they
    are missing), in two regimes:

    - cached (PACKED_CACHED_KEY): a span of a third of the last-level cache, `hidden` wide, stepped through again and
      again, so its weights stay in the cache, as a small model's do (issue 23: SmolLM2's 84 MB of packed weights fit
      a 105 MiB L3, and decoded faster than a span beyond it); and a span of as many bytes of narrower blocks
      (narrow_width: many more of them). Fitting seconds = weights / rate + blocks x fixed cost to the two
      (fit_bytes_and_blocks, as the fp32 spans are fitted) gives a packed block's fixed cost (its norms, attention,
      the kernels' hand-offs), and the median of the three formats' fits is PACKED_BLOCK_KEY (packed_block_overhead:
      one cost, as robust as three readings), which the planner adds to each block of a packed model; each cached
      rate is its span's step less that cost. Issue 23 (session 14): subtracting the fp32 spans' fitted cost instead (0.3-0.43 ms a block on an
      AVX512-VNNI host, where a whole 768-wide packed block took ~0.26 ms) left the 25% floor of
      packed_kernel_seconds, a rate 4x too high, and the planner then added 0.3 ms to each of SmolLM2's 30 blocks:
      9 ms of a 6.3 ms step;
    - streamed (PACKED_KERNEL_KEY, only with `streamed`): a span of `stream_hidden`-wide blocks (a thin model's:
      STREAM_THIN, SmolLM2's 576), of `total_bytes` or twice the last-level cache, the larger, so caches are cold
      between blocks and the packed bytes come from RAM, as a model beyond the cache takes them; its rate is its step
      less the same fitted cost a block. The three formats' streamed spans share one buffer (packed_arena). Issue 14
      item 12 / 23 (session 15): `measure --quick` timed the cached spans only (3 blocks, ~0.9 ms a step), and the
      planner priced SmolLM2's 66 MB of Q4_1 blocks, twice a 32 MiB L3, at their rate: between quick measurements
      it read 3.4-26.7 G weights/s and put the model at 0.54-0.90x its measured tokens/s; the streamed span is that
      model's shape (47 blocks of 576, 7-8 ms a step) and read 31-34 G weights/s in three measurements in a row
      (load 1.4): ~22 G weights/s before the blocks' fixed cost, where the model's blocks in `generate` took ~23.

    The planner takes the cached rate for a model whose weights fit the cache, the streamed one for a model twice its
    size, and blends between (costmodel.cached_share).

    The spans are timed in turn (q8_0, q4_0, q4_1, the narrow ones, q8_0, ...), at least `step_repeats` times each,
    and each keeps the median of its repeats (median_and_spread): on a shared machine a busy spell hits every span
    alike rather than one of them, and the rate is the machine's typical one, not its luckiest instant.

    A prefill pass through each cached span's first blocks (prefill_pass, in turn) gives PACKED_PREFILL_KEY: row-weight
    products/s of the int8 kernels on many rows, the blocks' own costs included (the planner adds no per-block
    prefill cost beside it: the fp32 spans' fitted one is mostly OpenBLAS's thin GEMMs, which packed blocks skip)."""
    from hivekeeper.core.runtime.quant.blocks import FORMATS

    cache = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    cached, stream = max(cache // 3, 1), max(total_bytes, 2 * cache)
    previous_threads = torch.get_num_threads()
    use_blas_threads()  # the runtime's thread layout (its decode path depends on it)
    try:
        load = load_average()
        spans = {(PACKED_CACHED_KEY, name): packed_span(name, hidden, cached) for name in FORMATS}
        if streamed:
            arena = packed_arena(stream_hidden, stream)
            spans.update({(PACKED_KERNEL_KEY, name): packed_span(name, stream_hidden, stream, arena)
                          for name in FORMATS})
        spans.update({(PACKED_BLOCK_KEY, name): packed_span(name, narrow_width(hidden), cached)
                      for name in FORMATS})
        steps = {(key, name, 1): decode_steps(config, span, 1) for (key, name), (config, span, _) in spans.items()}
        steps.update({(PACKED_ROWS_KEY, name, rows): decode_steps(config, span, rows)
                      for (key, name), (config, span, _) in spans.items() if key == PACKED_KERNEL_KEY
                      for rows in PACKED_ROW_COUNTS})
        timed = dict(zip(steps, _alternating_seconds(list(steps.values()), max(repeats, step_repeats))))
        prefills = {name: prefill_pass(config, span) for (key, name), (config, span, _) in spans.items()
                    if key == PACKED_CACHED_KEY}
        prefill_timed = _alternating_seconds([run for run, _, _ in prefills.values()], PREFILL_REPEATS)
    finally:
        torch.set_num_threads(previous_threads)
    runs = {key: (timed[(*key, 1)], weights, config.num_layers) for key, (config, _, weights) in spans.items()}
    block = packed_block_overhead({name: (runs[(PACKED_CACHED_KEY, name)], runs[(PACKED_BLOCK_KEY, name)])
                                   for name in FORMATS}, load, f"widths {hidden} and {narrow_width(hidden)}")
    path = "native kernels" if native_kernels.library() is not None else "numpy (no native kernels)"
    results, block_s = [], block.value
    for (key, name), (seconds, weights, count) in runs.items():
        if key == PACKED_BLOCK_KEY:
            continue
        kernel_seconds = [packed_kernel_seconds(s, count, block_s) for s in seconds]
        where = "in the last-level cache" if key == PACKED_CACHED_KEY else "beyond the caches"
        width = hidden if key == PACKED_CACHED_KEY else stream_hidden
        results.append(_median_rate_measurement(
            f"{key}{name}", f"{name} one-row decode steps of {count} blocks {where}", WEIGHTS_PER_S, float(weights),
            kernel_seconds, load,
            f"one-row decode steps of {count} random {name} blocks of width {width} "
            f"({weights * format_bytes(name) / 2**20:.0f} MiB packed, {where}: {cache / 2**20:.0f} MiB), {path}, "
            f"median {median_and_spread(seconds)[0] * 1e3:.3g} ms less {block_s * 1e3:.3g} ms a block (the fixed "
            "cost fitted to the packed spans); the spans timed in turn"
            + (f"; {CACHED_RATE_CAVEAT}" if key == PACKED_CACHED_KEY else "")))
    results.append(block)
    for (_, name, rows), seconds in timed.items():
        if rows > 1:
            one_row, _, count = runs[(PACKED_KERNEL_KEY, name)]
            results.append(packed_rows_measurement(name, rows, one_row, seconds, count, block_s, load))
    for (name, (_, flops, count)), seconds in zip(prefills.items(), prefill_timed):
        products = flops / 2.0  # row-weight products (attention's few aside)
        results.append(_median_rate_measurement(
            f"{PACKED_PREFILL_KEY}{name}", f"{name} prefill ({PREFILL_SEQUENCES * PREFILL_TOKENS} rows)",
            WEIGHTS_PER_S, products, seconds, load,
            f"prefill passes of {PREFILL_SEQUENCES} x {PREFILL_TOKENS} tokens through {count} random {name} blocks "
            f"of width {hidden}, {path}, median {median_and_spread(seconds)[0] * 1e3:.3g} ms; the formats timed in "
            "turn"))
    return results


def packed_rows_measurement(fmt: str, rows: int, one_row: list[float], few_rows: list[float], blocks: int,
                            block_s: float, load: float) -> Measurement:
    """PACKED_ROWS_KEY: a packed format's decode step of `rows` rows over its one-row step through the same streamed
    span, each repeat's pair timed side by side (`one_row`, `few_rows`: seconds of each repeat, in turn), each less
    its blocks' fixed cost (packed_kernel_seconds); the median of the repeats' ratios, at least 1 (a step of more
    rows never takes less). Issue 23 (session 22): the planner took a step of r rows as r one-row steps of kernel
    time; the built-in model's 4-row steps took ~1.7 and its 8-row ones ~4 (the kernels take 4 rows and more in pairs
    of weight rows), and its 2- to 8-row decode was predicted at 0.5-0.7x its measured tokens/s."""
    ratios = [max(1.0, packed_kernel_seconds(f, blocks, block_s) / packed_kernel_seconds(o, blocks, block_s))
              for o, f in zip(one_row, few_rows)]
    value, spread = median_and_spread(ratios)
    return Measurement(f"{PACKED_ROWS_KEY}{fmt}x{rows}", f"{fmt} {rows}-row decode step / one-row step", value,
                       "x", spread, len(ratios), max(load, load_average()),
                       f"{rows}-row and one-row decode steps of the streamed span of {blocks} random {fmt} blocks, "
                       f"timed in turn, each less {block_s * 1e3:.3g} ms a block; the median of the repeats' ratios",
                       ratios)


def thin_width(hidden: int, thin: int = STREAM_THIN) -> int:
    """The thin decode span's width beside a `hidden`-wide one: `thin` (STREAM_THIN: a small model's blocks), or
    narrow_width(hidden) where that is narrower (small test spans).

    Issue 23 (session 15): one-row steps of random spans on this project's AVX512 host read 576-wide blocks at
    13-15 GB/s, 768-wide ones at 17-19 and 2048-wide ones at 17-20 (timed in turn): the blocks' cost does not
    scale from 768 down to 576, so a fit to 2048 and 768 (or QUICK's 1024 and 384) priced a span of 30 blocks of 576
    (SmolLM2's shape) 15% fast (27% slow); a fit to 2048 and 576 predicted it 1.06x and a 2 x 2048 one 0.94x."""
    return min(thin, narrow_width(hidden))


def narrow_width(hidden: int) -> int:
    """The narrower span's width beside a `hidden`-wide one (3/8 of it, whole heads of 64): as many bytes in more,
    thinner blocks, so that a fit to both separates a block's fixed cost from the weights' rate."""
    return max(64, hidden * 3 // 8 // 64 * 64)


def packed_block_overhead(runs: dict[str, tuple[tuple[list[float], float, int], tuple[list[float], float, int]]],
                          load: float, widths: str) -> Measurement:
    """PACKED_BLOCK_KEY: the fixed cost of a packed block, the median over the formats of the cost fitted with each
    format's rate to its cached span and its narrow one (`runs`: format -> (wide, narrow), each seconds of every
    repeat, weights, blocks), on their median steps (fit_bytes_and_blocks: 0 where noise makes the split
    meaningless, and the rates then hold the whole step). A block's norms, attention and hand-offs are the same
    whatever its weights' format, and one fit moved 0.06-0.25 ms between formats timed in the same seconds (load
    4-7): the median of three is the steadier reading. Samples: each format's fit; spread: their range."""
    fits, words = [], []
    for fmt, ((s1, w1, n1), (s2, w2, n2)) in runs.items():
        m1, m2 = statistics.median(s1), statistics.median(s2)
        fits.append(fit_bytes_and_blocks((m1, w1, n1), (m2, w2, n2))[0])
        words.append(f"{fmt} {n1} and {n2} blocks ({w1 / 1e6:.3g} and {w2 / 1e6:.3g} M weights) {m1 * 1e3:.3g} and "
                     f"{m2 * 1e3:.3g} ms: {fits[-1] * 1e3:.3g} ms")
    value, spread = median_and_spread(fits)
    detail = (f"one-row steps of random packed blocks of {widths} in the last-level cache (medians of "
              f"{len(next(iter(runs.values()))[0][0])} in turn), fitted as weights / rate + blocks x cost: "
              f"{'; '.join(words)}; the median of the formats' fits (0: the noise does not resolve it)")
    return Measurement(PACKED_BLOCK_KEY, "fixed cost of a packed block in a decode step", value, "s", spread,
                       len(fits), max(load, load_average()), detail, fits)


def packed_kernel_seconds(step_s: float, blocks: int, block_overhead_s: float) -> float:
    """A packed span's step less its blocks' fixed costs (which the planner adds to every block itself): the time
    its products took. Where the fixed costs would leave under a quarter of the step (a fit the noise moved), a
    quarter is kept."""
    return max(step_s - blocks * block_overhead_s, 0.25 * step_s)


def format_bytes(fmt: str) -> float:
    """Packed bytes per weight of a block format (scales included)."""
    from hivekeeper.core.runtime.quant.blocks import BLOCK_WEIGHTS, format_named

    return format_named(fmt).block_bytes / BLOCK_WEIGHTS


def measure_half_decode(hidden: int = HALF_THIN, total_bytes: int = 256 << 20, repeats: int = 5,
                        step_repeats: int = STEP_REPEATS, wide: int | None = None) -> Measurement:
    """Whole decode steps in bf16 against the same steps in fp32 (HALF_DECODE_KEY: bf16 time / fp32 time; below 1
    bf16 is faster), through the runtime's own decode path (Span.forward, as `generate` runs a span): one row
    through random decoder blocks of width `hidden` (decode_span: about `total_bytes` of fp32 weights), fp32 laid
    out as a loaded model (the native kernels' whole-span step where they are built), and a bf16 copy laid out as
    a bf16 checkpoint loads (torch's kernels block by block: norms, rotary, attention, the products and the
    conversions). The steps are timed in turn (fp32, bf16, fp32, ...); a width's ratio is the median of its pairs'
    ratios, so a swing of the host hits both sides of each pair. With `wide`, blocks of that width are timed too
    and the larger ratio counts: bf16 must beat fp32 at both widths.

    Whether a CPU with native bf16 math (AVX512-BF16, AMX) should run 16-bit plans in bf16 depends on this, not on
    the flag: core/machine/cpu_dtype.py. It must time what runs: a chain of bf16 matmuls alone (session 11's
    measurement) read bf16 at 0.89-0.93x of fp32, while whole bf16 steps of the demo model decoded at 13.9-16
    tokens/s against fp32's 23.5. And the answer depends on the model's shape: on this project's 2-core AMX VM
    (load ~12) whole bf16 steps took 1.3x fp32's through 768-wide blocks (torch's per-block work) and 0.75x through
    one 2048-wide block (half the bytes); the decision is one per machine, so it holds for both. Both dtypes run in
    the runtime's thread layout (use_blas_threads)."""
    load = load_average()
    previous_threads = torch.get_num_threads()
    use_blas_threads()
    try:
        widths = [half_decode_width(width, total_bytes, max(repeats, step_repeats))
                  for width in (hidden, *([wide] if wide else []))]
    finally:
        torch.set_num_threads(previous_threads)
    ratio, spread, ratios, _ = max(widths)
    detail = ("; ".join(part for _, _, _, part in widths)
              + f" (steps timed in turn; a width's value is its median pair's ratio"
              + ("; the larger of the widths' ratios counts)" if len(widths) > 1 else ")"))
    return Measurement(HALF_DECODE_KEY, "bf16 decode step / fp32 one", ratio, "x", spread, len(ratios),
                       max(load, load_average()), detail, ratios)


def half_decode_width(hidden: int, total_bytes: int, repeats: int) -> tuple[float, float, list[float], str]:
    """(median ratio, its spread, each pair's ratio, in words) of bf16 against fp32 one-row decode steps through
    random blocks of width `hidden`, in the thread layout set."""
    config, fp32 = decode_span(hidden, total_bytes)
    bf16 = half_span(config, fp32)
    fp32_s, bf16_s = _alternating_seconds([decode_steps(config, fp32, 1),
                                           decode_steps(config, bf16, 1, torch.bfloat16)], repeats)
    ratios = [b / f for f, b in zip(fp32_s, bf16_s)]
    ratio, spread = median_and_spread(ratios)
    megabytes = sum(p.numel() for p in fp32.parameters()) * 4 / 2**20
    words = (f"one-row decode steps through {config.num_layers} random blocks of width {hidden}: fp32 "
             f"({megabytes:.0f} MiB, {decode_path_name()}) {statistics.median(fp32_s) * 1e3:.3g} ms, bf16 "
             f"({megabytes / 2:.0f} MiB, torch block by block) {statistics.median(bf16_s) * 1e3:.3g} ms, "
             f"{ratio:.2f}x (medians of {len(ratios)})")
    return ratio, spread, ratios, words


def measure_half_prefill(hidden: int = HALF_THIN, repeats: int = 5) -> Measurement:
    """PREFILL_BF16_KEY: FLOP/s of prefill passes (prefill_pass) through random bf16 decoder blocks of width `hidden`
    (half_span: laid out as a bf16 checkpoint loads), the runtime's bf16 path, blocks' own costs included; the median
    of PREFILL_REPEATS or `repeats` passes, whichever is more. The planner prices a bf16 CPU plan's prefill and its
    many-row decode steps at it (profiles.apply_measurements), not at a bf16 matmul alone, which the blocks' products
    do not reach (issue 22: 318 GFLOP/s alone, ~110 in the engine's blocks)."""
    load = load_average()
    previous_threads = torch.get_num_threads()
    use_blas_threads()  # the runtime's thread layout
    try:
        config, fp32 = decode_span(hidden, PREFILL_WEIGHTS * 4)
        run, flops, blocks = prefill_pass(config, half_span(config, fp32), torch.bfloat16)
        del fp32
        seconds = _timings(run, max(repeats, PREFILL_REPEATS), torch.device("cpu"))
    finally:
        torch.set_num_threads(previous_threads)
    return _median_rate_measurement(
        PREFILL_BF16_KEY, "bf16 prefill through decoder blocks", "FLOP/s", flops, seconds, load,
        f"prefill passes ({PREFILL_SEQUENCES} x {PREFILL_TOKENS} tokens) through {blocks} random bf16 blocks of width "
        f"{hidden}, median {statistics.median(seconds) * 1e3:.3g} ms, through the runtime's bf16 path (torch block by "
        "block), the blocks' own costs included")


def half_span(config, span):
    """A bf16 copy of a decode_span span, laid out as checkpoint.load_block loads a bf16 checkpoint: each weight
    its own row-major tensor (the fp32 layout's column-major tall matrices and one packed buffer are fp32 only)."""
    from hivekeeper.core.runtime.model import RotaryTable, Span

    with torch.device("meta"):
        half = Span(config, 0, config.num_layers)
    half = half.to_empty(device="cpu").requires_grad_(False)
    with torch.no_grad():
        for target, source in zip(half.parameters(), span.parameters()):
            target.data = source.detach().to(torch.bfloat16, memory_format=torch.contiguous_format)
    half.rotary = RotaryTable(config)
    for block in half.blocks:
        block.rotary = half.rotary
    return half


def _fitting_shape(shape: MatmulShape, dtype: str, device: torch.device, seconds_budget: float) -> MatmulShape:
    """The shape, with k and n halved until one multiply takes about `seconds_budget` or less.

    Some dtypes are ~100x slower on some CPUs (bf16 without AVX512-BF16): measuring them at the full shape would
    take minutes, and the rate is the same at a smaller one.
    """
    probe = MatmulShape(shape.m, min(shape.k, 512), min(shape.n, 512))
    rate = measure_matmul(probe, dtype, device, repeats=1).value
    # not below 512 x 512 (where it was asked larger): smaller multiplies measure call overheads, not the kernel
    floor = min(512, shape.k, shape.n)
    while shape.flops / rate > seconds_budget and min(shape.k, shape.n) // 2 >= max(64, floor):
        shape = MatmulShape(shape.m, shape.k // 2, shape.n // 2)
    return shape


# ---- host <-> device ------------------------------------------------------------------------------------------------
def host_device_bandwidth(direction: str, pinned: bool, size_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Copy bandwidth between host RAM and the first CUDA device ("h2d" or "d2h"), in bytes/s."""
    return measure_host_device(direction, pinned, size_bytes, repeats).value


def measure_host_device(direction: str, pinned: bool, size_bytes: int = 256 << 20, repeats: int = 5) -> Measurement:
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', not {direction!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    device = torch.device("cuda", 0)
    load = load_average()
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    if direction == "h2d":
        seconds = _timings(lambda: dev.copy_(host, non_blocking=pinned), repeats, device)
    else:
        seconds = _timings(lambda: host.copy_(dev, non_blocking=pinned), repeats, device)
    kind = "pinned" if pinned else "pageable"
    arrow = "host→GPU" if direction == "h2d" else "GPU→host"
    return _rate_measurement(f"gpu0_{direction}_{kind}", f"{arrow} copy, {kind} memory", "B/s", size_bytes, seconds,
                             load, f"{size_bytes / 2**20:.0f} MiB copies, {kind} host buffer")


# ---- disk -----------------------------------------------------------------------------------------------------------
def drop_file_from_page_cache(fd: int) -> None:
    """Ask the kernel to forget a file's cached pages so the next read comes from the disk itself.

    posix_fadvise(DONTNEED) evicts clean pages of that one file (we fsync first so all are clean); it needs no
    privileges, unlike writing to /proc/sys/vm/drop_caches.
    """
    os.fsync(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def disk_bandwidth(folder: str | os.PathLike, size_bytes: int = 256 << 20, repeats: int = 3,
                   progress: Progress = _silent) -> tuple[float, float, bool]:
    """Sequential (write, read) bandwidth of the disk holding `folder`, in bytes/s, reading past the page cache.

    Returns (write_bps, read_bps, cache_bypassed): cache_bypassed is False where the platform has no
    posix_fadvise, in which case the read figure may include the page cache and overstates the disk.
    """
    write, read = measure_disk(folder, size_bytes, repeats, progress)
    return write.value, read.value, hasattr(os, "posix_fadvise")


def measure_disk(folder: str | os.PathLike, size_bytes: int = 256 << 20, repeats: int = 3,
                 progress: Progress = _silent) -> tuple[Measurement, Measurement]:
    """(write, read) Measurements of the disk holding `folder`: a temporary file written with fsync, evicted from
    the page cache (posix_fadvise DONTNEED), then read back in 8 MiB chunks."""
    chunk = 8 << 20
    size_bytes = max(chunk, size_bytes // chunk * chunk)
    block = os.urandom(chunk)
    load = load_average()
    write_s, read_s = [], []
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".hivekeeper-disk-", delete=True) as handle:
        fd = handle.fileno()
        for attempt in range(max(1, repeats)):
            os.lseek(fd, 0, os.SEEK_SET)
            start = time.perf_counter()
            for _ in range(size_bytes // chunk):
                os.write(fd, block)
            os.fsync(fd)
            write_s.append(time.perf_counter() - start)
            drop_file_from_page_cache(fd)
            os.lseek(fd, 0, os.SEEK_SET)
            start = time.perf_counter()
            while os.read(fd, chunk):
                pass
            read_s.append(time.perf_counter() - start)
            progress((attempt + 1) / max(1, repeats), "disk")
    bypassed = hasattr(os, "posix_fadvise")
    how = "page cache bypassed: posix_fadvise(DONTNEED) after fsync" if bypassed else \
        "page cache NOT bypassed (no posix_fadvise here): the read figure may overstate the disk"
    detail = f"{size_bytes / 2**20:.0f} MiB file in {folder}; {how}"
    write = _rate_measurement("disk_write", "disk write (sequential, fsync)", "B/s", size_bytes, write_s, load, detail)
    read = _rate_measurement("disk_read", "disk read (sequential, uncached)", "B/s", size_bytes, read_s, load, detail)
    return write, read


# ---- peers: round-trip time and bandwidth ---------------------------------------------------------------------------
# A peer is host:port (or a multiaddr /ip4/HOST/tcp/PORT/...). RTT is the TCP handshake time (connect() returns
# after SYN, SYN-ACK: one round trip), so any listening peer answers it (a hivemind node's libp2p port too).
# Bandwidth needs a peer that takes part: `hivekeeper measure --listen PORT` runs the small protocol below.
#   client -> b"U" + u64 n, then n bytes; server -> b"K" once all n arrived    (upload)
#   client -> b"D" + u64 n; server -> n bytes                                  (download)
_HEADER = struct.Struct("!cQ")
_MAX_TRANSFER = 1 << 32


def parse_peer(address: str) -> tuple[str, int]:
    """(host, port) from "host:port", "[v6]:port" or a multiaddr "/ip4/1.2.3.4/tcp/31337/p2p/..."."""
    text = address.strip()
    if text.startswith("/"):
        parts = text.strip("/").split("/")
        try:
            host = parts[parts.index(next(p for p in parts if p in ("ip4", "ip6", "dns", "dns4", "dns6"))) + 1]
            port = int(parts[parts.index("tcp") + 1])
        except (StopIteration, ValueError, IndexError):
            raise InputError(f"peer {address!r}: a multiaddr needs /ip4|ip6|dns/HOST and /tcp/PORT") from None
    else:
        host, sep, port_text = text.rpartition(":")
        host = host.strip("[]")
        if not sep or not host:
            raise InputError(f"peer {address!r}: expected HOST:PORT or a multiaddr")
        try:
            port = int(port_text)
        except ValueError:
            raise InputError(f"peer {address!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise InputError(f"peer {address!r}: port {port} is outside 1-65535")
    return host, port


def _recv_exactly(sock: socket.socket, n: int) -> None:
    view = memoryview(bytearray(min(n, 1 << 20)))
    left = n
    while left:
        got = sock.recv_into(view, min(left, len(view)))
        if not got:
            raise ConnectionError("peer closed the connection")
        left -= got


class _BandwidthHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock = self.request
        sock.settimeout(30)
        payload = b"\0" * (1 << 20)
        try:
            while True:
                header = bytearray()
                while len(header) < _HEADER.size:
                    piece = sock.recv(_HEADER.size - len(header))
                    if not piece:
                        return
                    header += piece
                command, n = _HEADER.unpack(bytes(header))
                if n > _MAX_TRANSFER:
                    return
                if command == b"U":
                    _recv_exactly(sock, n)
                    sock.sendall(b"K")
                elif command == b"D":
                    left = n
                    while left:
                        sent = sock.send(payload[: min(left, len(payload))])
                        left -= sent
                else:
                    return
        except (OSError, ConnectionError):
            return


class BandwidthServer(socketserver.ThreadingTCPServer):
    """The peer side of bandwidth measurements (`hivekeeper measure --listen`); `serve_forever` to run it."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        super().__init__((host, port), _BandwidthHandler)

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"


def measure_peer(address: str, repeats: int = 5, transfer_bytes: int = 16 << 20,
                 timeout_s: float = 5.0) -> list[Measurement]:
    """RTT to a peer (TCP handshake), and upload/download bandwidth (bit/s) when it runs `measure --listen`."""
    host, port = parse_peer(address)
    load = load_average()
    rtts = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                rtts.append(time.perf_counter() - start)
        except OSError as exc:
            raise InputError(f"peer {address}: cannot connect ({exc.strerror or exc})") from None
    best = min(rtts)
    results = [Measurement(f"peer_rtt:{address}", f"round trip to {address}", best, "s",
                           (max(rtts) - best) / best if best > 0 else 0.0, len(rtts), max(load, load_average()),
                           "TCP handshake (connect) time", rtts)]
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up, down = [], []
            payload = b"\0" * (1 << 20)
            for _ in range(max(1, min(repeats, 3))):
                start = time.perf_counter()
                sock.sendall(_HEADER.pack(b"U", transfer_bytes))
                left = transfer_bytes
                while left:
                    sent = sock.send(payload[: min(left, len(payload))])
                    left -= sent
                if sock.recv(1) != b"K":
                    raise ConnectionError("no acknowledgement")
                up.append(time.perf_counter() - start)
                start = time.perf_counter()
                sock.sendall(_HEADER.pack(b"D", transfer_bytes))
                _recv_exactly(sock, transfer_bytes)
                down.append(time.perf_counter() - start)
    except (OSError, ConnectionError):
        return results  # a peer that does not run `measure --listen`: RTT only
    bits = transfer_bytes * 8.0
    detail = f"{transfer_bytes / 2**20:.0f} MiB each way over one TCP connection"
    results.append(_rate_measurement(f"peer_upload:{address}", f"upload to {address}", "bit/s", bits, up, load, detail))
    results.append(_rate_measurement(f"peer_download:{address}", f"download from {address}", "bit/s", bits, down, load,
                                     detail))
    return results


# ---- everything -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchmarkSizes:
    """How big and how often: the defaults take about a minute on a laptop; QUICK is for tests and a first look."""

    ram_bytes: int = 1 << 30
    matmul_k: int = 4096  # weight matrix [n, k] of the matmul benchmarks
    matmul_n: int = 8192  # fp32: 128 MiB, far beyond any CPU cache, as a decode step's weights are
    prefill_rows: int = 512
    decode_rows: int = 1
    stream_hidden: int = 2048  # decode steps: a span of random decoder blocks this wide and one this thin
    stream_thin: int = STREAM_THIN  # (thin_width: or 3/8 of stream_hidden where narrower)...
    stream_bytes: int = 384 << 20  # ...each of this many bytes or twice the last-level cache, the larger
    cache_bytes: int | None = None  # the last-level cache the spans must exceed (None: read from /sys)
    half_hidden: int = HALF_THIN  # bf16 against fp32 at decode: whole steps through blocks of this width and (the
    half_wide: int | None = HALF_WIDE  # full measure) this one, each span of this many fp32 bytes or twice the
    half_bytes: int = 256 << 20  # cache
    matmul_seconds: float = 1.0  # one prefill-shape multiply takes at most about this long (slow dtypes shrink)
    disk_bytes: int = 512 << 20
    link_bytes: int = 256 << 20
    peer_bytes: int = 16 << 20
    repeats: int = 5
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    packed_hidden: int | None = PACKED_HIDDEN  # the packed formats' cached spans: this wide, a third of the
    # last-level cache each; the streamed ones stream_thin wide, stream_bytes or twice the cache each, the larger (one
    # buffer for the three formats); None: skip them (TINY)
    packed_streamed: bool = True  # False: only the cached spans
    packed_bytes: int | None = None  # the packed streamed spans' bytes (None: stream_bytes)
    step_repeats: int = STEP_REPEATS  # timings of each whole decode step at least (they take milliseconds)
    attention_bytes: int = 128 << 20  # the decode attention's cache at ATTENTION_KEYS tokens: this or 4x the cache


# QUICK's matmul is large enough for the kernels to reach their rate (a 64 x 256 x 512 one measured call overheads).
# Its decode spans are the full measurement's, widths 2048 and 576 and 384 MiB each (two 2048-wide blocks, 28 of 576),
# as large as the models a CPU runs. Issue 23, session 15: its earlier spans, one 1024-wide block of 43 MiB, 1.4x a
# 32 MiB L3, and 64 MiB of 384-wide ones, fitted 0.26 ms a block and put SmolLM2's fp32 decode 1.41x slow. Session
# 17: a native step call starts at a fixed cost of ~0.3-0.6 ms (two 8-block calls took 0.4-0.7 ms more than one
# 16-block call; an LM head of 113 MB read as 226 MB did in 2x less 0.3 ms), which its spans of then, one 2048-wide
# block (172 MiB, ~6.5 ms) and 7 of 576 (95 MiB, ~3.8 ms), charged to the rate: they read 24-26 GB/s where spans of
# 384 MiB and the models (400-540 MB in a span call and a head call) read 27-30 in the same loop, and the planner
# priced both calibration models' one-row steps 1.05-1.19x slow. Its packed streamed spans stay 96 MiB of 576-wide
# blocks (a packed small model's size; one buffer for the three formats: measure_packed_kernels)
QUICK = BenchmarkSizes(ram_bytes=32 << 20, matmul_k=1024, matmul_n=2048, prefill_rows=128, matmul_seconds=0.05,
                       stream_hidden=2048, stream_bytes=384 << 20, packed_bytes=96 << 20, half_wide=None,
                       half_bytes=64 << 20, disk_bytes=8 << 20, link_bytes=16 << 20, peer_bytes=1 << 20, repeats=2,
                       dtypes=("fp32", "bf16"), step_repeats=4)


# a few megabytes, the caches ignored: for tests and screenshots, where the numbers do not matter
TINY = BenchmarkSizes(ram_bytes=4 << 20, matmul_k=128, matmul_n=256, prefill_rows=32, matmul_seconds=0.02,
                      stream_hidden=256, stream_bytes=4 << 20, cache_bytes=0, half_hidden=256, half_wide=None,
                      half_bytes=4 << 20, disk_bytes=4 << 20, link_bytes=4 << 20, peer_bytes=256 << 10, repeats=2,
                      dtypes=("fp32", "bf16"), packed_hidden=None, attention_bytes=2 << 20)


def sizes_from_environment(default: str = "full") -> BenchmarkSizes:
    """The BenchmarkSizes that HIVEKEEPER_MEASURE_SIZES (measurement.SIZES_ENV) names ("full": the defaults;
    "quick": QUICK; "tiny": TINY), or `default`'s when it is unset: the app's and the commands' one switch."""
    choice = os.environ.get(SIZES_ENV, "").strip().lower() or default
    if choice not in SIZES_CHOICES:
        raise InputError(f"{SIZES_ENV}={os.environ[SIZES_ENV]!r}: use one of {', '.join(SIZES_CHOICES)}")
    return {"quick": QUICK, "tiny": TINY}.get(choice) or BenchmarkSizes()


# the decode spans take at most this share of the memory available when a measurement starts, each (two spans)
SPAN_MEMORY_SHARE = 8


def within_memory(sizes: BenchmarkSizes, available: int | None = None) -> BenchmarkSizes:
    """`sizes` with each decode span (stream_bytes) at most 1/SPAN_MEMORY_SHARE of the memory `available` (None:
    psutil's, now), so that the quick measurement of a small machine does not push it into swap; never below
    twice the last-level cache, which the spans must exceed (stream_span_configs)."""
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    return replace(sizes, stream_bytes=min(sizes.stream_bytes, max(available // SPAN_MEMORY_SHARE, 1)))


def run_benchmarks(sizes: BenchmarkSizes = BenchmarkSizes(), *, disk_folder: str | os.PathLike | None = None,
                   peers: tuple[str, ...] = (), gpu: bool = True, progress: Progress = _silent,
                   should_stop: Callable[[], bool] = lambda: False) -> list[Measurement]:
    """Every benchmark this machine allows, in turn: RAM, CPU matmuls per dtype (decode and prefill shapes), decode
    weight streaming, a bf16 decode step against fp32 (with native bf16 math), disk (when a folder is given), GPU
    memory, GPU matmuls and host<->device copies (pinned and pageable) when a CUDA device is present (and gpu=True),
    and each peer; the decode steps' streaming rate (and their few-row reads) is read again between the later steps
    and the pooled figures kept (StreamRereads, fold_stream_readings), the decode loop's fixed cost per step
    (step_overhead); the packed formats' decode steps (their rates and a packed block's fixed cost, fitted to packed
    spans of two widths) are read after the decode steps, in the middle and last, and pooled (pool_packed), as the
    fp32 prefill passes are (StreamRereads.read_prefill, fold_prefill_readings). The decode spans
    fit the memory available (within_memory). progress(fraction, label) is called before each step;
    should_stop() is checked between steps (what was measured so far is returned)."""
    sizes = within_memory(sizes)
    steps: list[tuple[str, Callable[[], list[Measurement]]]] = []
    beyond_cache = 2 * (last_level_cache_bytes() if sizes.cache_bytes is None else sizes.cache_bytes)
    steps.append(("RAM bandwidth", lambda: [measure_memory_read("cpu", max(sizes.ram_bytes, beyond_cache),
                                                                sizes.repeats)]))
    for dtype in sizes.dtypes:
        steps.append((f"CPU {dtype} matmul", lambda dtype=dtype: _matmul_pair(dtype, torch.device("cpu"), sizes)))
    rereads = StreamRereads(sizes) if "fp32" in sizes.dtypes else None
    results: list[Measurement] = []
    reread = [("CPU decode streaming, read again", rereads.read)] if rereads is not None else []
    if "fp32" in sizes.dtypes:
        steps.append(("CPU decode steps",
                      lambda: measure_decode_blocks(sizes.stream_hidden, sizes.stream_bytes, sizes.repeats,
                                                    sizes.cache_bytes, sizes.step_repeats, rereads.built(),
                                                    sizes.stream_thin)))
    if sizes.packed_hidden is not None:  # read early, in the middle and last (pool_packed); each fits its own spans
        steps.append(("CPU packed-format decode steps", lambda: measure_packed_at(sizes)))
    steps += reread
    if has_half_math():  # where bf16 is native, whether it beats fp32 at decode decides 16-bit plans (cpu_dtype)
        steps.append(("CPU bf16 vs fp32 decode step",
                      lambda: [measure_half_decode(sizes.half_hidden, max(sizes.half_bytes, beyond_cache),
                                                   sizes.repeats, wide=sizes.half_wide),
                               measure_half_prefill(sizes.half_hidden, sizes.repeats)]))
    steps += reread
    prefill_again = [("CPU prefill passes, read again", rereads.read_prefill)] if rereads is not None else []
    steps += prefill_again
    packed_later: list[list[Measurement]] = []  # the packed formats' later readings, pooled last (pool_packed)
    if sizes.packed_hidden is not None:
        steps.append(("CPU packed-format decode steps, read again",
                      lambda: packed_later.append(measure_packed_at(sizes)) or []))
    if disk_folder is not None:
        steps.append(("disk", lambda: list(measure_disk(disk_folder, sizes.disk_bytes, max(1, min(sizes.repeats, 3))))))
    steps += reread
    if gpu and torch.cuda.is_available():
        cuda = torch.device("cuda", 0)
        steps.append(("GPU memory bandwidth",
                      lambda: [measure_memory_read(cuda, max(sizes.ram_bytes, 256 << 20), sizes.repeats)]))
        for dtype in sizes.dtypes:
            steps.append((f"GPU {dtype} matmul", lambda dtype=dtype: _matmul_pair(dtype, cuda, sizes, gpu=True)))
        for direction in ("h2d", "d2h"):
            for pinned in (True, False):
                steps.append((f"{'host→GPU' if direction == 'h2d' else 'GPU→host'} "
                              f"{'pinned' if pinned else 'pageable'}",
                              lambda d=direction, p=pinned: [measure_host_device(d, p, sizes.link_bytes,
                                                                                 sizes.repeats)]))
    for peer in peers:
        steps.append((f"peer {peer}", lambda peer=peer: measure_peer(peer, sizes.repeats, sizes.peer_bytes)))
    steps += prefill_again
    if rereads is not None:
        steps.append(("CPU decode streaming, read again", lambda: rereads.pool(results)))
    if "fp32" in sizes.dtypes:  # what a decode step costs beyond its blocks and head (the engine's own loop)
        steps.append(("CPU decode step overhead", lambda: [measure_step_overhead(cache_bytes=sizes.cache_bytes)]))
        steps.append(("CPU decode attention", lambda: [measure_decode_attention(sizes.attention_bytes,
                                                                                sizes.cache_bytes)]))
    if sizes.packed_hidden is not None:
        steps.append(("CPU packed-format decode steps, read again",
                      lambda: pool_packed(results, [*packed_later, measure_packed_at(sizes)])))
    for index, (label, step) in enumerate(steps):
        if should_stop():
            break
        progress(index / len(steps), label)
        results.extend(step())
    progress(1.0, "done")
    return results


def pool_packed(results: list[Measurement], later: list[list[Measurement]]) -> list[Measurement]:
    """`results` (in place) with each packed-format measurement pooled with the `later` readings of the same key
    (pooled_packed), and any key of the later readings not in them added; no measurement of its own. Session 17: a
    packed span's step takes 2-4 ms, so one reading of 9 repeats spans a tenth of a second of a host whose rate swings
    within seconds; between quick measurements the streamed Q4_1 rate read 26-43 G weights/s and put SmolLM2's packed
    decode 0.81-1.11x its measured tokens/s. Read early and last in the measurement, the median spanned ~5 s of it, as
    the fp32 streaming rate's pooled readings do. Session 19: a quick measurement whose two readings both fell in a
    slow spell read the kernels' Q4_1 rate at 27 G weights/s (40 when the model ran) and put SmolLM2's packed decode
    0.71x; a third reading, in the middle, and the median of all three readings' samples."""
    again: dict[str, list[Measurement]] = {}
    for reading in later:
        for m in reading:
            again.setdefault(m.key, []).append(m)
    results[:] = [pooled_packed(m, again.pop(m.key)) if m.key in again else m for m in results]
    results.extend(pooled_packed(found[0], found[1:]) for found in again.values())
    return []


def pooled_packed(first: Measurement, later: list[Measurement]) -> Measurement:
    """One measurement from readings of one key (`first`, then the `later` ones): the median of every reading's
    samples (a cost at least 0), so that one reading at a slow spell among three does not set it; their range over
    it as the spread. `first` alone: itself."""
    if not later:
        return first
    readings = [first, *later]
    samples = [x for m in readings for x in m.samples]
    median, spread = median_and_spread(samples)
    value = max(0.0, median) if first.unit == "s" else median
    values = ", ".join(f"{m.value:.4g}" for m in readings)
    return replace(first, value=value, spread=spread, repeats=len(samples),
                   loadavg=max(m.loadavg for m in readings), samples=samples,
                   detail=f"{first.detail}; read {len(readings)} times over the measurement ({values}): the median "
                          f"of the readings' {len(samples)} samples")


def measure_step_overhead(runs: int = step_overhead.LOOP_RUNS, steps: int = step_overhead.LOOP_STEPS,
                          cache_bytes: int | None = None) -> Measurement:
    """STEP_OVERHEAD_KEY: the decode loop's fixed cost per step (seconds), the median rest over `runs` generate() runs
    on step_overhead's tiny decoder (one warm-up run first), with the rests' spread. The decoder: one block laid out
    as a loaded model's (span_of_config), a packed embedding of random rows (step_overhead.LOOP_EMBEDDING);
    `cache_bytes`: the last-level cache its span leaves cold (None: read from /sys; 0: none)."""
    from hivekeeper.core.offload.packed_stream import PackedEmbedding

    load = load_average()
    config, span = span_of_config(step_overhead.loop_config())
    embedding = PackedEmbedding(random_packed_matrix(step_overhead.LOOP_EMBEDDING, config.vocab_size,
                                                     config.hidden_size))
    model = step_overhead.loop_model(config, span, embedding,
                                     last_level_cache_bytes() if cache_bytes is None else cache_bytes)
    step_overhead.loop_rests(model, 4)  # first-call costs: allocator, kernel choice
    rests = [max(0.0, rest) for _ in range(runs) for rest in step_overhead.loop_rests(model, steps)]
    value, spread = median_and_spread(rests)  # (a step whose span or head call caught a burst of load: 0)
    return Measurement(STEP_OVERHEAD_KEY, "decode step overhead (embedding, sampling, loop)", value, "s",
                       spread, len(rests), max(load, load_average()),
                       f"generate() on a 1-block {config.hidden_size}-wide decoder of {config.vocab_size} tokens "
                       f"({step_overhead.LOOP_EMBEDDING} embedding, caches left cold): each step less its span and "
                       f"head calls, the median of {len(rests)} steps", rests)


# measure_decode_attention: the long context (a few thousand tokens, as a long chat's), the short one it is set
# against, the blocks' shape (SmolLM2's grouping, 3 query heads a KV head, heads of 64, in a thinner block: the
# weights only add to both steps) and the pairs of steps timed (each ~5-10 ms; the median of their differences)
ATTENTION_KEYS, ATTENTION_SHORT = 4096, 64
ATTENTION_HEADS, ATTENTION_KV_HEADS = 6, 2
ATTENTION_PAIRS = 7


def attention_span_config(total_bytes: int, cache_bytes: int):
    """The ModelConfig of measure_decode_attention's span: ATTENTION_HEADS heads of 64 (ATTENTION_KV_HEADS KV
    heads), a small MLP, as many blocks as hold `total_bytes` or 4x `cache_bytes` (the last-level cache) of fp32
    K and V at ATTENTION_KEYS tokens, the larger (at least one). At 2.5x a 32 MiB L3 (84 MB) the rate read 15-26 GB/s
    from run to run on the 2-core dev VM, where SmolLM2's steps at 4-8k tokens (190-370 MB) read theirs at ~14.5."""
    from hivekeeper.core.runtime.model import ModelConfig

    config = ModelConfig("llama", 256, ATTENTION_HEADS * 64, 64, 1, ATTENTION_HEADS, ATTENTION_KV_HEADS, 64,
                         max_position_embeddings=ATTENTION_KEYS)
    per_block = 2 * ATTENTION_KV_HEADS * 64 * 4 * ATTENTION_KEYS
    return replace(config, num_layers=max(1, math.ceil(max(total_bytes, 4 * cache_bytes) / per_block)))


def measure_decode_attention(total_bytes: int = 128 << 20, cache_bytes: int | None = None,
                             pairs: int = ATTENTION_PAIRS) -> Measurement:
    """ATTENTION_KEY: bytes of KV cache per second a one-row decode step's attention reads, through the runtime's
    decode path (Span.forward: the C kernels where built) over a span of thin fp32 blocks (attention_span_config):
    steps at ATTENTION_KEYS cached tokens and at ATTENTION_SHORT, timed in alternating pairs; the extra K and V
    bytes over the median of the pairs' differences. `cache_bytes`: the last-level cache (None: read from /sys)."""
    from hivekeeper.core.runtime.model import KVCache

    load = load_average()
    config, span = span_of_config(attention_span_config(
        total_bytes, last_level_cache_bytes() if cache_bytes is None else cache_bytes))
    cache = KVCache.allocate(config, config.num_layers, 1, ATTENTION_KEYS)
    with torch.no_grad():
        cache.k.fill_(0.01)  # written: zero pages would read from one cached page
        cache.v.fill_(0.01)
    hidden = torch.randn(1, 1, config.hidden_size) * 0.1

    def step(keys: int) -> float:
        cache.length = keys - 1
        started = time.perf_counter()
        with torch.inference_mode():
            span(hidden, cache)
        return time.perf_counter() - started

    previous_threads = torch.get_num_threads()
    use_blas_threads()  # the runtime's thread layout, in which its decode path runs
    try:
        step(ATTENTION_KEYS), step(ATTENTION_SHORT)  # first-call costs: the kernels' scratch, page faults
        differences = [step(ATTENTION_KEYS) - step(ATTENTION_SHORT) for _ in range(pairs)]
    finally:
        torch.set_num_threads(previous_threads)
    seconds, spread = median_and_spread(differences)
    extra = config.num_layers * 2 * ATTENTION_KV_HEADS * 64 * 4 * (ATTENTION_KEYS - ATTENTION_SHORT)
    rate = extra / max(seconds, 1e-6)
    return Measurement(ATTENTION_KEY, "decode attention (KV cache read)", rate, "B/s", spread, len(differences),
                       max(load, load_average()),
                       f"one-row decode steps through {config.num_layers} fp32 blocks of {ATTENTION_HEADS} heads "
                       f"({ATTENTION_KV_HEADS} KV heads, head_dim 64) at {ATTENTION_KEYS} cached tokens less the same "
                       f"at {ATTENTION_SHORT} ({decode_path_name()}): {extra / 1e6:.3g} MB of K and V more, the "
                       f"median of {len(differences)} alternating pairs", [extra / max(d, 1e-6) for d in differences])


def measure_packed_at(sizes: BenchmarkSizes) -> list[Measurement]:
    """The packed formats' decode steps at `sizes` (measure_packed_kernels), as run_benchmarks takes them: a bench
    reads them again with this, at the moment it runs a packed model."""
    return measure_packed_kernels(sizes.repeats, sizes.packed_hidden, sizes.packed_bytes or sizes.stream_bytes,
                                  sizes.cache_bytes, sizes.packed_streamed,
                                  max(sizes.step_repeats, PACKED_STEP_REPEATS),
                                  thin_width(sizes.stream_hidden, sizes.stream_thin))


def _matmul_pair(dtype: str, device: torch.device, sizes: BenchmarkSizes, gpu: bool = False) -> list[Measurement]:
    """A dtype's matmul rate at a decode shape (few rows: bound by reading the weights) and at a prefill shape."""
    k, n = (max(sizes.matmul_k, 8192), max(sizes.matmul_n, 8192)) if gpu else (sizes.matmul_k, sizes.matmul_n)
    prefill = MatmulShape(max(sizes.prefill_rows, 4096) if gpu else sizes.prefill_rows, k, n)
    # decode keeps the full weight matrix (it must not fit in a cache); only the prefill shape may shrink
    decode = MatmulShape(sizes.decode_rows, k, n)
    prefill = _fitting_shape(prefill, dtype, device, sizes.matmul_seconds) if not gpu else prefill
    return [measure_matmul(decode, dtype, device, sizes.repeats, phase="decode"),
            measure_matmul(prefill, dtype, device, sizes.repeats, phase="prefill")]


# ---- a terminal progress bar ----------------------------------------------------------------------------------------
class TerminalProgress:
    """progress(fraction, label) drawn as one bar on stderr: redrawn in place on a terminal, else one line per step."""

    def __init__(self, title: str = "", stream: TextIO | None = None, width: int = 30):
        self.title, self.stream, self.width = title, stream or sys.stderr, width
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_label: str | None = None

    def __call__(self, fraction: float, label: str) -> None:
        fraction = min(max(fraction, 0.0), 1.0)
        filled = int(round(fraction * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        text = f"{self.title}[{bar}] {100 * fraction:3.0f}% {label}"
        if self.interactive:
            self.stream.write("\r" + text.ljust(self.width + 40))
            if fraction >= 1.0:
                self.stream.write("\n")
        elif label != self._last_label:
            self.stream.write(text + "\n")
        self._last_label = label
        self.stream.flush()


def format_value(measurement: Measurement) -> str:
    """A measurement's best value in readable units."""
    v = measurement.value
    if measurement.unit == "B/s":
        return f"{v / 1e9:.3g} GB/s"
    if measurement.unit == "FLOP/s":
        return f"{v / 1e9:.3g} GFLOP/s" if v < 1e12 else f"{v / 1e12:.3g} TFLOP/s"
    if measurement.unit == "bit/s":
        return f"{v / 1e6:.4g} Mbit/s"
    if measurement.unit == "s":
        return f"{v * 1e3:.3g} ms"
    if measurement.unit == WEIGHTS_PER_S:
        return f"{v / 1e9:.3g} G weights/s"
    return f"{v:.4g} {measurement.unit}"

