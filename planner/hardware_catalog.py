"""The hardware catalog, hardware JSON files, and GPU specs derived from what a driver reports.

A catalog machine is a catalog GPU (planner/data/hardware.json, "gpus") on a default host ("hosts": CPU and RAM,
disk, network); `get_hardware` builds one and applies host overrides (RAM, disk, network, price). Catalog entries,
user files (docs/hardware-json.md) and detection all go through one parser, so they obey the same units and limits:

    sizes *_gb (10^9 bytes) or *_gib (2^30 bytes), bandwidths *_gbps (10^9 bytes/s), compute *_tflops (10^12 FLOP/s),
    network *_mbps (10^6 bit/s), rtt_ms (milliseconds), power_w (watts), price_per_hour (USD).

Values are stored at fixed resolutions (whole bytes, bytes/s and bit/s, 1 MFLOP/s, 1 µs), so a spec written with
`hardware_to_json` and read back is equal to the original.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any

from . import fields
from .errors import InputError
from .fields import REQUIRED, Fields
from .formats import PACKED_FORMATS
from .hardware import (GIB, PACKED_ROW_COUNTS, ComputeDevice, DecodeStreaming, DiskSpec, HardwareSpec, NetworkSpec,
                       PrefillRate)

CATALOG_PATH = Path(__file__).parent / "data" / "hardware.json"

DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8", "int4")
# keys any section may hold besides its fields (where its numbers come from, comments)
_META_KEYS = frozenset({"source", "sources", "_doc"})
# Source labels that stand on their own; anything else read from the catalog is prefixed "catalog:".
SOURCE_LABELS = ("catalog", "measured", "detected", "derived", "user", "estimated", "default")

# Field limits: (smallest allowed, largest allowed). Larger values are typos (10 PB of RAM), not hardware.
_LIMITS: dict[str, tuple[float, float]] = {
    "memory_gb": (0.001, 4096.0),  # one accelerator's memory
    "memory_bandwidth_gbps": (0.001, 100_000.0),
    "tflops": (1e-6, 100_000.0),
    "power_w": (0.1, 10_000.0),
    "host_link_gbps": (0.001, 10_000.0),
    "cores": (1, 8192),
    "ram_gb": (0.001, 65_536.0),  # 64 TB: more than the largest single servers
    "ram_bandwidth_gbps": (0.001, 50_000.0),
    "clock_ghz": (0.1, 10.0),
    "capacity_gb": (0.001, 1_000_000.0),  # 1 PB of local disk
    "disk_gbps": (0.0001, 1000.0),
    "network_mbps": (0.001, 10_000_000.0),
    "rtt_ms": (0.0, 60_000.0),
    "price_per_hour": (0.0, 10_000.0),
    "gpu_count": (1, 64),
    "pcie_gen": (1, 7),
    "pcie_lanes": (1, 32),
    "gweights_per_s": (0.001, 100_000.0),  # a CPU's packed-format kernels, billions of weights per second
    "row_step_ratio": (0.1, 64.0),  # a packed few-row decode step over a one-row one (ComputeDevice.packed_row_steps)
    "packed_block_overhead_ms": (0.0, 100.0),  # ... and the fixed cost of a packed block in a decode step
    "cache_mib": (0.0625, 65_536.0),  # a CPU's last-level cache, MiB
    "half_decode_ratio": (0.05, 16.0),  # a CPU's measured bf16 decode step over its fp32 one
    # a CPU's fp32 prefill rate by rows at one width (hardware.PrefillRate): the width, the peak, the half-rate rows
    "prefill_hidden": (1, 1 << 20),
    "prefill_peak_gflops": (0.001, 1_000_000.0),
    "prefill_half_rows": (0.0, 65_536.0),
}

# the end of a too-large value's error: a value 1000x too large is usually in the wrong unit
UNIT_HINT = "(check the unit)"


# ---- canonical values ---------------------------------------------------------------------------------------------
def _bytes(gb: float, *, binary: bool = False) -> int:
    return int(round(gb * (GIB if binary else 1e9)))


def _bandwidth(gbps: float) -> float:
    return float(round(gbps * 1e9))  # whole bytes/s


def _flops(tflops: float) -> float:
    return round(tflops * 1e6) * 1e6  # whole MFLOP/s


def _bits_per_s(mbps: float) -> float:
    return float(round(mbps * 1e6))  # whole bit/s


def _seconds(ms: float) -> float:
    return round(ms * 1e3) / 1e6  # whole microseconds


def pcie_bandwidth(gen: int, lanes: int) -> float:
    """Practical host<->device bandwidth of a PCIe link, bytes/s: 80% of nominal (hardware.md).

    Nominal per lane: gen 1-2 use 8b/10b encoding (2.5, 5 GT/s), gen 3-5 128b/130b (8, 16, 32 GT/s), gen 6+ FLIT.
    """
    transfer_rate = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0, 7: 128.0}[gen]  # GT/s per lane
    encoding = 0.8 if gen <= 2 else (128 / 130 if gen <= 5 else 242 / 256)
    nominal_gbps = transfer_rate * encoding / 8 * lanes  # GB/s
    return _bandwidth(0.8 * nominal_gbps)


# ---- CPU compute ----------------------------------------------------------------------------------------------------
# fp32 FLOP per cycle per core at each SIMD level: FMA units × lanes × 2 (two FMA units on AVX2/AVX-512 cores).
SIMD_FP32_FLOPS_PER_CYCLE = {"sse": 8, "avx": 16, "avx2": 32, "avx512": 64, "neon": 32}


def simd_level(flags: set[str] | list[str]) -> str:
    """The widest SIMD level a CPU offers, from its /proc/cpuinfo flags (x86) or features (Arm)."""
    flags = {flag.lower() for flag in flags}
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    if "avx" in flags:
        return "avx"
    if {"asimd", "neon"} & flags:
        return "neon"
    return "sse"


CPU_SOFTWARE_HALF_SLOWDOWN = 7.0


def cpu_peak_flops_tflops(cores: int, clock_ghz: float, flags: set[str] | list[str] | str) -> dict[str, float]:
    """Peak matmul TFLOP/s of a CPU: cores × clock × FLOP/cycle for its SIMD level and matrix extensions.

    `flags` is a SIMD level name ('avx2') or a set of cpuinfo flags. bf16/int8 are listed only where the CPU has
    native instructions for them (AVX512_BF16, VNNI, AMX); otherwise those dtypes run at the fp32 rate or worse.
    """
    flag_set = {flags} if isinstance(flags, str) else {flag.lower() for flag in flags}
    level = flags if isinstance(flags, str) else simd_level(flag_set)
    if level not in SIMD_FP32_FLOPS_PER_CYCLE:
        raise InputError(f"unknown SIMD level {level!r}; choose one of {', '.join(SIMD_FP32_FLOPS_PER_CYCLE)}")
    per_cycle = cores * clock_ghz * 1e9 / 1e12  # TFLOP/s per FLOP/cycle/core
    fp32 = SIMD_FP32_FLOPS_PER_CYCLE[level]
    result = {"fp32": per_cycle * fp32}
    if "amx_bf16" in flag_set:
        result["bf16"] = per_cycle * 1024  # AMX tile multiply: 512 bf16 FMAs per cycle per core
    elif "avx512_bf16" in flag_set:
        result["bf16"] = per_cycle * 2 * fp32
    else:
        # No native 16-bit float math: kernels convert to fp32 first. Measured here (AVX2, torch 2.13 linear):
        # bf16 and fp16 reach about 1/7 of the fp32 rate at prefill shapes, so never plan them at fp32 speed.
        result["bf16"] = result["fp32"] / CPU_SOFTWARE_HALF_SLOWDOWN
        result["fp16"] = result["fp32"] / CPU_SOFTWARE_HALF_SLOWDOWN
    if "amx_int8" in flag_set:
        result["int8"] = per_cycle * 2048
    elif "avx512_vnni" in flag_set or "avx_vnni" in flag_set:
        result["int8"] = per_cycle * 4 * fp32
    return result


# ---- field reading --------------------------------------------------------------------------------------------------
class _Section(Fields):
    """Checked reads of one hardware JSON object (fields.Fields) in the units and named limits of this module."""

    def check_keys(self, allowed: set[str], what: str = "a known field here") -> None:
        super().check_keys(allowed, what, ignored=_META_KEYS)

    def limited(self, key: str, limit: str, *, required: bool = True) -> float | None:
        """A number inside the limits named `limit` (_LIMITS); None when absent and not required."""
        low, high = _LIMITS[limit]
        return self.number(key, low, high, default=REQUIRED if required else None, hint=UNIT_HINT)

    def limited_integer(self, key: str, limit: str, *, required: bool = True) -> int | None:
        low, high = _LIMITS[limit]
        return self.integer(key, low=int(low), high=int(high), default=REQUIRED if required else None)

    def label(self, key: str, *, required: bool = True) -> str:
        """A non-empty string; "" when absent (or given as "") and not required."""
        if not required and self.doc.get(key) == "":
            return ""
        return self.text(key, default=REQUIRED if required else "", non_empty=True, max_len=1000)

    def size_gb(self, stem: str, limit: str) -> int:
        """A size given as <stem>_gb (10^9 bytes) or <stem>_gib (2^30 bytes), exactly one of them."""
        given = [key for key in (f"{stem}_gb", f"{stem}_gib") if self.has(key)]
        if len(given) != 1:
            problem = "is missing" if not given else f"and {self.name(stem + '_gib')!r} are both given; keep one"
            raise self.error(f"{stem}_gb", problem)
        value = self.limited(given[0], limit)
        if given[0].endswith("_gib"):
            check_number(value * GIB / 1e9, limit, where=self.where, field=self.name(given[0]))
            return _bytes(value, binary=True)
        return _bytes(value)

    def flops_table(self, key: str) -> dict[str, float]:
        table = self.doc.get(key)
        if table is None:
            raise self.error(key, "is missing")
        if not isinstance(table, dict) or not table:
            raise self.error(key, "must be an object of dtype -> TFLOP/s, e.g. {\"fp16\": 65}")
        result = {}
        for dtype, value in table.items():
            if dtype not in DTYPES:
                raise self.error(f"{key}.{dtype}", f"is not a known dtype ({', '.join(DTYPES)})")
            result[dtype] = _flops(check_number(value, "tflops", where=self.where, field=self.name(f"{key}.{dtype}")))
        return result

    def sources(self, default: str, keys: tuple[str, ...]) -> dict[str, str]:
        given = self.doc.get("sources") or {}
        if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
            raise self.error("sources", "must be an object of field -> text")
        own = self.doc.get("source")
        if own is not None and not isinstance(own, str):
            raise self.error("source", "must be a string")
        base = _source_label(own, default) if own else default
        return {key: given.get(key, base) for key in keys}


def check_number(value: Any, limit: str, *, where: str, field: str) -> float:
    """A finite number inside the limits named `limit`, else InputError naming the file (`where`) and field."""
    low, high = _LIMITS[limit]
    return fields.check_number(value, low, high, where=where, name=field, hint=UNIT_HINT)


def field_limits(limit: str) -> tuple[float, float]:
    """(smallest, largest) allowed of the hardware field limits named `limit` (e.g. "ram_gb"), for options that
    override such a field (`plan --ram-gb`), checked before anything else runs."""
    return _LIMITS[limit]


def clamp_to_limit(value: float, limit: str) -> float:
    """A measured or detected value pulled inside the limits named `limit` (detection must not fail on them)."""
    low, high = _LIMITS[limit]
    return min(max(value, low), high)


def _source_label(text: str, default: str) -> str:
    if text.split(":", 1)[0].strip() in SOURCE_LABELS:
        return text
    prefix = default.split(":", 1)[0]
    return f"{prefix}:{text}"


# ---- sections -------------------------------------------------------------------------------------------------------
_GPU_SOURCE_KEYS = ("memory_bytes", "memory_bandwidth", "flops", "power_watts", "host_link_bandwidth")
_CPU_SOURCE_KEYS = ("cores", "memory_bytes", "memory_bandwidth", "flops", "power_watts")
_DISK_SOURCE_KEYS = ("capacity_bytes", "read_bandwidth", "write_bandwidth")
_NETWORK_SOURCE_KEYS = ("upload_bps", "download_bps", "rtt_s")
_GPU_KEYS = {"name", "memory_gb", "memory_gib", "memory_bandwidth_gbps", "flops_tflops", "power_w", "host_link_gbps",
             "pcie_gen", "pcie_lanes", "unified_memory", "in_use_gb"}
_CPU_KEYS = {"name", "cores", "ram_gb", "ram_gib", "ram_bandwidth_gbps", "flops_tflops", "clock_ghz", "simd", "power_w",
             "decode_streaming", "in_use_gb", "packed_kernels_gweights_per_s", "packed_kernels_cached_gweights_per_s",
             "packed_prefill_gweights_per_s", "packed_block_overhead_ms", "cache_mib", "half_decode_ratio",
             "packed_row_steps"}
# the cpu section's optional "decode_streaming" object (measured): key -> (lower, upper bound)
_STREAMING_FIELDS = {"bandwidth_fraction": (0.01, 1.0), "small_row_reads": (1.0, 16.0), "matmul_start_ms": (0.0, 100.0)}
_STREAMING_OPTIONAL = {"block_overhead_ms": (0.0, 100.0),  # issue 23: measured per-block cost of a decode step
                       "prefill_block_overhead_ms": (0.0, 500.0),  # ... and of a prefill (session 11)
                       "row_block_overhead_ms": (0.0, 100.0),  # ... and per extra row of a few-row step (session 13)
                       "step_overhead_ms": (0.0, 100.0),  # ... and of a whole step beyond blocks and head (session 16)
                       "prefill_rates": None,  # ... and the fp32 prefill rate by rows per width (session 16)
                       "attention_gbps": (0.01, 10_000.0)}  # ... and the decode attention's cache reads (session 25)
_STREAMING_TABLE = "small_row_reads_by_width"  # ... and a few-row step's reads per width of blocks (session 16)
# one entry of "prefill_rates" (hardware.PrefillRate): key -> its _LIMITS name
_PREFILL_RATE_FIELDS = {"hidden": "prefill_hidden", "peak_gflops": "prefill_peak_gflops",
                        "half_rows": "prefill_half_rows"}


def _parse_decode_streaming(doc: Any, where: str) -> DecodeStreaming | None:
    if doc is None:
        return None
    s = _Section(doc, where, "cpu.decode_streaming")
    allowed = {*_STREAMING_FIELDS, *_STREAMING_OPTIONAL, _STREAMING_TABLE}
    if not isinstance(doc, dict) or not set(_STREAMING_FIELDS) <= set(doc) <= allowed:
        raise InputError(f"{where}: field 'cpu.decode_streaming' must be an object with exactly "
                         f"{', '.join(_STREAMING_FIELDS)} (and optionally "
                         f"{', '.join([*_STREAMING_OPTIONAL, _STREAMING_TABLE])}), "
                         f"got {doc!r}")
    values = {key: s.number(key, low, high) for key, (low, high) in _STREAMING_FIELDS.items()}
    block, prefill, row, step = (s.number(key, *_STREAMING_OPTIONAL[key]) / 1e3 if key in doc else None
                                 for key in ("block_overhead_ms", "prefill_block_overhead_ms", "row_block_overhead_ms",
                                             "step_overhead_ms"))
    return DecodeStreaming(values["bandwidth_fraction"], values["small_row_reads"], values["matmul_start_ms"] / 1e3,
                           block, prefill, row, row_reads_by_width=_parse_row_reads(doc.get(_STREAMING_TABLE), where),
                           step_overhead_s=step, prefill_rates=_parse_prefill_rates(doc.get("prefill_rates"), where),
                           attention_bandwidth=(s.number("attention_gbps", *_STREAMING_OPTIONAL["attention_gbps"]) * 1e9
                                                if "attention_gbps" in doc else None))


def _parse_row_reads(doc: Any, where: str) -> tuple[tuple[int, int, float], ...]:
    """The decode_streaming object's optional "small_row_reads_by_width": {"576x4": 1.4, "2048x8": 2.4} (the weight
    reads of a step of <rows> rows through blocks <width> wide, measured), as ((width, rows, reads), ...)."""
    if doc is None:
        return ()
    field = f"cpu.decode_streaming.{_STREAMING_TABLE}"
    if not isinstance(doc, dict) or not doc:
        raise InputError(f"{where}: field '{field}' must be an object of \"<width>x<rows>\": reads, got {doc!r}")
    triples = []
    for key, reads in doc.items():
        width, _, rows = str(key).partition("x")
        if not (width.isdigit() and rows.isdigit() and 0 < int(width) <= 1 << 20 and 2 <= int(rows) <= 4096):
            raise InputError(f"{where}: field '{field}' has key {key!r}; keys are \"<width>x<rows>\", a width of 1 "
                             f"to {1 << 20} and 2 to 4096 rows, e.g. \"576x4\"")
        if isinstance(reads, bool) or not isinstance(reads, (int, float)) or not 1.0 <= reads <= 16.0:
            raise InputError(f"{where}: field '{field}.{key}' must be a number in [1, 16], got {reads!r}")
        triples.append((int(width), int(rows), float(reads)))
    return tuple(sorted(triples))


def _parse_prefill_rates(doc: Any, where: str) -> tuple[PrefillRate, ...]:
    """decode_streaming's optional "prefill_rates": [{"hidden": 576, "peak_gflops": 150, "half_rows": 40}, ...],
    one entry per measured width (hardware.PrefillRate); () when absent."""
    if doc is None:
        return ()
    name = "cpu.decode_streaming.prefill_rates"
    if not isinstance(doc, list) or not doc or len(doc) > 16:
        raise InputError(f"{where}: field '{name}' must be a list of 1 to 16 objects "
                         f"({', '.join(_PREFILL_RATE_FIELDS)}), got {doc!r}")
    rates = []
    for i, entry in enumerate(doc):
        if not isinstance(entry, dict):
            raise InputError(f"{where}: field '{name}[{i}]' must be an object, got {entry!r}")
        s = _Section(entry, where, f"{name}[{i}]")
        s.check_keys(set(_PREFILL_RATE_FIELDS))
        rates.append(PrefillRate(s.limited_integer("hidden", "prefill_hidden"),
                                 s.limited("peak_gflops", "prefill_peak_gflops") * 1e9,
                                 s.limited("half_rows", "prefill_half_rows")))
    if len({r.hidden for r in rates}) != len(rates):
        raise InputError(f"{where}: field '{name}' lists a width twice: {doc!r}")
    return tuple(sorted(rates, key=lambda r: r.hidden))


def prefill_rate_in_limits(hidden: int, peak_flops: float, half_rows: float) -> PrefillRate:
    """A measured prefill rate (hardware.PrefillRate) pulled inside the limits a profile's is read back with."""
    return PrefillRate(int(clamp_to_limit(hidden, "prefill_hidden")),
                       clamp_to_limit(peak_flops / 1e9, "prefill_peak_gflops") * 1e9,
                       clamp_to_limit(half_rows, "prefill_half_rows"))


def _packed_table(s: _Section, key: str, what: str) -> dict:
    """The cpu section's optional object `key` of packed format -> value (`what` says the values, for the error), its
    format names checked; {} when absent."""
    table = s.doc.get(key)
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise s.error(key, f"must be an object of format ({', '.join(PACKED_FORMATS)}) -> {what}")
    for name in table:
        if name not in PACKED_FORMATS:
            raise s.error(f"{key}.{name}", f"is not a packed format ({', '.join(PACKED_FORMATS)})")
    return table


def _parse_packed_kernels(s: _Section, key: str = "packed_kernels_gweights_per_s") -> dict[str, float]:
    """The cpu section's optional "packed_kernels_gweights_per_s": {"q4_0": 6.1, ...} (measured rates of the packed
    formats' kernels, hardware.ComputeDevice.packed_kernels) in weights/s; or, with key
    "packed_kernels_cached_gweights_per_s", their rates with the weights in the last-level cache; with
    "packed_prefill_gweights_per_s", their row-weight products/s in a prefill (ComputeDevice.packed_prefill)."""
    return {name: 1e9 * check_number(value, "gweights_per_s", where=s.where, field=s.name(f"{key}.{name}"))
            for name, value in _packed_table(s, key, "billions of weights/s").items()}


def _parse_packed_row_steps(s: _Section, key: str = "packed_row_steps") -> dict[str, tuple[float, ...]]:
    """The cpu section's optional "packed_row_steps": {"q4_1": [1.7, 3.9], ...}: a packed format's decode step of
    each of PACKED_ROW_COUNTS rows over its one-row step (hardware.ComputeDevice.packed_row_steps)."""
    counts = ", ".join(map(str, PACKED_ROW_COUNTS))
    steps = {}
    for name, values in _packed_table(s, key, f"[step ratio at {counts} rows]").items():
        if not isinstance(values, list) or len(values) != len(PACKED_ROW_COUNTS):
            raise s.error(f"{key}.{name}", f"must be a list of {len(PACKED_ROW_COUNTS)} step ratios (at {counts} "
                                           f"rows), got {values!r}")
        steps[name] = tuple(check_number(v, "row_step_ratio", where=s.where, field=s.name(f"{key}.{name}[{i}]"))
                            for i, v in enumerate(values))
    return steps


def _parse_gpu(doc: Any, where: str, path: str, default_source: str) -> ComputeDevice:
    s = _Section(doc, where, path)
    s.check_keys(_GPU_KEYS)
    sources = s.sources(default_source, _GPU_SOURCE_KEYS)
    name = s.label("name")
    memory = s.size_gb("memory", "memory_gb")
    bandwidth = _bandwidth(s.limited("memory_bandwidth_gbps", "memory_bandwidth_gbps"))
    flops = s.flops_table("flops_tflops")
    power = s.limited("power_w", "power_w")
    if s.has("host_link_gbps"):
        host_link = _bandwidth(s.limited("host_link_gbps", "host_link_gbps"))
    elif s.has("pcie_gen") or s.has("pcie_lanes"):
        gen, lanes = s.limited_integer("pcie_gen", "pcie_gen"), s.limited_integer("pcie_lanes", "pcie_lanes")
        host_link = pcie_bandwidth(gen, lanes)
        if "host_link_bandwidth" not in (doc.get("sources") or {}):
            sources["host_link_bandwidth"] = (f"{default_source.split(':', 1)[0]}:PCIe {gen}.0 x{lanes}, "
                                              "80% of nominal (practical)")
    else:
        raise s.error("host_link_gbps", "is missing (or give pcie_gen and pcie_lanes)")
    return ComputeDevice(kind="gpu", name=name, memory_bytes=memory, memory_bandwidth=bandwidth, flops=flops,
                         power_watts=power, host_link_bandwidth=host_link, unified_memory=s.flag("unified_memory", False),
                         sources=sources, in_use_bytes=in_use_bytes(s, memory))


def _parse_cpu(doc: Any, where: str, default_source: str) -> ComputeDevice:
    s = _Section(doc, where, "cpu")
    s.check_keys(_CPU_KEYS)
    cores = s.limited_integer("cores", "cores")
    if s.has("flops_tflops"):
        flops = s.flops_table("flops_tflops")
    elif s.has("clock_ghz") or s.has("simd"):
        simd = s.label("simd")
        if simd not in SIMD_FP32_FLOPS_PER_CYCLE:
            raise s.error("simd", f"must be one of {', '.join(SIMD_FP32_FLOPS_PER_CYCLE)}, got {simd!r}")
        clock = s.limited("clock_ghz", "clock_ghz")
        flops = {k: _flops(v) for k, v in cpu_peak_flops_tflops(cores, clock, simd).items()}
    else:
        raise s.error("flops_tflops", "is missing (or give clock_ghz and simd)")
    sources = s.sources(default_source, _CPU_SOURCE_KEYS)
    if not s.has("flops_tflops") and "flops" not in (doc.get("sources") or {}):
        sources["flops"] = f"estimated: {cores} cores x {s.doc['clock_ghz']} GHz x {s.doc['simd']} FLOP/cycle"
    return ComputeDevice(
        kind="cpu",
        name=s.label("name"),
        memory_bytes=s.size_gb("ram", "ram_gb"),
        memory_bandwidth=_bandwidth(s.limited("ram_bandwidth_gbps", "ram_bandwidth_gbps")),
        flops=flops,
        power_watts=s.limited("power_w", "power_w"),
        host_link_bandwidth=None,
        sources=sources,
        cores=cores,
        decode_streaming=_parse_decode_streaming(s.doc.get("decode_streaming"), where),
        in_use_bytes=in_use_bytes(s, s.size_gb("ram", "ram_gb")),
        packed_kernels=_parse_packed_kernels(s),
        packed_kernels_cached=_parse_packed_kernels(s, "packed_kernels_cached_gweights_per_s"),
        packed_prefill=_parse_packed_kernels(s, "packed_prefill_gweights_per_s"),
        packed_row_steps=_parse_packed_row_steps(s),
        packed_block_overhead_s=(s.limited("packed_block_overhead_ms", "packed_block_overhead_ms") / 1e3
                                 if s.has("packed_block_overhead_ms") else None),
        cache_bytes=int(s.limited("cache_mib", "cache_mib") * (1 << 20)) if s.has("cache_mib") else None,
        half_decode_ratio=s.limited("half_decode_ratio", "half_decode_ratio", required=False),
    )


def in_use_bytes(section, memory_bytes: int) -> int:
    """The optional "in_use_gb" of a cpu or gpu section (what other programs held at detection): 0 to the memory."""
    if not section.has("in_use_gb"):
        return 0
    return _bytes(section.number("in_use_gb", 0.0, memory_bytes / 1e9))


def _parse_disk(doc: Any, where: str, default_source: str) -> DiskSpec:
    s = _Section(doc, where, "disk")
    s.check_keys({"capacity_gb", "read_gbps", "write_gbps"})
    return DiskSpec(
        capacity_bytes=_bytes(s.limited("capacity_gb", "capacity_gb")),
        read_bandwidth=_bandwidth(s.limited("read_gbps", "disk_gbps")),
        write_bandwidth=_bandwidth(s.limited("write_gbps", "disk_gbps")),
        sources=s.sources(default_source, _DISK_SOURCE_KEYS),
    )


def _parse_network(doc: Any, where: str, default_source: str) -> NetworkSpec:
    s = _Section(doc, where, "network")
    s.check_keys({"upload_mbps", "download_mbps", "rtt_ms"})
    return NetworkSpec(
        upload_bps=_bits_per_s(s.limited("upload_mbps", "network_mbps")),
        download_bps=_bits_per_s(s.limited("download_mbps", "network_mbps")),
        rtt_s=_seconds(s.limited("rtt_ms", "rtt_ms")),
        sources=s.sources(default_source, _NETWORK_SOURCE_KEYS),
    )


# ---- the catalog ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _catalog() -> dict:
    return json.loads(CATALOG_PATH.read_text(encoding="utf-8"))


def hardware_ids() -> list[str]:
    """Ids of every catalog machine (a catalog GPU on its default host, or a CPU-only host)."""
    return list(_catalog()["machines"])


def gpu_ids() -> list[str]:
    """Ids of the catalog GPUs (usable as "gpu" in a hardware JSON file)."""
    return list(_catalog()["gpus"])


def catalog_gpu(gpu_id: str) -> ComputeDevice:
    """One catalog GPU as a ComputeDevice."""
    entry = _catalog()["gpus"].get(gpu_id)
    if entry is None:
        raise InputError(f"unknown GPU {gpu_id!r}; catalog GPUs: {', '.join(gpu_ids())}")
    return _parse_gpu(entry, str(CATALOG_PATH), f"gpus.{gpu_id}", f"catalog:{entry.get('source', gpu_id)}")


def _host_document(host_id: str) -> dict:
    """A host entry as the cpu/disk/network sections of a hardware document, with its source on each."""
    host = _catalog()["hosts"][host_id]
    source = host.get("source", f"host {host_id}")
    sections = {}
    for name in ("cpu", "disk", "network"):
        section = dict(host[name])
        section.setdefault("source", source)
        sections[name] = section
    return sections


def _catalog_machine(machine_id: str) -> HardwareSpec:
    catalog = _catalog()
    machine = catalog["machines"].get(machine_id)
    if machine is None:
        raise InputError(f"unknown hardware {machine_id!r}; catalog ids: {', '.join(hardware_ids())} "
                         "(or a hardware JSON file, see docs/hardware-json.md)")
    where = str(CATALOG_PATH)
    host = _host_document(machine["host"])
    default = "catalog:hardware.json"
    return HardwareSpec(
        id=machine_id,
        gpus=(catalog_gpu(machine["gpu"]),) if machine.get("gpu") else (),
        cpu=_parse_cpu(host["cpu"], where, default),
        disk=_parse_disk(host["disk"], where, default),
        network=_parse_network(host["network"], where, default),
        price_per_hour=machine.get("price_per_hour"),
        description=machine.get("description", ""),
    )


def get_hardware(hardware_id: str, *, ram_gb: float | None = None, disk_gb: float | None = None,
                 disk_read_gbps: float | None = None, network_mbps: float | None = None,
                 rtt_ms: float | None = None, price_per_hour: float | None = None) -> HardwareSpec:
    """A catalog machine, with optional host overrides (RAM, disk size and read speed, network, price).

    For example FlexGen's machine: get_hardware("t4", ram_gb=208, disk_gb=1500) (also catalog id "t4-flexgen").
    """
    return apply_host_overrides(_catalog_machine(hardware_id), ram_gb=ram_gb, disk_gb=disk_gb,
                                disk_read_gbps=disk_read_gbps, network_mbps=network_mbps, rtt_ms=rtt_ms,
                                price_per_hour=price_per_hour)


def apply_host_overrides(spec: HardwareSpec, *, ram_gb: float | None = None, disk_gb: float | None = None,
                         disk_read_gbps: float | None = None, network_mbps: float | None = None,
                         rtt_ms: float | None = None, price_per_hour: float | None = None,
                         where: str = "override") -> HardwareSpec:
    """Replace host numbers of a spec; each replaced number's source becomes "user". None leaves a field as is."""
    cpu, gpus, disk, network = spec.cpu, spec.gpus, spec.disk, spec.network
    changed = []
    if ram_gb is not None:
        ram = _bytes(check_number(ram_gb, "ram_gb", where=where, field="ram_gb"))
        cpu = dataclasses.replace(cpu, memory_bytes=ram, sources={**cpu.sources, "memory_bytes": "user"})
        # unified memory: the GPU's memory is the host RAM
        gpus = tuple(dataclasses.replace(g, memory_bytes=ram, sources={**g.sources, "memory_bytes": "user"})
                     if g.unified_memory else g for g in gpus)
        changed.append(f"ram {ram_gb:g} GB")
    if disk_gb is not None:
        size = _bytes(check_number(disk_gb, "capacity_gb", where=where, field="disk_gb"))
        disk = dataclasses.replace(disk, capacity_bytes=size, sources={**disk.sources, "capacity_bytes": "user"})
        changed.append(f"disk {disk_gb:g} GB")
    if disk_read_gbps is not None:
        read = _bandwidth(check_number(disk_read_gbps, "disk_gbps", where=where, field="disk_read_gbps"))
        disk = dataclasses.replace(disk, read_bandwidth=read, sources={**disk.sources, "read_bandwidth": "user"})
        changed.append(f"disk read {disk_read_gbps:g} GB/s")
    if network_mbps is not None:
        bps = _bits_per_s(check_number(network_mbps, "network_mbps", where=where, field="network_mbps"))
        network = dataclasses.replace(network, upload_bps=bps, download_bps=bps,
                                      sources={**network.sources, "upload_bps": "user", "download_bps": "user"})
        changed.append(f"network {network_mbps:g} Mbit/s")
    if rtt_ms is not None:
        rtt = _seconds(check_number(rtt_ms, "rtt_ms", where=where, field="rtt_ms"))
        network = dataclasses.replace(network, rtt_s=rtt, sources={**network.sources, "rtt_s": "user"})
        changed.append(f"rtt {rtt_ms:g} ms")
    price = spec.price_per_hour
    if price_per_hour is not None:
        price = check_number(price_per_hour, "price_per_hour", where=where, field="price_per_hour")
        changed.append(f"${price_per_hour:g}/h")
    if not changed:
        return spec
    description = f"{spec.description} (overridden: {', '.join(changed)})" if spec.description else \
        f"overridden: {', '.join(changed)}"
    return dataclasses.replace(spec, gpus=gpus, cpu=cpu, disk=disk, network=network, price_per_hour=price,
                               description=description)


# ---- hardware JSON documents -----------------------------------------------------------------------------------------
_OVERRIDE_KEYS = ("ram_gb", "disk_gb", "disk_read_gbps", "network_mbps", "rtt_ms")
_TOP_LEVEL_KEYS = {"id", "description", "base", "gpu", "gpus", "gpu_count", "cpu", "disk", "network",
                   "price_per_hour", "_doc", *_OVERRIDE_KEYS}
# Keys that replace each other when a section is merged onto a base machine's section.
_ALTERNATIVES = [{"ram_gb", "ram_gib"}, {"memory_gb", "memory_gib"},
                 {"flops_tflops", "clock_ghz", "simd"}]
# Which spec field (source key) a JSON key sets, so a merged field's source becomes the file's own.
_SOURCE_OF = {"cores": "cores", "ram_gb": "memory_bytes", "ram_gib": "memory_bytes",
              "ram_bandwidth_gbps": "memory_bandwidth", "flops_tflops": "flops", "clock_ghz": "flops",
              "simd": "flops", "power_w": "power_watts", "capacity_gb": "capacity_bytes",
              "read_gbps": "read_bandwidth", "write_gbps": "write_bandwidth", "upload_mbps": "upload_bps",
              "download_mbps": "download_bps", "rtt_ms": "rtt_s"}


def _merge_section(base: dict, given: dict, where: str, name: str) -> dict:
    """Fields of `given` replace those of `base` (a section from hardware_to_json); their sources are dropped."""
    _Section(given, where, name)  # type check
    merged = dict(base)
    for alternatives in _ALTERNATIVES:
        if alternatives & given.keys():
            for key in alternatives:
                merged.pop(key, None)
    merged.update(given)
    replaced = {_SOURCE_OF[key] for key in given if key in _SOURCE_OF}
    merged["sources"] = {k: v for k, v in base.get("sources", {}).items() if k not in replaced}
    merged["sources"].update(given.get("sources") or {})
    merged.pop("source", None)
    if "source" in given:
        merged["source"] = given["source"]
    return merged


def hardware_from_dict(doc: Any, *, where: str = "hardware JSON", default_id: str = "custom",
                       default_source: str = "user") -> HardwareSpec:
    """Build a HardwareSpec from a hardware document (the schema of docs/hardware-json.md)."""
    top = _Section(doc, where, "")
    unknown = sorted(set(doc) - _TOP_LEVEL_KEYS)
    if unknown:
        raise top.error(unknown[0], f"is not a hardware field (known: {', '.join(sorted(_TOP_LEVEL_KEYS - {'_doc'}))})")
    if top.has("gpu") and top.has("gpus"):
        raise top.error("gpu", "and 'gpus' are both given; keep one")

    # GPUs: catalog ids or full objects
    gpu_entries = doc.get("gpus")
    if top.has("gpu"):
        gpu_entries = [doc["gpu"]] * (top.limited_integer("gpu_count", "gpu_count", required=False) or 1)
    elif top.has("gpu_count"):
        raise top.error("gpu_count", "needs a 'gpu'")
    if gpu_entries is not None and not isinstance(gpu_entries, list):
        raise top.error("gpus", "must be a list of catalog GPU ids or GPU objects")
    gpu_field = "gpu" if top.has("gpu") else "gpus"
    gpus = []
    for index, entry in enumerate(gpu_entries or []):
        path = gpu_field if top.has("gpu") else f"gpus[{index}]"
        if isinstance(entry, str):
            if entry not in _catalog()["gpus"]:
                raise InputError(f"{where}: field {path!r} is {entry!r}, not a catalog GPU "
                                 f"({', '.join(gpu_ids())})")
            gpus.append(catalog_gpu(entry))
        else:
            gpus.append(_parse_gpu(entry, where, path, default_source))

    # the base machine that sections and missing GPUs come from
    base_id = top.label("base", required=False) or None
    if base_id is None:
        first_catalog_gpu = next((e for e in (gpu_entries or []) if isinstance(e, str)), None)
        if first_catalog_gpu and not all(top.has(name) for name in ("cpu", "disk", "network")):
            base_id = first_catalog_gpu
    base = None
    if base_id is not None:
        if base_id not in _catalog()["machines"]:
            raise top.error("base", f"is {base_id!r}, not a catalog machine ({', '.join(hardware_ids())})")
        base = _catalog_machine(base_id)
        if gpu_entries is None:
            gpus = list(base.gpus)
    base_doc = hardware_to_json(base) if base else {}

    sections = {}
    for name in ("cpu", "disk", "network"):
        given = doc.get(name)
        if given is None and not base:
            raise top.error(name, "is missing (or name a catalog 'base' machine or catalog 'gpu' to take it from)")
        sections[name] = _merge_section(base_doc[name], given, where, name) if base and given is not None else \
            (base_doc[name] if given is None else given)

    spec = HardwareSpec(
        id=top.label("id", required=False) or default_id,
        gpus=tuple(gpus),
        cpu=_parse_cpu(sections["cpu"], where, default_source),
        disk=_parse_disk(sections["disk"], where, default_source),
        network=_parse_network(sections["network"], where, default_source),
        price_per_hour=top.limited("price_per_hour", "price_per_hour", required=False)
        if "price_per_hour" in doc else (base.price_per_hour if base else None),
        description=top.label("description", required=False) or (base.description if base else ""),
    )
    overrides = {key: top.limited(key, {"ram_gb": "ram_gb", "disk_gb": "capacity_gb", "disk_read_gbps": "disk_gbps",
                                       "network_mbps": "network_mbps", "rtt_ms": "rtt_ms"}[key], required=False)
                 for key in _OVERRIDE_KEYS}
    return apply_host_overrides(spec, where=where, **overrides)


def load_hardware_json(path: str | Path) -> HardwareSpec:
    """Read a hardware JSON file (docs/hardware-json.md); errors name the file and the field."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot read hardware file: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from None
    return hardware_from_dict(doc, where=str(path), default_id=path.stem)


def resolve_hardware(arg: str, **host_overrides: float | None) -> HardwareSpec:
    """A catalog id or a hardware JSON path, with host overrides (the keyword arguments of get_hardware).

    "auto" (detect this machine) needs torch/NVML, so core's detection handles it before calling here.
    """
    if arg == "auto":
        raise InputError("hardware 'auto' is detected by hivekeeper.core.machine.detect, not by the planner")
    path = Path(arg).expanduser()
    if path.is_file() or arg.endswith(".json"):
        return apply_host_overrides(load_hardware_json(path), where="command line", **host_overrides)
    return get_hardware(arg, **host_overrides)


def _unit(value: float, scale: float) -> float:
    """value / scale, as an int when whole (keeps the JSON readable: 320 rather than 320.0)."""
    quotient = value / scale
    return int(quotient) if quotient == int(quotient) and abs(quotient) < 2**53 else quotient


def _gpu_to_json(gpu: ComputeDevice) -> dict:
    return {
        "name": gpu.name,
        "memory_gb": _unit(gpu.memory_bytes, 1e9),
        "memory_bandwidth_gbps": _unit(gpu.memory_bandwidth, 1e9),
        "flops_tflops": {dtype: _unit(value, 1e12) for dtype, value in gpu.flops.items()},
        "power_w": gpu.power_watts,
        "host_link_gbps": _unit(gpu.host_link_bandwidth or 0.0, 1e9),
        "unified_memory": gpu.unified_memory,
        **({"in_use_gb": _unit(gpu.in_use_bytes, 1e9)} if gpu.in_use_bytes else {}),
        "sources": dict(gpu.sources),
    }


def hardware_to_json(spec: HardwareSpec) -> dict:
    """A hardware document with every field explicit; hardware_from_dict of it gives back an equal spec."""
    cpu, disk, network = spec.cpu, spec.disk, spec.network
    return {
        "id": spec.id,
        "description": spec.description,
        "gpus": [_gpu_to_json(gpu) for gpu in spec.gpus],
        "cpu": {
            "name": cpu.name,
            "cores": cpu.cores or 1,
            "ram_gb": _unit(cpu.memory_bytes, 1e9),
            "ram_bandwidth_gbps": _unit(cpu.memory_bandwidth, 1e9),
            "flops_tflops": {dtype: _unit(value, 1e12) for dtype, value in cpu.flops.items()},
            "power_w": cpu.power_watts,
            **({"decode_streaming": {
                "bandwidth_fraction": round(cpu.decode_streaming.bandwidth_fraction, 4),
                "small_row_reads": round(cpu.decode_streaming.small_row_reads, 4),
                "matmul_start_ms": round(cpu.decode_streaming.matmul_start_s * 1e3, 4),
                **({"block_overhead_ms": round(cpu.decode_streaming.block_overhead_s * 1e3, 4)}
                   if cpu.decode_streaming.block_overhead_s is not None else {}),
                **({"prefill_block_overhead_ms": round(cpu.decode_streaming.prefill_block_overhead_s * 1e3, 4)}
                   if cpu.decode_streaming.prefill_block_overhead_s is not None else {}),
                **({"row_block_overhead_ms": round(cpu.decode_streaming.row_block_overhead_s * 1e3, 4)}
                   if cpu.decode_streaming.row_block_overhead_s is not None else {}),
                **({_STREAMING_TABLE: {f"{w}x{rows}": round(r, 4)
                                       for w, rows, r in cpu.decode_streaming.row_reads_by_width}}
                   if cpu.decode_streaming.row_reads_by_width else {}),
                **({"step_overhead_ms": round(cpu.decode_streaming.step_overhead_s * 1e3, 4)}
                   if cpu.decode_streaming.step_overhead_s is not None else {}),
                **({"prefill_rates": [{"hidden": r.hidden, "peak_gflops": _unit(r.peak_flops, 1e9),
                                       "half_rows": r.half_rows}
                                      for r in cpu.decode_streaming.prefill_rates]}
                   if cpu.decode_streaming.prefill_rates else {}),
                **({"attention_gbps": _unit(cpu.decode_streaming.attention_bandwidth, 1e9)}
                   if cpu.decode_streaming.attention_bandwidth is not None else {})}}
               if cpu.decode_streaming is not None else {}),
            **({"in_use_gb": _unit(cpu.in_use_bytes, 1e9)} if cpu.in_use_bytes else {}),
            **({"packed_kernels_gweights_per_s": {name: _unit(rate, 1e9) for name, rate in cpu.packed_kernels.items()}}
               if cpu.packed_kernels else {}),
            **({"packed_kernels_cached_gweights_per_s": {name: _unit(rate, 1e9)
                                                         for name, rate in cpu.packed_kernels_cached.items()}}
               if cpu.packed_kernels_cached else {}),
            **({"packed_prefill_gweights_per_s": {name: _unit(rate, 1e9) for name, rate in cpu.packed_prefill.items()}}
               if cpu.packed_prefill else {}),
            **({"packed_block_overhead_ms": round(cpu.packed_block_overhead_s * 1e3, 4)}
               if cpu.packed_block_overhead_s is not None else {}),
            **({"packed_row_steps": {name: [round(r, 4) for r in steps] for name, steps in cpu.packed_row_steps.items()}}
               if cpu.packed_row_steps else {}),
            **({"cache_mib": round(cpu.cache_bytes / (1 << 20), 4)} if cpu.cache_bytes else {}),
            **({"half_decode_ratio": round(cpu.half_decode_ratio, 4)} if cpu.half_decode_ratio else {}),
            "sources": dict(cpu.sources),
        },
        "disk": {
            "capacity_gb": _unit(disk.capacity_bytes, 1e9),
            "read_gbps": _unit(disk.read_bandwidth, 1e9),
            "write_gbps": _unit(disk.write_bandwidth, 1e9),
            "sources": dict(disk.sources),
        },
        "network": {
            "upload_mbps": _unit(network.upload_bps, 1e6),
            "download_mbps": _unit(network.download_bps, 1e6),
            "rtt_ms": round(network.rtt_s * 1e3, 3),
            "sources": dict(network.sources),
        },
        "price_per_hour": spec.price_per_hour,
    }


# ---- GPUs from what NVML / torch report -----------------------------------------------------------------------------
# Dense FLOP per clock per SM by compute capability (matmul rates from the architecture whitepapers).
# fp16/bf16/tf32 of consumer (GeForce) parts are halved below: they accumulate in fp32 at half rate.
_FLOPS_PER_CLOCK_PER_SM: dict[tuple[int, int], dict[str, int]] = {
    (5, 0): {"fp32": 256},  # Maxwell: 128 cores, no fast fp16
    (6, 0): {"fp32": 128, "fp16": 256},  # P100: 64 cores, packed fp16
    (6, 1): {"fp32": 256, "fp16": 4, "int8": 1024},  # GP10x: fp16 at 1/64, int8 dot products (dp4a)
    (7, 0): {"fp32": 128, "fp16": 1024, "bf16": 128, "int8": 512},  # V100: first tensor cores, no bf16
    (7, 5): {"fp32": 128, "fp16": 1024, "bf16": 128, "int8": 2048},  # Turing (T4): no bf16 tensor cores
    (8, 0): {"fp32": 128, "tf32": 1024, "fp16": 2048, "bf16": 2048, "int8": 4096},  # A100
    (8, 6): {"fp32": 256, "tf32": 512, "fp16": 1024, "bf16": 1024, "int8": 2048},  # GA10x (A10, RTX 30)
    (8, 9): {"fp32": 256, "tf32": 512, "fp16": 1024, "bf16": 1024, "fp8": 2048, "int8": 2048},  # Ada (L4, RTX 40)
    (9, 0): {"fp32": 256, "tf32": 2048, "fp16": 4096, "bf16": 4096, "fp8": 8192, "int8": 8192},  # Hopper
    (10, 0): {"fp32": 256, "tf32": 4096, "fp16": 8192, "bf16": 8192, "fp8": 16384, "int8": 16384},  # B200
    (12, 0): {"fp32": 256, "tf32": 512, "fp16": 1024, "bf16": 1024, "fp8": 2048, "int8": 2048},  # RTX 50
}
_HALF_RATE_ON_GEFORCE = ("tf32", "fp16", "bf16", "fp8")
_DEFAULT_SM_CLOCK_MHZ = 1500
_DEFAULT_POWER_W = 250.0


def _parse_compute_capability(value: Any) -> tuple[int, int]:
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return int(value[0]), int(value[1])
    major, _, minor = str(value).partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        raise InputError(f"compute capability {value!r} is not like '8.6' or (8, 6)") from None


def known_gpu_id(name: str, memory_bytes: int | None = None) -> str | None:
    """The catalog id of a GPU by the name its driver reports ('NVIDIA GeForce RTX 4090' -> 'rtx-4090'), or None.

    Only exact matches: variants with other clocks, power or memory (PCIe A100, H100 PCIe/NVL, 3060 8GB, laptop
    parts) are left to derive_gpu_spec.
    """
    n = " " + " ".join(name.lower().replace("-", " ").replace("_", " ").split()) + " "
    if " laptop " in n or " mobile " in n or " max q " in n:
        return None
    gib = memory_bytes / GIB if memory_bytes else None
    if re.search(r" h200 ", n) and " nvl " not in n:
        return "h200"
    if re.search(r" h100 ", n) and (" sxm" in n or " hbm3 " in n) and " nvl " not in n:
        return "h100-sxm"
    if re.search(r" a100 ", n) and " sxm" in n:
        if " 80gb " in n or (gib and gib > 60):
            return "a100-80gb"
        return "a100-40gb"
    if re.search(r" (tesla )?t4 ", n):
        return "t4"
    if re.search(r" l4 ", n):
        return "l4"
    if re.search(r" rtx 4090 ", n) and " d " not in n:
        return "rtx-4090"
    if re.search(r" rtx 3090 ", n) and " ti " not in n:
        return "rtx-3090"
    if re.search(r" rtx 3060 ", n) and " ti " not in n and (gib is None or gib > 10):
        return "rtx-3060-12gb"
    if re.search(r" apple m2 ultra ", n):
        return "apple-m2-ultra"
    return None


def derive_gpu_spec(name: str, memory_bytes: int, sm_count: int, sm_clock_mhz: float, mem_clock_mhz: float,
                    mem_bus_width_bits: int, compute_capability: Any, power_limit_w: float | None,
                    pcie_gen: int | None, pcie_width: int | None) -> ComputeDevice:
    """A GPU spec from what NVML/torch report. Known names map to the catalog entry (with the reported memory).

    Otherwise: FLOP/s = SMs × max SM clock × dense FLOP per clock per SM of the architecture (halved for fp16/bf16
    on GeForce parts, which accumulate in fp32 at half rate); bandwidth = memory clock × 2 (NVML reports the
    clock of a double-data-rate interface) × bus width / 8; host link = PCIe gen × width at 80%. Nothing is zero:
    a missing number falls back to a default marked "default". NVML's max SM clock can exceed the rated boost
    clock of consumer cards, so derived FLOP/s are upper bounds.
    """
    catalog_id = known_gpu_id(name, memory_bytes)
    if catalog_id is not None:
        gpu = catalog_gpu(catalog_id)
        if memory_bytes and memory_bytes > 0:
            gpu = dataclasses.replace(gpu, name=name, memory_bytes=int(memory_bytes),
                                      sources={**gpu.sources, "memory_bytes": "detected"})
        return gpu

    cc = _parse_compute_capability(compute_capability)
    known = sorted(_FLOPS_PER_CLOCK_PER_SM)
    arch = max((k for k in known if k <= cc), default=known[0])
    flops_note = f"derived: SMs x max SM clock x dense FLOP/clock/SM of compute capability {arch[0]}.{arch[1]}"
    if cc > known[-1] or cc < known[0]:
        flops_note += f" (assumed for {cc[0]}.{cc[1]})"
    per_sm = dict(_FLOPS_PER_CLOCK_PER_SM[arch])
    if "geforce" in name.lower() or "titan" in name.lower():
        per_sm = {k: v // 2 if k in _HALF_RATE_ON_GEFORCE and arch >= (7, 5) else v for k, v in per_sm.items()}
        flops_note += "; fp16/bf16 halved for fp32 accumulate on GeForce"

    sources = {"memory_bytes": "detected", "memory_bandwidth": "derived: memory clock x 2 x bus width / 8",
               "flops": flops_note, "power_watts": "detected", "host_link_bandwidth": "derived: PCIe link, 80%"}
    sms = sm_count if sm_count and sm_count > 0 else 1
    if not (sm_count and sm_count > 0):
        sources["flops"] += "; SM count unknown, assumed 1"
    clock = sm_clock_mhz if sm_clock_mhz and sm_clock_mhz > 0 else _DEFAULT_SM_CLOCK_MHZ
    if not (sm_clock_mhz and sm_clock_mhz > 0):
        sources["flops"] += f"; SM clock unknown, assumed {_DEFAULT_SM_CLOCK_MHZ} MHz"
    if mem_clock_mhz and mem_clock_mhz > 0 and mem_bus_width_bits and mem_bus_width_bits > 0:
        bandwidth_gbps = mem_clock_mhz * 1e6 * 2 * mem_bus_width_bits / 8 / 1e9
    else:
        bandwidth_gbps = 300.0
        sources["memory_bandwidth"] = "default: memory clock or bus width unknown"
    power = power_limit_w if power_limit_w and power_limit_w > 0 else _DEFAULT_POWER_W
    if not (power_limit_w and power_limit_w > 0):
        sources["power_watts"] = "default: power limit unknown"
    if pcie_gen and pcie_gen > 0 and pcie_width and pcie_width > 0:
        gen, lanes = min(int(pcie_gen), 7), min(int(pcie_width), 32)
    else:
        gen, lanes = 4, 16
        sources["host_link_bandwidth"] = "default: PCIe link unknown, assumed 4.0 x16 at 80%"
    memory_gb = memory_bytes / 1e9 if memory_bytes and memory_bytes > 0 else 1.0
    if not (memory_bytes and memory_bytes > 0):
        sources["memory_bytes"] = "default: memory size unknown"
    doc = {
        "name": name or "unknown GPU",
        "memory_gb": memory_gb,
        "memory_bandwidth_gbps": bandwidth_gbps,
        "flops_tflops": {dtype: sms * clock * 1e6 * per_clock / 1e12 for dtype, per_clock in per_sm.items()},
        "power_w": float(power),
        "host_link_gbps": pcie_bandwidth(gen, lanes) / 1e9,
        "sources": sources,
    }
    return _parse_gpu(doc, "derived GPU spec", "gpu", "derived")
