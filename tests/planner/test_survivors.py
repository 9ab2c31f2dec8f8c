"""Rules of the cost model and the policy search that a mutation run found untested (docs/testing.md), each stated
with its expectation worked out here from the machine's numbers, not read back from the planner.

- a machine with one memory tier refuses a policy naming the other, counts nothing in a separate RAM, and a reserve
  comes off its tier's capacity;
- prefetch depth 1 overlaps compute with the host link and the disk one after the other (link + disk), depth 2
  overlaps all three (max);
- under --quant auto a quantized format wins only by its margin (QUALITY_WEIGHT: int8 11%, nf4 25%);
- the search keeps depth 2 where only the KV cache is on disk (disk reads of the cache overlap the link);
- a fixed batch is split into every (micro-batch, count) pair, chat runs one stream, and the batch curve is the
  best plan at each batch size;
- the search times every candidate that fits but those provably as fast as a simpler one (depth > 0 where nothing
  streams, depth 2 where nothing is on disk), and tries the runtime's packed formats on a CPU;
- on a CPU a 16-bit plan the engine would compute in fp32 is not planned; a KV cache read in bf16 costs its bytes
  with native bf16 math, HALF_AS_FP32_ON_CPU times them without; a CPU listing no fp32 rate is not taken to
  multiply bf16 natively.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hivekeeper.planner.costmodel import (HALF_AS_FP32_ON_CPU, Placement, Policy, Workload, block_weight_bytes,
                                          cpu_native_half, decode_step_terms, evaluate,
                                          evaluate_arrays, fixed_memory, format_traits, machine_view, model_numbers,
                                          peak_memory, sixteen_bit_format, solve_weight_placement, weight_bytes)
from hivekeeper.planner.efficiency import Efficiency, MachineEfficiency, default_efficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.models import ModelSpec
from hivekeeper.planner.swarm import plan_server
from hivekeeper.planner.policy import (QUALITY_WEIGHT, Constraints, GridResult, batch_curve, build_grid,
                                      candidate_formats, evaluate_grid, search)

LLAMA2_7B = ModelSpec(name="llama-2-7b", family="llama", num_layers=32, hidden_size=4096, intermediate_size=11008,
                      num_heads=32, num_kv_heads=32, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                      max_position_embeddings=4096)
# a 1.4B-parameter model whose KV cache (no grouped-query attention) outgrows its weights at long contexts
SMALL = ModelSpec(name="small", family="llama", num_layers=24, hidden_size=2048, intermediate_size=5504,
                  num_heads=16, num_kv_heads=16, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                  max_position_embeddings=4096)

LINK_BPS, DISK_BPS = 10e9, 1e9
NET = NetworkSpec(upload_bps=1e9, download_bps=1e9, rtt_s=0.01)


def machine(gpu_gb: float = 40, ram_gb: float = 200, disk_bps: float = DISK_BPS,
            disk_gb: float = 2000) -> HardwareSpec:
    """A made-up machine with round numbers: 100 GB/s, 100 TFLOP/s GPU; 10 GB/s link; 1 GB/s disk."""
    gpu = ComputeDevice(kind="gpu", name="Test GPU", memory_bytes=int(gpu_gb * 1e9), memory_bandwidth=100e9,
                        flops={"fp16": 100e12, "bf16": 100e12, "fp32": 10e12}, power_watts=300.0,
                        host_link_bandwidth=LINK_BPS)
    cpu = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=int(ram_gb * 1e9), memory_bandwidth=50e9,
                        flops={"fp32": 1e12}, power_watts=100.0)
    disk = DiskSpec(capacity_bytes=int(disk_gb * 1e9), read_bandwidth=disk_bps, write_bandwidth=disk_bps)
    return HardwareSpec(id="test", gpus=(gpu,), cpu=cpu, disk=disk, network=NET)


# transfers at their spec rates, so that their seconds can be written out
EFF = MachineEfficiency(
    Efficiency("test-gpu", matmul_fraction=0.5, bandwidth_fraction=0.8, link_fraction=1.0, disk_fraction=1.0,
               layer_overhead_s=0.3e-3, step_overhead_s=1e-3, runtime_bytes=10**9),
    Efficiency("test-cpu", matmul_fraction=0.5, bandwidth_fraction=0.5, link_fraction=1.0, disk_fraction=1.0,
               layer_overhead_s=0.2e-3, step_overhead_s=1e-3, runtime_bytes=10**9),
)


# ---- prefetch depth: what overlaps what ---------------------------------------------------------------------------
def test_prefetch_depth_1_adds_link_and_disk_depth_2_overlaps_them():
    """20% of the weights on the GPU, 30% in RAM, 50% on disk: every block streams 80% of itself over the link
    (25 ms) and reads 50% from disk (202 ms), both far longer than its compute (~4 ms). Depth 1 loads the next block
    while computing but the disk read and the link copy follow each other; depth 2 also overlaps those two."""
    block = block_weight_bytes(LLAMA2_7B, "fp16")
    link_s, disk_s = 0.8 * block / LINK_BPS, 0.5 * block / DISK_BPS
    workload = Workload(prompt_len=100, output_len=2)
    step = {depth: evaluate(LLAMA2_7B, machine(), Policy("fp16", weights=Placement(0.2, 0.3, 0.5),
                                                           prefetch_depth=depth), workload, EFF).decode_step_s
            for depth in (0, 1, 2)}
    layers = LLAMA2_7B.num_layers
    # the same LM head and step overhead in all three: depth 1 waits for link + disk, depth 2 for the disk alone
    assert step[1] - step[2] == pytest.approx(layers * link_s, rel=1e-6)
    assert step[0] > step[1]  # depth 0 adds the compute on top
    # and against the whole step: 32 blocks of link + disk, the head on the GPU, the step overhead
    head = LLAMA2_7B.vocab_size * LLAMA2_7B.embedding_dim * 2
    head_s = head / (100e9 * 0.8) + 2 * head / (100e12 * 0.5)
    assert step[1] == pytest.approx(layers * (link_s + disk_s) + head_s + 1e-3, rel=1e-6)


# ---- the machine as the cost model sees it ---------------------------------------------------------------------------
def test_several_gpus_act_as_one_pipeline_paced_by_the_slowest():
    fast = machine().gpus[0]
    slow = dataclasses.replace(fast, name="Slow GPU", memory_bytes=24 * 10**9, memory_bandwidth=50e9,
                               host_link_bandwidth=None)  # its spec leaves the link out
    disk = DiskSpec(capacity_bytes=500 * 10**9, read_bandwidth=2e9, write_bandwidth=0)  # write speed unknown
    hardware = dataclasses.replace(machine(), gpus=(fast, slow), disk=disk)
    view = machine_view(hardware, {"gpu": 4e9, "cpu": 8e9, "disk": 100e9})
    assert view.acc is slow and view.num_gpus == 2 and view.acc_bandwidth == 50e9
    assert view.acc_capacity == 40e9 + 24e9 - 4e9 and view.host_capacity == 200e9 - 8e9
    assert view.disk_capacity == 400e9 and view.disk_read == view.disk_write == 2e9
    assert view.link_bandwidth == LINK_BPS  # the known link; a GPU without one does not count
    assert view.power_watts == 300.0 + 300.0 + 100.0
    alone = machine_view(dataclasses.replace(machine(), gpus=(slow,)))
    assert alone.link_bandwidth == 12e9  # PCIe 3.0 x16's practical rate when no GPU gives one


def test_one_memory_machines_have_no_host_tier():
    cpu_only = machine_view(cpu_only_machine(), {"cpu": 8e9})
    assert (cpu_only.acc_tier, cpu_only.num_gpus, cpu_only.link_bandwidth, cpu_only.host_capacity) == \
        ("cpu", 0, None, 0.0)
    assert cpu_only.acc_capacity == 200e9 - 8e9 and cpu_only.acc is cpu_only.cpu
    unified = machine_view(unified_machine(64), {"cpu": 8e9})
    assert (unified.acc_tier, unified.link_bandwidth, unified.host_capacity) == ("gpu", None, 0.0)
    assert unified.acc_capacity == 64e9 and not unified.has_host_tier


def test_a_cpu_multiplies_16_bit_natively_only_at_its_fp32_rate_or_better():
    cpu = machine().cpu  # fp32 only
    assert not cpu_native_half(cpu)
    for dtype in ("bf16", "fp16"):
        assert cpu_native_half(dataclasses.replace(cpu, flops={"fp32": 1e12, dtype: 1e12}))
        assert not cpu_native_half(dataclasses.replace(cpu, flops={"fp32": 1e12, dtype: 0.5e12}))
    assert not cpu_native_half(dataclasses.replace(cpu, flops={"bf16": 1e12}))  # no fp32 rate to compare with


def test_recomputing_k_and_v_by_hand():
    """Kept per token and block: the block's input (8 KB) instead of K and V (16 KB); each decode step computes K and
    V again for the whole context: 4 × hidden × kv_dim FLOPs a position."""
    workload = Workload(prompt_len=1000, output_len=2)
    pred = evaluate(LLAMA2_7B, machine(), Policy("fp16", kv_recompute=True), workload, EFF)
    layer_bytes = BLOCK + 1001 * 4096 * 2
    layer_flops = 2 * MATRICES + 4 * 4096 * 1001 + 4 * 4096 * 4096 * 1001
    layer = layer_bytes / (100e9 * 0.8) + layer_flops / (100e12 * 0.5) + 0.3e-3
    head = 32000 * 4096 * 2 / (100e9 * 0.8) + 2 * 32000 * 4096 / (100e12 * 0.5)
    assert pred.decode_step_s == pytest.approx(32 * layer + head + 1e-3, rel=1e-9)


# ---- the prefill and the memory of a policy, by hand ------------------------------------------------------------------
MATRICES = 4 * 4096 * 4096 + 3 * 4096 * 11008  # per block: q, k, v, o + gate, up, down
BLOCK = MATRICES * 2 + 2 * 4096 * 2  # fp16 matrices + two norms
OUTSIDE = (32000 * 4096 * 2 + 4096) * 2  # embedding, untied head, final norm
KV_TOKEN = 2 * 4096 * 2  # one token of one block's K and V in fp16
WORKSPACE = 2 * 4096 + max(2 * 4096 + 2 * 4096, 2 * 11008 + 4096)  # values alive inside a block, per token
RUNTIME = 10**9  # EFF's runtime_bytes on each device


def test_prefill_all_on_the_gpu_by_hand():
    """1000 prompt tokens, one sequence: each block reads its weights once and writes the new K, V (16 KB a token),
    computes 2 FLOPs per weight per token plus causal attention (token i attends to i positions)."""
    pred = evaluate(LLAMA2_7B, machine(), Policy("fp16"), Workload(prompt_len=1000, output_len=2), EFF)
    layer_bytes = BLOCK + 1000 * KV_TOKEN
    layer_flops = 1000 * 2 * MATRICES + 4 * 4096 * 1000 * 1001 / 2
    layer = layer_bytes / (100e9 * 0.8) + layer_flops / (100e12 * 0.5) + 0.3e-3
    head_bytes, head_flops = 32000 * 4096 * 2, 2 * 32000 * 4096  # the LM head on the last position only
    head = head_bytes / (100e9 * 0.8) + head_flops / (100e12 * 0.5)
    assert pred.prefill_s == pytest.approx(32 * layer + head + 1e-3, rel=1e-9)


def test_peak_memory_of_a_spread_policy_by_hand():
    """Weights 80% GPU / 10% RAM / 10% disk, KV cache 50/25/25, attention over the off-GPU cache on the CPU, depth 2,
    two sequences of 100 + 28 tokens."""
    policy = Policy("fp16", weights=Placement(0.8, 0.1, 0.1), kv_cache=Placement(0.5, 0.25, 0.25),
                    micro_batch_size=2, prefetch_depth=2, attention_on_cpu=True)
    pred = evaluate(LLAMA2_7B, machine(), policy, Workload(prompt_len=100, output_len=28), EFF)
    batch, tokens, prompt = 2, 128, 100
    cache = batch * tokens * 32 * KV_TOKEN
    per_sequence_block = tokens * KV_TOKEN  # one block's cache of one sequence
    hidden = 2 * batch * prompt * 4096 * 2  # a block's inputs and outputs, kept on the GPU
    workspace = batch * prompt * WORKSPACE * 2 + batch * 32000 * 4  # + fp32 logits
    gpu = (OUTSIDE + 0.5 * cache + hidden + workspace + RUNTIME  # no cache buffers: CPU attention reads it in RAM
           + 0.8 * 32 * BLOCK + 3 * 0.2 * BLOCK)  # 1 + depth buffers for the streamed fifth of a block
    ram = (0.25 * cache + batch * per_sequence_block * 2 * 0.5  # CPU attention's fp32 copy of the off-GPU cache
           + batch * per_sequence_block * 0.25 + RUNTIME  # staging of the cache read from disk
           + 0.1 * 32 * BLOCK + 2 * 0.1 * BLOCK)  # depth 2: two staging buffers for weights read from disk
    disk = 0.25 * cache + 0.1 * 32 * BLOCK
    assert pred.peak_memory_bytes == {"gpu": round(gpu), "cpu": round(ram), "disk": round(disk)}
    # attention on the GPU instead: the off-GPU half of a block's cache comes in, into 1 + depth buffers, and RAM
    # holds no fp32 copy
    on_gpu = evaluate(LLAMA2_7B, machine(), dataclasses.replace(policy, attention_on_cpu=False),
                      Workload(prompt_len=100, output_len=28), EFF)
    buffers = 3 * batch * per_sequence_block * 0.5
    copies = batch * per_sequence_block * 2 * 0.5
    assert on_gpu.peak_memory_bytes == {"gpu": round(gpu + buffers), "cpu": round(ram - copies), "disk": round(disk)}


def test_transfers_of_a_spread_policy_by_hand():
    """The same spread policy with the activations kept in RAM: per block of a decode step (mean context 114) the link
    carries the streamed fifth of the block, the activations and CPU attention's queries in, the new K, V and the
    attention's outputs out; the disk reads its tenth of the block and its quarter of the cache and writes the new
    K, V; the CPU reads its half of the cache (copied to fp32 first: 5 bytes of traffic per 2) and runs its share of
    the attention. The disk is the slowest, and depth 2 overlaps the rest with it, in the prefill too."""
    policy = Policy("fp16", weights=Placement(0.8, 0.1, 0.1), kv_cache=Placement(0.5, 0.25, 0.25),
                    activations=Placement(0.0, 1.0, 0.0), micro_batch_size=2, prefetch_depth=2,
                    attention_on_cpu=True)
    # the link and the disk at half their rates here, so that their efficiency is seen
    eff = MachineEfficiency(dataclasses.replace(EFF.accelerator, link_fraction=0.5),
                            dataclasses.replace(EFF.host, disk_fraction=0.5))
    pred = evaluate(LLAMA2_7B, machine(), policy, Workload(prompt_len=100, output_len=28), eff)
    batch, context, prompt = 2, 100 + 28 / 2, 100
    activations, queries = batch * 4096 * 2, batch * 4096 * 2 * 0.5
    link_in = 0.2 * BLOCK + activations + queries
    assert link_in > batch * KV_TOKEN * 0.5 + activations + queries  # more comes in than goes out
    disk_read = 0.1 * BLOCK + 0.25 * batch * context * KV_TOKEN
    disk_write = 0.25 * batch * KV_TOKEN
    cpu_bytes = batch * context * KV_TOKEN * 0.5
    cpu_flops = 4 * 4096 * context * batch * 0.5
    expected = {"host link": link_in / (LINK_BPS * 0.5), "disk": (disk_read + disk_write) / (DISK_BPS * 0.5),
                "cpu attention": cpu_bytes * 5 / (50e9 * 0.5) + cpu_flops / (1e12 * 0.5)}
    for name, seconds in expected.items():
        assert pred.step_breakdown_s[name] == pytest.approx(32 * seconds, rel=1e-9), name
    head_bytes, head_flops = 32000 * 4096 * 2, batch * 2 * 32000 * 4096
    head = head_bytes / (100e9 * 0.8) + head_flops / (100e12 * 0.5)
    assert pred.decode_step_s == pytest.approx(32 * expected["disk"] + head + 1e-3, rel=1e-9)
    prefill_disk = (0.1 * BLOCK + 0.25 * batch * prompt * KV_TOKEN) / (DISK_BPS * 0.5)  # the new cache written
    assert pred.prefill_s == pytest.approx(32 * prefill_disk + head + 1e-3, rel=1e-9)
    # the disk's bytes per step, in the bottleneck's words
    assert pred.bottleneck == "disk" and f"({32 * disk_read / 1e9:.3g} GB per decode step)" in pred.bottleneck_detail
    # compute-bound from the batch whose FLOPs take as long as streaming the block: depth 2 waits for the slower of
    # link and disk (here the disk), depth 1 for both
    stream_link, stream_disk = 0.2 * BLOCK / (LINK_BPS * 0.5), 0.1 * BLOCK / (DISK_BPS * 0.5)
    for depth, stream in ((2, max(stream_link, stream_disk)), (1, stream_link + stream_disk)):
        at_depth = evaluate(LLAMA2_7B, machine(), dataclasses.replace(policy, prefetch_depth=depth),
                            Workload(prompt_len=100, output_len=28), eff)
        assert at_depth.min_compute_bound_batch == math.ceil(stream * 100e12 * 0.5 / (2 * MATRICES) - 1e-9)
        assert at_depth.min_compute_bound_basis == "disk"


# ---- one memory tier: what a policy may say, and what fits -----------------------------------------------------------
def unified_machine(memory_gb: float = 64) -> HardwareSpec:
    """Apple-silicon-like: the GPU computes in the one memory it shares with the CPU (no host tier, no link)."""
    gpu = ComputeDevice(kind="gpu", name="Unified GPU", memory_bytes=int(memory_gb * 1e9), memory_bandwidth=400e9,
                        flops={"fp16": 30e12, "bf16": 30e12, "fp32": 15e12}, power_watts=60.0, unified_memory=True)
    cpu = ComputeDevice(kind="cpu", name="Unified CPU", memory_bytes=int(memory_gb * 1e9), memory_bandwidth=400e9,
                        flops={"fp32": 1e12}, power_watts=30.0)
    disk = DiskSpec(capacity_bytes=1000 * 10**9, read_bandwidth=DISK_BPS, write_bandwidth=DISK_BPS)
    return HardwareSpec(id="unified", gpus=(gpu,), cpu=cpu, disk=disk, network=NET)


def cpu_only_machine() -> HardwareSpec:
    return HardwareSpec(id="cpu-only", gpus=(), cpu=machine().cpu, disk=machine().disk, network=NET)


@pytest.mark.parametrize("hardware, tier, other", [(unified_machine(), "gpu", "cpu"),
                                                   (cpu_only_machine(), "cpu", "gpu")])
def test_a_one_tier_machine_refuses_a_policy_naming_the_other_tier(hardware, tier, other):
    right = Placement(**{tier: 1.0, other: 0.0})
    for field in ("weights", "kv_cache", "activations"):
        policy = Policy("fp16", **{"weights": right, "kv_cache": right, "activations": right,
                                   field: Placement(**{tier: 0.5, other: 0.5})})
        with pytest.raises(InputError, match=f"policy puts {field} on '{other}', but this machine's memory is one "
                                             f"tier \\('{tier}'\\)"):
            evaluate(LLAMA2_7B, hardware, policy, Workload(100, 2), EFF)


def test_on_unified_memory_nothing_is_counted_in_a_separate_ram():
    """Everything in the one memory: it fits, and the CPU tier (the same memory, not a second one) holds nothing."""
    pred = evaluate(LLAMA2_7B, unified_machine(), Policy("fp16"), Workload(100, 2), EFF)
    assert pred.fits and pred.peak_memory_bytes["cpu"] == 0 and pred.peak_memory_bytes["disk"] == 0
    assert weight_bytes(LLAMA2_7B, "fp16") == OUTSIDE + 32 * BLOCK
    # the GPU framework's runtime memory and the process's own both sit in the one memory
    expected = OUTSIDE + 32 * BLOCK + 102 * 32 * KV_TOKEN + 2 * 100 * 4096 * 2 + 100 * WORKSPACE * 2 + 32000 * 4 \
        + 2 * RUNTIME
    assert pred.peak_memory_bytes["gpu"] == round(expected)


def test_a_reserve_is_taken_off_the_capacity_of_its_tier():
    free = evaluate(LLAMA2_7B, machine(), Policy("fp16"), Workload(100, 2), EFF)
    reserved = evaluate(LLAMA2_7B, machine(), Policy("fp16"), Workload(100, 2), EFF, reserve_bytes={"gpu": 30e9})
    assert free.capacity_bytes["gpu"] - reserved.capacity_bytes["gpu"] == 30 * 10**9
    assert free.fits and not reserved.fits  # 13.5 GB of weights in the 10 GB left


# ---- where the block weights go: the most that fits, nearest first ----------------------------------------------------
@pytest.mark.parametrize("hardware", [machine(gpu_gb=10, ram_gb=8), machine(gpu_gb=10, ram_gb=64),
                                      machine(gpu_gb=80, ram_gb=16)], ids=["small", "big-ram", "big-gpu"])
def test_weight_placement_puts_the_most_that_fits_on_the_accelerator_then_in_ram(hardware):
    """For every candidate of a batch grid the closed form's fractions must fit, and moving 0.02% more of the
    weights one tier closer (disk to RAM, RAM or disk to the GPU) must not: checked with the peak memory of those
    placements, not with the closed form."""
    view = machine_view(hardware)
    constraints, workload = Constraints(quant="none"), Workload(prompt_len=512, output_len=128)
    formats = candidate_formats(LLAMA2_7B, view, "none")
    traits = [format_traits(view, f) for f in formats]
    cols = build_grid(LLAMA2_7B, view, "batch", constraints, len(formats))
    mem = fixed_memory(model_numbers(LLAMA2_7B), view, EFF, workload, traits, cols)
    wa, wh, wd, ok = solve_weight_placement(mem, view)
    assert ok.any() and (~ok).any()
    capacity = {"acc": view.acc_capacity, "host": view.host_capacity, "disk": view.disk_capacity}

    def fits(a, h, d):
        peaks = peak_memory(mem, a, h, d)
        return np.logical_and.reduce([peaks[tier] <= capacity[tier] + 1.0 for tier in capacity])

    assert np.allclose(wa + wh + wd, 1.0) and fits(wa, wh, wd)[ok].all()
    step = 2e-4
    closer_to_acc = ok & (wa < 1.0)
    from_host = np.minimum(wh, step)
    more_on_acc = fits(wa + step, wh - from_host, wd - (step - from_host))
    assert not more_on_acc[closer_to_acc & (wa + step <= 1.0)].any()
    closer_to_host = ok & (wd > step) & view.has_host_tier
    assert not fits(wa, wh + step, wd - step)[closer_to_host].any()
    assert closer_to_acc.any() and (not view.has_host_tier or closer_to_host.any() or (wd[ok] == 0).all())


# ---- which 16-bit format ------------------------------------------------------------------------------------------
def test_the_16_bit_format_is_bf16_only_where_the_checkpoint_is_and_it_runs_at_full_rate():
    bf16_model, fp16_model = LLAMA2_7B, dataclasses.replace(LLAMA2_7B, torch_dtype="fp16")
    full_rate = machine()  # bf16 and fp16 at 100 TFLOP/s
    half_rate_gpu = dataclasses.replace(full_rate.gpus[0], flops={"fp16": 65e12, "bf16": 8e12, "fp32": 8e12})
    half_rate = dataclasses.replace(full_rate, gpus=(half_rate_gpu,))  # a T4-like GPU: bf16 emulated
    cases = [(bf16_model, full_rate, "bf16"), (fp16_model, full_rate, "fp16"), (bf16_model, half_rate, "fp16"),
             (bf16_model, cpu_only_machine(), "bf16"), (fp16_model, cpu_only_machine(), "fp16")]
    for model, hardware, expected in cases:
        assert sixteen_bit_format(model, machine_view(hardware)) == expected, (model.torch_dtype, hardware.id)
        plan = search(model, hardware, "chat", Constraints(quant="none"), Workload(100, 2), EFF)
        assert plan.prediction.policy.weight_format in (expected, "fp32")


# ---- --quant auto: the quality margin -----------------------------------------------------------------------------
def best_speed(hardware: HardwareSpec, quant: str, workload: Workload) -> float:
    """1 / runtime of the best chat plan using only this quantization ("none": the 16-bit format)."""
    return 1.0 / search(LLAMA2_7B, hardware, "chat", Constraints(quant=quant), workload).prediction.runtime_s


def test_quant_auto_takes_int8_or_nf4_only_when_faster_by_their_margin():
    """On the GPU int8 and nf4 read fewer bytes per decoded token but dequantize during the prefill: the longer the
    reply, the more they gain. Over replies of 1 to 256 tokens, --quant auto must pick the format whose speed
    times its quality weight (1, 0.9, 0.8: int8 needs 11% more speed, nf4 25%) is highest."""
    hardware = machine(gpu_gb=40)
    weights = {"none": 1.0, "int8": 0.9, "nf4": 0.8}
    assert {q: QUALITY_WEIGHT[q] for q in ("int8", "nf4")} == {"int8": weights["int8"], "nf4": weights["nf4"]}
    margin_decided = []
    for output_len in (1, 2, 3, 4, 5, 8, 64, 256):
        workload = Workload(prompt_len=512, output_len=output_len)
        speed = {quant: best_speed(hardware, quant, workload) for quant in weights}
        expected = max(speed, key=lambda quant: speed[quant] * weights[quant])
        chosen = search(LLAMA2_7B, hardware, "chat", Constraints(quant="auto"), workload).prediction.policy
        format_of = {"none": "bf16", "int8": "int8", "nf4": "nf4"}
        assert chosen.weight_format == format_of[expected], (output_len, speed)
        if max(speed, key=speed.get) != expected:
            margin_decided.append(output_len)
    # somewhere a quantized format is faster but not by its margin, and the 16-bit plan is kept
    assert margin_decided, "no reply length where the margin decides: the scan does not test the rule"


# ---- pruning keeps depth 2 when only the KV cache is on disk -------------------------------------------------------
def exhaustive_best(model: ModelSpec, hardware: HardwareSpec, workload: Workload) -> tuple[float, dict]:
    """The best chat candidate of the whole grid, every candidate timed (the search skips some it proves equal)."""
    constraints = Constraints(quant="none")
    eff = default_efficiency(hardware)
    view = machine_view(hardware)
    formats = candidate_formats(model, view, constraints.quant)
    traits = [format_traits(view, f) for f in formats]
    cols = build_grid(model, view, "chat", constraints, len(formats))
    mem = fixed_memory(model_numbers(model), view, eff, workload, traits, cols)
    wa, wh, wd, feasible = solve_weight_placement(mem, view)
    cols.update(wa=wa, wh=wh, wd=wd)
    out = evaluate_arrays(model_numbers(model), view, eff, workload, traits, cols)
    score = np.where(feasible, 1.0 / out["runtime_s"], -np.inf)
    i = int(np.argmax(score))
    return float(score[i]), {key: float(values[i]) for key, values in cols.items()}


def test_kv_cache_on_disk_with_weights_in_ram_keeps_prefetch_depth_2():
    """A 100k-token chat of a small model on a 12 GB GPU with 2.93 GB of RAM (2.5 GB beside the runtime's 0.5 GiB):
    the weights fit in GPU + RAM (streamed over the link), half the KV cache must sit on disk. Depth 2 reads the cache
    from disk while the link streams weights, so it beats depth 1; the search must not skip it as "nothing on
    disk"."""
    hardware, workload = machine(gpu_gb=12, ram_gb=2.93, disk_bps=2e9), Workload(prompt_len=100_000, output_len=64)
    plan = search(SMALL, hardware, "chat", Constraints(quant="none"), workload)
    policy = plan.prediction.policy
    assert policy.weights.disk == 0 and policy.kv_cache.disk > 0 and policy.prefetch_depth == 2
    shallower = Policy(policy.weight_format, policy.weights, policy.kv_cache, policy.activations,
                       policy.micro_batch_size, policy.num_micro_batches, policy.kv_recompute, 1,
                       policy.attention_on_cpu)
    assert plan.prediction.runtime_s < evaluate(SMALL, hardware, shallower, workload).runtime_s
    best_score, best = exhaustive_best(SMALL, hardware, workload)
    assert 1.0 / plan.prediction.runtime_s == pytest.approx(best_score, rel=1e-9)
    assert best["wd"] == 0 and best["cd"] > 0 and best["d"] == 2


# ---- the plan says what the search found --------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size, output_len, knob", [(None, 32, "attention_on_cpu"), (64, 256, "kv_recompute")])
def test_the_plans_policy_evaluated_again_gives_the_plans_prediction(batch_size, output_len, knob):
    """A 16 GB GPU with 64 GB of RAM batching 512-token prompts: the best plan runs attention on the CPU (any batch,
    32 new tokens) or recomputes K and V (64 sequences, 256 new tokens). The policy the plan reports, evaluated on
    its own, must predict exactly what the plan says: every knob the search chose is in it."""
    hardware, workload = machine(gpu_gb=16, ram_gb=64), Workload(prompt_len=512, output_len=output_len)
    plan = search(LLAMA2_7B, hardware, "batch", Constraints(quant="none", batch_size=batch_size), workload, EFF)
    policy = plan.prediction.policy
    assert getattr(policy, knob)
    again = evaluate(LLAMA2_7B, hardware, policy, workload, EFF)
    for field in ("decode_step_s", "prefill_s", "throughput_tokens_per_s"):
        assert getattr(again, field) == pytest.approx(getattr(plan.prediction, field), rel=1e-9), field
    assert again.peak_memory_bytes == plan.prediction.peak_memory_bytes


# ---- what a model that fits nowhere lacks ---------------------------------------------------------------------------
def grown(hardware: HardwareSpec, missing: dict[str, int], extra: int = 0) -> HardwareSpec:
    """The machine with each tier's missing bytes (plus `extra`, which may be negative, where some are) added."""
    more = {tier: missing[tier] + extra if missing[tier] else 0 for tier in ("gpu", "cpu", "disk")}
    gpus = tuple(dataclasses.replace(g, memory_bytes=g.memory_bytes + more["gpu"]) for g in hardware.gpus)
    cpu = dataclasses.replace(hardware.cpu, memory_bytes=hardware.cpu.memory_bytes + more["cpu"])
    disk = dataclasses.replace(hardware.disk, capacity_bytes=hardware.disk.capacity_bytes + more["disk"])
    return dataclasses.replace(hardware, gpus=gpus, cpu=cpu, disk=disk)


@pytest.mark.parametrize("hardware, short", [
    (machine(gpu_gb=8, ram_gb=4, disk_gb=2), "disk"),  # 13.5 GB of weights: GPU + RAM + disk hold 14 GB, less runtime
    (machine(gpu_gb=0.5), "gpu"),  # not even the runtime and the embeddings
    (machine(gpu_gb=8, ram_gb=0.5), "cpu"),  # no RAM to stage weights streamed from disk
    # session 9's finding: asked for 7.09 GB more disk, then, with that added, for 0 GB more
    (machine(gpu_gb=4, ram_gb=2, disk_gb=3), "disk"),
], ids=["disk", "gpu", "ram", "small-gpu"])
def test_the_missing_memory_is_on_the_short_tier_and_adding_it_is_enough(hardware, short):
    for goal in ("chat", "batch"):
        plan = search(LLAMA2_7B, hardware, goal, Constraints(quant="none"), Workload(512, 128), EFF)
        missing = plan.missing_bytes
        assert plan.prediction is None and missing[short] > 0
        assert missing["total"] == missing["gpu"] + missing["cpu"] + missing["disk"] == missing[short]
        # exactly the bytes asked for are enough (no reserve here: Constraints() keeps nothing free)
        bigger = search(LLAMA2_7B, grown(hardware, missing), goal, Constraints(quant="none"), Workload(512, 128), EFF)
        assert bigger.prediction is not None, (goal, missing)
        if short == "disk":  # the disk takes the weights left over byte for byte: a megabyte less is not enough
            less = search(LLAMA2_7B, grown(hardware, missing, -10**6), goal, Constraints(quant="none"),
                          Workload(512, 128), EFF)
            assert less.prediction is None and 0 < less.missing_bytes["disk"] <= 10**6 + 10**3, goal


# ---- the grid's batch pairs, and the batch curve against the search -------------------------------------------------
def pairs(grid) -> set[tuple[int, int]]:
    return set(zip(grid.cols["b"].astype(int).tolist(), grid.cols["n"].astype(int).tolist()))


def test_a_fixed_batch_is_split_into_every_divisor_pair_and_chat_runs_one_stream():
    hardware = machine(gpu_gb=24)
    workload = Workload(prompt_len=256, output_len=64)
    grid = evaluate_grid(LLAMA2_7B, hardware, "batch", Constraints(quant="none", batch_size=12), workload)
    # 12 = b x n with at most 16 micro-batches: (1, 12) (2, 6) (3, 4) (4, 3) (6, 2) (12, 1)
    assert pairs(grid) == {(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)}
    grid = evaluate_grid(LLAMA2_7B, hardware, "batch", Constraints(quant="none", batch_size=34), workload)
    assert pairs(grid) == {(34, 1), (17, 2)}  # 34 / 2 = 17 micro-batches would be too many
    assert pairs(evaluate_grid(LLAMA2_7B, hardware, "chat", Constraints(quant="none"), workload)) == {(1, 1)}
    assert pairs(evaluate_grid(LLAMA2_7B, hardware, "chat", Constraints(quant="none", batch_size=3),
                               workload)) == {(3, 1)}


def test_the_batch_curve_is_the_best_plan_at_each_batch():
    """Each point of the chart equals the search for that batch size, with the same quantization, reserve and
    efficiency (a slower made-up set, so that the defaults would show)."""
    hardware = machine(gpu_gb=16, ram_gb=30, disk_gb=200)  # the largest batches' KV caches fit nowhere
    constraints = Constraints(quant="int8", reserve_bytes={"gpu": 4e9})
    workload = Workload(prompt_len=256, output_len=64)
    points = batch_curve(LLAMA2_7B, hardware, workload, constraints, EFF)
    # every batch size of the grid, fitting or not: micro-batch sizes 1..512 times 1..16 micro-batches
    assert [p.batch_size for p in points] == sorted({b * n for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
                                                     for n in (1, 2, 4, 8, 16)})
    checked = 0
    for point in points:
        if point.throughput_tokens_per_s is None or point.batch_size > 512:
            continue
        plan = search(LLAMA2_7B, hardware, "batch", Constraints("int8", point.batch_size, {"gpu": 4e9}), workload,
                      EFF)
        assert point.throughput_tokens_per_s == pytest.approx(plan.prediction.throughput_tokens_per_s, rel=1e-9)
        assert point.decode_tokens_per_s == pytest.approx(plan.prediction.decode_tokens_per_s, rel=1e-9)
        checked += 1
    assert checked >= 5 and sum(p.throughput_tokens_per_s is None for p in points) >= 2


def test_the_batch_curve_spans_every_batch_even_when_the_constraints_fix_one():
    """The chart shows every batch size whatever batch the plan itself was asked for: a fixed batch of 12 in the
    constraints is dropped for the curve, which is the same as the curve without it."""
    hardware, workload = machine(gpu_gb=24), Workload(prompt_len=256, output_len=64)
    fixed = batch_curve(LLAMA2_7B, hardware, workload, Constraints(quant="none", batch_size=12), EFF)
    free = batch_curve(LLAMA2_7B, hardware, workload, Constraints(quant="none"), EFF)
    assert [p.batch_size for p in fixed] == sorted({b * n for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
                                                    for n in (1, 2, 4, 8, 16)})
    assert fixed == free


def test_a_cpu_keeps_a_bf16_checkpoint_in_bf16_even_where_it_lists_fp16_faster():
    """On a CPU the engine computes a bf16 checkpoint in bf16 or fp32, never in fp16 (core/machine/cpu_dtype_rule.py:
    fp16 has no native CPU path), so a CPU whose table lists fp16 above bf16 (an ARM-like core) still plans a bf16
    checkpoint as bf16; an fp16 checkpoint stays fp16."""
    cpu = dataclasses.replace(machine().cpu, flops={"fp32": 1e12, "fp16": 2e12, "bf16": 0.5e12})
    hardware = HardwareSpec(id="fp16-cpu", gpus=(), cpu=cpu, disk=machine().disk, network=NET)
    view = machine_view(hardware)
    assert sixteen_bit_format(LLAMA2_7B, view) == "bf16"  # LLAMA2_7B's checkpoint is bf16
    assert sixteen_bit_format(dataclasses.replace(LLAMA2_7B, torch_dtype="fp16"), view) == "fp16"


# ---- the plan's verdict: local, swarm or none, and what it says --------------------------------------------------
def test_a_chat_that_would_stream_weights_from_disk_goes_to_the_swarm_a_batch_stays_local():
    """Llama-2-7B (13.5 GB of bf16 weights) on an 8 GB GPU with 4 GB of RAM: a third of the weights would sit on
    disk. A chat is sent to the swarm (the machine holds the client side) and says how much would sit on disk; a batch
    job runs locally anyway. The price passed to the search (2 $/h, the machine lists none) prices the run."""
    hardware, workload = machine(gpu_gb=8, ram_gb=4), Workload(prompt_len=512, output_len=128)
    chat = search(LLAMA2_7B, hardware, "chat", Constraints(quant="none"), workload, EFF, price_per_hour=2.0)
    disk = chat.prediction.policy.weights.disk
    assert chat.fit == "swarm" and disk > 0.1 and chat.missing_bytes is None
    assert f"Locally {100 * disk:.0f}% of the weights would sit on disk" in chat.reason
    assert chat.reason.startswith(chat.prediction.bottleneck_detail)
    assert chat.reason.endswith("run it with the swarm instead.")
    assert chat.runtime.cost_usd == pytest.approx(chat.runtime.runtime_s / 3600 * 2.0, rel=1e-9)
    batch = search(LLAMA2_7B, hardware, "batch", Constraints(quant="none"), workload, EFF)
    assert batch.fit == "local" and batch.prediction.policy.weights.disk > 0 and "swarm" not in batch.reason


def test_a_model_that_fits_nowhere_goes_to_the_swarm_only_if_the_client_side_fits():
    """With 2 GB of disk the 13.5 GB of weights fit nowhere: the swarm runs it (the embeddings and LM head, 0.5 GB,
    fit on the GPU). On a machine with 0.3 GB of GPU memory and of RAM not even the client side fits."""
    workload = Workload(prompt_len=512, output_len=128)
    for goal in ("chat", "batch"):
        plan = search(LLAMA2_7B, machine(gpu_gb=8, ram_gb=4, disk_gb=2), goal, Constraints(quant="none"), workload, EFF)
        assert plan.fit == "swarm" and plan.prediction is None and "The swarm can run it" in plan.reason, goal
        tiny = search(LLAMA2_7B, machine(gpu_gb=0.3, ram_gb=0.3, disk_gb=1), goal, Constraints(quant="none"),
                      workload, EFF)
        assert tiny.fit == "none" and "cannot even hold the client side" in tiny.reason, goal


def test_the_default_goal_is_chat():
    hardware = machine()
    assert search(LLAMA2_7B, hardware).goal == "chat"
    assert search(LLAMA2_7B, hardware).prediction == search(LLAMA2_7B, hardware, "chat").prediction


def grid_with(score, host, disk, depth, count):
    """A GridResult holding only what `best` reads: the scores, the off-accelerator peaks, prefetch depths and
    micro-batch counts of each candidate."""
    arrays = lambda values: np.array(values, dtype=float)  # noqa: E731
    return GridResult(machine=None, efficiency=None, formats=[], cols={"d": arrays(depth), "n": arrays(count)},
                      peaks={"host": arrays(host), "disk": arrays(disk)}, out={}, feasible=np.isfinite(arrays(score)),
                      speed=arrays(score), score=arrays(score), mem={}, batch_sizes=np.array([1]))


def test_ties_go_to_the_least_off_the_accelerator_then_the_shallowest_prefetch_then_the_fewest_micro_batches():
    """Scores within 1e-9 of the best tie. Candidates 1-4 tie (4 is 1e-12 lower); 1 keeps 5 off the accelerator,
    2 keeps 2, 3 and 4 keep 1 each: 4 wins by its shallower prefetch. With equal depths, the fewer micro-batches win.
    Candidate 5 is 5% slower and never chosen."""
    score = [1.0, 2.0, 2.0, 2.0, 2.0 * (1 - 1e-12), 1.9]
    host, disk = [0, 5, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0]
    assert grid_with(score, host, disk, depth=[0, 0, 0, 2, 1, 0], count=[1, 1, 1, 1, 4, 1]).best() == 4
    assert grid_with(score, host, disk, depth=[0, 0, 0, 1, 1, 0], count=[1, 1, 1, 2, 4, 1]).best() == 3
    assert grid_with(score, [0] * 6, [0] * 6, depth=[0] * 6, count=[1] * 6).best() == 1


def test_native_bf16_math_makes_bf16_the_16_bit_format_of_any_checkpoint_but_an_fp16_one_on_a_cpu_only():
    """A CPU that multiplies bf16 natively (at twice its fp32 rate) and lists no fp16 computes a 16-bit plan in bf16
    (sixteen_bit_format's docstring): an fp32 checkpoint is planned in bf16, an fp16 one stays fp16. A GPU with the
    same table plans an fp32 or fp16 checkpoint in fp16: on an accelerator bf16 is only a bf16 checkpoint's format."""
    table = {"fp32": 1e12, "bf16": 2e12}
    cpu_hardware = HardwareSpec(id="bf16-cpu", gpus=(), cpu=dataclasses.replace(machine().cpu, flops=table),
                                disk=machine().disk, network=NET)
    gpu_hardware = dataclasses.replace(machine(), gpus=(dataclasses.replace(machine().gpus[0], flops=table),))
    fp32_model = dataclasses.replace(LLAMA2_7B, torch_dtype="fp32")
    fp16_model = dataclasses.replace(LLAMA2_7B, torch_dtype="fp16")
    assert sixteen_bit_format(fp32_model, machine_view(cpu_hardware)) == "bf16"
    assert sixteen_bit_format(fp16_model, machine_view(cpu_hardware)) == "fp16"
    assert sixteen_bit_format(fp32_model, machine_view(gpu_hardware)) == "fp16"
    assert sixteen_bit_format(fp16_model, machine_view(gpu_hardware)) == "fp16"


def test_a_serve_plan_times_one_session_through_its_blocks_and_says_what_it_serves():
    """Goal serve on a 16 GB GPU keeping 6 GB free, at a slower made-up efficiency: the server is sized with that
    reserve and efficiency (plan_server called the same way), and one client session through its n blocks takes
    n x prompt / forward rps for the prompt and n / inference rps per further token (α + β(o − 1), batch 1), priced
    at the price passed."""
    hardware, workload = machine(gpu_gb=16), Workload(prompt_len=256, output_len=32)
    constraints = Constraints(quant="none", reserve_bytes={"gpu": 6e9})
    plan = search(LLAMA2_7B, hardware, "serve", constraints, workload, EFF, price_per_hour=3.0)
    server = plan_server(LLAMA2_7B, hardware, "none", None, {"gpu": 6e9}, EFF)
    assert plan.server == server and 0 < server.num_blocks < 32
    n, runtime = server.num_blocks, plan.runtime
    alpha, beta = n * 256 / server.forward_rps, n / server.inference_rps
    assert (runtime.alpha_s, runtime.beta_s) == (pytest.approx(alpha, rel=1e-12), pytest.approx(beta, rel=1e-12))
    assert runtime.runtime_s == pytest.approx(alpha + 31 * beta, rel=1e-12) and runtime.batch_size == 1
    assert runtime.cost_usd == pytest.approx(runtime.runtime_s / 3600 * 3.0, rel=1e-12)
    assert plan.reason.startswith(f"serves {n} of 32 blocks in {server.weight_format} with a "
                                  f"{server.cache_tokens}-token cache per block; a 1-token step is bound by "
                                  f"{server.inference_bound}. ")
    none = search(LLAMA2_7B, machine(gpu_gb=0.5), "serve", Constraints(quant="none"), workload, EFF)
    assert none.server.num_blocks == 0 and none.runtime is None
    assert none.reason.startswith(f"cannot hold a single block for serving ({none.server.block_bytes / 1e9:.3g} GB "
                                  f"each). ")


def gb_up(nbytes: int) -> str:
    """GB to three significant digits, rounded up (so that adding the quoted amount is enough)."""
    digits = 2 - math.floor(math.log10(nbytes / 1e9))
    return f"{math.ceil(nbytes / 1e9 * 10**digits) / 10**digits:.3g}"


def test_the_reason_of_a_model_that_fits_nowhere_quotes_the_missing_memory_per_tier():
    workload = Workload(prompt_len=512, output_len=128)
    for hardware in (machine(gpu_gb=8, ram_gb=4, disk_gb=2), machine(gpu_gb=0.3, ram_gb=0.3, disk_gb=1)):
        plan = search(LLAMA2_7B, hardware, "chat", Constraints(quant="none"), workload, EFF)
        missing = plan.missing_bytes
        lacking = ", ".join(f"{tier} {gb_up(missing[tier])} GB" for tier in ("gpu", "cpu", "disk")
                            if missing[tier] > 0)
        assert plan.reason.startswith(f"does not fit locally: needs {gb_up(missing['total'])} GB more memory "
                                      f"({lacking}).")
    # the second machine lacks memory on every tier: the GPU and RAM get only their fixed bytes and one block's
    # buffers, so every block's fp16 weights go to the 1 GB disk: 32 × (4·4096² + 3·4096·11008 + 2·4096) × 2 bytes
    assert missing["disk"] == 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) * 2 - 10**9
    assert "gpu 1.85 GB, cpu 1.11 GB, disk 12 GB" in plan.reason  # 1.8405, 1.1048 and 11.95 GB, rounded up


def test_a_plan_names_its_model_machine_and_efficiency_and_says_whether_the_swarm_can_run_what_does_not_fit():
    workload = Workload(prompt_len=512, output_len=128)
    fits = search(LLAMA2_7B, machine(gpu_gb=24), "chat", Constraints(quant="none"), workload, EFF)
    grid = evaluate_grid(LLAMA2_7B, machine(gpu_gb=24), "chat", Constraints(quant="none"), workload, EFF)
    assert (fits.model, fits.hardware, fits.efficiency) == (LLAMA2_7B.name, "test", EFF.name)
    assert fits.candidates_evaluated == grid.score.size > 0  # what the search timed, after pruning
    client_side = search(LLAMA2_7B, machine(gpu_gb=8, ram_gb=4, disk_gb=2), "chat", Constraints(quant="none"),
                         workload, EFF)
    assert client_side.reason.endswith(". The swarm can run it: this machine holds the client side.")
    nothing = search(LLAMA2_7B, machine(gpu_gb=0.3, ram_gb=0.3, disk_gb=1), "chat", Constraints(quant="none"),
                     workload, EFF)
    assert nothing.reason.endswith(". This machine cannot even hold the client side (embeddings and LM head).")


# ---- session 12: the formats the search tries (issue 22: fp32 only where a CPU has no 16-bit math) ----------------
def bf16_cpu_machine() -> HardwareSpec:
    """A CPU-only machine whose CPU multiplies bf16 natively at twice its fp32 rate (AMX-like)."""
    cpu = dataclasses.replace(machine().cpu, flops={"fp32": 1e12, "bf16": 2e12})
    return HardwareSpec(id="bf16-cpu", gpus=(), cpu=cpu, disk=machine().disk, network=NET)


BF16_7B = dataclasses.replace(LLAMA2_7B, torch_dtype="bf16")


@pytest.mark.parametrize("hardware, quant, expected", [
    (cpu_only_machine(), "none", ["fp32"]),  # no 16-bit math: a 16-bit plan would run in fp32 at 4 bytes a weight
    (cpu_only_machine(), "auto", ["fp32", "q8_0", "q4_0"]),
    (bf16_cpu_machine(), "none", ["bf16", "fp32"]),
    (bf16_cpu_machine(), "auto", ["bf16", "fp32", "q8_0", "q4_0"]),
    (bf16_cpu_machine(), "q4_0", ["q4_0"]),
    (machine(), "none", ["bf16"]),
    (machine(), "auto", ["bf16", "int8", "nf4"]),
])
def test_the_search_tries_what_runs_on_the_machine(hardware, quant, expected):
    """A CPU tries fp32, and its 16-bit format only where it multiplies 16-bit values natively; with --quant auto also
    the packed formats the runtime holds for the model (q8_0 and q4_0 here), never bitsandbytes. A GPU tries its 16-bit
    format, and int8 and nf4 with auto. A named format is tried alone."""
    assert candidate_formats(BF16_7B, machine_view(hardware), quant, ("q8_0", "q4_0")) == expected


def test_a_packed_format_named_for_a_gpu_is_refused():
    with pytest.raises(InputError, match="q4_0 is a CPU format"):
        candidate_formats(BF16_7B, machine_view(machine()), "q4_0", ("q4_0",))


# ---- session 14: the survivors of evaluate_grid, runs_as_planned, half_cpu_traits and cpu_native_bf16 ---------------
def test_the_search_times_every_candidate_that_fits_but_those_provably_as_fast_as_a_simpler_one():
    """The plan's candidates_evaluated, worked out from the grid: a chat is one stream; llama-2-7b may recompute K and
    V (2 x 32 heads x 128 > 4096), so 2 recompute choices; 3 prefetch depths.

    CPU only (no host tier: no activations or attention on the host, the cache on the CPU or on disk, 5 options), the
    fp32 weights all in its 200 GB: where the cache too is all in RAM nothing streams, so only depth 0 is timed;
    where part of it is on disk all three depths are. 2 x (1 + 4 x 3) = 26 a format; with --quant auto the
    runtime's packed q8_0 and q4_0 are tried too: 3 formats, 78.

    A GPU of 8 GB with 200 GB of RAM: the bf16 weights (13.5 GB) stream from RAM, nothing from disk. 13 cache
    options (all on the GPU; 75/50/25/0% on it with the rest all in RAM, half on disk, or all on disk), 2
    activation tiers, attention on the CPU only with part of the cache off the GPU and no recomputing. Depth 2
    only where some of the cache is on disk (8 of the 13 options): 13 x 2 x 2 x 3 - 5 x 2 x 2 (depth 2, no disk)
    = 136 with attention on the GPU, 12 x 2 x 3 - 4 x 2 = 64 on the CPU, 200 in all."""
    workload = Workload(prompt_len=512, output_len=128)
    cpu_only = cpu_only_machine()
    assert search(LLAMA2_7B, cpu_only, "chat", Constraints(quant="none"), workload).candidates_evaluated == 26
    packed = Constraints(quant="auto", packed_formats=("q8_0", "q4_0"))
    assert search(LLAMA2_7B, cpu_only, "chat", packed, workload).candidates_evaluated == 3 * 26
    streaming = search(LLAMA2_7B, machine(gpu_gb=8), "chat", Constraints(quant="none"), workload)
    assert 0 < streaming.prediction.policy.weights.gpu < 1 and streaming.prediction.policy.weights.disk == 0
    assert streaming.candidates_evaluated == 136 + 64


def cpu_machine(flops: dict[str, float], ram_gb: float = 200, half_decode_ratio: float | None = None) -> HardwareSpec:
    cpu = dataclasses.replace(machine().cpu, flops=flops, memory_bytes=int(ram_gb * 1e9),
                              half_decode_ratio=half_decode_ratio)
    return HardwareSpec(id="cpu", gpus=(), cpu=cpu, disk=machine().disk, network=NET)


IN_RAM = Placement(gpu=0.0, cpu=1.0, disk=0.0)


def in_ram(weight_format: str) -> Policy:
    return Policy(weight_format, weights=IN_RAM, kv_cache=IN_RAM, activations=IN_RAM)


def test_a_cpu_does_not_plan_fp16_which_it_would_compute_in_fp32():
    """An fp16 checkpoint on a CPU that multiplies bf16 natively but not fp16, with 20 GB of RAM: in fp16 the 7B
    weights (13.5 GB) would fit and run far faster than fp32's 27 GB streamed partly from disk, but the engine computes
    an fp16 plan in fp32 on a CPU (costmodel.runs_as_planned), so the search plans fp32."""
    fp16_model = dataclasses.replace(LLAMA2_7B, torch_dtype="fp16")
    hardware, workload = cpu_machine({"fp32": 1e12, "bf16": 2e12}, ram_gb=20), Workload()
    plan = search(fp16_model, hardware, "chat", Constraints(quant="none"), workload)
    assert plan.prediction.policy.weight_format == "fp32" and plan.prediction.policy.weights.disk > 0
    fp16_in_ram = evaluate(fp16_model, hardware, in_ram("fp16"), workload)
    assert fp16_in_ram.fits and fp16_in_ram.runtime_s < plan.prediction.runtime_s / 2


def test_a_bf16_kv_cache_costs_its_bytes_with_native_bf16_math_and_three_times_them_converted():
    """2000 more positions of context add 32 blocks x 2000 x 16 KB (K and V of 4096 values in bf16) to a decode
    step's reads: at the CPU's 50 GB/s x 0.8 (EFF's accelerator efficiency: the CPU is the accelerator) where it
    multiplies bf16 natively (bf16 listed at its fp32 rate), HALF_AS_FP32_ON_CPU times that where it converts."""
    def added_reads(flops):
        reads = [decode_step_terms(LLAMA2_7B, cpu_machine(flops), in_ram("bf16"), Workload(prompt_len=p, output_len=2),
                                   EFF)["blocks_reads_s"] for p in (1000, 3000)]
        return reads[1] - reads[0]

    by_hand = 32 * 2000 * 2 * 4096 * 2 / (50e9 * 0.8)
    assert added_reads({"fp32": 1e12, "bf16": 1e12}) == pytest.approx(by_hand, rel=1e-9)
    assert added_reads({"fp32": 1e12}) == pytest.approx(HALF_AS_FP32_ON_CPU * by_hand, rel=1e-9)


def test_a_cpu_listing_no_fp32_rate_is_not_taken_to_multiply_bf16_natively():
    """A hardware file may list a CPU's bf16 rate alone. Native bf16 math is bf16 at or above fp32's rate, so
    with no fp32 rate to compare with the CPU server computes fp32, even with a measured bf16 step at half fp32's;
    the same CPU listing fp32 below bf16 serves bf16."""
    assert plan_server(LLAMA2_7B, cpu_machine({"bf16": 2e12}, half_decode_ratio=0.5), "auto", None, None,
                       EFF).weight_format == "fp32"
    assert plan_server(LLAMA2_7B, cpu_machine({"fp32": 1e12, "bf16": 2e12}, half_decode_ratio=0.5), "auto", None,
                       None, EFF).weight_format == "bf16"
