"""Swarm sizing: how many blocks a node serves and how fast, where its span should go, how fast a client's chain is.

Follows the Petals conventions (shared/protocol/petals-wire.md): a server keeps whole blocks on its accelerator plus
a KV cache for `cache_tokens` tokens per block (4096, or 16384 for grouped-query models); inference_rps is tokens/s
of one block for 1-token steps with a cache, forward_rps tokens/s of one block for a 1024-token forward; a server
advertises min(forward_rps / ((blocks + 1) / 2), network_rps). Block choice and rebalancing follow Petals' rule
too (choose_start, should_move): the only implementation, which core/swarm/server/server.py calls.

A GGUF span on a CPU is served packed (its Q8_0/Q4_0/Q4_1 linears kept as the file's block bytes, computed by the
native kernels; core/runtime/checkpoint.load_span): plan_server then sizes it by the file's bytes per block
(PackedSpan, from gguf_metadata.GGUFSizes.packed_block_bytes) and times its 1-token steps at the slower of the
packed reads and the kernels' measured rate (costmodel.packed_traits), as the local planner does.
format_choice.plan_model_server finds the span's format from the file; `hivekeeper serve` and the Swarm page ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .costmodel import (Machine, Workload, cpu_bf16_at, experts_touched, format_traits, machine_view, model_numbers,
                        sixteen_bit_format)
from .efficiency import MachineEfficiency, default_efficiency
from .errors import InputError
from .formats import PACKED_FORMATS, bits_of, get_format
from .hardware import HardwareSpec
from .models import ModelSpec

CACHE_TOKENS_MHA = 4096
CACHE_TOKENS_GQA = 16384
FORWARD_TOKENS = 1024
INFERENCE_CONTEXT = 64  # Petals measures inference_rps over short sessions that start from an empty cache


def default_cache_tokens(model: ModelSpec) -> int:
    """Petals' attn_cache_tokens: 4096, or 16384 for grouped-query models (their cache is smaller per token)."""
    return CACHE_TOKENS_GQA if model.num_kv_heads < model.num_heads else CACHE_TOKENS_MHA


@dataclass(frozen=True)
class BlockSpeed:
    """Speed of one block on this machine's accelerator, with the roofline bound beside each number."""

    inference_rps: float
    forward_rps: float
    roofline_inference_rps: float
    roofline_forward_rps: float
    inference_bound: str  # what dominates a 1-token step: "gpu memory bandwidth", "gpu compute", "overhead", …
    min_compute_bound_batch: int  # batch at which a step's compute time reaches its weight-read time


def block_speed(model: ModelSpec, machine: Machine, eff: MachineEfficiency, weight_format: str,
                context_len: int = INFERENCE_CONTEXT, forward_tokens: int = FORWARD_TOKENS,
                block_bytes: float | None = None) -> BlockSpeed:
    """Tokens/s of one resident block: 1-token steps at a short context, and a long forward. block_bytes: the
    block's bytes as its file stores them (a packed span), read in place of the format's size of its weights."""
    numbers = model_numbers(model)
    traits = format_traits(machine, weight_format)
    ea = eff.accelerator
    bw, peak = machine.acc_bandwidth, traits.peak_flops
    kv_token = 2.0 * numbers.kv_dim * traits.kv_bytes
    vectors = numbers.vector_params * traits.vector_bytes

    def matrices(tokens: int) -> float:
        experts = float(experts_touched(numbers.experts, numbers.experts_per_token, tokens))
        return numbers.shared_matrix_params + experts * numbers.expert_matrix_params

    def weights(tokens: int, per_param: float) -> float:  # bytes of weights a pass of `tokens` tokens moves
        if block_bytes is not None and numbers.experts <= 1:
            return float(block_bytes) + matrices(tokens) * (per_param - traits.stored_bytes)
        return matrices(tokens) * per_param + vectors

    # one token attending to context_len cached positions
    bytes_1 = weights(1, traits.read_bytes_gemv) + context_len * kv_token * traits.kv_read_factor
    bytes_1_min = weights(1, traits.stored_bytes) + context_len * kv_token
    flops_1 = numbers.flops_per_token + 4.0 * numbers.q_dim * context_len
    memory_t = bytes_1 / (bw * ea.bandwidth_fraction)
    compute_t = flops_1 / (peak * ea.matmul_fraction)
    if traits.overlapped:  # packed kernels: their own (measured) rate, reads and compute overlapped
        compute_t = 2.0 * matrices(1) / traits.gemv_flops + 4.0 * numbers.q_dim * context_len / peak
        memory_t, compute_t = (memory_t, 0.0) if memory_t >= compute_t else (0.0, compute_t)
    step = memory_t + compute_t + ea.layer_overhead_s
    roof_step = max(bytes_1_min / bw, flops_1 / peak)
    # a forward of T tokens (causal attention, cache written)
    T = forward_tokens
    bytes_f = weights(T, traits.read_bytes_gemm) + T * kv_token
    bytes_f_min = weights(T, traits.stored_bytes) + T * kv_token
    flops_f = T * numbers.flops_per_token + 4.0 * numbers.q_dim * T * (T + 1) / 2.0
    forward = bytes_f / (bw * ea.bandwidth_fraction) + flops_f / (peak * ea.matmul_fraction) + ea.layer_overhead_s
    roof_forward = max(bytes_f_min / bw, flops_f / peak)
    gpu = machine.acc_tier == "gpu"
    compute_words = f"cpu {bits_of(weight_format)}-bit kernel compute" if traits.overlapped else "cpu compute"
    parts = {"gpu memory bandwidth" if gpu else "ram bandwidth": memory_t,
             "gpu compute" if gpu else compute_words: compute_t, "overhead": ea.layer_overhead_s}
    weight_read_t = matrices(1) * traits.stored_bytes / (bw * ea.bandwidth_fraction)
    ridge = int(np.ceil(weight_read_t * peak * ea.matmul_fraction / numbers.flops_per_token))
    return BlockSpeed(
        inference_rps=min(1.0 / step, 1.0 / roof_step), forward_rps=min(T / forward, T / roof_forward),
        roofline_inference_rps=1.0 / roof_step, roofline_forward_rps=T / roof_forward,
        inference_bound=max(parts, key=parts.get), min_compute_bound_batch=max(1, ridge),
    )


@dataclass(frozen=True)
class ServerPlan:
    """A node serving a span of blocks: what fits, how fast, what it advertises."""

    weight_format: str
    num_blocks: int  # blocks that fit (at most the model's)
    total_blocks: int  # the model's blocks
    cache_tokens: int  # KV cache reserved per block, in tokens
    block_bytes: int
    cache_bytes_per_block: int
    workspace_bytes: int  # activations of a FORWARD_TOKENS forward plus the framework's own memory
    peak_memory_bytes: int  # on the accelerator
    capacity_bytes: int
    inference_rps: float  # per block
    forward_rps: float  # per block
    roofline_inference_rps: float
    roofline_forward_rps: float
    network_rps: float | None
    throughput: float  # what the server advertises for its span (Petals' formula)
    inference_bound: str
    min_compute_bound_batch: int  # sequences per step at which a block's weight reads stop dominating
    tier: str  # where the blocks live: "gpu", or "cpu" on a CPU-only machine
    efficiency: str

    @property
    def packed(self) -> bool:
        """Whether the span is served packed (a GGUF's Q8_0/Q4_0/Q4_1 blocks on the CPU's kernels)."""
        return self.weight_format in PACKED_FORMATS

    def span_words(self) -> str:
        """'30 blocks, q4_1 packed' (or '12 blocks, fp32'): what `hivekeeper serve` and the Swarm page say."""
        return f"{self.num_blocks} blocks, {self.weight_format}{' packed' if self.packed else ''}"


@dataclass(frozen=True)
class PackedSpan:
    """A GGUF span a CPU server keeps packed: the file's Q8_0/Q4_0/Q4_1 format and its largest block's bytes as the
    server holds them (gguf_metadata.GGUFSizes.packed_block_bytes: packed tensors as stored, the rest fp32)."""

    weight_format: str
    block_bytes: int

    def __post_init__(self) -> None:
        if self.weight_format not in PACKED_FORMATS or self.block_bytes <= 0:
            raise InputError(f"a packed span needs one of {', '.join(PACKED_FORMATS)} and bytes > 0, got "
                             f"{self.weight_format!r} and {self.block_bytes}")


def choose_server_format(model: ModelSpec, machine: Machine, quant: str, cache_tokens: int,
                         eff: MachineEfficiency) -> str:
    """The weight format a server uses: 16 bits where every block fits, else nf4 (Petals' choice for GPUs).

    A CPU server stays unquantized (bitsandbytes' CPU kernels are slower than dense matmuls): bf16 where a few-row
    step computes in bf16 there (costmodel.bf16_by_rows: native bf16 math and a measured bf16 step faster), else
    fp32.
    """
    quant = quant.lower()
    if quant in ("int8", "nf4"):
        return quant
    if machine.acc.kind == "cpu":
        return "bf16" if cpu_bf16_at(machine.acc, 1) else "fp32"  # a server's steps: a few rows
    sixteen = sixteen_bit_format(model, machine)
    if quant == "none":
        return sixteen
    if quant != "auto":
        raise InputError(f"unknown quantization {quant!r}; choose auto, none, int8 or nf4")
    if _blocks_that_fit(model, machine, sixteen, cache_tokens, eff)[0] >= model.num_layers:
        return sixteen
    return "nf4"


def _blocks_that_fit(model: ModelSpec, machine: Machine, weight_format: str, cache_tokens: int,
                     eff: MachineEfficiency, block_bytes: float | None = None) -> tuple[int, float, float, float]:
    """(blocks that fit, one block's bytes, its KV cache's, the workspace); block_bytes: a block's bytes as the
    file gives them (a packed span), else the format's size of the model's parameters."""
    numbers = model_numbers(model)
    traits = format_traits(machine, weight_format)
    fmt = get_format(weight_format)
    block = (numbers.shared_matrix_params + numbers.experts * numbers.expert_matrix_params) * fmt.bytes_per_param \
        + numbers.vector_params * traits.vector_bytes if block_bytes is None else float(block_bytes)
    cache = cache_tokens * 2.0 * numbers.kv_dim * traits.kv_bytes
    workspace = FORWARD_TOKENS * numbers.workspace_values_per_token * traits.kv_bytes + eff.accelerator.runtime_bytes
    usable = machine.acc_capacity - workspace
    count = int(max(0.0, usable) // (block + cache))
    return min(count, model.num_layers), block, cache, workspace


def plan_server(model: ModelSpec, hardware: HardwareSpec, quant: str = "auto", cache_tokens: int | None = None,
                reserve_bytes: dict[str, float] | None = None, efficiency: MachineEfficiency | None = None,
                using_relay: bool = False, packed: PackedSpan | None = None) -> ServerPlan:
    """Size a server for this machine: format, blocks, per-block rps, advertised throughput. packed: the span is a
    GGUF's, kept packed (a CPU only): its format and bytes per block replace the chosen format's."""
    eff = efficiency or default_efficiency(hardware)
    machine = machine_view(hardware, reserve_bytes)
    cache_tokens = default_cache_tokens(model) if cache_tokens is None else int(cache_tokens)
    if not 1 <= cache_tokens <= 10_000_000:
        raise InputError(f"cache tokens must be in 1..10000000, got {cache_tokens}")
    if packed is not None and machine.acc.kind != "cpu":
        raise InputError(f"a {packed.weight_format} packed span is served on a CPU only (a GPU dequantizes a GGUF)")
    weight_format = packed.weight_format if packed else choose_server_format(model, machine, quant, cache_tokens, eff)
    count, block, cache, workspace = _blocks_that_fit(model, machine, weight_format, cache_tokens, eff,
                                                      packed.block_bytes if packed else None)
    speed = block_speed(model, machine, eff, weight_format, block_bytes=packed.block_bytes if packed else None)
    network = hardware.network
    network_rps = min(network.upload_bps, network.download_bps) / (16.0 * model.hidden_size) \
        if network and network.upload_bps and network.download_bps else None
    throughput = span_throughput(speed.forward_rps, max(count, 1), network_rps, using_relay) if count else 0.0
    return ServerPlan(
        weight_format=weight_format, num_blocks=count, total_blocks=model.num_layers, cache_tokens=cache_tokens,
        block_bytes=int(block),
        cache_bytes_per_block=int(cache), workspace_bytes=int(workspace),
        peak_memory_bytes=int(workspace + count * (block + cache)), capacity_bytes=int(max(0.0, machine.acc_capacity)),
        inference_rps=speed.inference_rps, forward_rps=speed.forward_rps,
        roofline_inference_rps=speed.roofline_inference_rps, roofline_forward_rps=speed.roofline_forward_rps,
        network_rps=network_rps, throughput=throughput, inference_bound=speed.inference_bound,
        min_compute_bound_batch=speed.min_compute_bound_batch, tier=machine.acc_tier, efficiency=eff.name,
    )


def span_throughput(forward_rps: float, num_blocks: int, network_rps: float | None, using_relay: bool = False) -> float:
    """Petals' advertised throughput: min(forward_rps / ((blocks + 1) / 2), network_rps × (0.2 if relayed))."""
    compute = forward_rps / ((num_blocks + 1) / 2.0)
    if network_rps is None:
        return compute
    return min(compute, network_rps * (0.2 if using_relay else 1.0))


# ---- where a span should go (Petals' rule; core/swarm/server/server.py runs it on live DHT records) ---------------------
BALANCE_QUALITY = 0.75  # Petals' default: move only when the weakest block gains more than a third
_ROUND_DECIMALS = 6  # keeps float noise from add/subtract cycles out of window comparisons


@dataclass(frozen=True)
class ServerSpan:
    """A server's span [start, end) and the throughput it adds to each block of it."""

    start: int
    end: int
    throughput: float

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise InputError(f"span [{self.start}, {self.end}) is empty or negative")
        if self.throughput < 0:
            raise InputError(f"span throughput must be >= 0, got {self.throughput}")


def block_throughputs(total_blocks: int, spans: Sequence[ServerSpan]) -> np.ndarray:
    """T[i]: the summed throughput of the servers covering block i."""
    per_block = np.zeros(total_blocks)
    for span in spans:
        if span.end > total_blocks:
            raise InputError(f"span [{span.start}, {span.end}) is past the model's {total_blocks} blocks")
        per_block[span.start:span.end] += span.throughput
    return per_block


def choose_start(throughputs: Sequence[float], num_blocks: int) -> int:
    """Start of the window of `num_blocks` blocks whose sorted throughputs are lexicographically smallest (it
    strengthens the weakest blocks first); ties go to the lowest start. `throughputs` is T per block."""
    per_block = np.round(np.asarray(throughputs, dtype=float), _ROUND_DECIMALS)
    total = len(per_block)
    if not 1 <= num_blocks <= total:
        raise InputError(f"cannot place {num_blocks} blocks in a model of {total}")
    windows = np.sort(np.lib.stride_tricks.sliding_window_view(per_block, num_blocks), axis=1)  # (starts, num_blocks)
    return min(range(len(windows)), key=lambda start: (tuple(windows[start]), start))


def choose_span(total_blocks: int, spans: Sequence[ServerSpan], num_blocks: int) -> int:
    """Where a new server with room for `num_blocks` blocks starts, given the servers already there."""
    return choose_start(block_throughputs(total_blocks, spans), num_blocks)


def _best_start(per_block: np.ndarray, span: ServerSpan) -> int:
    without = per_block.copy()
    without[span.start:span.end] -= span.throughput
    return choose_start(without, span.end - span.start)


def _move(per_block: np.ndarray, span: ServerSpan, start: int) -> ServerSpan:
    """Move `span` to `start`, updating `per_block` in place."""
    length = span.end - span.start
    per_block[span.start:span.end] -= span.throughput
    per_block[start:start + length] += span.throughput
    return ServerSpan(start, start + length, span.throughput)


def should_move(total_blocks: int, spans: Sequence[ServerSpan], index: int, balance_quality: float = BALANCE_QUALITY,
                max_rounds: int = 10) -> int | None:
    """The start server `index` should move to, or None to stay.

    Simulates this server taking its best window given everyone else, then every server re-choosing greedily in
    turn (until no one moves, or `max_rounds`), and moves only when min T before / min T after < `balance_quality`.
    Re-placing the others matters: a move can pay off only once someone else follows it.
    """
    spans = list(spans)
    if not 0 <= index < len(spans):
        raise InputError(f"server index {index} is not among the {len(spans)} servers")
    per_block = block_throughputs(total_blocks, spans)
    before = per_block.min()
    my_start = _best_start(per_block, spans[index])
    if my_start == spans[index].start:
        return None
    spans[index] = _move(per_block, spans[index], my_start)
    for _ in range(max_rounds):
        changed = False
        for i, span in enumerate(spans):
            start = _best_start(per_block, span)
            if start != span.start:
                spans[i] = _move(per_block, span, start)
                changed = True
        if not changed:
            break
    after = per_block.min()
    if after <= 0:
        return None  # moving cannot close every gap: stay and let newcomers fill it
    return my_start if before / after < balance_quality else None


# ---- a client's chain of servers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hop:
    """One server of a client's chain: its blocks, per-block speeds, RTT from the previous hop, link speed."""

    num_blocks: int
    inference_rps: float
    forward_rps: float
    rtt_s: float
    bandwidth_bps: float  # the slower of the two ends' links, bit/s

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.inference_rps <= 0 or self.forward_rps <= 0 or self.rtt_s < 0 \
                or self.bandwidth_bps <= 0:
            raise InputError(f"bad hop {self}: blocks >= 1, rps > 0, rtt >= 0 and bandwidth > 0 are required")


@dataclass(frozen=True)
class SessionSpeed:
    inference_steps_per_s: float  # 1-token steps of one session through the whole chain
    forward_tokens_per_s: float  # tokens/s of a long forward through the chain
    step_s: float
    slowest_hop: int  # index of the hop that takes longest per step


def session_speed(hops: Sequence[Hop], hidden_size: int, batch: int = 1, forward_tokens: int = FORWARD_TOKENS,
                  bytes_per_value: float = 2.0) -> SessionSpeed:
    """Predicted speed of a client session: each hop costs its RTT, its blocks' compute, and sending the hidden
    states both ways (the client relays them from hop to hop)."""
    if not hops:
        raise InputError("a chain needs at least one server")
    bits_per_token = 2.0 * hidden_size * bytes_per_value * 8.0  # there and back
    step_parts = [h.rtt_s + batch * h.num_blocks / h.inference_rps + batch * bits_per_token / h.bandwidth_bps
                  for h in hops]
    forward = sum(h.rtt_s + forward_tokens * h.num_blocks / h.forward_rps
                  + forward_tokens * bits_per_token / h.bandwidth_bps for h in hops)
    step = sum(step_parts)
    return SessionSpeed(1.0 / step, forward_tokens / forward, step, int(np.argmax(step_parts)))


# ---- the client side of a swarm run --------------------------------------------------------------------------------
def client_bytes(model: ModelSpec, workload: Workload, eff: MachineEfficiency) -> float:
    """Memory a swarm client needs locally: embeddings and LM head in 16 bits, one prompt's activations, the
    framework. Blocks run on the servers."""
    numbers = model_numbers(model)
    return numbers.outside_params * 2.0 + workload.prompt_len * numbers.hidden * 2.0 * 4 \
        + numbers.vocab * 4.0 + eff.accelerator.runtime_bytes


def client_fits(model: ModelSpec, machine: Machine, workload: Workload, eff: MachineEfficiency) -> bool:
    """Whether this machine can run the client side (on its accelerator or in RAM)."""
    need = client_bytes(model, workload, eff)
    return need <= max(machine.acc_capacity, machine.host_capacity)
