"""The cost model: memory per tier, time per phase, and the roofline bound, for one policy or a whole grid of them.

A run has two phases: prefill of p tokens for every sequence, then decode steps of one token per sequence at a
growing context. Time per block follows the engine FlexGen describes: weights and KV cache that live off the
accelerator are streamed in over the host link (and from disk) while the accelerator computes, so per block

    accelerator = bytes / (bandwidth × η_bw) + FLOPs / (peak × η_mm) + micro-batches × launch overhead
    chain       = accelerator + CPU attention (FlexGen runs attention for a CPU-resident cache on the CPU)
    prefetch 0: chain + link + disk;  1: max(chain, link + disk);  2: max(chain, link, disk)

The additive accelerator term is a roofline with a soft corner: at small batch it is the weight reads, at large
batch the FLOPs, so the effective FLOP/s rises with batch (arithmetic intensity) on its own. On a CPU a matmul of
a few rows reads its weights Efficiency.weight_reread_rows times (BLAS kernels of small-row matmuls), so there
decode at batch 2-4 costs about 3x batch 1 rather than a few percent more. Beside every
prediction sits the roofline of the same policy (FLOPs at peak, bytes at spec bandwidth, transfers at link and disk
speed, no overheads, full overlap), and a prediction never exceeds it (a final min).

Everything is computed on numpy arrays, one element per candidate policy, so the policy search evaluates
thousands of candidates in one pass; `evaluate` is the same code on a single candidate. docs/cost-model.md has
the formulas.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np

from .efficiency import Efficiency, MachineEfficiency, at_width, default_efficiency
from .errors import InputError
from .formats import WeightFormat, bits_of, get_format
from .hardware import PACKED_ROW_COUNTS, ComputeDevice, HardwareSpec, PrefillRate, rate_at_rows
from .models import ModelSpec
from .words import counted

TIERS = ("gpu", "cpu", "disk")
# A CPU without 16-bit math: PyTorch's matmul kernels widen 16-bit values in registers, so a 16-bit weight costs
# at least what an fp32 one does. Measured on the development machine (bench/quant_cpu.py, the runtime's thread
# layout): a bf16 decode step takes 1.5x the fp32 one, whose product goes through OpenBLAS (core/runtime/kernels/cpu_matmul.py),
# i.e. 6 bytes of traffic per 2-byte weight.
HALF_AS_FP32_ON_CPU = 3.0
# A CPU with native bf16 math whose one-row bf16 decode step (torch's kernels) `hivekeeper measure` has not timed
# against the fp32 one (the native kernels): a bf16 step is taken as this many fp32 steps, the slowest measured on the
# project's machines (AMD EPYC with AVX512-BF16, quiet: 83 tokens/s in fp32, 33 in bf16; elsewhere 1.0-2.2x,
# core/machine/cpu_dtype_rule.py). A few-row plan is then bf16 only where fp32 is predicted slower by more than
# that, as where fp32 weights would stream from disk and bf16 ones fit in RAM.
UNMEASURED_HALF_DECODE_RATIO = 2.5
# bitsandbytes' int8 / nf4 kernels on a CPU, relative to fp32 (decode step, 128-token prefill): measured by
# bench/quant_cpu.py on the development machine (AVX2 EPYC, bitsandbytes 0.50.2, torch on one thread as the runtime
# runs it) for a TinyLlama-sized block. They dequantize in unfused ops, so the time follows the weight count, not
# the packed size: modelled as that many fp32 reads per weight, and the fp32 FLOP/s divided by the prefill factor.
CPU_QUANT_SLOWDOWN = {"int8": (16.9, 3.2), "nf4": (16.7, 3.5)}
# The packed formats' native kernels (GGUF Q8_0/Q4_0/Q4_1, one row) unpack each block and take integer dot products:
# weights per second per physical core where `hivekeeper measure` has not timed them (ComputeDevice.packed_kernels).
# Measured on the development machines (2-core AVX2 EPYC, 2-core AVX512 Xeon): SmolLM2-135M Q4_1 decoded at 52-74
# tokens/s quiet, ~134M weights a step beside 30 blocks of fixed costs, about 4-6e9 weights/s per core; the
# micro-benchmark at load 6 gave 1-4.6e9 per core. The default takes the low end of the quiet figures.
DEFAULT_PACKED_WEIGHTS_PER_CORE_S = {"q8_0": 4.0e9, "q4_0": 4.0e9, "q4_1": 4.0e9}
# the LM head and embedding of a GGUF: llama.cpp's files keep them at 8 bits or more; the runtime packs a Q8_0 head
PACKED_HEAD_FORMAT = "q8_0"
# FlexGen's CPU attention copies the fp16 cache to fp32 first: read 2 B + write 4 B + read 4 B per 2-byte value.
HALF_COPY_TRAFFIC_ON_CPU = 5.0
_MAX_TOKENS = 10_000_000  # longer prompts or contexts are typos, not workloads


# ---- inputs -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What is asked: prompt and output lengths, and the KV cache capacity to reserve (default prompt + output)."""

    prompt_len: int = 512
    output_len: int = 128
    context_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or not 1 <= value <= _MAX_TOKENS:
                raise InputError(f"{name.replace('_', '-')} must be an integer from 1 to {_MAX_TOKENS}, got {value!r}")
        if self.context_len is not None:
            if not isinstance(self.context_len, (int, np.integer)) or not 1 <= self.context_len <= _MAX_TOKENS:
                raise InputError(f"context must be an integer from 1 to {_MAX_TOKENS}, got {self.context_len!r}")
            if self.context_len < self.prompt_len + self.output_len:
                raise InputError(
                    f"context {self.context_len} is shorter than prompt-len + output-len "
                    f"({self.prompt_len} + {self.output_len})")

    @property
    def cache_len(self) -> int:
        """Tokens of KV cache reserved per sequence."""
        return max(self.context_len or 0, self.prompt_len + self.output_len)

    @property
    def decode_context(self) -> float:
        """Mean context length over the decode steps (they run at p+1 … p+o-1); step time is linear in it."""
        return self.prompt_len + self.output_len / 2.0


@dataclass(frozen=True)
class Placement:
    """Fractions of something (weights, KV cache, activations) on each tier; they sum to 1."""

    gpu: float = 1.0
    cpu: float = 0.0
    disk: float = 0.0

    def __post_init__(self) -> None:
        values = (self.gpu, self.cpu, self.disk)
        if any(not (-1e-9 <= v <= 1 + 1e-9) for v in values) or abs(sum(values) - 1.0) > 1e-6:
            raise InputError(f"placement fractions must be in [0, 1] and sum to 1, got gpu={self.gpu} "
                             f"cpu={self.cpu} disk={self.disk}")

    def as_dict(self) -> dict[str, float]:
        return {"gpu": round(self.gpu, 4), "cpu": round(self.cpu, 4), "disk": round(self.disk, 4)}


@dataclass(frozen=True)
class Policy:
    """Every knob of a local run. Weight fractions cover the transformer blocks; embeddings and the LM head stay on
    the accelerator. On a CPU-only machine "cpu" is the accelerator's memory and "gpu" must be 0."""

    weight_format: str = "fp16"
    weights: Placement = field(default_factory=Placement)
    kv_cache: Placement = field(default_factory=Placement)
    activations: Placement = field(default_factory=Placement)  # hidden states between blocks (gpu or cpu)
    micro_batch_size: int = 1  # sequences computed together (rows of a decode matmul)
    num_micro_batches: int = 1  # micro-batches sharing one pass over the weights (FlexGen's block schedule)
    kv_recompute: bool = False  # keep each block's input hidden states and recompute K, V every step
    prefetch_depth: int = 1  # 0: load then compute; 1: load the next block while computing; 2: also disk→RAM
    attention_on_cpu: bool = False  # attention over a CPU/disk-resident cache runs on the CPU (FlexGen)

    def __post_init__(self) -> None:
        get_format(self.weight_format)
        if not 1 <= self.micro_batch_size <= 65536 or not 1 <= self.num_micro_batches <= 4096:
            raise InputError("micro_batch_size must be in 1..65536 and num_micro_batches in 1..4096")
        if self.prefetch_depth not in (0, 1, 2):
            raise InputError(f"prefetch_depth must be 0, 1 or 2, got {self.prefetch_depth}")
        if self.activations.disk > 0:
            raise InputError("activations live on gpu or cpu, not on disk")
        if self.kv_recompute and self.attention_on_cpu:
            raise InputError("kv_recompute and attention_on_cpu cannot be combined")

    @property
    def batch_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    def as_dict(self) -> dict:
        return {
            "weight_format": self.weight_format,
            "weights": self.weights.as_dict(),
            "kv_cache": self.kv_cache.as_dict(),
            "activations": self.activations.as_dict(),
            "batch_size": self.batch_size,
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "kv_cache_mode": "recompute" if self.kv_recompute else "keep",
            "prefetch_depth": self.prefetch_depth,
            "attention_on_cpu": self.attention_on_cpu,
        }


# ---- the model's numbers ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelNumbers:
    """Shape numbers the cost model needs, derived once from a ModelSpec."""

    layers: int
    hidden: int
    q_dim: int
    kv_dim: int
    vocab: int
    experts: int
    experts_per_token: int
    shared_matrix_params: int  # per block: attention projections and router (touched by every token)
    expert_matrix_params: int  # per block, per expert
    vector_params: int  # per block: norms and biases, kept in 16 bits by quantized formats
    outside_params: int  # embeddings, final norm, LM head
    head_params: int  # the LM head matmul (vocab × embedding width), tied or not
    flops_per_token: float  # matmul FLOPs of one block for one token (active experts)
    workspace_values_per_token: int  # activations alive inside one block, per token
    cpu_step_values_per_token: int  # the same in a CPU step as the engine holds them (cpu_step_values)
    largest_matrix_params: int  # the largest weight matrix the engine multiplies in a block (fused q, k, v or MLP)
    outside_matrix_params: int = 0  # of outside_params: the embedding and an untied LM head (vocab × width each)

    @property
    def matrix_params(self) -> int:
        """Matrix parameters of one block, every expert included."""
        return self.shared_matrix_params + self.experts * self.expert_matrix_params


def model_numbers(model: ModelSpec) -> ModelNumbers:
    h = model.hidden_size
    attention = h * model.q_dim + 2 * h * model.kv_dim + model.q_dim * h
    expert = (3 if model.gated_mlp else 2) * h * model.intermediate_size
    router = model.router_params()
    vector = model.block_params() - attention - model.num_experts * expert - router
    active_experts = min(model.experts_per_token, model.num_experts)
    # alive inside a block: its input and the residual, plus the larger of the attention phase (q, k, v and the
    # attention output) and the MLP phase (the intermediate activations and the output)
    attention_phase = 2 * model.q_dim + 2 * model.kv_dim
    mlp_phase = (2 if model.gated_mlp else 1) * model.intermediate_size * active_experts + h
    workspace = 2 * h + max(attention_phase, mlp_phase)
    return ModelNumbers(
        layers=model.num_layers, hidden=h, q_dim=model.q_dim, kv_dim=model.kv_dim, vocab=model.vocab_size,
        experts=model.num_experts, experts_per_token=active_experts,
        shared_matrix_params=attention + router, expert_matrix_params=expert, vector_params=max(0, vector),
        outside_params=model.outside_block_params(), head_params=model.vocab_size * model.embedding_dim,
        flops_per_token=float(model.block_matmul_flops_per_token()), workspace_values_per_token=workspace,
        cpu_step_values_per_token=cpu_step_values(h, model.q_dim, model.kv_dim,
                                                  model.intermediate_size * active_experts),
        largest_matrix_params=largest_matrix_params(h, model.q_dim, model.kv_dim, model.intermediate_size),
        outside_matrix_params=(1 if model.tie_word_embeddings else 2) * model.vocab_size * model.embedding_dim,
    )


def block_weight_bytes(model: ModelSpec, weight_format: str) -> float:
    """Bytes of one transformer block in a format: matrices at the format's size (with its quantization
    statistics), norms and biases in 16 bits (32 for fp32)."""
    numbers = model_numbers(model)
    fmt = get_format(weight_format)
    return numbers.matrix_params * fmt.bytes_per_param + numbers.vector_params * _vector_bytes(fmt)


def weight_bytes(model: ModelSpec, weight_format: str) -> float:
    """Bytes of the whole model: every block in the format, embeddings and LM head in 16 bits (32 for fp32)."""
    fmt = get_format(weight_format)
    blocks = model.num_layers * block_weight_bytes(model, weight_format)
    return blocks + model.outside_block_params() * _vector_bytes(fmt)


def kv_cache_bytes(model: ModelSpec, tokens: int, batch: int = 1, bytes_per_value: float = 2.0) -> float:
    """KV cache of all blocks: 2 (K and V) × layers × kv_heads × head_dim × bytes per value, per token."""
    return batch * tokens * model.num_layers * model.kv_bytes_per_token_per_block(bytes_per_value)


def decode_flops_per_token(model: ModelSpec, context_len: int) -> float:
    """FLOPs of one decode token at a context length: every block's matmuls and attention, plus the LM head."""
    per_block = model.block_matmul_flops_per_token() + model.block_attention_flops_per_token(context_len)
    return model.num_layers * per_block + 2.0 * model.vocab_size * model.embedding_dim


def _vector_bytes(fmt: WeightFormat) -> float:
    """Norms, biases, embeddings: fp32 beside fp32 or packed block weights (the runtime computes those in fp32)."""
    return 4.0 if fmt.name == "fp32" or fmt.packed else 2.0


def packed_kernel_rate(cpu: ComputeDevice, weight_format: str) -> tuple[float, bool]:
    """(weights/s of the packed format's one-row kernel on this CPU with its weights streamed from RAM, whether
    measured): `hivekeeper measure`'s figure (ComputeDevice.packed_kernels); where only the in-cache rate was
    measured (a `measure --quick` profile from before session 15, which timed no streamed spans), that one (a
    step's reads from RAM are the cost model's own term beside it); else DEFAULT_PACKED_WEIGHTS_PER_CORE_S times the
    physical cores."""
    measured = cpu.packed_kernels.get(weight_format) or cpu.packed_kernels_cached.get(weight_format)
    if measured:
        return float(measured), True
    return DEFAULT_PACKED_WEIGHTS_PER_CORE_S[weight_format] * (cpu.cores or 4), False


def packed_cached_rate(cpu: ComputeDevice, weight_format: str) -> float:
    """Weights/s of the packed format's one-row kernel with its weights in the last-level cache (measured:
    ComputeDevice.packed_kernels_cached), else the streamed rate (packed_kernel_rate)."""
    return float(cpu.packed_kernels_cached.get(weight_format) or packed_kernel_rate(cpu, weight_format)[0])


def packed_block_cost(cpu: ComputeDevice) -> float | None:
    """Seconds of a packed block's fixed cost in a one-row decode step, as `hivekeeper measure` fitted it on packed
    spans (ComputeDevice.packed_block_overhead_s), or None where not measured: the decode then takes the fp32 blocks'
    fitted cost (Efficiency.layer_overhead_s), which profiles measured before it subtracted from their packed rates,
    so rate and cost stay one fit either way. Issue 23 (session 14): the fp32 cost (0.3 ms a block on an AVX512-VNNI
    host) on SmolLM2's 30 packed blocks predicted a 6.3 ms step at ~15 ms."""
    return cpu.packed_block_overhead_s


def packed_prefill_rate(cpu: ComputeDevice, weight_format: str) -> tuple[float, bool]:
    """(FLOP/s of the packed format's kernels on many rows, whether measured): a prefill (or a batch of more than
    PACKED_KERNEL_ROWS rows) multiplies up to PACKED_PREFILL_ROWS rows per pass over each packed weight chunk with
    the int8 kernels. `hivekeeper measure` times a prefill through a packed span (ComputeDevice.packed_prefill:
    row-weight products/s, 2 FLOPs each); unmeasured, the fp32 rate stands in (the rate of the dequantize-and-BLAS
    path the kernels replaced). The measured rate is whole prefill passes through packed blocks, their per-block
    costs included, so a prefill priced at it pays no Efficiency.prefill_layer_overhead_s (FormatTraits)."""
    measured = cpu.packed_prefill.get(weight_format)
    if measured:
        return 2.0 * float(measured), True
    return float(cpu.peak_flops("fp32")), False


def cached_share(working_bytes, cache_bytes: int | None):
    """The share of a decode step's weights read from the last-level cache rather than RAM, for a step that reads
    `working_bytes` of weights in turn: all of them where they fit the cache, none from twice its size (a span
    that large leaves the cache cold between blocks: what measure's streamed spans time), linear between. 0 where
    the cache is unknown."""
    working = np.asarray(working_bytes, dtype=float)
    if not cache_bytes:
        return np.zeros_like(working)
    return np.clip((2.0 * cache_bytes - working) / cache_bytes, 0.0, 1.0)


def blended_rate(streamed, cached, share):
    """The rate of a step that does `share` of its work at the cached rate and the rest at the streamed one."""
    return 1.0 / (share / cached + (1.0 - share) / streamed)


def experts_touched(experts: int, per_token: int, tokens):
    """Expected distinct experts a block touches for `tokens` tokens routed uniformly, `per_token` each."""
    if experts <= 1:
        return np.ones_like(np.asarray(tokens, dtype=float))
    return experts * (1.0 - (1.0 - per_token / experts) ** np.asarray(tokens, dtype=float))


# ---- the machine as the cost model sees it ----------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """Three memory tiers: the accelerator's memory, the host's RAM when separate, and the disk.

    On a CPU-only machine the CPU is the accelerator and RAM its memory; on Apple silicon the GPU's unified
    memory is RAM. Either way there is no separate host tier and no host link; `acc_tier` names the accelerator
    tier the way users see it ("gpu" or "cpu").
    """

    hardware: HardwareSpec
    acc: ComputeDevice
    acc_tier: str
    num_gpus: int
    acc_capacity: float  # bytes usable after the reserve
    host_capacity: float
    disk_capacity: float
    acc_bandwidth: float
    link_bandwidth: float | None  # host→accelerator bytes/s, None when there is no separate host memory
    cpu: ComputeDevice
    disk_read: float
    disk_write: float
    power_watts: float  # the devices a plan keeps busy: every GPU used plus the CPU

    @property
    def has_host_tier(self) -> bool:
        return self.link_bandwidth is not None


def machine_view(hardware: HardwareSpec, reserve_bytes: dict[str, float] | None = None) -> Machine:
    """Tiers, capacities (minus the per-tier reserve) and rates; several identical GPUs act as one pipeline."""
    reserve = {tier: float((reserve_bytes or {}).get(tier, 0.0)) for tier in TIERS}
    if any(v < 0 for v in reserve.values()):
        raise InputError("memory reserve must be >= 0")
    cpu = hardware.cpu
    if hardware.gpus:
        gpus = hardware.gpus
        acc = min(gpus, key=lambda g: (g.memory_bandwidth, g.peak_flops("fp16")))  # the slowest sets the pace
        unified = any(g.unified_memory for g in gpus)
        acc_memory = float(sum(g.memory_bytes for g in gpus))
        if unified:
            acc_memory = min(acc_memory, float(cpu.memory_bytes))
            host_memory, link = 0.0, None
        else:
            host_memory = float(cpu.memory_bytes)
            links = [g.host_link_bandwidth for g in gpus if g.host_link_bandwidth]
            link = float(min(links)) if links else 12e9  # PCIe 3.0 x16 practical when a spec leaves it out
        acc_capacity = acc_memory - reserve["gpu"]
        host_capacity = host_memory - reserve["cpu"] if not unified else 0.0
        acc_tier, power = "gpu", float(sum(g.power_watts for g in gpus)) + cpu.power_watts
        acc_bw, num_gpus = float(acc.memory_bandwidth), len(gpus)
    else:
        acc, acc_tier, num_gpus = cpu, "cpu", 0
        acc_capacity, host_capacity, link = float(cpu.memory_bytes) - reserve["cpu"], 0.0, None
        acc_bw, power = float(cpu.memory_bandwidth), cpu.power_watts
    disk = hardware.disk
    return Machine(
        hardware=hardware, acc=acc, acc_tier=acc_tier, num_gpus=num_gpus,
        acc_capacity=acc_capacity, host_capacity=max(0.0, host_capacity),
        disk_capacity=float(disk.capacity_bytes) - reserve["disk"], acc_bandwidth=acc_bw, link_bandwidth=link,
        cpu=cpu, disk_read=float(disk.read_bandwidth), disk_write=float(disk.write_bandwidth or disk.read_bandwidth),
        power_watts=power,
    )


def cpu_native_half(cpu: ComputeDevice) -> bool:
    """Whether a CPU multiplies 16-bit values natively (AVX512_BF16, AMX); else it converts to fp32 first."""
    fp32 = cpu.flops.get("fp32", 0.0)
    return any(cpu.flops.get(dtype, 0.0) >= fp32 > 0 for dtype in ("bf16", "fp16"))


def bf16_by_rows(native: bool, step_ratio: float | None, rows, planned_rows=None):
    """The one rule for what a bf16 plan computes in on a CPU, by the rows its decode steps multiply (the engine asks
    it through core/machine/cpu_dtype_rule, the planner through cpu_bf16_at): bf16 where the CPU multiplies bf16
    natively (`native`: AVX512-BF16 or AMX) and either a step multiplies more rows than the native decode kernels take
    (PACKED_KERNEL_ROWS: such steps, as a prefill, run torch's matmuls, bf16 ones on AMX at their measured rate), a
    measured bf16 decode step took less than fp32's (`step_ratio` < 1), or the plan was made for steps of at most
    those rows (`planned_rows`, its micro-batch: the planner names bf16 for them only where it predicts the measured
    bf16 step faster than fp32 as placed, e.g. bf16 weights in RAM where fp32 ones would stream from disk, and the
    engine's fp32 would hold twice the bytes the plan placed); else fp32 (a run of fewer rows than its plan was made
    for, or no plan: the kernels' fp32 decode beat torch's bf16 one, 1.1-2.2x its time on the AMX VM). True where
    bf16, per `rows`."""
    few_rows_faster = step_ratio is not None and step_ratio < 1.0
    planned_few = False if planned_rows is None else np.asarray(planned_rows) <= PACKED_KERNEL_ROWS
    beyond = np.asarray(rows) > PACKED_KERNEL_ROWS
    return np.logical_and(bool(native), np.logical_or(beyond, np.logical_or(few_rows_faster, planned_few)))


def cpu_native_bf16(cpu: ComputeDevice) -> bool:
    """Whether a CPU's FLOP/s table lists bf16 at or above fp32: native bf16 math as the planner sees it
    (core/machine/cpu_dtype_rule.with_choice writes the table so from the CPU's flags)."""
    fp32 = cpu.flops.get("fp32", 0.0)
    return cpu.flops.get("bf16", 0.0) >= fp32 > 0


def cpu_bf16_at(cpu: ComputeDevice, rows, planned_rows=None):
    """bf16_by_rows for a CPU as the planner sees it: its FLOP/s table and its measured bf16-vs-fp32 decode step."""
    return bf16_by_rows(cpu_native_bf16(cpu), cpu.half_decode_ratio, rows, planned_rows)


def runs_as_planned(machine: Machine, traits: list[FormatTraits], c: dict[str, np.ndarray],
                    planned_rows=None) -> np.ndarray:
    """Per candidate: whether the engine computes it in the format it names. On a CPU a 16-bit candidate runs as
    planned only in bf16 where bf16_by_rows says so for its micro-batch rows (the engine's rows:
    placement.micro_batch_rows, `b` on the grid) and the rows its plan was made for (`planned_rows`; None: `b`, a
    candidate is its own plan, so a native CPU computes every bf16 candidate in bf16 and the search weighs it by its
    price); elsewhere the engine computes fp32 at twice the bytes, which the fp32 candidates already plan. Other
    accelerators and formats: every candidate."""
    if machine.acc.kind != "cpu":
        return np.ones(len(c["fmt"]), dtype=bool)
    names = np.array([t.fmt.name for t in traits])[c["fmt"]]
    sixteen = (names == "bf16") | (names == "fp16")
    planned = c["b"] if planned_rows is None else planned_rows
    return ~sixteen | ((names == "bf16") & cpu_bf16_at(machine.acc, c["b"], planned))


@dataclass(frozen=True)
class FormatTraits:
    """How a weight format behaves on this machine's accelerator."""

    fmt: WeightFormat
    stored_bytes: float  # per matrix parameter, at rest (in memory, on the link, on disk)
    read_bytes_gemv: float  # accelerator memory traffic per matrix parameter, one row (fused dequant kernel)
    read_bytes_gemm: float  # … several rows (dequantize to 16 bits, write, read back)
    vector_bytes: float
    kv_bytes: float  # per cached value
    kv_read_factor: float  # accelerator traffic per byte of cache read (conversion on a CPU without half math)
    peak_flops: float  # accelerator peak for the format's compute dtype
    # decode of a few rows (packed formats: their native kernels, 2 FLOPs per weight at packed_kernel_rate), and
    # whether a step's reads and those FLOPs overlap (max) rather than add up
    gemv_flops: float = 0.0
    overlapped: bool = False
    head_bytes: float = 0.0  # bytes per LM head parameter a step reads
    head_flops: float = 0.0  # the LM head's FLOP/s
    # packed formats: the kernels' FLOP/s with the weights in the last-level cache (0: as gemv_flops / head_flops)
    gemv_flops_cached: float = 0.0
    head_flops_cached: float = 0.0
    # 1: a prefill pays Efficiency.prefill_layer_overhead_s a block; 0: the format's measured prefill rate holds it
    prefill_overhead: float = 1.0
    # decode micro-batches up to these rows read read_bytes_gemv a weight (bf16 on a CPU: the measured step ratio up
    # to the decode kernels' rows, PACKED_KERNEL_ROWS); more rows read_bytes_gemm
    gemv_rows: float = 1.0
    # packed formats: a block's fixed cost in a decode step within the kernels' rows, as measured on packed spans
    # (packed_block_cost); negative: Efficiency.layer_overhead_s
    decode_block_s: float = -1.0
    # a decode block's fixed costs within gemv_rows, relative to the fp32 kernels' (bf16 on a CPU: its measured step
    # ratio, half_step_ratio, which times whole steps, fixed costs and all: torch's norms, rotary and attention)
    decode_block_factor: float = 1.0
    # packed formats: a decode step of each of PACKED_ROW_COUNTS rows over a one-row one, as measured
    # (ComputeDevice.packed_row_steps); empty: not measured (kernel_row_factor)
    row_steps: tuple[float, ...] = ()


def format_traits(machine: Machine, weight_format: str) -> FormatTraits:
    fmt = get_format(weight_format)
    stored = fmt.bytes_per_param
    kv_bytes = 4.0 if fmt.name == "fp32" else 2.0
    if fmt.packed:
        return packed_traits(machine, fmt)
    if machine.acc.kind == "cpu":
        native = cpu_native_half(machine.acc)
        fp32_rate = machine.acc.peak_flops("fp32")
        if fmt.name == "fp32":
            gemv = gemm = 4.0
            peak = fp32_rate
        elif fmt.quantized:  # bitsandbytes dequantizes on every use: CPU_QUANT_SLOWDOWN
            decode_factor, prefill_factor = CPU_QUANT_SLOWDOWN[fmt.name]
            gemv = gemm = 4.0 * decode_factor
            peak = fp32_rate / prefill_factor
        else:
            return half_cpu_traits(machine, fmt, native)
        kv_factor = 1.0 if (native or fmt.name == "fp32") else HALF_AS_FP32_ON_CPU
    else:
        gemv = stored
        gemm = stored + 4.0 if fmt.quantized else stored
        peak = machine.acc.peak_flops(fmt.compute_dtype)
        kv_factor = 1.0
    vector = _vector_bytes(fmt)
    return FormatTraits(fmt, stored, gemv, gemm, vector, kv_bytes, kv_factor, float(peak), float(peak), False,
                        vector, float(peak))


def half_cpu_traits(machine: Machine, fmt: WeightFormat, native: bool) -> FormatTraits:
    """A 16-bit format on a CPU. Natively multiplied bf16: a decode micro-batch of up to PACKED_KERNEL_ROWS rows
    takes the bf16 decode step through torch (half_step_ratio: that many fp32 steps, measured or the slowest seen), more
    rows (and a prefill) read 2 bytes a weight at the CPU's bf16 matmul rate (measured by `hivekeeper measure`: 527
    GFLOP/s against fp32's ~100 on the AMX VM). Converted to fp32 first (no native math, or fp16):
    HALF_AS_FP32_ON_CPU the bytes, at the rate the FLOP/s table lists for the format (the catalog's rate of
    software-converted kernels), else fp32's."""
    cpu = machine.acc
    half_native = native and fmt.name == "bf16"
    gemm = 2.0 if half_native else 2.0 * HALF_AS_FP32_ON_CPU
    gemv = 4.0 * half_step_ratio(cpu) if half_native else gemm  # a bf16 step is that many fp32 steps
    peak = float(cpu.peak_flops(fmt.name) if fmt.name in cpu.flops else cpu.peak_flops("fp32"))
    vector = _vector_bytes(fmt)
    return FormatTraits(fmt, fmt.bytes_per_param, gemv, gemm, vector, 2.0, 1.0 if native else HALF_AS_FP32_ON_CPU,
                        peak, peak, False, vector, peak, gemv_rows=PACKED_KERNEL_ROWS if half_native else 1.0,
                        decode_block_factor=half_step_ratio(cpu) if half_native else 1.0)


def half_step_ratio(cpu: ComputeDevice) -> float:
    """A few-row bf16 decode step (torch's kernels) over the fp32 one (the native kernels) on a CPU with native bf16
    math: measured (ComputeDevice.half_decode_ratio), else UNMEASURED_HALF_DECODE_RATIO."""
    return cpu.half_decode_ratio or UNMEASURED_HALF_DECODE_RATIO


def packed_traits(machine: Machine, fmt: WeightFormat) -> FormatTraits:
    """A GGUF block format on a CPU: a decode step reads the packed bytes once and the native kernels unpack and
    multiply them at packed_kernel_rate, the two overlapped; a prefill (and a batch beyond PACKED_KERNEL_ROWS) runs
    the int8 kernels too, each packed weight read once per PACKED_PREFILL_ROWS rows, at packed_prefill_rate; the
    KV cache, norms and embeddings stay fp32; the head is packed Q8_0."""
    if machine.acc.kind != "cpu":
        raise InputError(f"{fmt.name} is a CPU format (hivekeeper's native kernels); a GPU runs GGUF weights "
                         f"dequantized to 16 bits (--quant none) or bitsandbytes int8/nf4")
    cpu, stored = machine.acc, fmt.bytes_per_param
    head_rate, _ = packed_kernel_rate(cpu, PACKED_HEAD_FORMAT)
    block_cost = packed_block_cost(cpu)
    return FormatTraits(fmt, stored, read_bytes_gemv=stored, read_bytes_gemm=stored, vector_bytes=4.0,
                        kv_bytes=4.0, kv_read_factor=1.0, peak_flops=packed_prefill_rate(cpu, fmt.name)[0],
                        gemv_flops=2.0 * packed_kernel_rate(cpu, fmt.name)[0], overlapped=True,
                        head_bytes=get_format(PACKED_HEAD_FORMAT).bytes_per_param, head_flops=2.0 * head_rate,
                        gemv_flops_cached=2.0 * packed_cached_rate(cpu, fmt.name),
                        head_flops_cached=2.0 * packed_cached_rate(cpu, PACKED_HEAD_FORMAT),
                        prefill_overhead=0.0 if packed_prefill_rate(cpu, fmt.name)[1] else 1.0,
                        decode_block_s=-1.0 if block_cost is None else block_cost,
                        row_steps=cpu.packed_row_steps.get(fmt.name, ()))


def sixteen_bit_format(model: ModelSpec, machine: Machine) -> str:
    """bf16 where the checkpoint is bf16 and the accelerator runs bf16 at full rate, else fp16. On a CPU that
    multiplies bf16 natively but not fp16 (AVX512_BF16, AMX), bf16 for any checkpoint but an fp16 one: the engine
    computes a 16-bit plan there in bf16 (cpu_dtype's choice) and would run an fp16 plan in fp32, at twice the
    bytes the plan placed."""
    acc = machine.acc
    if model.torch_dtype == "bf16" and acc.peak_flops("bf16") >= acc.peak_flops("fp16"):
        return "bf16"
    if acc.kind == "cpu" and model.torch_dtype == "bf16":
        return "bf16"
    if acc.kind == "cpu" and model.torch_dtype != "fp16" and cpu_native_bf16_only(acc):
        return "bf16"
    return "fp16"


def cpu_native_bf16_only(cpu: ComputeDevice) -> bool:
    """Whether a CPU lists bf16 at or above its fp32 rate (native bf16 math) and fp16 at none (no native fp16)."""
    return "fp16" not in cpu.flops and cpu_native_bf16(cpu)


# On a CPU the engine runs a prefill chunk in parts of whole micro-batches of at least this many token rows (a CPU
# multiplies few rows poorly) and a decode step as the whole batch (core/offload/offloaded_model.py, _step_rows); its
# head leaves fp32 logits and two temporaries of their size for the whole batch.
CPU_PART_TOKENS = 1024
LOGIT_COPIES = 3


def cpu_step_values(hidden: int, q_dim: int, kv_dim: int, intermediate: int) -> int:
    """Values a token holds inside a block during a CPU step, all at once as the engine's torch code leaves them
    (its input, residual, normed input and output; q, k and v; the MLP's gate, up and their product): one count for
    the planner and the engine's placement (core/offload/placement.workspace_bytes)."""
    return 4 * hidden + q_dim + 2 * kv_dim + 3 * intermediate


def cpu_step_activation_bytes(values_per_token, hidden, vocab, batch, part, tokens, value_bytes):
    """A CPU step's activations over `batch` sequences of `tokens` new tokens run `part` of them at a time through
    each block: one part's values inside the block (cpu_step_values), the other parts' hidden states between blocks,
    and fp32 logits of every sequence's last token with the head's temporaries (LOGIT_COPIES). The one rule the
    planner and the engine's placement both use (numbers or numpy arrays)."""
    return (part * tokens * values_per_token * value_bytes + (batch - part) * tokens * hidden * value_bytes
            + LOGIT_COPIES * batch * vocab * 4.0)


def largest_matrix_params(hidden: int, q_dim: int, kv_dim: int, intermediate: int) -> int:
    """Parameters of a block's largest matrix as the engine multiplies it: one MLP matrix or the fused q, k, v."""
    return max(intermediate * hidden, (q_dim + 2 * kv_dim) * hidden)


def sixteen_bit_cpu_transient_bytes(largest_params: int, value_bytes: int) -> int:
    """What a 16-bit plan computed on a CPU holds beyond its tensors for the largest matrix of a block: the block
    reader's fp32 scratch (it converts an fp32 file through it) and the matmul library's reordered copy of the
    weight during a 16-bit matmul (oneDNN). The planner's and the engine's placement's one count."""
    return largest_params * (4 + value_bytes)


def cpu_part_sequences(batch, micro_batch, tokens):
    """Sequences in one part of a CPU prefill chunk of `tokens` tokens a sequence: whole micro-batches until the part
    holds CPU_PART_TOKENS token rows, at most the batch (numbers or numpy arrays)."""
    return np.minimum(batch, micro_batch * np.ceil(CPU_PART_TOKENS / np.maximum(micro_batch * tokens, 1)))


# ---- the vectorized core ----------------------------------------------------------------------------------------
# Candidate columns (numpy arrays of one length): fmt (index into `traits`), wa/wh/wd (block weights on
# accelerator / host / disk), ca/ch/cd (KV cache), ah (activations on the host), b (micro-batch), n (micro-batches),
# rec (recompute K,V), d (prefetch depth), cattn (attention on the CPU for the off-accelerator cache).

COMPONENTS = ("accelerator compute", "accelerator memory", "host link", "disk", "cpu attention", "overhead")


def _per_format(traits: list[FormatTraits], index: np.ndarray, attribute: str) -> np.ndarray:
    return np.array([getattr(t, attribute) for t in traits], dtype=float)[index]


def fixed_memory(numbers: ModelNumbers, machine: Machine, eff: MachineEfficiency, workload: Workload,
                 traits: list[FormatTraits], c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Memory per tier that does not depend on where the block weights go, and the weight sizes.

    Returned: acc/host/disk (fixed bytes), w_all (all block weights), w_blk (one block), and the buffer
    multipliers: acc_buffers (streaming buffers per streamed block fraction) and host_staging (disk staging).
    """
    f = c["fmt"]
    stored = _per_format(traits, f, "stored_bytes")
    vbytes = _per_format(traits, f, "vector_bytes")
    kvb = _per_format(traits, f, "kv_bytes")
    w_blk = numbers.matrix_params * stored + numbers.vector_params * vbytes
    w_all = numbers.layers * w_blk
    outside = outside_bytes(numbers, traits, f)
    b, n, d = c["b"], c["n"], c["d"]
    batch = b * n
    ctx = float(workload.cache_len)
    p = float(workload.prompt_len)
    # one token of one block's cache: K and V, or the block's input hidden state when recomputing them
    per_token = np.where(c["rec"] > 0, numbers.hidden * kvb, 2.0 * numbers.kv_dim * kvb)
    cache_all = batch * ctx * numbers.layers * per_token
    off_acc_cache = 1.0 - c["ca"]
    # one block's cache for one micro-batch, in flight to the accelerator (1 + depth buffers)
    cache_buffers = np.where(c["cattn"] > 0, 0.0, (1.0 + d) * b * ctx * per_token * off_acc_cache)
    hidden_states = 2.0 * batch * p * numbers.hidden * kvb  # inputs and outputs of a block, all micro-batches
    workspace = b * p * numbers.workspace_values_per_token * kvb + b * numbers.vocab * 4.0  # + fp32 logits
    on_acc = 1.0 - c["ah"]
    if machine.acc.kind == "cpu":  # the engine's CPU steps, counted as its placement counts them: one part of the
        # batch inside a block (the plan's micro-batch when recomputing), the other parts' hidden states, the logits
        part = np.where(c["rec"] > 0, b, cpu_part_sequences(batch, b, p))
        hidden_states = 0.0  # in cpu_step_activation_bytes
        workspace = cpu_step_activation_bytes(numbers.cpu_step_values_per_token, numbers.hidden, numbers.vocab,
                                              batch, part, p, kvb)
        # a disk-tier block's cache is mapped in for its turn, the whole batch's (core/offload/tiered_cache)
        workspace = workspace + np.where(c["cd"] > 0, batch * ctx * per_token, 0.0)
        sixteen_bit = np.array([t.fmt.name in ("bf16", "fp16") for t in traits])[f]
        workspace = workspace + np.where(sixteen_bit, sixteen_bit_cpu_transient_bytes(
            numbers.largest_matrix_params, 2), 0.0)
        on_acc = 1.0  # one memory: hidden states "on the host" are in it too
    acc = outside + c["ca"] * cache_all + cache_buffers + on_acc * hidden_states + workspace \
        + eff.accelerator.runtime_bytes
    disk = c["cd"] * cache_all
    if machine.has_host_tier:
        cpu_attention_copies = np.where(c["cattn"] > 0, b * ctx * per_token * 2.0 * off_acc_cache, 0.0)
        cache_staging = np.where(c["cd"] > 0, b * ctx * per_token * c["cd"], 0.0)
        host = c["ch"] * cache_all + c["ah"] * hidden_states + cpu_attention_copies + cache_staging \
            + eff.host.runtime_bytes
        host_staging = 1.0 + (d >= 2)
    else:
        if machine.acc.kind != "cpu":  # unified memory: the process's own memory shares the GPU's
            acc = acc + eff.host.runtime_bytes
        host = np.zeros_like(acc)
        host_staging = np.zeros_like(acc)
    return {"acc": acc, "host": host, "disk": disk, "w_all": w_all, "w_blk": w_blk,
            "acc_buffers": 1.0 + d, "host_staging": host_staging}


def outside_bytes(numbers: ModelNumbers, traits: list[FormatTraits], index: np.ndarray) -> np.ndarray:
    """Bytes of the embedding, final norm and LM head per candidate: at the format's vector bytes, except that a
    packed format (a GGUF) holds the embedding and head matrices packed at head_bytes a weight (PACKED_HEAD_FORMAT),
    as the engine does (core/offload/packed_stream.load_outside: a tied embedding looks its rows up in the head's
    bytes). Counted in fp32 they made SmolLM2's 30 MB of Q8_0 113 MB, and no plan fitted 0.5-1.0x its file."""
    vector = _per_format(traits, index, "vector_bytes")
    packed = _per_format(traits, index, "overlapped") > 0
    matrices = min(numbers.outside_matrix_params, numbers.outside_params)
    return np.where(packed, matrices * _per_format(traits, index, "head_bytes")
                    + (numbers.outside_params - matrices) * vector, numbers.outside_params * vector)


def peak_memory(mem: dict[str, np.ndarray], wa, wh, wd) -> dict[str, np.ndarray]:
    """Peak bytes per tier once the block weights are placed (streaming buffers only for what is streamed)."""
    w_all, w_blk = mem["w_all"], mem["w_blk"]
    streamed = 1.0 - wa
    acc = mem["acc"] + wa * w_all + np.where(streamed > 1e-12, mem["acc_buffers"] * streamed * w_blk, 0.0)
    host = mem["host"] + wh * w_all + np.where(wd > 1e-12, mem["host_staging"] * wd * w_blk, 0.0)
    disk = mem["disk"] + wd * w_all
    return {"acc": acc, "host": host, "disk": disk}


def solve_weight_placement(mem: dict[str, np.ndarray], machine: Machine) -> tuple[np.ndarray, ...]:
    """Most of the block weights on the accelerator, then on the host, the rest on disk (closed form).

    Streaming time only falls as more weights sit closer, so the largest fractions that fit are the best ones
    for every other knob fixed. Fractions are floored to 1e-4 so the peak stays within capacity.
    Returns wa, wh, wd and a feasibility mask.
    """
    w_all, w_blk = mem["w_all"], mem["w_blk"]
    # accelerator: wa·W + (1+d)·(1-wa)·W_blk + fixed ≤ C
    room = machine.acc_capacity - mem["acc"]
    whole = room >= w_all
    slope = w_all - mem["acc_buffers"] * w_blk
    with np.errstate(divide="ignore", invalid="ignore"):
        partial = (room - mem["acc_buffers"] * w_blk) / slope
    wa = np.where(whole, 1.0, np.floor(np.clip(partial, 0.0, 1.0) * 1e4) / 1e4)
    ok = whole | ((slope > 0) & (room - mem["acc_buffers"] * w_blk >= 0))
    wa = np.where(whole, 1.0, np.minimum(wa, 0.9999))
    rest = 1.0 - wa
    # host: wh·W + staging·(rest-wh)·W_blk + fixed ≤ C
    room_h = machine.host_capacity - mem["host"]
    fits_rest = room_h >= rest * w_all
    slope_h = w_all - mem["host_staging"] * w_blk
    with np.errstate(divide="ignore", invalid="ignore"):
        partial_h = (room_h - mem["host_staging"] * w_blk * rest) / slope_h
    wh = np.where(fits_rest, rest, np.floor(np.clip(partial_h, 0.0, 1.0) * 1e4) / 1e4)
    wh = np.minimum(wh, rest)
    wd = np.maximum(rest - wh, 0.0)
    wd = np.where(wd < 1e-9, 0.0, wd)
    peaks = peak_memory(mem, wa, wh, wd)
    ok &= peaks["acc"] <= machine.acc_capacity + 1.0
    ok &= peaks["host"] <= machine.host_capacity + 1.0
    ok &= peaks["disk"] <= machine.disk_capacity + 1.0
    ok &= room_h >= 0
    return wa, wh, wd, ok


def evaluate_arrays(numbers: ModelNumbers, machine: Machine, eff: MachineEfficiency, workload: Workload,
                    traits: list[FormatTraits], c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Times, bounds and memory of every candidate in `c` (which must include wa, wh, wd)."""
    grid = candidate_arrays(numbers, machine, eff, traits, c)
    head = lm_head(grid)
    block = decode_block(grid, workload.decode_context)
    step = whole_pass(grid, block, head)
    prefill = whole_pass(grid, prefill_block(grid, float(workload.prompt_len)), head)
    out = speeds(grid, workload, step, prefill)
    out.update(step_components(grid, workload.decode_context, block, head))
    out.update(compute_bound_batch(grid, workload.decode_context))
    return out


@dataclass(frozen=True)
class CandidateArrays:
    """The candidates of one evaluation under readable names (one array element per candidate): their knobs, read
    from the table's short keys, their format's traits, and the per-block sizes every phase uses."""

    numbers: ModelNumbers
    machine: Machine
    acc_eff: Efficiency  # the machine's efficiency on the accelerator
    host_eff: Efficiency  # … on the host (CPU attention, disk)
    weights_on_acc: np.ndarray  # wa: fraction of the block weights on the accelerator
    weights_on_disk: np.ndarray  # wd
    cache_on_acc: np.ndarray  # ca: fraction of the KV cache on the accelerator
    cache_on_disk: np.ndarray  # cd
    activations_on_host: np.ndarray  # ah
    micro_batch: np.ndarray  # b: sequences computed together
    micro_batches: np.ndarray  # n: micro-batches sharing one pass over the weights
    prefetch: np.ndarray  # d: prefetch depth 0, 1 or 2
    recompute: np.ndarray  # rec > 0: K, V recomputed from stored hidden states
    cpu_attention: np.ndarray  # cattn > 0: attention over the off-accelerator cache on the CPU
    batch: np.ndarray  # sequences in all: micro_batch × micro_batches
    stored_bytes: np.ndarray  # FormatTraits, per candidate
    gemv_bytes: np.ndarray
    gemm_bytes: np.ndarray
    gemv_rows: np.ndarray  # decode micro-batches up to these rows read gemv_bytes a weight
    vector_bytes: np.ndarray
    kv_bytes: np.ndarray
    kv_read_factor: np.ndarray
    peak_flops: np.ndarray
    gemv_flops: np.ndarray  # FLOP/s of a decode of a few rows (packed formats: their kernels, as cached as they fit)
    overlapped: np.ndarray  # packed formats: a decode step takes max(reads, kernel compute), not their sum
    head_bytes: np.ndarray  # bytes per LM head parameter read
    head_flops: np.ndarray
    cached_share: np.ndarray  # packed formats: the share of a step's weights read from the last-level cache
    prefill_overhead: np.ndarray  # FormatTraits.prefill_overhead
    decode_block_s: np.ndarray  # FormatTraits.decode_block_s (negative: Efficiency.layer_overhead_s)
    decode_block_factor: np.ndarray  # FormatTraits.decode_block_factor
    row_steps: np.ndarray  # [candidates, PACKED_ROW_COUNTS]: FormatTraits.row_steps (0: not measured)
    block_bytes: np.ndarray  # one block's weights at rest
    kv_token: np.ndarray  # one token of one block's K and V
    cached_per_token: np.ndarray  # what is kept per token and block: K and V, or the block's input when recomputing
    cache_off_acc: np.ndarray  # fraction of the cache off the accelerator
    attention_on_acc: np.ndarray  # fraction of the cache whose attention runs on the accelerator


def candidate_arrays(numbers: ModelNumbers, machine: Machine, eff: MachineEfficiency, traits: list[FormatTraits],
                     c: dict[str, np.ndarray]) -> CandidateArrays:
    """The candidate table `c` under readable names, with each format's traits spread over its candidates."""
    trait = lambda attribute: _per_format(traits, c["fmt"], attribute)  # noqa: E731
    stored, vector, kv = trait("stored_bytes"), trait("vector_bytes"), trait("kv_bytes")
    recompute, cpu_attention = c["rec"] > 0, c["cattn"] > 0
    kv_token = 2.0 * numbers.kv_dim * kv
    off = 1.0 - c["ca"]
    block_bytes = numbers.matrix_params * stored + numbers.vector_params * vector
    share, gemv_flops, head_flops = packed_cache_terms(numbers, machine, traits, c["fmt"], block_bytes)
    return CandidateArrays(
        numbers=numbers, machine=machine, acc_eff=eff.accelerator, host_eff=eff.host,
        weights_on_acc=c["wa"], weights_on_disk=c["wd"], cache_on_acc=c["ca"], cache_on_disk=c["cd"],
        activations_on_host=c["ah"], micro_batch=c["b"], micro_batches=c["n"], prefetch=c["d"],
        recompute=recompute, cpu_attention=cpu_attention, batch=c["b"] * c["n"],
        stored_bytes=stored, gemv_bytes=trait("read_bytes_gemv"), gemm_bytes=trait("read_bytes_gemm"),
        gemv_rows=trait("gemv_rows"), vector_bytes=vector, kv_bytes=kv, kv_read_factor=trait("kv_read_factor"),
        peak_flops=trait("peak_flops"),
        gemv_flops=gemv_flops, overlapped=trait("overlapped") > 0, head_bytes=trait("head_bytes"),
        head_flops=head_flops, cached_share=share, prefill_overhead=trait("prefill_overhead"),
        decode_block_s=trait("decode_block_s"), decode_block_factor=trait("decode_block_factor"),
        row_steps=np.array([t.row_steps or (0.0,) * len(PACKED_ROW_COUNTS) for t in traits], dtype=float)[c["fmt"]],
        block_bytes=block_bytes, kv_token=kv_token,
        cached_per_token=np.where(recompute, numbers.hidden * kv, kv_token), cache_off_acc=off,
        attention_on_acc=c["ca"] + off * (~cpu_attention),
    )


def packed_cache_terms(numbers: ModelNumbers, machine: Machine, traits: list[FormatTraits], index: np.ndarray,
                       block_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(share of a decode step's weights read from the last-level cache, the kernels' FLOP/s, the head's), per
    candidate: a packed model's blocks and head (every block: a CPU-only machine's decode reads them all in turn)
    against the CPU's cache (cached_share), each rate blended between its streamed and in-cache measurement. Other
    formats: share 0 and their rates as they are."""
    trait = lambda attribute: _per_format(traits, index, attribute)  # noqa: E731
    gemv, head = trait("gemv_flops"), trait("head_flops")
    packed = trait("overlapped") > 0
    working = numbers.layers * block_bytes + numbers.head_params * trait("head_bytes")
    cache = machine.acc.cache_bytes if machine.acc.kind == "cpu" else None
    share = np.where(packed, cached_share(working, cache), 0.0)
    gemv_cached = np.where(trait("gemv_flops_cached") > 0, trait("gemv_flops_cached"), gemv)
    head_cached = np.where(trait("head_flops_cached") > 0, trait("head_flops_cached"), head)
    return share, np.where(packed, blended_rate(gemv, gemv_cached, share), gemv), \
        np.where(packed, blended_rate(head, head_cached, share), head)


@dataclass(frozen=True)
class Resource:
    """One resource's share of a block's pass, per candidate: the bytes it moves, the seconds at the machine's
    efficiency, and the seconds at spec rates (the bound)."""

    nbytes: np.ndarray
    seconds: np.ndarray
    bound_s: np.ndarray


@dataclass(frozen=True)
class AcceleratorWork:
    """Work on the accelerator, per candidate: the least bytes it reads (each once) and its FLOPs; the seconds
    reading memory and computing at the machine's efficiency, and the bound at spec rates."""

    bytes_min: np.ndarray
    flops: np.ndarray
    memory_s: np.ndarray
    compute_s: np.ndarray
    bound_s: np.ndarray

    @property
    def seconds(self) -> np.ndarray:
        return self.memory_s + self.compute_s


@dataclass(frozen=True)
class BlockPass:
    """One block's share of a pass (a decode step or the prefill), per candidate: each resource; the chain
    (accelerator memory and compute, overheads and CPU attention, one after another); the time once transfers
    overlap it as far as the prefetch depth allows; and the bound."""

    accelerator: AcceleratorWork
    overhead_s: np.ndarray
    cpu: Resource
    link: Resource
    disk: Resource
    chain_s: np.ndarray
    time_s: np.ndarray
    bound_s: np.ndarray


def touched_matrices(numbers: ModelNumbers, tokens):
    """Matrix parameters of one block that `tokens` tokens touch: the shared ones and the experts routed to."""
    return numbers.shared_matrix_params + experts_touched(numbers.experts, numbers.experts_per_token, tokens) \
        * numbers.expert_matrix_params


def weight_reads(grid: CandidateArrays, rows):
    """How many times a matmul of `rows` rows reads its weights: once for one row; on CPUs as the few-row steps
    measured at the model's width (Efficiency.reread_curve: at REREAD_ROWS and, where measured, more rows), in
    proportion to the rows between them, and the last measured figure beyond (1 on GPUs). Issue 23: a 2-row step
    cost 1.33x a one-row step where a 4-row one cost 2.2x; priced at the 4-row factor, the calibration's batch-2
    points pulled the fitted factor down to 1.5. Where many rows make a matmul compute-bound the FLOP term takes
    over."""
    curve = ((1, 1.0), *grid.acc_eff.reread_curve(grid.numbers.hidden))
    return np.interp(np.asarray(rows, dtype=float), [r for r, _ in curve], [reads for _, reads in curve])


def format_reads(grid: CandidateArrays, rows):
    """How many times a matmul of `rows` rows reads its weights in each candidate's format: a packed format's
    kernels once per PACKED_PREFILL_ROWS rows (each weight chunk serves every row while it is in cache), others
    weight_reads."""
    return np.where(grid.overlapped, np.ceil(rows / PACKED_PREFILL_ROWS), weight_reads(grid, rows))


def accelerator_work(grid: CandidateArrays, nbytes, bytes_min, flops, peak=None) -> AcceleratorWork:
    """`nbytes` read from accelerator memory (`bytes_min` without re-reads and conversions) and `flops` computed
    (at `peak` FLOP/s, default the format's)."""
    bandwidth = grid.machine.acc_bandwidth
    peak = grid.peak_flops if peak is None else peak
    memory_s = nbytes / (bandwidth * grid.acc_eff.bandwidth_fraction)
    compute_s = flops / (peak * grid.acc_eff.matmul_fraction)
    return AcceleratorWork(bytes_min, flops, memory_s, compute_s, np.maximum(bytes_min / bandwidth, flops / peak))


def link_transfer(grid: CandidateArrays, nbytes) -> Resource:
    """Bytes over the host link (the busier direction), on a machine with a host tier."""
    bandwidth = grid.machine.link_bandwidth or np.inf
    return Resource(nbytes, nbytes / (bandwidth * grid.acc_eff.link_fraction), nbytes / bandwidth)


def idle(grid: CandidateArrays) -> Resource:
    """A resource a pass does not use."""
    zeros = np.zeros_like(grid.block_bytes)
    return Resource(zeros, zeros, zeros)


def block_pass(grid: CandidateArrays, accelerator: AcceleratorWork, overhead_s, cpu: Resource, link: Resource,
               disk: Resource) -> BlockPass:
    """A block's time: the chain, and the transfers overlapped with it as far as the prefetch depth allows (0: one
    after another; 1: loading the next block while computing; 2: also disk → RAM beside the host link)."""
    chain = accelerator.memory_s + accelerator.compute_s + overhead_s + cpu.seconds
    depth, link_s, disk_s = grid.prefetch, link.seconds, disk.seconds
    time = np.where(depth == 0, chain + link_s + disk_s,
                    np.where(depth == 1, np.maximum(chain, link_s + disk_s),
                             np.maximum(chain, np.maximum(link_s, disk_s))))
    bound = np.maximum.reduce([accelerator.bound_s, link.bound_s, disk.bound_s, cpu.bound_s])
    return BlockPass(accelerator, overhead_s, cpu, link, disk, chain, time, bound)


# ---- decode: one step at the mean context, per block ------------------------------------------------------------
def decode_block(grid: CandidateArrays, context: float) -> BlockPass:
    """One block's share of a decode step at a context length (the mean over the decode steps), with the rows the
    engine runs it in (decode_parts)."""
    grid = decode_parts(grid)
    attention_flops = decode_attention_flops(grid, context)
    return block_pass(grid, decode_accelerator(grid, context, attention_flops),
                      grid.micro_batches * decode_block_overhead(grid),
                      decode_cpu_attention(grid, context, attention_flops), decode_link(grid, context),
                      decode_disk(grid, context))


def decode_parts(grid: CandidateArrays) -> CandidateArrays:
    """The candidates' micro-batches as a decode step runs them: on a CPU with K/V kept, the whole batch as one
    (the engine's OffloadedModel._step_rows; placement.cpu_step_part), whatever the plan's split; elsewhere the plan's.
    Issue 23 (session 22): priced as 2 passes of 4 rows, the built-in model's `--batch 8` plan was 2 x 2.0 one-row
    kernel steps where its one 8-row step is 4.9."""
    merged = (grid.machine.acc.kind == "cpu") & ~grid.recompute
    if not np.any(merged & (grid.micro_batches > 1)):
        return grid
    return replace(grid, micro_batch=np.where(merged, grid.batch, grid.micro_batch),
                   micro_batches=np.where(merged, 1, grid.micro_batches))


def decode_attention_flops(grid: CandidateArrays, context: float):
    """FLOPs of one block's attention in a decode step over `context` cached tokens: each sequence's query times
    every key, and the weights times every value."""
    return 4.0 * grid.numbers.q_dim * context * grid.batch


def decode_block_overhead(grid: CandidateArrays):
    """A block's fixed cost in one micro-batch of a decode step: what the native kernels' whole-span call pays a
    block (up to PACKED_KERNEL_ROWS rows; kernel_block_cost; bf16's through torch: its measured step ratio of that,
    FormatTraits.decode_block_factor). On a CPU a micro-batch of more rows runs
    block by block through torch and BLAS, as a prefill does (core/runtime/model.Span.forward), so its blocks pay the
    prefill's fixed cost (prefill_block's; issue 23: at the kernels' per-block cost a thin model's batch-64 decode,
    30 blocks, was predicted several times faster than it ran at load 8)."""
    cpu = grid.machine.acc.kind == "cpu"
    torch_rows = cpu & (grid.micro_batch > PACKED_KERNEL_ROWS)
    # within the kernels' rows each row beyond the first adds its per-block work (norms, rotary, attention; issue 23:
    # SmolLM2's 30 thin blocks took a 4-row step ~2.1x a one-row one, a 2-block wide model ~1.6x)
    per_row = np.where(cpu, grid.acc_eff.row_overhead_s * np.maximum(grid.micro_batch - 1.0, 0.0), 0.0)
    return np.where(torch_rows, grid.acc_eff.prefill_layer_overhead_s * grid.prefill_overhead,
                    (kernel_block_cost(grid) + per_row) * grid.decode_block_factor)


def kernel_block_cost(grid: CandidateArrays):
    """A block's fixed cost in a one-row decode step on the kernels: a packed format's as measured on packed spans
    (FormatTraits.decode_block_s), else Efficiency.layer_overhead_s (the fp32 spans' fit, or the default)."""
    return np.where(grid.decode_block_s >= 0, grid.decode_block_s, grid.acc_eff.layer_overhead_s)


def decode_work(grid: CandidateArrays, context: float, attention_flops) -> tuple[np.ndarray, AcceleratorWork]:
    """The weights the micro-batches touch (re-read by small-row matmuls) and the cache whose attention runs
    here; matmul and attention FLOPs, and the K, V projections again when recomputing them."""
    numbers, rows = grid.numbers, grid.micro_batch
    touched = touched_matrices(numbers, rows)
    read_per_param = np.where(rows <= grid.gemv_rows, grid.gemv_bytes, grid.gemm_bytes) * format_reads(grid, rows)
    vectors = numbers.vector_params * grid.vector_bytes
    cache = grid.batch * context * grid.cached_per_token * grid.attention_on_acc
    timed = attention_timed(grid)  # its time is measured_attention_s's, after the products (decode_accelerator)
    nbytes = grid.micro_batches * (touched * read_per_param + vectors) + np.where(timed, 0.0,
                                                                                  cache * grid.kv_read_factor)
    bytes_min = grid.micro_batches * (touched * grid.stored_bytes + vectors) + cache
    flops = grid.batch * numbers.flops_per_token + np.where(timed, 0.0, attention_flops * grid.attention_on_acc) \
        + np.where(grid.recompute, 4.0 * numbers.hidden * numbers.kv_dim * context * grid.batch, 0.0)
    kernel_rows = grid.overlapped & (rows <= PACKED_KERNEL_ROWS)
    nbytes = nbytes - np.where(kernel_rows, grid.micro_batches * touched * read_per_param * grid.cached_share, 0.0)
    blas_peak = np.where(rows > PACKED_KERNEL_ROWS, pass_rate(grid, rows), grid.peak_flops)
    return kernel_rows, accelerator_work(
        grid, nbytes, bytes_min, flops,
        np.where(kernel_rows, kernel_peak(grid, few_rows_flops(grid, grid.gemv_flops, rows)), blas_peak))


def attention_timed(grid: CandidateArrays):
    """Where a decode step's attention is priced from `hivekeeper measure`'s timing of it
    (DecodeStreaming.attention_bandwidth: the runtime's one-row steps at a long context less a short one): fp32 caches
    the CPU kernels attend over (micro-batches of up to PACKED_KERNEL_ROWS rows), without recomputation. Elsewhere
    the cache is read at the weights' rate (times the format's kv_read_factor) and its FLOPs join the products'."""
    if measured_attention_rate(grid.machine) is None:
        return np.zeros(len(grid.micro_batch), dtype=bool)
    return (grid.kv_bytes == 4.0) & (grid.micro_batch <= PACKED_KERNEL_ROWS) & ~grid.recompute


def measured_attention_rate(machine: Machine) -> float | None:
    """Bytes/s of KV cache the CPU's decode attention read when `hivekeeper measure` timed it; None: not measured."""
    streaming = machine.acc.decode_streaming if machine.acc.kind == "cpu" else None
    return streaming.attention_bandwidth if streaming is not None and streaming.attention_bandwidth else None


def measured_attention_s(grid: CandidateArrays, context: float):
    """Seconds of a block's decode attention where attention_timed: its K and V bytes at the measured rate, after the
    block's products (the kernels run it between them: it overlaps neither the weights' reads nor their FLOPs).
    Session 25: priced at the weights' 42 GB/s, the built-in model's cache read at ~14.5 in steps of 4-8k tokens,
    and its decode over an 8k-token context was predicted ~1.8x its tokens/s; session 26: as bytes among the
    weights' reads, overlapped with the packed kernels' FLOPs, a 3000-token context was still predicted 1.16x."""
    rate = measured_attention_rate(grid.machine)
    if rate is None:
        return np.zeros(len(grid.micro_batch))
    cache = grid.batch * context * grid.cached_per_token * grid.attention_on_acc
    return np.where(attention_timed(grid), cache / rate, 0.0)


def attention_rate_words(machine: Machine, policy: Policy) -> str:
    """Where measured_attention_s prices the KV cache at the measured attention rate: saying so, else nothing."""
    rate = measured_attention_rate(machine)
    if rate is None or policy.kv_recompute or policy.micro_batch_size > PACKED_KERNEL_ROWS \
            or not (get_format(policy.weight_format).packed or policy.weight_format == "fp32"):
        return ""
    return f", the KV cache at {_rate(rate)} (the decode attention's measured rate)"


def decode_accelerator(grid: CandidateArrays, context: float, attention_flops) -> AcceleratorWork:
    """A decode step's block work on the accelerator (decode_work), its reads and the packed kernels' compute
    overlapped; on a CPU whose steps were measured, FLOPs counted only where they outlast the reads."""
    kernel_rows, work = decode_work(grid, context, attention_flops)
    if kernel_rows.any():
        work = overlap(work, kernel_rows)
    if steps_measured(grid.machine):
        # the measured steps ran the products too: their FLOPs count only where they outlast the reads. A
        # micro-batch of more rows than the kernels take runs block by block on BLAS, as a prefill does, and is
        # priced as one (reads_in_passes)
        within = grid.micro_batch <= PACKED_KERNEL_ROWS
        work = reads_in_passes(grid, AcceleratorWork(
            work.bytes_min, work.flops, work.memory_s,
            np.where(within, np.maximum(0.0, work.compute_s - work.memory_s), work.compute_s), work.bound_s), ~within)
    return replace(work, memory_s=work.memory_s + measured_attention_s(grid, context))


PACKED_KERNEL_ROWS = 8  # rows the decode kernels take at once (native_kernels.MAX_ROWS); more: packed_prefill_rate
PACKED_PREFILL_ROWS = 512  # rows one pass over a packed weight serves in a prefill (native_kernels.QUANT_MAX_ROWS)


def few_rows_flops(grid: CandidateArrays, one_row_flops, rows):
    """A packed kernel's FLOP/s in a step of `rows` rows (at most PACKED_KERNEL_ROWS) from its one-row rate: rows x
    that rate / kernel_row_factor (a step of r rows takes that many one-row steps of kernel time)."""
    rows = np.asarray(rows, dtype=float)
    return one_row_flops * np.maximum(rows, 1.0) / kernel_row_factor(grid, rows)


def kernel_row_factor(grid: CandidateArrays, rows):
    """A packed kernel step of `rows` rows over a one-row one: where measured (FormatTraits.row_steps), linear
    between 1 at one row and the measured ratios at PACKED_ROW_COUNTS rows; else `rows` (each row a one-row step's
    kernel time, as before session 22). Issue 23 (session 22): the built-in Q4_1 model's 4-row steps took ~1.7
    one-row steps (measured 400-440 tokens/s against 214 predicted), its 8-row ones ~4."""
    rows = np.clip(np.broadcast_to(np.asarray(rows, dtype=float), grid.row_steps.shape[:1]), 1.0,
                   float(PACKED_ROW_COUNTS[-1]))
    xs = (1.0, *map(float, PACKED_ROW_COUNTS))
    ys = np.column_stack((np.ones(len(rows)), grid.row_steps))
    factor = np.ones(len(rows))
    for k in range(1, len(xs)):  # the segment a row count falls in overwrites the ones before it
        slope = (ys[:, k] - ys[:, k - 1]) / (xs[k] - xs[k - 1])
        factor = np.where(rows >= xs[k - 1], ys[:, k - 1] + (rows - xs[k - 1]) * slope, factor)
    return np.where(np.all(grid.row_steps > 0, axis=1), factor, rows)


def kernel_peak(grid: CandidateArrays, flops):
    """A packed kernel's FLOP/s as accelerator_work takes it: the rate is the kernels' own (measured or the default
    of what they reach), so the matmul efficiency, which discounts spec peaks, must not discount it again."""
    return flops / grid.acc_eff.matmul_fraction


def overlap(work: AcceleratorWork, where) -> AcceleratorWork:
    """Where `where` holds, reads and compute overlap: the slower of the two is the whole time, and is reported
    under its own name (the other 0), so the bottleneck names what a step waits for."""
    compute_bound = where & (work.compute_s > work.memory_s)
    memory_s = np.where(compute_bound, 0.0, work.memory_s)
    compute_s = np.where(where & ~compute_bound, 0.0, work.compute_s)
    return AcceleratorWork(work.bytes_min, work.flops, memory_s, compute_s, work.bound_s)


def steps_measured(machine: Machine) -> bool:
    """Whether the accelerator is a CPU whose decode rate was measured through whole decode steps (`hivekeeper
    measure`: hardware.DecodeStreaming.block_overhead_s). Those steps multiply as they read, so a decode step's
    time there is max(reads, FLOPs) rather than their sum (issue 23: the sum put SmolLM2 ~30% slow)."""
    streaming = machine.acc.decode_streaming if machine.acc.kind == "cpu" else None
    return streaming is not None and streaming.block_overhead_s is not None


def reads_in_passes(grid: CandidateArrays, work: AcceleratorWork, many_rows) -> AcceleratorWork:
    """A pass of many rows through BLAS (a prefill; `many_rows`: where a decode micro-batch is one) with its weight
    reads counted only beyond its FLOPs, for fp32 candidates on a CPU whose fp32 FLOP rate `hivekeeper measure` fitted
    to the runtime's own prefill passes (FLOPs / rate + blocks x cost; DecodeStreaming.prefill_block_overhead_s is
    measured with it): those passes read their weights as they multiplied, so the rate holds the reads. Issue 23,
    session 15: added to the FLOPs, they were counted twice: the calibration bench's prefills were predicted
    1.24-1.29x slow, the wide model's batch-64 step 1.59x (its reads 39 of 157 ms). Packed formats keep their reads
    (their prefill rate was timed on cached spans), as do 16-bit ones (no such evidence)."""
    streaming = grid.machine.acc.decode_streaming if grid.machine.acc.kind == "cpu" else None
    if streaming is None or streaming.prefill_block_overhead_s is None:
        return work
    where = many_rows & (grid.stored_bytes == 4.0) & ~grid.overlapped
    return AcceleratorWork(work.bytes_min, work.flops,
                           np.where(where, np.maximum(0.0, work.memory_s - work.compute_s), work.memory_s),
                           work.compute_s, work.bound_s)


def pass_rate(grid: CandidateArrays, rows):
    """FLOP/s of a pass of `rows` rows a product through BLAS (a prefill, or a decode micro-batch beyond the
    kernels' rows), per candidate: for fp32 on a CPU whose prefill rate `hivekeeper measure` timed at several row counts
    (DecodeStreaming.prefill_rates), that rate at the model's width, peak x rows / (rows + half_rows); else the
    format's one rate (grid.peak_flops). Issue 23, session 16: at the one rate of 96-row passes the wide model's
    32-row prefills were predicted 0.68x their time, its 384-512-row ones 1.22-1.26x."""
    streaming = grid.machine.acc.decode_streaming if grid.machine.acc.kind == "cpu" else None
    if streaming is None or not streaming.prefill_rates:
        return grid.peak_flops
    peak, half_rows = prefill_rate_at(streaming.prefill_rates, grid.numbers.hidden)
    rows = np.maximum(rows, 1.0)
    return np.where((grid.stored_bytes == 4.0) & ~grid.overlapped, rate_at_rows(peak, half_rows, rows),
                    grid.peak_flops)


def prefill_rate_at(rates: tuple[PrefillRate, ...], hidden: int) -> tuple[float, float]:
    """(peak FLOP/s, half-rate rows) of the measured prefill rates (PrefillRate, any order) at a model's width:
    interpolated between the measured widths on a log scale of width, the nearest one's beyond them (at_width)."""
    ordered = sorted(rates, key=lambda r: r.hidden)
    widths = [r.hidden for r in ordered]
    return (at_width(hidden, widths, [r.peak_flops for r in ordered]),
            at_width(hidden, widths, [r.half_rows for r in ordered]))


def decode_cpu_attention(grid: CandidateArrays, context: float, attention_flops) -> Resource:
    """Attention over the off-accelerator cache on the CPU, for the candidates that ask for it (FlexGen): the cache
    read from RAM (a CPU without half math copies it to fp32 first) and the attention FLOPs."""
    cpu, host_eff = grid.machine.cpu, grid.host_eff
    traffic = 1.0 if cpu_native_half(cpu) else HALF_COPY_TRAFFIC_ON_CPU
    nbytes = np.where(grid.cpu_attention, grid.batch * context * grid.kv_token * grid.cache_off_acc, 0.0)
    flops = np.where(grid.cpu_attention, attention_flops * grid.cache_off_acc, 0.0)
    seconds = nbytes * traffic / (cpu.memory_bandwidth * host_eff.bandwidth_fraction) \
        + flops / (cpu.peak_flops("fp32") * host_eff.matmul_fraction)
    return Resource(nbytes, seconds, nbytes / cpu.memory_bandwidth)


def cache_streamed(grid: CandidateArrays, context: float):
    """Bytes of the off-accelerator cache streamed to the accelerator per decode step and block (none where its
    attention runs on the CPU)."""
    return np.where(grid.cpu_attention, 0.0, grid.batch * context * grid.cached_per_token * grid.cache_off_acc)


def decode_link(grid: CandidateArrays, context: float) -> Resource:
    """In: the streamed weights and cache, activations kept on the host, CPU attention's outputs; out: the new
    K, V of the off-accelerator cache, activations, CPU attention's queries."""
    if not grid.machine.has_host_tier:
        return idle(grid)
    activations = grid.activations_on_host * grid.batch * grid.numbers.hidden * grid.kv_bytes
    attention = np.where(grid.cpu_attention, grid.batch * grid.numbers.q_dim * grid.kv_bytes * grid.cache_off_acc,
                         0.0)
    to_acc = (1.0 - grid.weights_on_acc) * grid.block_bytes + cache_streamed(grid, context) + activations \
        + attention
    to_host = grid.batch * grid.kv_token * grid.cache_off_acc + activations + attention
    return link_transfer(grid, np.maximum(to_acc, to_host))


def decode_disk(grid: CandidateArrays, context: float) -> Resource:
    """Reads of the weights and cache kept on disk; writes of the new K, V."""
    machine = grid.machine
    read = grid.weights_on_disk * grid.block_bytes + grid.cache_on_disk * grid.batch * context * grid.cached_per_token
    write = grid.cache_on_disk * grid.batch * grid.kv_token
    bound = read / machine.disk_read + write / machine.disk_write
    return Resource(read, bound / grid.host_eff.disk_fraction, bound)


def lm_head(grid: CandidateArrays) -> AcceleratorWork:
    """The LM head runs on the last position of each sequence, in decode and prefill alike: `batch` rows (a packed
    head on its kernels, reads and compute overlapped, up to PACKED_KERNEL_ROWS rows)."""
    nbytes = grid.numbers.head_params * grid.head_bytes
    flops = grid.batch * 2.0 * grid.numbers.head_params
    kernel_rows = grid.overlapped & (grid.batch <= PACKED_KERNEL_ROWS)
    many_rows = grid.batch > PACKED_KERNEL_ROWS
    reads = nbytes * format_reads(grid, grid.batch) * np.where(kernel_rows, 1.0 - grid.cached_share, 1.0)
    blas_peak = np.where(many_rows, pass_rate(grid, grid.batch), grid.peak_flops)
    work = accelerator_work(grid, reads, nbytes, flops,
                            np.where(kernel_rows, kernel_peak(grid, few_rows_flops(grid, grid.head_flops, grid.batch)),
                                     blas_peak))
    work = overlap(work, kernel_rows) if kernel_rows.any() else work
    if not steps_measured(grid.machine):
        return work
    # an fp32 head of up to PACKED_KERNEL_ROWS rows runs on the decode kernels (cpu_decode.head_step), which multiply
    # as they read, as the measured steps' blocks do: its FLOPs count only where they outlast its reads (issue 23:
    # added, they put 2-4 ms on a thin model's one-row step, as much again at 4 rows, more at a busy measurement's
    # rate). Beyond them it is one BLAS pass of `batch` rows, priced as the blocks' passes are: at the rate of its rows, its
    # reads inside it (reads_in_passes; session 17: at the 96-row rate with its reads added, a batch-64 step's head
    # put SmolLM2's step ~5% and the wide demo's ~4% slow)
    kernel_head = (grid.head_bytes == 4.0) & (grid.batch <= PACKED_KERNEL_ROWS)
    return reads_in_passes(grid, AcceleratorWork(
        work.bytes_min, work.flops, work.memory_s,
        np.where(kernel_head, np.maximum(0.0, work.compute_s - work.memory_s), work.compute_s), work.bound_s),
        many_rows)


# ---- prefill of p tokens per sequence, per block ------------------------------------------------------------------
def prefill_block(grid: CandidateArrays, prompt_len: float) -> BlockPass:
    """One block's share of the prefill of `prompt_len` tokens per sequence (no CPU attention: the new cache is
    computed on the accelerator)."""
    return block_pass(grid, prefill_accelerator(grid, prompt_len),
                      grid.micro_batches * grid.acc_eff.prefill_layer_overhead_s * grid.prefill_overhead, idle(grid),
                      prefill_link(grid, prompt_len), prefill_disk(grid, prompt_len))


def prefill_accelerator(grid: CandidateArrays, prompt_len: float) -> AcceleratorWork:
    """The weights the prompt's rows touch and every new K, V (or hidden state), written to accelerator memory
    first wherever it is kept; matmul FLOPs and causal attention (token i attends to i positions)."""
    numbers, p = grid.numbers, prompt_len
    rows = grid.micro_batch * p
    touched = touched_matrices(numbers, rows)
    vectors = numbers.vector_params * grid.vector_bytes
    new_cache = grid.batch * p * grid.cached_per_token
    nbytes = grid.micro_batches * (touched * np.where(rows <= 1, grid.gemv_bytes, grid.gemm_bytes)
                                   * format_reads(grid, rows) + vectors) + new_cache
    bytes_min = grid.micro_batches * (touched * grid.stored_bytes + vectors) + new_cache
    flops = grid.batch * p * numbers.flops_per_token + 4.0 * numbers.q_dim * p * (p + 1.0) / 2.0 * grid.batch
    # a packed pass of no more rows than the decode kernels take runs at their rate, reads and products overlapped,
    # as a decode step of that many rows does (session 21: the built-in model's 8-token prefills, priced at the
    # 96-row prefill rate, were predicted 1.9x too fast)
    kernel_rows = grid.overlapped & (rows <= PACKED_KERNEL_ROWS)
    # (not few_rows_flops: a prompt runs block by block, not in the decode kernels' one call for the span, and its
    # 8 rows took ~6 one-row steps, where a decode step of 8 rows took ~4; session 22)
    peak = np.where(kernel_rows, kernel_peak(grid, grid.gemv_flops), pass_rate(grid, rows))
    work = accelerator_work(grid, nbytes, bytes_min, flops, peak)
    if np.any(kernel_rows):
        work = overlap(work, kernel_rows)
    return reads_in_passes(grid, work, True)


def prefill_link(grid: CandidateArrays, prompt_len: float) -> Resource:
    """In: the streamed weights and activations kept on the host; out: the new off-accelerator cache and
    activations."""
    if not grid.machine.has_host_tier:
        return idle(grid)
    p = prompt_len
    activations = grid.activations_on_host * grid.batch * p * grid.numbers.hidden * grid.kv_bytes
    to_acc = (1.0 - grid.weights_on_acc) * grid.block_bytes + activations
    to_host = grid.cache_off_acc * grid.batch * p * grid.cached_per_token + activations
    return link_transfer(grid, np.maximum(to_acc, to_host))


def prefill_disk(grid: CandidateArrays, prompt_len: float) -> Resource:
    """Reads of the weights kept on disk; writes of the new cache kept there."""
    machine = grid.machine
    read = grid.weights_on_disk * grid.block_bytes
    write = grid.cache_on_disk * grid.batch * prompt_len * grid.cached_per_token
    bound = read / machine.disk_read + write / machine.disk_write
    return Resource(read, bound / grid.host_eff.disk_fraction, bound)


# ---- the whole pass and what is reported --------------------------------------------------------------------------
def whole_pass(grid: CandidateArrays, block: BlockPass, head: AcceleratorWork) -> tuple[np.ndarray, np.ndarray]:
    """Every block, the LM head and the per-step overhead: (seconds, never under the bound; the bound)."""
    layers = grid.numbers.layers
    bound = layers * block.bound_s + head.bound_s
    return np.maximum(layers * block.time_s + head.seconds + grid.acc_eff.step_overhead_s, bound), bound


def speeds(grid: CandidateArrays, workload: Workload, step: tuple, prefill: tuple) -> dict[str, np.ndarray]:
    """Seconds and tokens/s of a decode step, the prefill and the whole run, each beside its bound."""
    (step_s, step_roof), (prefill_s, prefill_roof) = step, prefill
    batch, p = grid.batch, float(workload.prompt_len)
    runtime = prefill_s + (workload.output_len - 1) * step_s
    return {
        "step_s": step_s, "step_roof_s": step_roof, "prefill_s": prefill_s, "prefill_roof_s": prefill_roof,
        "runtime_s": runtime,
        "decode_tps": np.minimum(batch / step_s, batch / step_roof),
        "roof_decode_tps": batch / step_roof,
        "prefill_tps": np.minimum(batch * p / prefill_s, batch * p / prefill_roof),
        "roof_prefill_tps": batch * p / prefill_roof,
        "throughput_tps": batch * workload.output_len / runtime,
    }


def step_components(grid: CandidateArrays, context: float, block: BlockPass,
                    head: AcceleratorWork) -> dict[str, np.ndarray]:
    """One decode step by resource (seconds, for the bottleneck), and the bytes and FLOPs behind them."""
    layers, acc = grid.numbers.layers, block.accelerator
    return {
        "accelerator compute": layers * acc.compute_s + head.compute_s,
        "accelerator memory": layers * acc.memory_s + head.memory_s,
        "weight_reads": weight_reads(grid, grid.micro_batch),  # reads of each weight per decode step and micro-batch
        "host link": layers * block.link.seconds, "disk": layers * block.disk.seconds,
        "cpu attention": layers * block.cpu.seconds,
        "overhead": layers * block.overhead_s + grid.acc_eff.step_overhead_s,
        "chain_s": layers * block.chain_s,
        "link_bytes_step": layers * block.link.nbytes, "disk_bytes_step": layers * block.disk.nbytes,
        "acc_bytes_step": layers * acc.bytes_min, "cpu_cache_bytes_step": layers * block.cpu.nbytes,
        "acc_flops_step": layers * acc.flops,
        # of those FLOPs' products: the blocks' weights (each multiplied by every row of a micro-batch), and
        # attention over the KV cache on the accelerator (growing with the context); the LM head's are apart
        # (packed_kernel_detail)
        "block_weights_step": layers * touched_matrices(grid.numbers, grid.micro_batch),
        "attention_products_step": layers * decode_attention_flops(grid, context) * grid.attention_on_acc / 2.0,
        "streamed_weight_bytes_step": layers * (1.0 - grid.weights_on_acc) * grid.block_bytes,
        "cache_streamed_step": layers * cache_streamed(grid, context),
    }


def decode_step_terms(model: ModelSpec, hardware: HardwareSpec, policy: Policy, workload: Workload,
                      efficiency: MachineEfficiency | None = None) -> dict[str, float]:
    """One policy's predicted decode step term by term (seconds, and the bytes behind the reads), in the order the
    step adds them: the blocks' reads (weights, norms and KV cache at the accelerator's rate), their FLOPs beyond
    the reads, their fixed costs, the LM head's reads and FLOPs, the per-step overhead; "step_s" is `evaluate`'s
    step (issue 23: a miss on one shape of model names its term)."""
    eff = efficiency or default_efficiency(hardware)
    machine = machine_view(hardware)
    grid = candidate_arrays(model_numbers(model), machine, eff, [format_traits(machine, policy.weight_format)],
                            policy_columns(machine, policy))
    block, head = decode_block(grid, workload.decode_context), lm_head(grid)
    layers, acc = grid.numbers.layers, block.accelerator
    terms = {"blocks_reads_s": layers * acc.memory_s, "blocks_compute_s": layers * acc.compute_s,
             "blocks_fixed_s": layers * block.overhead_s, "cpu_attention_s": layers * block.cpu.seconds,
             "head_reads_s": head.memory_s, "head_compute_s": head.compute_s,
             "step_overhead_s": np.asarray(grid.acc_eff.step_overhead_s),
             "step_s": whole_pass(grid, block, head)[0],
             "read_rate_bytes_per_s": machine.acc_bandwidth * grid.acc_eff.bandwidth_fraction,
             "blocks_bytes_min": layers * acc.bytes_min, "head_bytes": grid.numbers.head_params * grid.head_bytes}
    return {name: float(np.asarray(value).ravel()[0]) for name, value in terms.items()}


def pass_terms(grid: CandidateArrays, block: BlockPass, head: AcceleratorWork) -> dict[str, float]:
    """One pass (a prefill, or a decode step) term by term, in seconds: the blocks' reads, FLOPs and fixed costs
    (their chain), CPU attention, the disk and host-link transfers, the blocks' time with the transfers overlapped as
    the prefetch depth allows ("blocks_s"), the LM head's reads and FLOPs, the per-step overhead, and the pass
    ("pass_s", as `evaluate` adds them)."""
    layers, acc = grid.numbers.layers, block.accelerator
    terms = {"blocks_reads_s": layers * acc.memory_s, "blocks_compute_s": layers * acc.compute_s,
             "blocks_fixed_s": layers * block.overhead_s, "cpu_attention_s": layers * block.cpu.seconds,
             "disk_s": layers * block.disk.seconds, "host_link_s": layers * block.link.seconds,
             "blocks_s": layers * block.time_s, "head_reads_s": head.memory_s, "head_compute_s": head.compute_s,
             "step_overhead_s": np.asarray(grid.acc_eff.step_overhead_s), "pass_s": whole_pass(grid, block, head)[0]}
    return {name: float(np.asarray(value).ravel()[0]) for name, value in terms.items()}


def run_terms(model: ModelSpec, hardware: HardwareSpec, policy: Policy, workload: Workload,
              efficiency: MachineEfficiency | None = None) -> dict:
    """One policy's predicted run term by term: the prefill's and one decode step's pass_terms, the decode steps
    after the first token, and the run's seconds (issue 22: a batch plan's prediction written out beside what the
    engine's run measured, bench/offload_throughput.py)."""
    eff = efficiency or default_efficiency(hardware)
    machine = machine_view(hardware)
    grid = candidate_arrays(model_numbers(model), machine, eff, [format_traits(machine, policy.weight_format)],
                            policy_columns(machine, policy))
    head = lm_head(grid)
    prefill = pass_terms(grid, prefill_block(grid, float(workload.prompt_len)), head)
    step = pass_terms(grid, decode_block(grid, workload.decode_context), head)
    steps = workload.output_len - 1
    return {"prefill": prefill, "decode_step": step, "decode_steps": steps,
            "runtime_s": prefill["pass_s"] + steps * step["pass_s"]}


def compute_bound_batch(grid: CandidateArrays, context: float) -> dict[str, np.ndarray]:
    """The batch at which streaming the off-accelerator weights takes no longer than computing on them, and what
    sets that streaming time (0: accelerator memory, all weights resident; 1: the host link; 2: the disk)."""
    machine, acc_eff = grid.machine, grid.acc_eff
    link_bw = machine.link_bandwidth or np.inf
    stream_link = np.where(machine.has_host_tier,
                           (1.0 - grid.weights_on_acc) * grid.block_bytes / (link_bw * acc_eff.link_fraction), 0.0)
    stream_disk = grid.weights_on_disk * grid.block_bytes / (machine.disk_read * grid.host_eff.disk_fraction)
    stream = np.where(grid.prefetch >= 2, np.maximum(stream_link, stream_disk), stream_link + stream_disk)
    resident = grid.numbers.matrix_params * grid.stored_bytes / (machine.acc_bandwidth * acc_eff.bandwidth_fraction)
    basis_time = np.where(stream > 0, stream, resident)
    effective_flops = grid.peak_flops * acc_eff.matmul_fraction
    batch = np.ceil(basis_time * effective_flops / grid.numbers.flops_per_token - 1e-9)
    if grid.overlapped.any():  # packed formats: from their kernels' steps (8 more decode passes over the grid)
        batch = np.where(grid.overlapped, kernel_bound_batch(grid, context, stream, batch), batch)
    return {
        "min_compute_bound_batch": batch,
        "min_compute_bound_basis": np.where(stream > 0, np.where(stream_disk > stream_link, 2, 1), 0),
    }


def kernel_bound_batch(grid: CandidateArrays, context: float, stream, beyond):
    """For packed formats on a CPU: the fewest rows (one micro-batch) whose decode kernels' time for a block reaches
    its reads (decode_work's, at the decode `context`), or the weights' `stream` time where they stream; where no step
    within PACKED_KERNEL_ROWS does, the prefill kernels run it: `beyond` (the prefill rate's batch), at least
    PACKED_KERNEL_ROWS + 1. A newcomer (session 22) read "compute-bound from batch 2" beside a why line that said
    the kernels bound batch 1."""
    found = np.zeros(len(grid.micro_batch))
    for rows in range(PACKED_KERNEL_ROWS, 0, -1):  # the smallest count that reaches it is the last written
        one = replace(grid, micro_batch=np.full(len(found), float(rows)), batch=np.full(len(found), float(rows)),
                      micro_batches=np.ones(len(found)))
        _, work = decode_work(one, context, decode_attention_flops(one, context))
        found = np.where(work.compute_s >= np.where(stream > 0, stream, work.memory_s), rows, found)
    return np.where(found > 0, found, np.maximum(beyond, PACKED_KERNEL_ROWS + 1))


# ---- one policy ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """What the cost model says about one policy on one machine."""

    policy: Policy
    decode_tokens_per_s: float  # all sequences together, at the mean decode context
    prefill_tokens_per_s: float
    throughput_tokens_per_s: float  # generated tokens / (prefill + decode time): FlexGen's metric
    roofline_decode_tokens_per_s: float
    roofline_prefill_tokens_per_s: float
    prefill_s: float  # α: prefill of the prompt, first token included
    decode_step_s: float  # β: one more token for every sequence
    runtime_s: float  # α + β (o − 1) for the whole batch
    peak_memory_bytes: dict[str, int]
    capacity_bytes: dict[str, int]
    fits: bool
    bottleneck: str  # the resource, e.g. "host link"
    bottleneck_detail: str  # in words, with numbers
    min_compute_bound_batch: int
    min_compute_bound_basis: str
    step_breakdown_s: dict[str, float]
    efficiency: str
    # evaluate_as_run: where the engine would not compute the policy asked for as named (a 16-bit plan it runs in
    # fp32: as_run), what `policy` became and why, in words; "" where it runs as named
    engine_note: str = ""

    def as_dict(self) -> dict:
        data = asdict(self)
        data["policy"] = self.policy.as_dict()
        return data


def _tier_map(machine: Machine, acc, host, disk) -> dict[str, float]:
    """Accelerator/host/disk numbers under the names users see: gpu, cpu, disk."""
    if machine.acc_tier == "gpu":
        return {"gpu": acc, "cpu": host, "disk": disk}
    return {"gpu": 0.0, "cpu": acc, "disk": disk}


def policy_columns(machine: Machine, policy: Policy, format_index: int = 0) -> dict[str, np.ndarray]:
    """A one-element candidate table for a policy, in accelerator/host/disk terms (validated for this machine)."""
    w, kv, act = policy.weights, policy.kv_cache, policy.activations
    if machine.acc_tier == "cpu" or not machine.has_host_tier:
        acc_name = machine.acc_tier
        other = "cpu" if acc_name == "gpu" else "gpu"
        for what, placement in (("weights", w), ("kv_cache", kv), ("activations", act)):
            if getattr(placement, other) > 1e-9:
                raise InputError(f"policy puts {what} on {other!r}, but this machine's memory is one tier "
                                 f"({acc_name!r}); use {acc_name!r} and 'disk'")
            if policy.attention_on_cpu:
                raise InputError("attention_on_cpu needs a GPU with separate host memory")
        wa, wh = getattr(w, acc_name), 0.0
        ca, ch = getattr(kv, acc_name), 0.0
        ah = 0.0
    else:
        wa, wh, ca, ch, ah = w.gpu, w.cpu, kv.gpu, kv.cpu, act.cpu
    col = lambda v: np.array([float(v)])  # noqa: E731
    return {
        "fmt": np.array([format_index]), "wa": col(wa), "wh": col(wh), "wd": col(w.disk),
        "ca": col(ca), "ch": col(ch), "cd": col(kv.disk), "ah": col(ah),
        "b": col(policy.micro_batch_size), "n": col(policy.num_micro_batches), "rec": col(policy.kv_recompute),
        "d": col(policy.prefetch_depth), "cattn": col(policy.attention_on_cpu),
    }


_BASIS = {0: "accelerator memory", 1: "host link", 2: "disk"}


def prediction_from_arrays(machine: Machine, eff: MachineEfficiency, policy: Policy, mem_peaks, out, i: int,
                           model: ModelSpec) -> Prediction:
    """Build the Prediction of candidate i from the grid's arrays."""
    pick = lambda key: float(out[key][i])  # noqa: E731
    breakdown = {name: pick(name) for name in COMPONENTS}
    resource, detail = describe_bottleneck(machine, model, policy, out, i)
    peaks = _tier_map(machine, *(float(mem_peaks[t][i]) for t in ("acc", "host", "disk")))
    capacity = _tier_map(machine, machine.acc_capacity, machine.host_capacity, machine.disk_capacity)
    fits = all(peaks[t] <= capacity[t] + 1.0 for t in TIERS)
    basis = _BASIS[int(out["min_compute_bound_basis"][i])]
    if machine.acc.kind == "cpu" and basis == "accelerator memory":
        basis = "RAM bandwidth"
    elif basis == "accelerator memory":
        basis = "GPU memory bandwidth"
    return Prediction(
        policy=policy,
        decode_tokens_per_s=pick("decode_tps"), prefill_tokens_per_s=pick("prefill_tps"),
        throughput_tokens_per_s=pick("throughput_tps"),
        roofline_decode_tokens_per_s=pick("roof_decode_tps"), roofline_prefill_tokens_per_s=pick("roof_prefill_tps"),
        prefill_s=pick("prefill_s"), decode_step_s=pick("step_s"), runtime_s=pick("runtime_s"),
        peak_memory_bytes={t: int(round(v)) for t, v in peaks.items()},
        capacity_bytes={t: int(max(0.0, v)) for t, v in capacity.items()},
        fits=fits, bottleneck=resource, bottleneck_detail=detail,
        min_compute_bound_batch=int(max(1, out["min_compute_bound_batch"][i])), min_compute_bound_basis=basis,
        step_breakdown_s=breakdown, efficiency=eff.name,
    )


def evaluate(model: ModelSpec, hardware: HardwareSpec, policy: Policy, workload: Workload | None = None,
             efficiency: MachineEfficiency | None = None,
             reserve_bytes: dict[str, float] | None = None) -> Prediction:
    """Predict speed, memory and the bottleneck of one policy ("move a knob, get a new prediction"; ~1 ms)."""
    workload = workload or Workload()
    eff = efficiency or default_efficiency(hardware)
    machine = machine_view(hardware, reserve_bytes)
    numbers = model_numbers(model)
    traits = [format_traits(machine, policy.weight_format)]
    cols = policy_columns(machine, policy)
    mem = fixed_memory(numbers, machine, eff, workload, traits, cols)
    peaks = peak_memory(mem, cols["wa"], cols["wh"], cols["wd"])
    out = evaluate_arrays(numbers, machine, eff, workload, traits, cols)
    return prediction_from_arrays(machine, eff, policy, peaks, out, 0, model)


def evaluate_as_run(model: ModelSpec, hardware: HardwareSpec, policy: Policy, workload: Workload | None = None,
                    efficiency: MachineEfficiency | None = None,
                    reserve_bytes: dict[str, float] | None = None, planned_rows: int | None = None) -> Prediction:
    """`evaluate` of what the engine would run for `policy` (as_run): a 16-bit policy it computes in fp32 is
    predicted in fp32, saying so first in bottleneck_detail and in engine_note (the Plan page's what-if knobs, and a
    plan of `planned_rows` rows a micro-batch run in `policy`'s fewer; the search offers no such policy). `evaluate`
    itself prices the format as named."""
    ran, note = as_run(machine_view(hardware, reserve_bytes), policy, planned_rows)
    prediction = evaluate(model, hardware, ran, workload, efficiency, reserve_bytes)
    if not note:
        return prediction
    return replace(prediction, engine_note=note, bottleneck_detail=f"{note}. {prediction.bottleneck_detail}")


def as_run(machine: Machine, policy: Policy, planned_rows: int | None = None) -> tuple[Policy, str]:
    """(the policy the engine runs for `policy` on this machine, why it differs in words, else ""): a 16-bit policy
    that runs_as_planned says the engine computes in fp32 (a CPU without native bf16 math, fp16 on a CPU, or a bf16
    plan made for micro-batches of `planned_rows` rows, beyond PACKED_KERNEL_ROWS, run in micro-batches of at most
    those rows where the measured bf16 decode step is not faster; None: the policy is its own plan) is the fp32 one,
    twice the bytes in every tier (issue 22: the Plan page's knobs showed such a plan in bf16; the search drops
    them, policy.evaluate_grid)."""
    traits = [format_traits(machine, policy.weight_format)]
    if runs_as_planned(machine, traits, policy_columns(machine, policy), planned_rows)[0]:
        return policy, ""
    name, rows = policy.weight_format, policy.micro_batch_size
    if name != "bf16" or not cpu_native_bf16(machine.acc):
        why = f"this CPU multiplies no {name} natively"
    else:
        why = (f"its micro-batches multiply {counted(rows, 'row')}, at most the native decode kernels' "
               f"{PACKED_KERNEL_ROWS}, and no bf16 decode step measured on this CPU beat fp32's (the plan was made "
               f"for {planned_rows} rows)")
    return replace(policy, weight_format="fp32"), f"Computed in fp32, as the engine runs this {name} plan: {why}"


def policy_batch_curve(model: ModelSpec, hardware: HardwareSpec, policy: Policy, batch_sizes,
                       workload: Workload | None = None, efficiency: MachineEfficiency | None = None,
                       reserve_bytes: dict[str, float] | None = None) -> list[dict]:
    """One policy at other micro-batch sizes, everything else fixed, in one vectorized pass (for a chart).

    Each point: batch_size (sequences), decode_tokens_per_s, throughput_tokens_per_s, roofline_decode_tokens_per_s,
    fits.
    """
    workload = workload or Workload()
    eff = efficiency or default_efficiency(hardware)
    machine = machine_view(hardware, reserve_bytes)
    numbers = model_numbers(model)
    traits = [format_traits(machine, policy.weight_format)]
    sizes = np.array([int(b) for b in batch_sizes], dtype=float)
    if sizes.size == 0 or sizes.min() < 1:
        raise InputError("batch sizes must be integers >= 1")
    cols = {k: np.repeat(v, sizes.size) for k, v in policy_columns(machine, policy).items()}
    cols["b"] = sizes
    mem = fixed_memory(numbers, machine, eff, workload, traits, cols)
    peaks = peak_memory(mem, cols["wa"], cols["wh"], cols["wd"])
    out = evaluate_arrays(numbers, machine, eff, workload, traits, cols)
    fits = (peaks["acc"] <= machine.acc_capacity + 1) & (peaks["host"] <= machine.host_capacity + 1) \
        & (peaks["disk"] <= machine.disk_capacity + 1)
    return [{"batch_size": int(b * policy.num_micro_batches), "decode_tokens_per_s": float(out["decode_tps"][i]),
             "throughput_tokens_per_s": float(out["throughput_tps"][i]),
             "roofline_decode_tokens_per_s": float(out["roof_decode_tps"][i]), "fits": bool(fits[i])}
            for i, b in enumerate(sizes)]


# ---- the bottleneck in words --------------------------------------------------------------------------------------
def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB"


def _rate(x: float) -> str:
    return f"{x / 1e9:.3g} GB/s"


QUANT_BITS = {"int8": 8, "nf4": 4}


def cpu_dequantizes(machine: Machine, policy: Policy) -> bool:
    """True where the accelerator is a CPU and the weights are bitsandbytes int8/nf4, which it dequantizes on every
    use (CPU_QUANT_SLOWDOWN): that, not reading memory, is then what the matmuls wait for."""
    return machine.acc.kind == "cpu" and policy.weight_format in CPU_QUANT_SLOWDOWN


def dequantization_detail(machine: Machine, policy: Policy, packed_bytes: float) -> str:
    """The sentence for a decode step bound by bitsandbytes' CPU dequantization."""
    fmt = policy.weight_format
    decode_factor = CPU_QUANT_SLOWDOWN[fmt][0]
    return (f"CPU {QUANT_BITS[fmt]}-bit dequantization (bitsandbytes): it dequantizes the {fmt} weights in unfused "
            f"ops on every use, {decode_factor:g}× the time of reading them as fp32 at {_rate(machine.acc_bandwidth)} "
            f"({_gb(packed_bytes)} of weights and KV cache per decode step); 16-bit weights or a GPU avoid it")


def packed_kernel_detail(machine: Machine, model: ModelSpec, policy: Policy, out, i: int) -> str:
    """The sentence for a decode step bound by the packed formats' CPU kernels rather than by reading RAM. It counts
    the blocks' packed weights the kernels unpack in a step (the same whatever the prompt, so `plan` and `generate`
    say the same number for a model) apart from the products of attention over the KV cache (which grow with the
    context) and from the LM head's weights (on their own kernel)."""
    fmt = policy.weight_format
    rate, measured = packed_kernel_rate(machine.acc, fmt)
    weights, attention = (float(out[key][i]) for key in ("block_weights_step", "attention_products_step"))
    nbytes = float(out["acc_bytes_step"][i])
    source = "measured" if measured else "default estimate; `hivekeeper measure` times it"
    return (f"CPU {bits_of(fmt)}-bit kernel compute: per decode step the {fmt} kernels unpack the blocks' "
            f"{_count(weights)} packed weights and multiply them by {rows_words(machine, policy)} (the LM head's "
            f"{_count(model_numbers(model).head_params)} weights on their own {PACKED_HEAD_FORMAT} kernel), and "
            f"attention over the KV cache adds "
            f"{_count(attention)} products (more as the context grows), at {rate / 1e9:.3g} G weights/s "
            f"({source}); reading the weights and KV cache ({_gb(nbytes)}) from RAM at "
            f"{_rate(machine.acc_bandwidth)} would take only {nbytes / machine.acc_bandwidth * 1e3:.3g} ms")


def _count(x: float) -> str:
    """A count of weights or products for people: "106 M", "6.48 G"."""
    return f"{x / 1e9:.3g} G" if x >= 1e9 else f"{x / 1e6:.3g} M"


def rows_words(machine: Machine, policy: Policy) -> str:
    """The rows a decode step multiplies the weights by: "1 row", "4 rows", "2 micro-batches of 4 rows"; on a CPU
    with K/V kept the engine runs the micro-batches as one step (decode_parts): "8 rows (the plan's 2 micro-batches of
    4, run as one step)" (a newcomer, session 22, read "2 micro-batches of 4 rows" as two passes)."""
    plural = lambda n: f"{n} row{'s' if n > 1 else ''}"  # noqa: E731
    if policy.num_micro_batches == 1:
        return plural(policy.micro_batch_size)
    if machine.acc.kind == "cpu" and not policy.kv_recompute:
        return (f"{plural(policy.batch_size)} (the plan's {policy.num_micro_batches} micro-batches of "
                f"{policy.micro_batch_size}, run as one step)")
    return f"{policy.num_micro_batches} micro-batches of {plural(policy.micro_batch_size)}"


def half_step_words(machine: Machine, policy: Policy, memory_s: float) -> str:
    """The clause for a bf16 step of up to PACKED_KERNEL_ROWS rows on a CPU with native bf16 math: it runs through
    torch and is charged half_step_ratio fp32 steps over the same weights, more than its bytes at the RAM rate say,
    with the time that makes (`memory_s`: the step's reads as priced; a newcomer, session 22, multiplied the factor
    by the bf16 bytes' time and got half of it); else ""."""
    if machine.acc.kind != "cpu" or policy.weight_format != "bf16" or not cpu_native_bf16(machine.acc) \
            or policy.micro_batch_size > PACKED_KERNEL_ROWS:
        return ""
    measured = machine.acc.half_decode_ratio
    why = "as measured" if measured else "the slowest seen; not measured here: `hivekeeper measure` times it"
    return (f"; its bf16 step runs through torch, charged {half_step_ratio(machine.acc):.3g}x the fp32 kernels' step "
            f"over the same weights (read as fp32, twice these bytes): {memory_s:.3g} s a step ({why})")


def describe_bottleneck(machine: Machine, model: ModelSpec, policy: Policy, out, i: int) -> tuple[str, str]:
    """The resource that sets the decode step time, and a sentence with its numbers."""
    value = lambda key: float(out[key][i])  # noqa: E731
    chain, link, disk = value("chain_s"), value("host link"), value("disk")
    depth = policy.prefetch_depth
    if depth >= 1 and max(link, disk) > chain:
        resource = "host link" if link >= disk else "disk"
    else:
        inside = {name: value(name) for name in ("accelerator compute", "accelerator memory", "cpu attention",
                                                 "overhead")}
        if depth == 0:
            inside.update({"host link": link, "disk": disk})
        resource = max(inside, key=inside.get)
    acc_name = "GPU" if machine.acc_tier == "gpu" else "CPU"
    mem_name = "GPU memory" if machine.acc_tier == "gpu" else "RAM"
    weights = policy.weights
    if resource == "host link":
        parts = []
        streamed = value("streamed_weight_bytes_step")
        if streamed > 0:
            parts.append(f"{100 * (1 - weights.gpu):.0f}% of the weights ({_gb(streamed)})")
        if value("cache_streamed_step") > 0:
            parts.append(f"the off-GPU KV cache ({_gb(value('cache_streamed_step'))})")
        what = " and ".join(parts) or "activations"
        detail = f"host→GPU link: streaming {what} per decode step at {_rate(machine.link_bandwidth or 0)}"
    elif resource == "disk":
        parts = []
        if weights.disk > 0:
            parts.append(f"{100 * weights.disk:.0f}% of the weights")
        if policy.kv_cache.disk > 0:
            parts.append(f"{100 * policy.kv_cache.disk:.0f}% of the KV cache")
        detail = (f"disk reads: {' and '.join(parts) or 'data'} ({_gb(value('disk_bytes_step'))} per decode step) "
                  f"at {_rate(machine.disk_read)}")
    elif resource in ("accelerator memory", "accelerator compute") and cpu_dequantizes(machine, policy):
        resource, detail = "cpu dequantization", dequantization_detail(machine, policy, value("acc_bytes_step"))
    elif resource == "accelerator memory":
        resource = "gpu memory bandwidth" if machine.acc_tier == "gpu" else "ram bandwidth"
        detail = (f"{mem_name} bandwidth: reading {_gb(value('acc_bytes_step'))} of weights and KV cache per decode "
                  f"step at {_rate(machine.acc_bandwidth)}")
        if value("weight_reads") > 1.0:
            detail += f" (the weights {value('weight_reads'):.3g} times: small-row CPU matmuls re-read them per row)"
        detail += attention_rate_words(machine, policy)
        detail += half_step_words(machine, policy, value("accelerator memory"))
    elif resource == "accelerator compute" and get_format(policy.weight_format).packed \
            and policy.micro_batch_size <= PACKED_KERNEL_ROWS:
        resource, detail = "packed kernel compute", packed_kernel_detail(machine, model, policy, out, i)
    elif resource == "accelerator compute":
        resource = "gpu compute" if machine.acc_tier == "gpu" else "cpu compute"
        flops = value("acc_flops_step")
        detail = (f"{acc_name} compute: {flops / 1e12:.3g} TFLOP per decode step for "
                  f"{policy.batch_size} sequences")
    elif resource == "cpu attention":
        detail = (f"CPU attention over the KV cache in RAM: {_gb(value('cpu_cache_bytes_step'))} per decode step at "
                  f"{_rate(machine.cpu.memory_bandwidth)} RAM bandwidth")
    else:
        what = "kernel launches" if machine.acc_tier == "gpu" else "fixed costs (norms, rotary, calls)"
        detail = (f"fixed overhead: {model.num_layers} blocks × {policy.num_micro_batches} micro-batch(es) of "
                  f"{what} per decode step")
    return resource, detail

