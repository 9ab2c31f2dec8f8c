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
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hivekeeper.planner.costmodel import Placement, Policy, Workload, evaluate, machine_view, solve_weight_placement
from hivekeeper.planner.efficiency import Efficiency, MachineEfficiency
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
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
