"""Efficiency factors: the fraction of a device's spec numbers that real kernels reach, plus fixed overheads.

Spec numbers (planner/hardware.py) are vendor upper bounds. The cost model multiplies them by the factors here, so
calibration (`hivekeeper profile`, a later issue) can replace a whole set without touching any spec. Every plan names
the set it used. docs/cost-model.md explains where each default comes from; in short:

- matmul_fraction: large matmuls (prefill). Datacenter GPUs 0.5: the Narayanan et al. davinci prefill slope,
  (0.597 s - 0.109 s) / 1664 tokens for 2 × 175e9 FLOP per token on 8 × A100 = 150 TFLOP/s per GPU = 48% of
  312. Power-capped inference cards (T4, L4: ≤ 100 W boards) 0.32: FlexGen's fitted T4 prefill rate 21 TFLOP/s
  of 65. Consumer GPUs, CPUs, Apple: no published measurement, 0.5.
- bandwidth_fraction: decode's weight and KV reads. GPUs 0.8, the middle of the 0.7–0.85 that decode kernels
  reach. CPUs 0.5: PyTorch's CPU kernels over large tensors reach about half of the theoretical DRAM rate
  (STREAM-like loops ~0.7–0.8). Apple 0.7 (no measurement; MPS kernels trail CUDA's).
- layer_overhead_s, prefill_layer_overhead_s (decode, prefill): eager PyTorch launches ~20 kernels per block at
  ~15 µs each: 0.3 ms per block per micro-batch on a GPU. On a CPU a decode step runs in hivekeeper's native
  kernels (0.2 ms a block, `hivekeeper measure` adds the measured start-up of its products) while a prefill runs
  torch's ops block by block through OpenBLAS: 3 ms a block, measured on the development machine (2-core AVX2
  EPYC): an 8-token prefill of a 4-block, 768-wide demo model took 25-28 ms, of which ~6 ms were weight reads, and
  calibration fitted 3.9 ms. What the reads at 0.8 leave unexplained per block: FlexGen's OPT-6.7B decode on a T4
  (~59 ms per step vs 52 ms of reads) 0.2 ms, the GPT-J β on an A100 (21 ms vs 7–10 ms of reads) 0.4–0.5 ms.
- link_fraction: the catalog's host-link numbers are already practical rates (80% of PCIe nominal), so 1.0.
- disk_fraction: large sequential reads reach ~90% of a drive's rated speed.
- runtime_bytes: memory the framework holds before any weight: CUDA context + cuBLAS workspace + allocator
  slack on a GPU (1 GiB); Python + torch + tokenizer + the runtime's warm-up in RAM (CPU_RUNTIME_BYTES, 0.5 GiB:
  `generate --json`'s baseline_rss_bytes, what the process held before the model, was 0.31 GB on the 2-core EPYC
  and 0.39 GB in a newcomer's run, torch 2.13 CPU; until session 21 a round 1.5 GiB, which put the built-in 97 MB
  model's plan at a 1.75 GB peak against 0.52 GB measured, and "does not fit" on a 4 GB machine).
- weight_reread_rows: a CPU matmul of a few rows (decode at batch 2-8) takes several times the one-row time:
  the one-row product is a bandwidth-tuned matrix-vector kernel, a few rows go through a GEMM kernel that reads
  the weights less efficiently. Measured on the development machine (AVX2 EPYC), [m, 4096] x [4096, 8192] fp32:
  OpenBLAS (the runtime's kernel) 3.5x / 3.6x / 2.5x the one-row time at m = 2 / 4 / 8; MKL 2.7x / 4.6x / 5x.
  CPUs 3. `hivekeeper measure` measures it (decode weight streaming at 1 and 4 rows) and then replaces it.
  GPUs 1 (a GPU GEMM reads a weight tile once for all rows of a batch; no measurement says otherwise).

Numbers that were measured on the machine (a source starting with "measured") are already what kernels reach:
`default_efficiency` gives them a fraction of 1, so a measured hardware JSON is not discounted twice.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np

from .errors import InputError
from .hardware import ComputeDevice, HardwareSpec
from .hardware_catalog import GIB

# the rows of the few-row decode steps `hivekeeper measure` times (core.machine.measure), at which
# Efficiency.weight_reread_rows is measured and fitted (costmodel.weight_reads)
REREAD_ROWS = 4
HARDWARE_CLASSES = ("datacenter-gpu", "inference-gpu", "consumer-gpu", "apple", "cpu")


@dataclass(frozen=True)
class Efficiency:
    """What one class of device reaches of its spec numbers, and its fixed costs. Fractions are in (0, 1]."""

    name: str  # e.g. "default:datacenter-gpu"; calibration writes "measured:<machine>"
    matmul_fraction: float  # of peak dense FLOP/s, reached by large matmuls
    bandwidth_fraction: float  # of memory bandwidth, reached by streaming weight / KV reads
    link_fraction: float = 1.0  # of the host link's practical rate (GPUs)
    disk_fraction: float = 0.9  # of the disk's rated read/write speed (used for the host)
    layer_overhead_s: float = 0.3e-3  # per block per micro-batch of a decode step: kernel launches, Python
    step_overhead_s: float = 1.0e-3  # per decode step: embedding, sampling, the generation loop
    # per block per micro-batch of a prefill: its own figure because decode may run another code path (on a CPU,
    # hivekeeper's native kernels run a whole decode step in one call; a prefill runs torch's ops block by block)
    prefill_layer_overhead_s: float = 0.3e-3
    runtime_bytes: int = GIB  # memory held by the framework on this device before any tensor
    # a matmul of 2 or more rows (but not enough to be compute-bound) reads its weights this many times; 1: once
    weight_reread_rows: float = 1.0
    # per block, per row beyond the first of a CPU decode micro-batch the native kernels take (up to 8 rows): each
    # row's norms, rotary and attention (measured: hardware.DecodeStreaming.row_block_overhead_s; else 0)
    row_overhead_s: float = 0.0
    # measured weight reads of few-row steps through blocks of each width, ((width, rows, reads), ...): a model's
    # are read off them at its width (reread_curve); empty: weight_reread_rows at REREAD_ROWS for every width
    reread_rows_by_width: tuple[tuple[int, int, float], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        for field_name in ("matmul_fraction", "bandwidth_fraction", "link_fraction", "disk_fraction"):
            value = getattr(self, field_name)
            if not 0.0 < value <= 1.0:
                raise InputError(f"efficiency {self.name!r}: {field_name} must be in (0, 1], got {value}")
        for field_name in ("layer_overhead_s", "step_overhead_s", "prefill_layer_overhead_s", "row_overhead_s"):
            if not 0.0 <= getattr(self, field_name) < 10.0:
                raise InputError(f"efficiency {self.name!r}: {field_name} must be in [0, 10) s")
        if self.runtime_bytes < 0:
            raise InputError(f"efficiency {self.name!r}: runtime_bytes must be >= 0")
        if not 1.0 <= self.weight_reread_rows <= 1024.0:
            raise InputError(f"efficiency {self.name!r}: weight_reread_rows must be in [1, 1024], "
                             f"got {self.weight_reread_rows}")
        # lists where read back from JSON (calibration files, the app's hardware probe): triples by width and rows
        table = tuple(sorted((int(width), int(rows), float(reads)) for width, rows, reads in self.reread_rows_by_width))
        if any(width <= 0 or rows < 2 or not 1.0 <= reads <= 1024.0 for width, rows, reads in table):
            raise InputError(f"efficiency {self.name!r}: reread_rows_by_width must hold (width > 0, rows >= 2, reads "
                             f"in [1, 1024]), got {self.reread_rows_by_width}")
        object.__setattr__(self, "reread_rows_by_width", table)

    def reread_curve(self, width: int) -> tuple[tuple[int, float], ...]:
        """((rows, weight reads of a step of that many rows), ...) through blocks `width` wide, by rows: where widths
        were measured, each measured row count's reads interpolated on log(width) between the measured widths (the
        nearest one's beyond them); else weight_reread_rows at REREAD_ROWS. Issue 23, session 16: a 4-row step read
        576-wide blocks 1.34-1.44 times and 2048-wide ones 1.5-1.7 (the rows' inputs stay in L1 beside a narrow
        matrix's weight row, not beside a wide one's); an 8-row step 2.4-3.0 and 2.35-2.5 times."""
        if not self.reread_rows_by_width:
            return ((REREAD_ROWS, self.weight_reread_rows),)
        curve = []
        for rows in sorted({r for _, r, _ in self.reread_rows_by_width}):
            measured = [(w, reads) for w, r, reads in self.reread_rows_by_width if r == rows]
            curve.append((rows, at_width(width, [w for w, _ in measured], [reads for _, reads in measured])))
        return tuple(curve)

    def reread_rows_at(self, width: int, rows: int = 0) -> float:
        """The weight reads of a step of `rows` rows (default REREAD_ROWS) through blocks `width` wide: once for one
        row, the curve's (reread_curve) between and at its row counts, its last beyond them."""
        curve = ((1, 1.0), *self.reread_curve(width))
        return float(np.interp(rows or REREAD_ROWS, [r for r, _ in curve], [reads for _, reads in curve]))


def at_width(width: int, widths: list[int], values: list[float]) -> float:
    """A figure measured at `widths` (of blocks, ascending) for blocks `width` wide: interpolated on log(width)
    between the measured widths, the nearest one's beyond them (a model as wide as SmolLM2's 576 reads as the thin
    span, a 960-wide one between it and the 2048-wide span)."""
    return float(np.interp(math.log(max(1, width)), [math.log(w) for w in widths], values))


_GPU_SOURCE = "0.3 ms/block launch overhead and 0.8 bandwidth: FlexGen OPT-6.7B on T4, HELM GPT-J on A100"

CPU_RUNTIME_BYTES = GIB // 2  # see runtime_bytes above


DEFAULTS: dict[str, Efficiency] = {
    "datacenter-gpu": Efficiency(
        "default:datacenter-gpu", matmul_fraction=0.5, bandwidth_fraction=0.8,
        source="matmul 0.5: davinci prefill slope on 8×A100 (Narayanan et al.); " + _GPU_SOURCE),
    "inference-gpu": Efficiency(
        "default:inference-gpu", matmul_fraction=0.32, bandwidth_fraction=0.8,
        source="matmul 0.32: FlexGen's fitted T4 prefill rate 21 of 65 TFLOP/s; " + _GPU_SOURCE),
    "consumer-gpu": Efficiency(
        "default:consumer-gpu", matmul_fraction=0.5, bandwidth_fraction=0.8,
        source="no published measurement: datacenter matmul fraction; " + _GPU_SOURCE),
    "apple": Efficiency(
        "default:apple", matmul_fraction=0.5, bandwidth_fraction=0.7,
        source="no published measurement: round figures (MPS kernels reach less of the bandwidth than CUDA)"),
    "cpu": Efficiency(
        "default:cpu", matmul_fraction=0.5, bandwidth_fraction=0.5, layer_overhead_s=0.2e-3,
        prefill_layer_overhead_s=3e-3,
        runtime_bytes=CPU_RUNTIME_BYTES, weight_reread_rows=3.0,
        source="round figures: PyTorch CPU kernels reach about half of theoretical DRAM bandwidth and FLOP/s; "
               "small-row matmuls re-read the weights per row, up to 3 times, and a prefill costs 3 ms a block "
               "beyond its matmuls (measured on an AVX2 EPYC)"),
}

_CONSUMER_NAME = re.compile(r"geforce|titan|\brtx\s*\d{4}\b", re.IGNORECASE)


def hardware_class(device: ComputeDevice) -> str:
    """The efficiency class of a device: cpu, apple, consumer-gpu, inference-gpu (≤ 100 W boards) or datacenter-gpu.

    Power-capped inference cards (T4, L4) get their own class: at 70 W they cannot hold the boost clocks their
    tensor-core peak assumes, and FlexGen's fitted T4 rate shows it (32% of peak on large matmuls).
    """
    if device.kind == "cpu":
        return "cpu"
    if device.unified_memory:
        return "apple"
    if _CONSUMER_NAME.search(device.name):
        return "consumer-gpu"
    if device.power_watts <= 100.0:
        return "inference-gpu"
    return "datacenter-gpu"


@dataclass(frozen=True)
class MachineEfficiency:
    """The efficiency sets a plan uses: one for the accelerator (the GPU, or the CPU of a CPU-only machine), one
    for the host CPU (its RAM bandwidth for CPU attention, its disk)."""

    accelerator: Efficiency
    host: Efficiency

    @property
    def name(self) -> str:
        if self.accelerator == self.host:
            return self.accelerator.name
        return f"{self.accelerator.name} + {self.host.name}"


MEASURED_PREFIX = "measured:"


def is_measured(sources: dict[str, str], key: str) -> bool:
    """Whether a spec number came from a measurement of this machine (its source says "measured ...")."""
    return sources.get(key, "").strip().lower().startswith("measured")


def _measured_fractions(eff: Efficiency, device: ComputeDevice, hardware: HardwareSpec, with_link: bool) -> Efficiency:
    """The set with a fraction of 1 for every number of `device` (and the disk) that was measured."""
    changes = {}
    if is_measured(device.sources, "memory_bandwidth"):
        changes["bandwidth_fraction"] = 1.0
    if is_measured(device.sources, "flops"):
        changes["matmul_fraction"] = 1.0
    if with_link and is_measured(device.sources, "host_link_bandwidth"):
        changes["link_fraction"] = 1.0
    if is_measured(hardware.disk.sources, "read_bandwidth"):
        changes["disk_fraction"] = 1.0
    if not changes:
        return eff
    return replace(eff, name=eff.name.replace("default:", MEASURED_PREFIX),
                   source=f"fractions of measured numbers are 1 ({', '.join(changes)}); {eff.source}", **changes)


def default_efficiency(hardware: HardwareSpec) -> MachineEfficiency:
    """The built-in efficiency sets for this machine's accelerator class and its CPU.

    The fractions discount spec numbers (catalog peaks, estimates) to what kernels reach; a number whose source
    says it was measured on the machine is already that, so its fraction is 1 (the set is then named
    "measured:<class>"). Overheads and weight re-reads keep their defaults: no micro-benchmark measures them.
    """
    host = _measured_fractions(DEFAULTS["cpu"], hardware.cpu, hardware, with_link=False)
    streaming = hardware.cpu.decode_streaming
    if streaming is not None:
        host = with_measured_streaming(host, streaming.bandwidth_fraction, streaming.small_row_reads,
                                       streaming.matmul_start_s, streaming.block_overhead_s,
                                       streaming.prefill_block_overhead_s, streaming.row_block_overhead_s,
                                       streaming.row_reads_by_width, streaming.step_overhead_s)
    if not hardware.gpus:
        return MachineEfficiency(host, host)
    accelerator = DEFAULTS[hardware_class(hardware.accelerator)]
    return MachineEfficiency(_measured_fractions(accelerator, hardware.accelerator, hardware, with_link=True), host)


# matmuls in a decoder block: fused q/k/v, o, fused gate/up, down (each pays a start-up time on a CPU)
MATMULS_PER_BLOCK = 4


def with_measured_streaming(efficiency: Efficiency, bandwidth_fraction: float, small_row_reads: float,
                            matmul_start_s: float, block_overhead_s: float | None = None,
                            prefill_block_overhead_s: float | None = None,
                            row_block_overhead_s: float | None = None,
                            row_reads_by_width: tuple[tuple[int, int, float], ...] = (),
                            step_overhead_s: float | None = None) -> Efficiency:
    """A CPU's set with what `hivekeeper measure` found of decode's weight streaming (hardware.DecodeStreaming):
    the fraction of the measured RAM bandwidth that decode's weight reads reach, the weight reads of a few-row
    step, and the per-block overhead: the measured fixed cost of a block in a decode step where it was measured
    (block_overhead_s: the runtime's own step, everything a block costs beyond its reads), else (older profiles) a
    start-up time per matmul, paid MATMULS_PER_BLOCK times per block on top of the default per-block overhead; and
    the fixed cost of a block in a prefill where measured (prefill passes through the same spans), else the
    default's; and what a block adds per row beyond the first of a few-row step where measured (row_overhead_s); and
    few-row steps' reads through blocks of each width measured (reread_rows_by_width); and the fixed cost of a decode
    step beyond its blocks and LM head where measured (step_overhead_s: the engine's own loop on a tiny model,
    core/machine/step_overhead.py), else the default's."""
    overhead = (block_overhead_s if block_overhead_s is not None
                else efficiency.layer_overhead_s + MATMULS_PER_BLOCK * matmul_start_s)
    changes = {"bandwidth_fraction": float(min(1.0, max(0.05, bandwidth_fraction))),
               "weight_reread_rows": float(min(16.0, max(1.0, small_row_reads))),
               "layer_overhead_s": float(min(1.0, max(0.0, overhead)))}
    if prefill_block_overhead_s is not None:
        changes["prefill_layer_overhead_s"] = float(min(1.0, max(0.0, prefill_block_overhead_s)))
    if row_block_overhead_s is not None:
        changes["row_overhead_s"] = float(min(1.0, max(0.0, row_block_overhead_s)))
    if row_reads_by_width:
        changes["reread_rows_by_width"] = tuple((w, rows, float(min(16.0, max(1.0, r))))
                                                for w, rows, r in row_reads_by_width)
    if step_overhead_s is not None:
        changes["step_overhead_s"] = float(min(1.0, max(0.0, step_overhead_s)))
    listed = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in changes.items())
    return replace(efficiency, source=f"measured decode weight streaming: {listed}; {efficiency.source}", **changes)


def with_overrides(efficiency: Efficiency, **changes) -> Efficiency:
    """A copy with some factors replaced (what calibration does), renamed unless a name is given."""
    changes.setdefault("name", efficiency.name.replace("default:", "custom:"))
    return replace(efficiency, **changes)
