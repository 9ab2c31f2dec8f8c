"""Cost-model rules that the costmodel scope's mutation run (docs/testing.md) found untested, each stated with its
expectation worked out here by hand from round numbers, not read back from the planner:

- the weight placement's closed form: weights that fill the accelerator exactly go whole on it, the fractions are
  floored to 1e-4 (so that the peak stays within capacity), all of a block may be streamed when exactly its buffers
  fit, and a tier may be over its capacity by the 1-byte rounding slack, not more;
- the host link carries the busier of its two directions: the new K, V and CPU attention's outputs when they go out
  more than comes in;
- attention on the CPU reads the off-accelerator cache once on a CPU with native 16-bit math (no fp32 copy), and
  costs nothing where attention runs on the GPU;
- a prefill over a slow link takes the busier direction too (the streamed weights in, or the new cache out), and its
  tokens per second are the prompt tokens over its seconds;
- the bottleneck's sentence quotes the bytes and FLOPs of a decode step: the weights and cache streamed over the
  link, the cache CPU attention reads, the GPU's FLOPs.

Session 12, the survivors in the functions issues 22 and 23 changed:
- a CPU whose decode steps were measured whole takes each block's step as the longer of its reads and FLOPs;
- the host's runtime memory counts on a unified-memory GPU, not on a CPU-only machine;
- a GPU prefill of two or more rows reads int8 weights as dequantized 16-bit copies, and a short prompt's roofline is
  its least bytes (weights once as stored, norms, the new cache) at the spec bandwidth;
- a packed head on up to 8 rows overlaps its reads with its kernels and reads from RAM only what the cache misses.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hivekeeper.planner.costmodel import (PACKED_KERNEL_ROWS, Placement, Policy, Workload, candidate_arrays, evaluate,
                                          format_traits, lm_head, machine_view, model_numbers, policy_columns,
                                          solve_weight_placement)
from hivekeeper.planner.efficiency import Efficiency, MachineEfficiency
from hivekeeper.planner.hardware import ComputeDevice, DecodeStreaming, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.models import ModelSpec

# a 7B-shaped model (MHA: K and V as wide as the hidden state) with a bf16 checkpoint
MODEL = ModelSpec(name="seven-b", family="llama", num_layers=32, hidden_size=4096, intermediate_size=11008,
                  num_heads=32, num_kv_heads=32, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                  max_position_embeddings=4096)
LINK_BPS, CPU_BPS = 16e9, 40e9
EFF = MachineEfficiency(
    Efficiency("gpu", matmul_fraction=0.5, bandwidth_fraction=0.8, link_fraction=0.5, disk_fraction=1.0,
               layer_overhead_s=0.0, step_overhead_s=0.0, runtime_bytes=10**9),
    Efficiency("cpu", matmul_fraction=0.25, bandwidth_fraction=0.5, link_fraction=1.0, disk_fraction=1.0,
               layer_overhead_s=0.0, step_overhead_s=0.0, runtime_bytes=10**9),
)


def gpu_machine(cpu_flops: dict[str, float], link_bps: float = LINK_BPS, tflops: float = 100) -> HardwareSpec:
    """A 40 GB GPU (100 GB/s, 100 TFLOP/s), 16 GB/s link, 200 GB of RAM at 40 GB/s, a CPU computing `cpu_flops`."""
    gpu = ComputeDevice(kind="gpu", name="GPU", memory_bytes=40 * 10**9, memory_bandwidth=100e9,
                        flops={"fp16": tflops * 1e12, "bf16": tflops * 1e12, "fp32": 10e12}, power_watts=300.0,
                        host_link_bandwidth=link_bps)
    cpu = ComputeDevice(kind="cpu", name="CPU", memory_bytes=200 * 10**9, memory_bandwidth=CPU_BPS,
                        flops=cpu_flops, power_watts=100.0)
    disk = DiskSpec(capacity_bytes=2000 * 10**9, read_bandwidth=1e9, write_bandwidth=1e9)
    return HardwareSpec(id="mutants", gpus=(gpu,), cpu=cpu, disk=disk,
                        network=NetworkSpec(upload_bps=1e9, download_bps=1e9, rtt_s=0.01))


# ---- the weight placement's closed form ---------------------------------------------------------------------------
# 10 blocks of 100 MB; prefetch depth 1 (2 streaming buffers of a block's streamed part on the accelerator, 1 staging
# buffer of its disk part in RAM). Capacities: 1 GB accelerator, 1 GB RAM, 2 GB disk. Per candidate (one column
# each) only the fixed memory of each tier differs.
W_BLK, W_ALL, ACC_C, HOST_C, DISK_C = 1e8, 1e9, 1e9, 1e9, 2e9


def placement_of(acc_fixed: list[float], host_fixed: list[float], disk_fixed: list[float]):
    mem = {"acc": np.array(acc_fixed), "host": np.array(host_fixed), "disk": np.array(disk_fixed)}
    ones = np.ones(len(acc_fixed))
    mem.update(w_all=W_ALL * ones, w_blk=W_BLK * ones, acc_buffers=2.0 * ones, host_staging=1.0 * ones)
    view = dataclasses.replace(machine_view(gpu_machine({"fp32": 1e12})), acc_capacity=ACC_C, host_capacity=HOST_C,
                               disk_capacity=DISK_C)
    return solve_weight_placement(mem, view)


def test_weights_that_fill_the_accelerator_exactly_go_whole_on_it():
    """Room for exactly the 1 GB of weights: all of them on the accelerator, no streaming buffer, nothing elsewhere."""
    wa, wh, wd, ok = placement_of([ACC_C - W_ALL], [0.0], [0.0])
    assert (wa[0], wh[0], wd[0], bool(ok[0])) == (1.0, 0.0, 0.0, True)


def test_fractions_are_floored_to_1e_4_so_that_the_peak_fits():
    """Accelerator: wa·W + 2·(1-wa)·W_blk + fixed = wa·800 MB + 200 MB + fixed. With 400.064 MB free after the
    buffers the exact fraction is 0.50008: floored to 0.5 (0.5001 would need 400.08 MB). RAM: the other half, wh·W +
    (0.5-wh)·W_blk + fixed = wh·900 MB + 50 MB + fixed; with 270.081 MB left after the staging buffer the exact
    fraction is 0.30009, floored to 0.3; the disk holds the last 0.2."""
    wa, wh, wd, ok = placement_of([ACC_C - 2e8 - 0.50008 * 8e8], [HOST_C - 5e7 - 0.30009 * 9e8], [0.0])
    assert wa[0] == 0.5 and wh[0] == 0.3 and wd[0] == pytest.approx(0.2, abs=1e-12) and ok[0]


def test_all_of_a_block_streamed_fits_when_exactly_its_buffers_do():
    """200 MB free on the accelerator: exactly the two buffers of a whole streamed block; every weight sits in RAM."""
    wa, wh, wd, ok = placement_of([ACC_C - 2 * W_BLK], [0.0], [0.0])
    assert (wa[0], wh[0], wd[0], bool(ok[0])) == (0.0, 1.0, 0.0, True)


def test_a_tier_may_exceed_its_capacity_by_the_one_byte_rounding_slack_not_more():
    """Nothing fits on the accelerator but the buffers (wa = 0); the RAM holds no weight but the staging buffer of
    the disk's block (100 MB), so its peak is its fixed memory + 100 MB; the disk's is its fixed memory + 1 GB.
    Exactly at capacity, 1 byte over (the slack for float rounding), and 1.5 bytes over."""
    acc = [ACC_C - 2 * W_BLK] * 6
    host = [HOST_C - W_BLK, HOST_C - W_BLK + 1.0, HOST_C - W_BLK + 1.5] + [HOST_C - W_BLK] * 3
    disk = [0.0] * 3 + [DISK_C - W_ALL, DISK_C - W_ALL + 1.0, DISK_C - W_ALL + 1.5]
    # the RAM's fixed memory leaves less than the weights: wh = 0 then
    wa, wh, wd, ok = placement_of(acc, host, disk)
    assert (wa == 0.0).all() and (wh == 0.0).all() and (wd == 1.0).all()
    assert ok.tolist() == [True, True, False, True, True, False]


# ---- the host link's two directions; attention on the CPU ---------------------------------------------------------
KV_TOKEN = 2 * 4096 * 2  # one token of one block's K and V in bf16


def spread(**changes) -> Policy:
    """All weights on the GPU, the KV cache in RAM with attention over it on the CPU, activations in RAM; 4
    sequences of 100 + 20 tokens (mean decode context 110)."""
    policy = Policy("bf16", weights=Placement(1.0, 0.0, 0.0), kv_cache=Placement(0.0, 1.0, 0.0),
                    activations=Placement(0.0, 1.0, 0.0), micro_batch_size=4, attention_on_cpu=True)
    return dataclasses.replace(policy, **changes)


def test_the_link_carries_the_busier_direction_the_new_cache_going_out():
    """No weight streams in: per block the link brings in the activations (4 × 4096 bf16 values) and CPU
    attention's queries (as many), and takes out the new K, V of every sequence (4 × 16 KB) besides the activations
    and the attention's outputs. The outgoing direction is the busier one."""
    pred = evaluate(MODEL, gpu_machine({"fp32": 1e12}), spread(), Workload(prompt_len=100, output_len=20), EFF)
    activations = queries = 4 * 4096 * 2
    out = 4 * KV_TOKEN + activations + queries
    assert pred.step_breakdown_s["host link"] == pytest.approx(32 * out / (LINK_BPS * 0.5), rel=1e-9)


@pytest.mark.parametrize("cpu_flops, traffic", [({"fp32": 1e12, "bf16": 2e12}, 1.0), ({"fp32": 1e12}, 5.0)])
def test_cpu_attention_reads_the_cache_once_where_the_cpu_has_native_16_bit_math(cpu_flops, traffic):
    """The CPU reads the 4 × 110 cached tokens of each block and computes 4 × q_dim × context FLOPs per token at its
    fp32 rate; without native bf16 it first copies the cache to fp32 (5 bytes of traffic per 2 stored), with it
    (bf16 at or above its fp32 rate) it reads the cache as it is."""
    pred = evaluate(MODEL, gpu_machine(cpu_flops), spread(), Workload(prompt_len=100, output_len=20), EFF)
    context = 100 + 20 / 2
    nbytes, flops = 4 * context * KV_TOKEN, 4 * 4096 * context * 4
    seconds = nbytes * traffic / (CPU_BPS * 0.5) + flops / (1e12 * 0.25)
    assert pred.step_breakdown_s["cpu attention"] == pytest.approx(32 * seconds, rel=1e-9)


def test_attention_on_the_gpu_costs_the_cpu_nothing_and_streams_the_cache_in():
    """The same cache in RAM with attention on the GPU: the CPU does nothing, and the link brings in each block's
    cache (4 × 110 tokens) and the activations; out go the new K, V and the activations."""
    policy = spread(attention_on_cpu=False)
    pred = evaluate(MODEL, gpu_machine({"fp32": 1e12}), policy, Workload(prompt_len=100, output_len=20), EFF)
    assert pred.step_breakdown_s["cpu attention"] == 0.0
    link_in = 4 * 110 * KV_TOKEN + 4 * 4096 * 2
    assert pred.step_breakdown_s["host link"] == pytest.approx(32 * link_in / (LINK_BPS * 0.5), rel=1e-9)


# ---- the prefill over the link; the bottleneck's numbers -----------------------------------------------------------
MATRICES = 4 * 4096 * 4096 + 3 * 4096 * 11008  # one block's matrix parameters: q, k, v, o, gate, up, down
BLOCK = MATRICES * 2 + 2 * 4096 * 2  # bf16 matrices and two norms
HEAD_BYTES, HEAD_FLOPS = 32000 * 4096 * 2, 2 * 32000 * 4096  # the untied LM head, per sequence


@pytest.mark.parametrize("prompt, busier", [(100, "in"), (4000, "out")])
def test_a_prefill_over_a_slow_link_takes_its_busier_direction(prompt, busier):
    """Half the weights in RAM, the KV cache and the activations too, over a 1 GB/s link (used at half of it), depth
    2. Per block the link brings in half the block and the activations (4 sequences × prompt × 4096 bf16 values),
    and takes out the new cache (4 × prompt × 16 KB) and the activations: a short prompt is bound by what comes in,
    a long one by what goes out. The link outlasts the GPU's work, so each block takes the link's time; the head
    runs on the last position of each sequence."""
    policy = Policy("bf16", weights=Placement(0.5, 0.5, 0.0), kv_cache=Placement(0.0, 1.0, 0.0),
                    activations=Placement(0.0, 1.0, 0.0), micro_batch_size=4, prefetch_depth=2)
    pred = evaluate(MODEL, gpu_machine({"fp32": 1e12}, link_bps=1e9), policy, Workload(prompt, 20), EFF)
    activations = 4 * prompt * 4096 * 2
    link_in, link_out = 0.5 * BLOCK + activations, 4 * prompt * KV_TOKEN + activations
    assert (link_in > link_out) == (busier == "in")
    head = HEAD_BYTES / (100e9 * 0.8) + 4 * HEAD_FLOPS / (100e12 * 0.5)
    assert pred.prefill_s == pytest.approx(32 * max(link_in, link_out) / 0.5e9 + head, rel=1e-9)
    assert pred.prefill_tokens_per_s == pytest.approx(4 * prompt / pred.prefill_s, rel=1e-9)


def test_a_link_bound_step_names_the_weights_and_cache_it_streams():
    """Half the weights and half the cache in RAM, attention on the GPU, depth 2: per step the link streams 32 half
    blocks and half of each block's cache (4 × 110 tokens)."""
    policy = Policy("bf16", weights=Placement(0.5, 0.5, 0.0), kv_cache=Placement(0.5, 0.5, 0.0), micro_batch_size=4,
                    prefetch_depth=2)
    pred = evaluate(MODEL, gpu_machine({"fp32": 1e12}), policy, Workload(100, 20), EFF)
    weights, cache = 32 * 0.5 * BLOCK, 32 * 0.5 * 4 * 110 * KV_TOKEN
    assert pred.bottleneck == "host link"
    assert pred.bottleneck_detail == (f"host→GPU link: streaming 50% of the weights ({weights / 1e9:.3g} GB) and the "
                                      f"off-GPU KV cache ({cache / 1e9:.3g} GB) per decode step at 16 GB/s")


def test_a_cpu_attention_bound_step_quotes_the_cache_it_reads():
    """16 sequences of 2000 + 20 tokens with their cache in RAM and attention on the CPU: per step the CPU reads
    32 blocks × 16 × 2010 tokens × 16 KB, more slowly (fp32 copies) than the GPU reads its weights."""
    policy = spread(micro_batch_size=16)
    pred = evaluate(MODEL, gpu_machine({"fp32": 1e12}), policy, Workload(2000, 20), EFF)
    assert pred.bottleneck == "cpu attention"
    read = 32 * 16 * 2010 * KV_TOKEN
    assert pred.bottleneck_detail == (f"CPU attention over the KV cache in RAM: {read / 1e9:.3g} GB per decode step "
                                      f"at 40 GB/s RAM bandwidth")


def test_a_compute_bound_step_quotes_its_flops():
    """128 sequences on a 10 TFLOP/s GPU: per block 2 FLOPs per matrix weight and sequence, and attention's 4 ×
    4096 × context per sequence (context 11: prompts of 10, 2 tokens out)."""
    policy = Policy("bf16", micro_batch_size=128)
    pred = evaluate(MODEL, gpu_machine({"fp32": 1e12}, tflops=10), policy, Workload(10, 2), EFF)
    flops = 32 * 128 * (2 * MATRICES + 4 * 4096 * 11)
    assert pred.bottleneck == "gpu compute"
    assert pred.bottleneck_detail == f"GPU compute: {flops / 1e12:.3g} TFLOP per decode step for 128 sequences"


# ---- session 12: the survivors in the functions issues 22 and 23 changed --------------------------------------------
CPU_EFF = Efficiency("cpu", matmul_fraction=0.25, bandwidth_fraction=0.5, link_fraction=1.0, disk_fraction=1.0,
                     layer_overhead_s=0.0, step_overhead_s=0.0, prefill_layer_overhead_s=0.0, runtime_bytes=10**9)
FP32_KV_TOKEN = 2 * 4096 * 4  # one token of one block's K and V in fp32
ON_CPU = dict(weights=Placement(0.0, 1.0, 0.0), kv_cache=Placement(0.0, 1.0, 0.0),
              activations=Placement(0.0, 1.0, 0.0))


def cpu_machine(streaming=None, **cpu_fields) -> HardwareSpec:
    """A CPU-only machine: 200 GB of RAM at 40 GB/s, 1 TFLOP/s fp32 (no native 16-bit math), a 1 GB/s disk."""
    fields = dict(kind="cpu", name="CPU", memory_bytes=200 * 10**9, memory_bandwidth=CPU_BPS, flops={"fp32": 1e12},
                  power_watts=100.0, cores=8, decode_streaming=streaming)
    cpu = ComputeDevice(**{**fields, **cpu_fields})
    return HardwareSpec(id="mutants-cpu", gpus=(), cpu=cpu, disk=DiskSpec(2000 * 10**9, 1e9, 1e9),
                        network=NetworkSpec(upload_bps=1e9, download_bps=1e9, rtt_s=0.01))


def fp32_block_decode(batch: int, context: float) -> tuple[float, float]:
    """(memory, compute) seconds of one fp32 block's decode step on cpu_machine with CPU_EFF: every matrix and norm
    weight read once (4 bytes), the batch's cache (context tokens of K and V each), at half the RAM bandwidth; 2
    FLOPs per matrix weight and sequence plus attention's 4 × q_dim × context per sequence, at a quarter of 1 TFLOP/s."""
    nbytes = MATRICES * 4 + 2 * 4096 * 4 + batch * context * FP32_KV_TOKEN
    flops = batch * (2 * MATRICES + 4 * 4096 * context)
    return nbytes / (CPU_BPS * 0.5), flops / (1e12 * 0.25)


@pytest.mark.parametrize("batch", [1, 64])
def test_measured_cpu_steps_take_the_longer_of_reads_and_flops_not_their_sum(batch):
    """A CPU whose decode rate came from whole measured decode steps (`block_overhead_s` set) overlaps each block's
    reads and FLOPs: its step is max(reads, FLOPs) a block, the FLOPs reported only where they outlast the reads (0
    at batch 1, memory-bound), up to the kernels' 8 rows; at batch 64 the step runs block by block on BLAS as a
    prefill does and its reads and FLOPs add up (issue 23), as they do where the steps were not measured. The fp32 head
    (batch rows of the 32000 × 4096 untied head) overlaps too where it runs on the decode kernels (up to 8 rows,
    issue 23: cpu_decode.head_step), and adds its FLOPs at 64 rows (BLAS) and where the steps were not measured."""
    memory, compute = fp32_block_decode(batch, 110.0)
    head_memory, head_compute = 32000 * 4096 * 4 / (CPU_BPS * 0.5), batch * HEAD_FLOPS / (1e12 * 0.25)
    head_beyond = max(0.0, head_compute - head_memory) if batch <= 8 else head_compute
    assert (memory > compute) == (batch == 1) and (head_memory > head_compute) == (batch == 1)
    measured = DecodeStreaming(bandwidth_fraction=0.5, small_row_reads=1.0, matmul_start_s=0.0, block_overhead_s=1e-4)
    cpu_eff = MachineEfficiency(CPU_EFF, CPU_EFF)
    policy = Policy("fp32", micro_batch_size=batch, **ON_CPU)
    steps = evaluate(MODEL, cpu_machine(measured), policy, Workload(prompt_len=100, output_len=20), cpu_eff)
    assert steps.step_breakdown_s["accelerator memory"] == pytest.approx(32 * memory + head_memory, rel=1e-9)
    assert steps.step_breakdown_s["accelerator compute"] == pytest.approx(
        32 * (max(0.0, compute - memory) if batch <= 8 else compute) + head_beyond, rel=1e-9)
    blocks = 32 * (max(memory, compute) if batch <= 8 else memory + compute)
    assert steps.decode_step_s == pytest.approx(blocks + head_memory + head_beyond, rel=1e-9)
    summed = evaluate(MODEL, cpu_machine(), policy, Workload(prompt_len=100, output_len=20), cpu_eff)
    assert summed.decode_step_s == pytest.approx(32 * (memory + compute) + head_memory + head_compute, rel=1e-9)


def test_only_unified_memory_adds_the_hosts_runtime_to_the_accelerator():
    """The host's framework memory (Efficiency.runtime_bytes of the host) counts on a unified-memory GPU, whose memory
    is the process's own, but not on a CPU-only machine, where the CPU is the accelerator and its runtime is counted
    once, as the accelerator's. Raising the host's runtime by 4 GB raises the unified GPU's peak by 4 GB, the CPU's
    by nothing."""
    apple = ComputeDevice(kind="gpu", name="Unified GPU", memory_bytes=64 * 10**9, memory_bandwidth=400e9,
                          flops={"fp16": 20e12, "fp32": 10e12}, power_watts=60.0, unified_memory=True)
    unified = dataclasses.replace(cpu_machine(), gpus=(apple,))
    gpu_policy = Policy("bf16")
    for hardware, policy, tier, grown in ((unified, gpu_policy, "gpu", 4 * 10**9),
                                          (cpu_machine(), Policy("fp32", **ON_CPU), "cpu", 0)):
        peaks = [evaluate(MODEL, hardware, policy, Workload(100, 20),
                          MachineEfficiency(EFF.accelerator, dataclasses.replace(EFF.host, runtime_bytes=runtime)))
                 .peak_memory_bytes[tier] for runtime in (10**9, 5 * 10**9)]
        assert peaks[1] - peaks[0] == grown


INT8_STORED = 1.0025  # bytes per int8 weight at rest (its scales included)


@pytest.mark.parametrize("micro_batch, prompt", [(1, 1), (1, 2), (4, 100)])
def test_a_resident_gpu_prefill_reads_int8_weights_as_dequantized_copies_from_two_rows_on(micro_batch, prompt):
    """int8 weights on the GPU: one row (a 1-token prompt) is a fused kernel reading each stored weight once; from two
    rows on bitsandbytes dequantizes each matrix to 16 bits first (write and read back: 4 bytes more a weight). Each
    block also reads its two bf16 norms and writes the new K, V of every prompt token (16 KB each). FLOPs: 2 a matrix
    weight per token, and causal attention's 4 × q_dim × (1 + ... + p) per sequence, at half the fp16 peak; the
    untied bf16 head runs on the last position of each sequence. Nothing streams, so the prefill is the blocks'
    reads, FLOPs and fixed cost (EFF's default 0.3 ms a block) one after the other, and the head. Its roofline (spec rates, each weight read once as stored)
    is the larger of the same bytes and FLOPs at full rate: the reads, for so short a prompt."""
    batch, rows = micro_batch, micro_batch * prompt
    per_weight = INT8_STORED if rows == 1 else INT8_STORED + 4.0
    new_cache = batch * prompt * KV_TOKEN
    block_bytes = MATRICES * per_weight + 2 * 4096 * 2 + new_cache
    block_flops = batch * prompt * 2 * MATRICES + 4 * 4096 * prompt * (prompt + 1) / 2 * batch
    head_bytes, head_flops = 32000 * 4096 * 2, batch * HEAD_FLOPS
    policy = Policy("int8", micro_batch_size=micro_batch)
    pred = evaluate(MODEL, gpu_machine({"fp32": 1e12}), policy, Workload(prompt, 20), EFF)
    blocks = 32 * (block_bytes / (100e9 * 0.8) + block_flops / (100e12 * 0.5) + 0.3e-3)
    head = head_bytes / (100e9 * 0.8) + head_flops / (100e12 * 0.5)
    assert pred.prefill_s == pytest.approx(blocks + head, rel=1e-9)
    if rows <= 2:
        least_bytes = 32 * (MATRICES * INT8_STORED + 2 * 4096 * 2 + new_cache) + head_bytes
        assert 32 * block_flops / 100e12 < least_bytes / 100e9
        assert pred.roofline_prefill_tokens_per_s == pytest.approx(batch * prompt / (least_bytes / 100e9), rel=1e-9)


STREAMED_WPS, CACHED_WPS, PREFILL_PRODUCTS = 40e9, 120e9, 50e9  # the packed kernels: weights/s, row-weight products/s


@pytest.mark.parametrize("batch", [1, 8, 9])
def test_a_packed_head_overlaps_reads_and_kernels_up_to_eight_rows_and_reads_from_the_cache_what_fits(batch):
    """A q4_0 model's head is Q8_0 (1.0625 bytes a weight). Up to 8 rows (the decode kernels' PACKED_KERNEL_ROWS) it
    runs on the decode kernels: its reads and kernel time overlap (the longer one is reported, the other 0), the part
    of the step's weights that sits in the last-level cache is not read from RAM, and the kernels run at the blend of
    their streamed and in-cache rates by that share. With a cache of 2/3 of the step's weights (blocks in q4_0 with
    fp32 norms, and the head) the share is (2 × cache - weights) / cache, about half: 1 row waits for the RAM, 8 rows
    for the kernels. 9 rows take the prefill's int8 kernels (2 FLOPs a row-weight product, at a quarter of their
    rate: CPU_EFF's matmul fraction) after reading the whole head from RAM, one after the other."""
    hardware = cpu_machine(packed_kernels={"q4_0": STREAMED_WPS, "q8_0": STREAMED_WPS},
                           packed_kernels_cached={"q4_0": CACHED_WPS, "q8_0": CACHED_WPS},
                           packed_prefill={"q4_0": PREFILL_PRODUCTS, "q8_0": PREFILL_PRODUCTS})
    head_params = 32000 * 4096
    weights = 32 * (MATRICES * 0.5625 + 2 * 4096 * 4) + head_params * 1.0625
    cache = int(weights * 2 / 3)
    hardware = dataclasses.replace(hardware, cpu=dataclasses.replace(hardware.cpu, cache_bytes=cache))
    share = (2 * cache - weights) / cache
    machine = machine_view(hardware)
    columns = policy_columns(machine, Policy("q4_0", micro_batch_size=batch, **ON_CPU))
    grid = candidate_arrays(model_numbers(MODEL), machine, MachineEfficiency(CPU_EFF, CPU_EFF),
                            [format_traits(machine, "q4_0")], columns)
    head = lm_head(grid)
    ram_s = head_params * 1.0625 / (CPU_BPS * 0.5)
    if batch <= 8:
        kernels_s = batch * 2 * head_params / (1 / (share / (2 * CACHED_WPS) + (1 - share) / (2 * STREAMED_WPS)))
        reads_s = ram_s * (1 - share)
        expected = (reads_s, 0.0) if reads_s > kernels_s else (0.0, kernels_s)
        assert (reads_s > kernels_s) == (batch == 1)
    else:
        expected = (ram_s, batch * 2 * head_params / (2 * PREFILL_PRODUCTS * 0.25))
    assert (head.memory_s[0], head.compute_s[0]) == pytest.approx(expected, rel=1e-9)


# ---- session 12: issue 22's CPU step activations and issue 23's decode overhead beyond the kernels' rows ----------
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_a_cpu_plans_ram_holds_one_parts_step_values_the_other_parts_hidden_states_and_the_logits(fmt):
    """Everything in RAM on a CPU-only machine: 2 micro-batches of 4 sequences, prompts of 300 and 20 tokens out.
    A prefill part holds whole micro-batches up to 1024 token rows: one micro-batch (1200 rows) here, so one part of
    4 sequences is inside a block while the other 4 wait as hidden states. Inside a block a token holds, in the
    format's activation size (fp32: 4 bytes, else 2), its input, residual, normed input and output (4 × 4096), q
    (4096), k and v (2 × 4096) and the MLP's gate, up and product (3 × 11008). Then fp32 logits of every sequence,
    three copies. A 16-bit plan also holds, for the largest matrix (the fused q, k, v: 3 × 4096 × 4096 weights), an
    fp32 scratch and a 16-bit copy (6 bytes a weight). Besides: the weights, the embeddings and head (2 × 32000 ×
    4096 + 4096), the KV cache of 8 × 320 tokens, and the CPU's 1 GB runtime. Counted to the byte."""
    act = 4 if fmt == "fp32" else 2
    weights = 32 * (MATRICES * act + 2 * 4096 * act) + (2 * 32000 * 4096 + 4096) * act
    cache = 8 * 320 * 32 * 2 * 4096 * act
    inside = 4 * 300 * (4 * 4096 + 4096 + 2 * 4096 + 3 * 11008) * act
    waiting = 4 * 300 * 4096 * act
    logits = 3 * 8 * 32000 * 4
    transient = 0 if fmt == "fp32" else 3 * 4096 * 4096 * 6
    policy = Policy(fmt, micro_batch_size=4, num_micro_batches=2, **ON_CPU)
    pred = evaluate(MODEL, cpu_machine(), policy, Workload(300, 20), MachineEfficiency(CPU_EFF, CPU_EFF))
    assert pred.peak_memory_bytes["cpu"] == weights + cache + inside + waiting + logits + transient + 10**9


def test_a_token_routed_to_two_experts_holds_both_experts_mlp_values_in_a_cpu_step():
    """A mixture of 8 experts, 2 a token: inside a block each token holds the gate, up and product of both its experts
    (3 × 512 values each). One expert a token instead: 3 × 512 fp32 values less per token of the part in the block
    (the whole batch here: 2 sequences of 100 tokens); nothing else in RAM changes."""
    moe = ModelSpec(name="moe", family="mixtral", num_layers=2, hidden_size=1024, intermediate_size=512, num_heads=8,
                    num_kv_heads=2, head_dim=128, vocab_size=1000, tie_word_embeddings=False,
                    max_position_embeddings=4096, num_experts=8, experts_per_token=2)
    policy = Policy("fp32", micro_batch_size=2, **ON_CPU)
    ram = [evaluate(model, cpu_machine(), policy, Workload(100, 10), MachineEfficiency(CPU_EFF, CPU_EFF))
           .peak_memory_bytes["cpu"] for model in (moe, dataclasses.replace(moe, experts_per_token=1))]
    assert ram[0] - ram[1] == 2 * 100 * 3 * 512 * 4


@pytest.mark.parametrize("kind, fmt, micro_batch, parts, per_block", [
    ("cpu", "fp32", 8, 1, 1e-3), ("cpu", "fp32", 4, 2, 1e-3), ("cpu", "fp32", 8, 2, 5e-3), ("cpu", "q4_0", 8, 2, 0.0),
    ("gpu", "bf16", 16, 2, 2e-3)])
def test_a_cpu_decode_of_more_rows_than_the_kernels_take_pays_the_prefills_block_cost(kind, fmt, micro_batch, parts,
                                                                                      per_block):
    """A decode step's fixed cost is 1 ms a block (the kernels' whole-span call) up to the native kernels' 8 rows; a
    CPU step runs its whole batch as one part whatever the plan's micro-batches (the engine's _step_rows: 2 x 4 rows
    pay the one call of 8), and a part of more rows runs block by block like a prefill and pays the prefill's 5 ms,
    or nothing where a packed format's measured prefill rate already holds it. A GPU pays 1 ms a micro-batch at any
    batch. 32 blocks, no per-step cost."""
    eff = dataclasses.replace(CPU_EFF, layer_overhead_s=1e-3, prefill_layer_overhead_s=5e-3)
    if kind == "cpu":
        hardware = cpu_machine(packed_prefill={"q4_0": PREFILL_PRODUCTS})
        policy = Policy(fmt, micro_batch_size=micro_batch, num_micro_batches=parts, **ON_CPU)
    else:
        hardware, policy = gpu_machine({"fp32": 1e12}), Policy(fmt, micro_batch_size=micro_batch, num_micro_batches=2)
    pred = evaluate(MODEL, hardware, policy, Workload(100, 20), MachineEfficiency(eff, eff))
    assert pred.step_breakdown_s["overhead"] == pytest.approx(32 * per_block, rel=1e-12, abs=1e-15)


def test_the_largest_matrix_is_the_fused_qkv_or_an_mlp_matrix_whichever_is_larger():
    """The 16-bit transients are counted for a block's largest matrix: the 7B's fused q, k, v (3 × 4096 × 4096 weights,
    more than an MLP matrix's 11008 × 4096), but with grouped K, V heads (8 of 32: q, k, v 6144 × 4096) an MLP matrix
    of 14336 × 4096."""
    grouped = dataclasses.replace(MODEL, num_kv_heads=8, intermediate_size=14336)
    assert model_numbers(MODEL).largest_matrix_params == 3 * 4096 * 4096
    assert model_numbers(grouped).largest_matrix_params == 14336 * 4096


# ---- session 13: the survivors in the functions issues 22 and 23 changed --------------------------------------------
@pytest.mark.parametrize("batch", [PACKED_KERNEL_ROWS, PACKED_KERNEL_ROWS + 1])
def test_the_kernels_eighth_row_still_overlaps_reads_and_flops_the_ninth_adds_them(batch):
    """On measured steps the block's and the fp32 head's reads and FLOPs overlap up to the kernels' 8 rows (both
    memory-bound at 8 rows here: no FLOPs beyond the reads) and add from 9 rows on (BLAS, as a prefill)."""
    memory, compute = fp32_block_decode(batch, 110.0)
    head_memory, head_compute = 32000 * 4096 * 4 / (CPU_BPS * 0.5), batch * HEAD_FLOPS / (1e12 * 0.25)
    assert memory > compute and head_memory > head_compute  # 4 bytes against 2 x rows FLOPs a weight, 80:250 rate
    measured = DecodeStreaming(bandwidth_fraction=0.5, small_row_reads=1.0, matmul_start_s=0.0, block_overhead_s=1e-4)
    policy = Policy("fp32", micro_batch_size=batch, **ON_CPU)
    pred = evaluate(MODEL, cpu_machine(measured), policy, Workload(prompt_len=100, output_len=20),
                    MachineEfficiency(CPU_EFF, CPU_EFF))
    beyond = 0.0 if batch <= 8 else 32 * compute + head_compute
    assert pred.step_breakdown_s["accelerator compute"] == pytest.approx(beyond, rel=1e-9, abs=1e-12)
    assert pred.decode_step_s == pytest.approx(32 * memory + head_memory + beyond, rel=1e-9)


def test_fp16_on_a_cpu_with_native_bf16_is_converted_to_fp32_and_multiplied_at_fp32s_rate():
    """A CPU's FLOP/s table listing fp32 and bf16 (5x) but not fp16: an fp16 plan is converted to fp32 first and runs
    at fp32's 1e11, not at the other 16-bit format's rate (ComputeDevice.peak_flops' fallback for a missing 16-bit
    entry); bf16 runs at its own 5e11."""
    machine = machine_view(cpu_machine(flops={"fp32": 1e11, "bf16": 5e11}))
    assert format_traits(machine, "fp16").peak_flops == 1e11
    assert format_traits(machine, "bf16").peak_flops == 5e11


def test_a_step_written_out_term_by_term_takes_the_efficiency_it_is_given_else_the_machines_default():
    """decode_step_terms with a 2 ms fixed cost a block: the 7B's 32 blocks pay 64 ms; without an efficiency it
    prices the step as with the machine's default one."""
    from hivekeeper.planner.costmodel import decode_step_terms
    from hivekeeper.planner.efficiency import default_efficiency

    hardware, policy, workload = cpu_machine(), Policy("fp32", **ON_CPU), Workload(prompt_len=100, output_len=20)
    slow_blocks = dataclasses.replace(CPU_EFF, layer_overhead_s=2e-3)
    terms = decode_step_terms(MODEL, hardware, policy, workload, MachineEfficiency(slow_blocks, slow_blocks))
    assert terms["blocks_fixed_s"] == pytest.approx(32 * 2e-3, rel=1e-12)
    assert decode_step_terms(MODEL, hardware, policy, workload) == decode_step_terms(
        MODEL, hardware, policy, workload, default_efficiency(hardware))
