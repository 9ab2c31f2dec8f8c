"""Hardware specs: compute devices (GPUs, the CPU), host memory, disk and network.

All sizes are bytes, bandwidths bytes/s, compute FLOP/s, power watts, network bit/s and seconds. Spec numbers are
vendor upper bounds; the fraction of them that real kernels reach lives in the cost model's efficiency factors.
`sources` says where each number came from: "catalog:<reference>", "measured", "detected", "derived", "user".

default_headroom() is the memory a plan leaves free unless told otherwise (docs/cost-model.md, "Headroom"): on RAM
the larger of 2 GiB and 10% of it, on a GPU the larger of 0.5 GiB and 5% of it, plus, on each, what other programs
held when the machine was detected (`in_use_bytes`); on disk the larger of 1 GiB and 5% of its (free) capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1024**3
# (at least, fraction of the tier's size) kept free for the OS and the user's programs: see default_headroom
HEADROOM_RULE = {"cpu": (2 * GIB, 0.10), "gpu": (GIB // 2, 0.05), "disk": (1 * GIB, 0.05)}
HEADROOM_TEXT = ("default headroom: the larger of 2 GiB and 10% of RAM, of 0.5 GiB and 5% of a GPU, of 1 GiB and 5% "
                 "of the free disk, plus what other programs held of RAM and GPU memory at detection")


# the row counts of a few-row packed decode step `hivekeeper measure` times beside the one-row step
# (ComputeDevice.packed_row_steps): the kernels take 4 rows and more in pairs of weight rows, so the cost per row
# changes there, and 8 is the most they take (costmodel.PACKED_KERNEL_ROWS)
PACKED_ROW_COUNTS = (4, 8)


@dataclass(frozen=True)
class PrefillRate:
    """A CPU's fp32 prefill rate at one block width, as `hivekeeper measure` fitted it to the runtime's prefill passes
    at several row counts: rate(m rows) = peak_flops x m / (m + half_rows). A pass over few rows multiplies poorly (BLAS
    packs every weight once a call, whatever the rows), and thin blocks reach less than wide ones at the same rows
    (issue 23, session 16: a 2048-wide block ~80 GFLOP/s at 32 rows, ~180 at 384-512; a 576-wide one ~70 and
    ~130), so one FLOP rate cannot price prefills of every size and width."""

    hidden: int  # the blocks' width
    peak_flops: float  # FLOP/s the rate tends to over many rows
    half_rows: float  # rows at which it reaches half the peak (the weights' per-pass cost, in rows)


def rate_at_rows(peak_flops, half_rows, rows):
    """A PrefillRate's FLOP/s at `rows` rows a product: peak_flops x rows / (rows + half_rows) (numbers or arrays)."""
    return peak_flops * rows / (rows + half_rows)


@dataclass(frozen=True)
class DecodeStreaming:
    """How a CPU's inference kernels read weights in decode, as `hivekeeper measure` found (measure_weight_streaming):
    the fraction of the RAM read bandwidth reached over a chain of layer-shaped matrices, how many times a matmul of
    a few rows reads its weights, and a fixed start-up time per matmul (profiles measured before issue 23), or the
    fixed cost of a whole block in a decode step (measure_decode_blocks: the runtime's own decode path); and the
    fixed cost of a whole step beyond its blocks and head (step_overhead.measure_step_overhead)."""

    bandwidth_fraction: float
    small_row_reads: float
    matmul_start_s: float
    block_overhead_s: float | None = None  # measured per-block cost of a step; replaces the per-matmul start-up
    prefill_block_overhead_s: float | None = None  # measured per-block cost of a prefill beyond its FLOPs (None: not)
    row_block_overhead_s: float | None = None  # measured cost a block adds per row beyond the first in a few-row step
    # measured weight reads of few-row steps through blocks of each width: ((width, rows, reads), ...); empty where
    # not measured (small_row_reads then holds for every width)
    row_reads_by_width: tuple[tuple[int, int, float], ...] = ()
    # measured fixed cost of a decode step outside its blocks and LM head: embedding, sampling, the generation loop
    # (core/machine/step_overhead.py; None: not measured, Efficiency.step_overhead_s's default stands)
    step_overhead_s: float | None = None
    # the fp32 prefill rate by rows at the measured widths (PrefillRate; the thinner first); empty: not measured
    # (profiles before session 16: one FLOP rate for every prefill)
    prefill_rates: tuple[PrefillRate, ...] = ()
    # bytes of KV cache per second a one-row decode step's attention reads, as measured through the runtime's decode
    # path over a cache beyond the last-level cache (measure.measure_decode_attention); None: not measured (the cache
    # is priced at the weights' RAM rate)
    attention_bandwidth: float | None = None


@dataclass(frozen=True)
class ComputeDevice:
    """One device that runs matmuls: a GPU, or the host CPU (whose memory is host RAM)."""

    kind: str  # "gpu" or "cpu"
    name: str
    memory_bytes: int
    memory_bandwidth: float  # bytes/s, device memory read bandwidth
    flops: dict[str, float]  # dtype name ("fp32", "fp16", "bf16", "int8") -> peak dense matmul FLOP/s
    power_watts: float  # board power (TDP) for energy estimates; for a CPU its package power
    host_link_bandwidth: float | None = None  # bytes/s host<->device, practical; None for the CPU itself
    unified_memory: bool = False  # True where the GPU shares host memory (Apple silicon)
    sources: dict[str, str] = field(default_factory=dict)
    cores: int | None = None  # physical cores of a CPU (None for GPUs)
    decode_streaming: DecodeStreaming | None = None  # a CPU's measured decode weight streaming (None: not measured)
    in_use_bytes: int = 0  # memory other programs held when this machine was detected (0 for catalog machines)
    # a CPU's packed-format kernels (GGUF Q8_0/Q4_0/Q4_1), as `hivekeeper measure` timed them: format -> weights
    # multiplied per second in whole one-row decode steps of a span beyond the last-level cache (its weights read from
    # RAM); empty where not measured (the cost model then uses costmodel.DEFAULT_PACKED_WEIGHTS_PER_CORE_S)
    packed_kernels: dict[str, float] = field(default_factory=dict)
    # the same kernels' rate where a decode step's weights stay in the last-level cache (a span smaller than it, timed
    # step after step): the planner takes it for a model whose weights fit `cache_bytes` (costmodel.cached_share)
    packed_kernels_cached: dict[str, float] = field(default_factory=dict)
    # the same kernels on many rows (a prefill: the int8 kernels, up to 512 rows per pass over a weight), as `hivekeeper
    # measure` timed a prefill through a packed span: format -> row-weight products per second (2 FLOPs each); empty:
    # not measured (costmodel.packed_prefill_rate then takes the fp32 FLOP/s)
    packed_prefill: dict[str, float] = field(default_factory=dict)
    # the fixed cost of a block of a packed model's decode step (norms, attention, the kernels' hand-offs), as
    # `hivekeeper measure` fitted it with the cached rates to packed spans of two widths, in seconds; None: not measured
    # (the cost model then takes the fp32 blocks' fitted cost, Efficiency.layer_overhead_s, which profiles measured
    # before session 14 subtracted from their packed rates)
    packed_block_overhead_s: float | None = None
    cache_bytes: int | None = None  # a CPU's last-level cache (detected); None: unknown, every model streamed
    # a CPU's packed-format kernels on a few rows: format -> a decode step of PACKED_ROW_COUNTS rows each over a one-row
    # step, as `hivekeeper measure` timed them side by side through the streamed span (the kernels' time of each, the
    # blocks' fixed cost off); empty where not measured (a step of r rows then takes r one-row steps' kernel time)
    packed_row_steps: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # a CPU's bf16 decode step over its fp32 one, as measured (bf16 through torch, fp32 through the native kernels):
    # the planner takes a one-row bf16 step at that many fp32 steps; None: not measured (half the fp32 bytes)
    half_decode_ratio: float | None = None

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype; falls back to fp32's rate (or the best known) when not listed."""
        if dtype in self.flops:
            return self.flops[dtype]
        if dtype in ("fp16", "bf16") and ("fp16" in self.flops or "bf16" in self.flops):
            return self.flops.get("fp16", self.flops.get("bf16"))
        return self.flops.get("fp32", max(self.flops.values()))


@dataclass(frozen=True)
class DiskSpec:
    capacity_bytes: int
    read_bandwidth: float  # bytes/s, sequential, without the page cache
    write_bandwidth: float
    sources: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NetworkSpec:
    upload_bps: float  # bit/s
    download_bps: float  # bit/s
    rtt_s: float  # round-trip time to a typical peer
    sources: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HardwareSpec:
    """A whole machine: its GPUs (possibly none), its CPU with host RAM, a disk and a network link."""

    id: str
    gpus: tuple[ComputeDevice, ...]
    cpu: ComputeDevice  # memory_bytes = host RAM, memory_bandwidth = RAM read bandwidth
    disk: DiskSpec
    network: NetworkSpec
    price_per_hour: float | None = None  # USD per hour of this machine, for cost per query
    description: str = ""

    @property
    def accelerator(self) -> ComputeDevice:
        """The device the model computes on: the first GPU, or the CPU on a CPU-only machine."""
        return self.gpus[0] if self.gpus else self.cpu

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)


def tier_headroom(tier: str, size_bytes: float, in_use_bytes: float = 0.0) -> float:
    """Bytes of one tier kept free by default: HEADROOM_RULE's larger of a minimum and a fraction of the tier's
    size, plus what other programs hold there now; never more than the tier's size."""
    minimum, fraction = HEADROOM_RULE[tier]
    return float(min(size_bytes, max(minimum, fraction * size_bytes) + max(0.0, in_use_bytes)))


def default_headroom(hardware: HardwareSpec) -> dict[str, float]:
    """Bytes per tier ("gpu", "cpu", "disk") a plan leaves free by default (module doc). A GPU that shares host
    memory (unified) follows the RAM rule, counting what other programs hold of RAM."""
    cpu = hardware.cpu
    reserve = {"cpu": tier_headroom("cpu", cpu.memory_bytes, cpu.in_use_bytes),
               "disk": tier_headroom("disk", hardware.disk.capacity_bytes), "gpu": 0.0}
    if hardware.gpus:
        gpu = hardware.gpus[0]
        if gpu.unified_memory:
            reserve["gpu"] = tier_headroom("cpu", gpu.memory_bytes, cpu.in_use_bytes)
        else:
            reserve["gpu"] = max(tier_headroom("gpu", g.memory_bytes, g.in_use_bytes) for g in hardware.gpus)
    return reserve
