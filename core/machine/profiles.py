"""Machine profiles: what `hivekeeper measure` and `hivekeeper profile` learned about this machine, kept for reuse.

A profile is one JSON file per machine in the user config folder (HIVEKEEPER_CONFIG_DIR, else the platform's,
e.g. ~/.config/hivekeeper/profiles/<fingerprint>.json). The fingerprint hashes what identifies the hardware: CPU
name and core count, RAM (whole GiB) and GPU names, so a profile is only used on the machine that made it.

It holds the benchmark results (core/machine/measure.py) and, after `hivekeeper profile`, a calibration
(planner/calibration.py). The planner then takes this machine as detected, with measured numbers in place of
estimates and catalog figures, and the efficiency factors that go with them:

    hardware, efficiency = detect_or_load_profile()       # efficiency is None without a profile
    plan = search(model, hardware, goal, efficiency=efficiency)

Measuring again replaces the measurements and drops the calibration: its factors were fitted to the old numbers.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from hivekeeper.planner.calibration import Calibration, measured_efficiency
from hivekeeper.planner.costmodel import packed_kernel_rate
from hivekeeper.planner.efficiency import DEFAULTS as DEFAULT_EFFICIENCY
from hivekeeper.planner.efficiency import MachineEfficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.formats import PACKED_FORMATS
from hivekeeper.planner.hardware import PACKED_ROW_COUNTS, ComputeDevice, DecodeStreaming, HardwareSpec, PrefillRate
from hivekeeper.planner.hardware_catalog import clamp_to_limit, prefill_rate_in_limits

from hivekeeper.core.atomic_file import write_json_atomic
from hivekeeper.core.machine.cpu_dtype_rule import choose, with_choice
from hivekeeper.core.machine.flops_words import flops_source
from hivekeeper.core.machine.measurement import (  # not .measure: reading a profile must not import torch
    ATTENTION_KEY, BLOCK_OVERHEAD_KEY, HALF_DECODE_KEY, MATMUL_START_KEY, PACKED_BLOCK_KEY, PACKED_CACHED_KEY,
    PACKED_KERNEL_KEY, PACKED_PREFILL_KEY, PACKED_ROWS_KEY, PREFILL_BF16_KEY, PREFILL_BLOCK_KEY, PREFILL_FLOPS_KEY,
    PREFILL_HALF_ROWS_KEY, PREFILL_PEAK_KEY, RAISED_RAM_WORDS, ROW_BLOCK_KEY, ROW_READS_AT_KEY, SMALL_ROWS_READS_KEY,
    STEP_OVERHEAD_KEY, WEIGHT_STREAM_KEY, WEIGHTS_PER_S, Measurement)
from hivekeeper.core.machine.profile_files import (  # where profiles live; imported from here by older code
    PROFILE_VERSION, check_profile_doc, config_dir, fingerprint_fields, machine_fingerprint, measurements_from,
    profile_path, read_profile_json)


# ---- the profile --------------------------------------------------------------------------------------------------
@dataclass
class MachineProfile:
    """Measurements (and a calibration) of one machine."""

    fingerprint: str
    machine: dict  # fingerprint_fields, for people reading the file
    measured_at: float | None  # unix time of the benchmarks; None when only a calibration was saved
    measurements: list[Measurement] = field(default_factory=list)
    calibration: Calibration | None = None
    threads: int = 0  # torch CPU threads the benchmarks ran with
    path: Path | None = None

    @property
    def calibrated(self) -> bool:
        """The flag a GUI shows: predictions on this machine use factors fitted to its own runtime."""
        return self.calibration is not None and self.calibration.calibrated

    def measurement(self, key: str) -> Measurement | None:
        return next((m for m in self.measurements if m.key == key), None)

    def hardware(self, detected: HardwareSpec) -> HardwareSpec:
        """The detected spec with every measured number in place of its estimate or catalog value."""
        return apply_measurements(detected, self.measurements, self.measured_at)

    def efficiency(self, hardware: HardwareSpec) -> MachineEfficiency:
        """The calibrated factors when there are some, else defaults with fractions of 1 for measured numbers."""
        if self.calibration is not None:
            return self.calibration.efficiency
        return measured_efficiency(hardware)

    def as_dict(self) -> dict:
        return {
            "version": PROFILE_VERSION, "fingerprint": self.fingerprint, "machine": self.machine,
            "measured_at": self.measured_at, "threads": self.threads,
            "measurements": [m.as_dict() for m in self.measurements],
            "calibration": self.calibration.as_dict() if self.calibration is not None else None,
        }

    @classmethod
    def from_dict(cls, doc: dict, where: str) -> "MachineProfile":
        check_profile_doc(doc, where)
        measurements = measurements_from(doc, where)
        calibration = doc.get("calibration")
        measured_at = doc.get("measured_at")
        if not isinstance(doc.get("fingerprint"), str):
            raise InputError(f"{where}: field 'fingerprint' must be a string")
        return cls(
            fingerprint=doc["fingerprint"], machine=dict(doc.get("machine") or {}),
            measured_at=float(measured_at) if measured_at is not None else None, measurements=measurements,
            calibration=Calibration.from_dict(calibration, f"{where}: field 'calibration'") if calibration else None,
            threads=int(doc.get("threads") or 0), path=Path(where),
        )


def new_profile(detected: HardwareSpec) -> MachineProfile:
    return MachineProfile(machine_fingerprint(detected), fingerprint_fields(detected), None)


def save_profile(profile: MachineProfile, path: Path | None = None) -> Path:
    """Write the profile atomically (temp file, fsync, rename); returns where."""
    path = Path(path) if path is not None else profile_path(profile.fingerprint)
    write_json_atomic(path, profile.as_dict())
    profile.path = path
    return path


def load_profile(path: str | Path) -> MachineProfile:
    """Read a profile file; errors name the file and the field."""
    path = Path(path).expanduser()
    return MachineProfile.from_dict(read_profile_json(path), str(path))


def load_machine_profile(detected: HardwareSpec | None = None) -> MachineProfile | None:
    """This machine's saved profile, or None when it has none (or the file belongs to other hardware)."""
    if detected is None:
        from hivekeeper.core.machine.detect import detect_hardware

        detected = detect_hardware()
    fingerprint = machine_fingerprint(detected)
    path = profile_path(fingerprint)
    if not path.is_file():
        return None
    profile = load_profile(path)
    return profile if profile.fingerprint == fingerprint else None


def detect_or_load_profile(data_dir: str | Path | None = None) -> tuple[HardwareSpec, MachineEfficiency | None]:
    """This machine for the planner: detected, with a matching saved profile's measured numbers and efficiency
    factors (calibrated when `hivekeeper profile` ran). Without a profile: (detected spec, None), and the planner
    uses its default factors."""
    from hivekeeper.core.machine.detect import detect_hardware

    detected = detect_hardware(data_dir)
    profile = load_machine_profile(detected)
    if profile is None:
        return detected, None
    hardware = profile.hardware(detected)
    return hardware, profile.efficiency(hardware)


def ram_bandwidth(measurements: list[Measurement]) -> float:
    """The RAM read bandwidth a profile stands for: the `sum()` rate, or the rate whole decode steps read weights
    from RAM at (beyond twice the last-level cache) where that was higher. On a shared machine either can catch a
    busy moment; the RAM delivered at least what the steps read, and a fraction of the RAM rate cannot exceed 1
    (issue 23: a `sum()` at load 15 read 0.76 GB/s beside steps at 7.3 GB/s, and decode was planned at 0.76)."""
    by_key = {m.key: m for m in measurements}
    ram, stream = by_key.get("ram_read"), by_key.get(WEIGHT_STREAM_KEY)
    value = ram.value if ram is not None else 0.0
    if stream is not None and BLOCK_OVERHEAD_KEY in by_key:  # measured by whole steps beyond the caches
        value = max(value, stream.value)
    return value


def decode_streaming(measurements: list[Measurement]) -> DecodeStreaming | None:
    """What `hivekeeper measure` found of decode's weight streaming (measure.measure_weight_streaming), relative
    to the measured RAM read bandwidth; None unless all of it was measured."""
    by_key = {m.key: m for m in measurements}
    stream, ram, reads, start, block = (by_key.get(k) for k in (WEIGHT_STREAM_KEY, "ram_read", SMALL_ROWS_READS_KEY,
                                                                MATMUL_START_KEY, BLOCK_OVERHEAD_KEY))
    if stream is None or ram is None or reads is None or (start is None and block is None) or ram.value <= 0:
        return None
    prefill_block, row_block = by_key.get(PREFILL_BLOCK_KEY), by_key.get(ROW_BLOCK_KEY)
    step = by_key.get(STEP_OVERHEAD_KEY)  # absent from profiles measured before session 16
    attention = by_key.get(ATTENTION_KEY)  # absent from profiles measured before session 25
    return DecodeStreaming(bandwidth_fraction=min(1.0, max(0.01, stream.value / ram_bandwidth(measurements))),
                           small_row_reads=min(16.0, max(1.0, reads.value)),
                           matmul_start_s=min(0.1, max(0.0, start.value)) if start is not None else 0.0,
                           block_overhead_s=min(0.1, max(0.0, block.value)) if block is not None else None,
                           prefill_block_overhead_s=(min(0.5, max(0.0, prefill_block.value))
                                                     if prefill_block is not None else None),
                           row_block_overhead_s=min(0.1, max(0.0, row_block.value)) if row_block is not None else None,
                           row_reads_by_width=row_reads_by_width(measurements),
                           step_overhead_s=min(0.1, max(0.0, step.value)) if step is not None else None,
                           prefill_rates=prefill_rates(measurements),
                           attention_bandwidth=attention.value if attention is not None and attention.value > 0
                           else None)


def row_reads_by_width(measurements: list[Measurement]) -> tuple[tuple[int, int, float], ...]:
    """((width, rows, weight reads of a step of that many rows through blocks that wide), ...) by width and rows, as
    measured (ROW_READS_AT_KEY + "<width>x<rows>"); empty for profiles measured before session 16."""
    found = {}
    for m in measurements:
        width, _, rows = m.key[len(ROW_READS_AT_KEY):].partition("x")
        if m.key.startswith(ROW_READS_AT_KEY) and width.isdigit() and rows.isdigit():
            found[int(width), int(rows)] = min(16.0, max(1.0, m.value))
    return tuple(sorted((width, rows, reads) for (width, rows), reads in found.items()))


def prefill_rates(measurements: list[Measurement]) -> tuple[PrefillRate, ...]:
    """The fp32 prefill rate by rows at each measured width (measure.prefill_curve: PREFILL_PEAK_KEY and
    PREFILL_HALF_ROWS_KEY + width), as the planner takes them (hardware.DecodeStreaming.prefill_rates), the thinner
    first; () where not measured (profiles saved before session 16)."""
    def by_width(prefix: str) -> dict[int, float]:
        return {int(m.key[len(prefix):]): m.value for m in measurements
                if m.key.startswith(prefix) and m.key[len(prefix):].isdigit()}

    peaks, halves = by_width(PREFILL_PEAK_KEY), by_width(PREFILL_HALF_ROWS_KEY)
    return tuple(prefill_rate_in_limits(width, peaks[width], halves[width]) for width in sorted(peaks)
                 if width in halves and peaks[width] > 0)


def packed_kernel_rates(measurements: list[Measurement], prefix: str = PACKED_KERNEL_KEY) -> dict[str, float]:
    """format -> weights/s of the packed formats' kernels (measure.measure_packed_kernels), as the planner takes them
    (hardware.ComputeDevice.packed_kernels; with prefix PACKED_CACHED_KEY, the rates in the last-level cache:
    packed_kernels_cached); empty where not measured (profiles saved before they were)."""
    return {m.key[len(prefix):]: clamp_to_limit(m.value / 1e9, "gweights_per_s") * 1e9
            for m in measurements if m.key.startswith(prefix) and m.key[len(prefix):] in PACKED_FORMATS
            and m.value > 0}


def packed_row_steps(measurements: list[Measurement]) -> dict[str, tuple[float, ...]]:
    """format -> its decode steps of PACKED_ROW_COUNTS rows over its one-row step (measure.packed_rows_measurement),
    as the planner takes them (hardware.ComputeDevice.packed_row_steps): a format with every row count measured;
    empty where none was (profiles saved before session 22)."""
    found = {m.key[len(PACKED_ROWS_KEY):]: clamp_to_limit(m.value, "row_step_ratio") for m in measurements
             if m.key.startswith(PACKED_ROWS_KEY) and m.value > 0}
    steps = {name: tuple(found.get(f"{name}x{rows}") for rows in PACKED_ROW_COUNTS) for name in PACKED_FORMATS}
    return {name: ratios for name, ratios in steps.items() if None not in ratios}


def packed_block_cost(measurements: list[Measurement]) -> float | None:
    """Seconds of a packed block's fixed cost in a decode step (measure.packed_block_overhead, fitted on packed
    spans), as the planner takes it (hardware.ComputeDevice.packed_block_overhead_s): 0 kept (the fit found none the
    noise resolves: the packed rates hold the whole step), at most 0.1 s as the fp32 one; None where not measured
    (profiles saved before session 14, whose packed rates were measured less the fp32 spans' cost)."""
    found = [m.value for m in measurements if m.key == PACKED_BLOCK_KEY]
    return min(0.1, max(0.0, found[-1])) if found else None


# ---- measured numbers into a spec ---------------------------------------------------------------------------------
def _measured_on(when: float | None) -> str:
    return f"measured {time.strftime('%Y-%m-%d %H.%M', time.localtime(when))}" if when else "measured"


def _source(m: Measurement, when: float | None) -> str:
    return (f"{_measured_on(when)}: {m.label}, best of {m.repeats} (spread {100 * m.spread:.0f}%, "
            f"load {m.loadavg:.1f}); {m.detail}")


def _matmul_rates(measurements: list[Measurement], prefix: str) -> dict[str, Measurement]:
    """dtype -> the prefill-shape matmul measurement of one device (prefix "cpu" or "gpu0")."""
    rates = {}
    for m in measurements:
        if m.key.startswith(f"{prefix}_matmul_") and m.key.endswith("_prefill"):
            rates[m.key[len(prefix) + len("_matmul_"):-len("_prefill")]] = m
    return rates


def _rate_words(m: Measurement) -> str:
    """What a FLOP/s measurement timed: the runtime's own prefill passes (fp32, bf16) or one matmul at a prefill
    shape."""
    runtime = m.key in (PREFILL_FLOPS_KEY, PREFILL_BF16_KEY)
    return "the runtime's prefill passes through decoder blocks" if runtime else "a matmul at the prefill shape"


def _with_flops(device: ComputeDevice, rates: dict[str, Measurement], when: float | None) -> ComputeDevice:
    """A device whose FLOP/s table is the measured rates (dtypes not measured are dropped: one table, one source)."""
    if not rates:
        return device
    flops = {dtype: clamp_to_limit(m.value / 1e12, "tflops") * 1e12 for dtype, m in rates.items()}
    first = rates.get("fp32") or next(iter(rates.values()))
    listed = ", ".join(f"{d} {m.value / 1e9:.3g} GFLOP/s ({_rate_words(m)})" for d, m in rates.items())
    source = (f"{_measured_on(when)}: {listed}; {first.label}: {first.repeats} repeats "
              f"(load {first.loadavg:.1f}); {first.detail}")
    return dataclasses.replace(device, flops=flops, sources={**device.sources, "flops": source})


def apply_measurements(spec: HardwareSpec, measurements: list[Measurement], when: float | None = None) -> HardwareSpec:
    """The spec with measured numbers in place: RAM bandwidth, CPU FLOP/s per dtype (16-bit entries as this machine's
    16-bit decision has them: core/machine/cpu_dtype.py), disk read/write, the first GPU's memory bandwidth, FLOP/s
    and host link (and every GPU of the same name), RTT and bandwidth to peers. Each replaced number's source says
    "measured ..." with the spread and load of its measurement."""
    by_key = {m.key: m for m in measurements}
    cpu, disk, network, gpus = spec.cpu, spec.disk, spec.network, list(spec.gpus)

    if "ram_read" in by_key:
        m = by_key["ram_read"]
        bandwidth = float(round(clamp_to_limit(ram_bandwidth(measurements) / 1e9, "ram_bandwidth_gbps") * 1e9))
        source = _source(m, when)
        if bandwidth > m.value * 1.0001:
            source += f"; {RAISED_RAM_WORDS} {bandwidth / 1e9:.3g} GB/s that decode steps read RAM at (measured beside it)"
        cpu = dataclasses.replace(cpu, memory_bandwidth=bandwidth,
                                  sources={**cpu.sources, "memory_bandwidth": source})
    cpu_rates = _matmul_rates(measurements, "cpu")
    for dtype, key in (("fp32", PREFILL_FLOPS_KEY), ("bf16", PREFILL_BF16_KEY)):  # the runtime's own prefill paths
        if key in by_key and by_key[key].value > 0:
            cpu_rates[dtype] = by_key[key]
    if cpu_rates:  # measured rates, as the planner must see them under this machine's 16-bit decision
        cpu = with_choice(_with_flops(cpu, cpu_rates, when), choose(measurements))
    streaming = decode_streaming(measurements)
    if streaming is not None:
        cpu = dataclasses.replace(cpu, decode_streaming=streaming)
    if HALF_DECODE_KEY in by_key and by_key[HALF_DECODE_KEY].value > 0:  # a bf16 step / an fp32 one (cpu_dtype)
        cpu = dataclasses.replace(cpu, half_decode_ratio=min(16.0, max(0.05, by_key[HALF_DECODE_KEY].value)))
    kernels, cached = packed_kernel_rates(measurements), packed_kernel_rates(measurements, PACKED_CACHED_KEY)
    prefill, block = packed_kernel_rates(measurements, PACKED_PREFILL_KEY), packed_block_cost(measurements)
    rows = packed_row_steps(measurements)
    if kernels or cached or prefill or rows or block is not None:
        cpu = dataclasses.replace(cpu, packed_kernels=kernels or cpu.packed_kernels,
                                  packed_row_steps=rows or cpu.packed_row_steps,
                                  packed_kernels_cached=cached or cpu.packed_kernels_cached,
                                  packed_prefill=prefill or cpu.packed_prefill,
                                  packed_block_overhead_s=cpu.packed_block_overhead_s if block is None else block)

    disk_changes, disk_sources = {}, dict(disk.sources)
    for key, attr in (("disk_read", "read_bandwidth"), ("disk_write", "write_bandwidth")):
        if key in by_key:
            disk_changes[attr] = float(round(clamp_to_limit(by_key[key].value / 1e9, "disk_gbps") * 1e9))
            disk_sources[attr] = _source(by_key[key], when)
    if disk_changes:
        disk = dataclasses.replace(disk, sources=disk_sources, **disk_changes)

    if gpus:
        first = gpus[0]
        gpu = _with_flops(first, _matmul_rates(measurements, "gpu0"), when)
        if "gpu0_memory_read" in by_key:
            m = by_key["gpu0_memory_read"]
            gpu = dataclasses.replace(gpu, memory_bandwidth=float(round(m.value)),
                                      sources={**gpu.sources, "memory_bandwidth": _source(m, when)})
        if "gpu0_h2d_pinned" in by_key and not gpu.unified_memory:
            m = by_key["gpu0_h2d_pinned"]
            gpu = dataclasses.replace(gpu, host_link_bandwidth=float(round(m.value)),
                                      sources={**gpu.sources, "host_link_bandwidth": _source(m, when)})
        gpus = [gpu if g.name == first.name else g for g in gpus]

    rtts = [m for m in measurements if m.key.startswith("peer_rtt:")]
    uploads = [m for m in measurements if m.key.startswith("peer_upload:")]
    downloads = [m for m in measurements if m.key.startswith("peer_download:")]
    net_changes, net_sources = {}, dict(network.sources)
    if rtts:
        net_changes["rtt_s"] = round(statistics.median(m.value for m in rtts), 6)
        net_sources["rtt_s"] = f"measured: median over {len(rtts)} peer(s) of the best TCP handshake time"
    for attr, found, what in (("upload_bps", uploads, "upload"), ("download_bps", downloads, "download")):
        if found:
            net_changes[attr] = float(round(statistics.median(m.value for m in found)))
            net_sources[attr] = f"measured: median {what} over {len(found)} peer(s) running `measure --listen`"
    if net_changes:
        network = dataclasses.replace(network, sources=net_sources, **net_changes)
    return dataclasses.replace(spec, cpu=cpu, disk=disk, network=network, gpus=tuple(gpus))


# ---- measured beside catalog, for the Hardware page ---------------------------------------------------------------
@dataclass(frozen=True)
class ComparisonRow:
    part: str  # "CPU", "RAM", "disk", "GPU 0", "network"
    quantity: str  # e.g. "read bandwidth"
    catalog: float | None  # the detected / catalog / estimated value (None: none)
    measured: float | None
    unit: str  # "B/s", "FLOP/s", "s", "bit/s"
    catalog_source: str
    spread: float | None  # of the measurement's repeats
    key: str = ""  # the measurement's (core/machine/measurement.py), where one was made


def comparison_rows(detected: HardwareSpec, profile: MachineProfile | None) -> list[ComparisonRow]:
    """Every number a measurement can replace: the catalog (or detected) value beside the measured one."""
    measured = {m.key: m for m in (profile.measurements if profile else [])}

    def row(part, quantity, catalog, key, unit, source) -> ComparisonRow:
        m = measured.get(key)
        return ComparisonRow(part, quantity, catalog, m.value if m else None, unit, source, m.spread if m else None,
                             key)

    cpu = detected.cpu
    rows = [row("RAM", "read bandwidth", cpu.memory_bandwidth, "ram_read", "B/s",
                cpu.sources.get("memory_bandwidth", ""))]
    dtypes = sorted(set(cpu.flops) | set(_matmul_rates(list(measured.values()), "cpu")),
                    key=lambda d: ("fp32", "bf16", "fp16").index(d) if d in ("fp32", "bf16", "fp16") else 9)
    for dtype in dtypes:
        rows.append(row("CPU", f"{dtype} matmul", cpu.flops.get(dtype), f"cpu_matmul_{dtype}_prefill", "FLOP/s",
                        flops_source(dtype, cpu.flops, cpu.sources.get("flops", ""))))
    # the runtime's own prefill passes, which the planner's FLOP/s table takes where measured (apply_measurements)
    for dtype, key in (("fp32", PREFILL_FLOPS_KEY), ("bf16", PREFILL_BF16_KEY)):
        if key in measured:
            rows.append(row("CPU", f"{dtype} prefill through blocks", cpu.flops.get(dtype), key, "FLOP/s",
                            flops_source(dtype, cpu.flops, cpu.sources.get("flops", ""))))
    # decode's weight streaming: the cost model's default (half the RAM bandwidth, 3 re-reads) beside the measured
    default_cpu = DEFAULT_EFFICIENCY["cpu"]
    rows.append(row("RAM", "decode weight streaming", cpu.memory_bandwidth * default_cpu.bandwidth_fraction,
                    WEIGHT_STREAM_KEY, "B/s", f"default: {default_cpu.bandwidth_fraction:g} of the RAM bandwidth"))
    rows.append(row("CPU", "fixed cost of a block in a decode step", default_cpu.layer_overhead_s, BLOCK_OVERHEAD_KEY,
                    "s", "default"))
    rows.append(row("CPU", "weight reads of a 4-row matmul", default_cpu.weight_reread_rows, SMALL_ROWS_READS_KEY,
                    "x", "default"))
    for width, count, _ in row_reads_by_width(list(measured.values())):
        rows.append(row("CPU", f"weight reads of a {count}-row step, blocks {width} wide",
                        default_cpu.weight_reread_rows, f"{ROW_READS_AT_KEY}{width}x{count}", "x", "default"))
    rows.append(row("CPU", "bf16 decode step / fp32 one", None, HALF_DECODE_KEY, "x", ""))
    for name in PACKED_FORMATS:  # the cost model's default beside the measured rate
        default, _ = packed_kernel_rate(dataclasses.replace(cpu, packed_kernels={}), name)
        rows.append(row("CPU", f"{name} kernel, one row", default, f"{PACKED_KERNEL_KEY}{name}", WEIGHTS_PER_S,
                        "default: costmodel.DEFAULT_PACKED_WEIGHTS_PER_CORE_S x cores"))
        rows.append(row("CPU", f"{name} kernel, one row, weights in cache", default, f"{PACKED_CACHED_KEY}{name}",
                        WEIGHTS_PER_S, "default: costmodel.DEFAULT_PACKED_WEIGHTS_PER_CORE_S x cores"))
    rows.append(row("CPU", "fixed cost of a packed block in a decode step", default_cpu.layer_overhead_s,
                    PACKED_BLOCK_KEY, "s", "default: the fp32 blocks'"))
    rows.append(row("disk", "read (uncached)", detected.disk.read_bandwidth, "disk_read", "B/s",
                    detected.disk.sources.get("read_bandwidth", "")))
    rows.append(row("disk", "write", detected.disk.write_bandwidth, "disk_write", "B/s",
                    detected.disk.sources.get("write_bandwidth", "")))
    if detected.gpus:
        gpu = detected.gpus[0]
        rows.append(row("GPU 0", "memory bandwidth", gpu.memory_bandwidth, "gpu0_memory_read", "B/s",
                        gpu.sources.get("memory_bandwidth", "")))
        for dtype in ("fp32", "fp16", "bf16"):
            rows.append(row("GPU 0", f"{dtype} matmul", gpu.flops.get(dtype), f"gpu0_matmul_{dtype}_prefill",
                            "FLOP/s", flops_source(dtype, gpu.flops, gpu.sources.get("flops", ""))))
        if not gpu.unified_memory:
            copies = (("gpu0_h2d_pinned", "host→GPU, pinned"), ("gpu0_h2d_pageable", "host→GPU, pageable"),
                      ("gpu0_d2h_pinned", "GPU→host, pinned"), ("gpu0_d2h_pageable", "GPU→host, pageable"))
            for key, quantity in copies:
                catalog = gpu.host_link_bandwidth if key.endswith("pinned") and "h2d" in key else None
                rows.append(row("GPU 0", quantity, catalog, key, "B/s", gpu.sources.get("host_link_bandwidth", "")))
    net = detected.network
    for m in measured.values():
        if m.key.startswith("peer_rtt:"):
            rows.append(ComparisonRow("network", m.label, net.rtt_s, m.value, "s", net.sources.get("rtt_s", ""),
                                      m.spread, m.key))
        elif m.key.startswith(("peer_upload:", "peer_download:")):
            catalog = net.upload_bps if m.key.startswith("peer_upload:") else net.download_bps
            rows.append(ComparisonRow("network", m.label, catalog, m.value, "bit/s", "", m.spread, m.key))
    return rows + unlisted_rows(measured, {r.key for r in rows})


def unlisted_rows(measured: dict[str, Measurement], listed: set[str]) -> list[ComparisonRow]:
    """A row for each saved measurement no row above shows (the packed prefill rates and few-row steps, the prefill
    fits' terms...), with no catalog value: every number a plan may read is on the table (a newcomer's run, session
    22: a busy measurement's 71 ms prefill block cost was saved and used, and shown nowhere)."""
    parts = (("cpu_", "CPU"), ("gpu", "GPU 0"), ("disk", "disk"), ("ram", "RAM"))
    return [ComparisonRow(next((part for prefix, part in parts if key.startswith(prefix)), "other"), m.label, None,
                          m.value, m.unit, "", m.spread, key)
            for key, m in measured.items() if key not in listed and not key.startswith("peer_")]
