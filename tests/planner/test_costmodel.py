"""The cost model's formulas against values computed by hand, for three models (a dense Llama, a mixture of experts,
an OPT with biases and LayerNorms), and its behaviour for one policy on a simple made-up machine."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hivekeeper.planner.costmodel import (Placement, Policy, Workload, block_weight_bytes, decode_flops_per_token,
                                          evaluate, evaluate_arrays, format_traits, kv_cache_bytes, machine_view,
                                          model_numbers, policy_columns, weight_bytes)
from hivekeeper.planner.efficiency import Efficiency, MachineEfficiency, default_efficiency, hardware_class
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.models import ModelSpec

NF4_BYTES = (4 + 8 / 64 + 64 / (64 * 256)) / 8  # 4-bit codes + 8-bit absmax per 64 + fp32 pair per 256 absmax

LLAMA2_7B = ModelSpec(name="llama-2-7b", family="llama", num_layers=32, hidden_size=4096, intermediate_size=11008,
                      num_heads=32, num_kv_heads=32, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                      max_position_embeddings=4096)
MIXTRAL = ModelSpec(name="mixtral-8x7b", family="mixtral", num_layers=32, hidden_size=4096, intermediate_size=14336,
                    num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                    max_position_embeddings=32768, num_experts=8, experts_per_token=2)
OPT_30B = ModelSpec(name="opt-30b", family="opt", num_layers=48, hidden_size=7168, intermediate_size=28672,
                    num_heads=56, num_kv_heads=56, head_dim=128, vocab_size=50272, tie_word_embeddings=True,
                    max_position_embeddings=2048, gated_mlp=False, linear_bias=True, norm_has_bias=True,
                    learned_positions=2050, torch_dtype="fp16")

# a made-up machine with round numbers: 100 GB/s, 100 TFLOP/s, 10 GB/s link, 1 GB/s disk
GPU = ComputeDevice(kind="gpu", name="Test GPU", memory_bytes=40 * 10**9, memory_bandwidth=100e9,
                    flops={"fp16": 100e12, "bf16": 100e12, "fp32": 10e12}, power_watts=300.0, host_link_bandwidth=10e9)
CPU = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=200 * 10**9, memory_bandwidth=50e9,
                    flops={"fp32": 1e12}, power_watts=100.0)
DISK = DiskSpec(capacity_bytes=2000 * 10**9, read_bandwidth=1e9, write_bandwidth=1e9)
NET = NetworkSpec(upload_bps=1e9, download_bps=1e9, rtt_s=0.01)
MACHINE = HardwareSpec(id="test", gpus=(GPU,), cpu=CPU, disk=DISK, network=NET)
CPU_ONLY = HardwareSpec(id="test-cpu", gpus=(), cpu=CPU, disk=DISK, network=NET)
# round efficiency numbers so that the expected times below can be written out
EFF = MachineEfficiency(
    Efficiency("test-gpu", matmul_fraction=0.5, bandwidth_fraction=0.8, link_fraction=1.0, disk_fraction=1.0,
               layer_overhead_s=0.3e-3, step_overhead_s=1e-3, runtime_bytes=10**9),
    Efficiency("test-cpu", matmul_fraction=0.5, bandwidth_fraction=0.5, link_fraction=1.0, disk_fraction=1.0,
               layer_overhead_s=0.2e-3, step_overhead_s=1e-3, runtime_bytes=10**9),
)


# ---- memory, FLOPs and bytes by hand --------------------------------------------------------------------------------
def test_llama2_7b_sizes_by_hand():
    matrices = 4 * 4096 * 4096 + 3 * 4096 * 11008  # q, k, v, o + gate, up, down = 202,375,168
    norms = 2 * 4096
    assert block_weight_bytes(LLAMA2_7B, "fp16") == matrices * 2 + norms * 2 == 404_766_720
    assert block_weight_bytes(LLAMA2_7B, "nf4") == pytest.approx(matrices * NF4_BYTES + norms * 2, rel=1e-12)
    outside = 32000 * 4096 * 2 + 4096  # embedding, untied head, final norm
    assert weight_bytes(LLAMA2_7B, "fp16") == 32 * 404_766_720 + outside * 2 == 13_476_831_232
    # 2 (K and V) × 32 layers × 32 heads × 128 dims × 2 bytes × 4096 tokens = 2 GiB
    assert kv_cache_bytes(LLAMA2_7B, 4096) == 2 * 2**30
    # per token at context 1000: each block's matmuls (2 FLOPs per weight) and attention (4 × q_dim × L), LM head
    expected = 32 * (2 * matrices + 4 * 4096 * 1000) + 2 * 32000 * 4096
    assert decode_flops_per_token(LLAMA2_7B, 1000) == expected == 13_738_442_752


def test_mixtral_counts_active_experts_only_in_flops():
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024  # q, o full width; k, v for 8 KV heads = 41,943,040
    expert = 3 * 4096 * 14336  # 176,160,768
    router = 4096 * 8
    numbers = model_numbers(MIXTRAL)
    assert numbers.shared_matrix_params == attention + router
    assert numbers.expert_matrix_params == expert
    assert numbers.vector_params == 2 * 4096
    assert block_weight_bytes(MIXTRAL, "bf16") == 2 * (attention + 8 * expert + router + 2 * 4096)
    assert numbers.flops_per_token == 2 * (attention + 2 * expert + router) == 788_594_688
    assert MIXTRAL.kv_bytes_per_token_per_block(2) == 2 * 8 * 128 * 2 == 4096


def test_mixtral_decode_reads_two_experts_at_batch_one_and_all_at_large_batch():
    machine = machine_view(MACHINE)
    traits = [format_traits(machine, "bf16")]
    workload = Workload(prompt_len=100, output_len=2)  # mean decode context 101

    def bytes_per_step(batch: int) -> float:
        policy = Policy("bf16", micro_batch_size=batch)
        out = evaluate_arrays(model_numbers(MIXTRAL), machine, EFF, workload, traits, policy_columns(machine, policy))
        return float(out["acc_bytes_step"][0])

    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 8
    expert = 3 * 4096 * 14336
    kv = 101 * 4096  # one sequence's cache at context 101
    assert bytes_per_step(1) == pytest.approx(32 * (2 * (attention + 2 * expert) + 2 * 8192 + kv), rel=1e-9)
    touched_512 = 8 * (1 - (1 - 2 / 8) ** 512)  # expected distinct experts for 512 tokens: all 8
    assert touched_512 == pytest.approx(8.0)
    expected_512 = 32 * (2 * (attention + touched_512 * expert) + 2 * 8192 + 512 * kv)
    assert bytes_per_step(512) == pytest.approx(expected_512, rel=1e-9)


def test_opt_30b_with_biases_and_layernorms_by_hand():
    h, i = 7168, 28672
    matrices = 4 * h * h + 2 * h * i  # 616,562,688
    vectors = 4 * h + (i + h) + 2 * 2 * h  # q, k, v, o biases; fc1, fc2 biases; two LayerNorms (weight + bias)
    assert OPT_30B.block_params() == matrices + vectors == 616_655_872
    assert block_weight_bytes(OPT_30B, "int8") == pytest.approx(matrices * 8.02 / 8 + vectors * 2, rel=1e-12)
    assert block_weight_bytes(OPT_30B, "fp32") == 4 * (matrices + vectors)
    assert OPT_30B.kv_bytes_per_token_per_block(2) == 2 * 56 * 128 * 2 == 28_672
    # 144 sequences × 544 tokens: 48 layers × 28,672 bytes per token
    assert kv_cache_bytes(OPT_30B, 544, batch=144) == 144 * 544 * 48 * 28_672


# ---- one policy on the made-up machine ------------------------------------------------------------------------------
def test_all_on_gpu_decode_step_by_hand():
    workload = Workload(prompt_len=1000, output_len=2)  # mean decode context 1001
    pred = evaluate(LLAMA2_7B, MACHINE, Policy("fp16"), workload, EFF)
    layer_bytes = 404_766_720 + 1001 * 16384  # weights + this sequence's K and V
    layer_flops = 2 * 202_375_168 + 4 * 4096 * 1001
    head_bytes, head_flops = 32000 * 4096 * 2, 2 * 32000 * 4096
    layer = layer_bytes / (100e9 * 0.8) + layer_flops / (100e12 * 0.5) + 0.3e-3
    step = 32 * layer + head_bytes / (100e9 * 0.8) + head_flops / (100e12 * 0.5) + 1e-3
    assert pred.decode_step_s == pytest.approx(step, rel=1e-9)
    roof = 32 * max(layer_bytes / 100e9, layer_flops / 100e12) + max(head_bytes / 100e9, head_flops / 100e12)
    assert pred.roofline_decode_tokens_per_s == pytest.approx(1 / roof, rel=1e-9)
    assert pred.decode_tokens_per_s < pred.roofline_decode_tokens_per_s
    assert pred.bottleneck == "gpu memory bandwidth"
    assert pred.fits


def test_streaming_half_the_weights_is_link_bound_and_named():
    workload = Workload(prompt_len=1000, output_len=2)
    policy = Policy("fp16", weights=Placement(0.5, 0.5, 0.0), prefetch_depth=1)
    pred = evaluate(LLAMA2_7B, MACHINE, policy, workload, EFF)
    link_per_layer = 0.5 * 404_766_720 / 10e9  # 20 ms, more than the ~5.6 ms of compute it overlaps
    head = 32000 * 4096 * 2 / 80e9 + 2 * 32000 * 4096 / 50e12
    assert pred.decode_step_s == pytest.approx(32 * link_per_layer + head + 1e-3, rel=1e-6)
    assert pred.bottleneck == "host link"
    assert "50% of the weights" in pred.bottleneck_detail and "10 GB/s" in pred.bottleneck_detail


def test_prefetch_depth_zero_serializes_transfers():
    workload = Workload(prompt_len=1000, output_len=2)
    overlapped = evaluate(LLAMA2_7B, MACHINE, Policy("fp16", weights=Placement(0.5, 0.5, 0.0)), workload, EFF)
    serial = evaluate(LLAMA2_7B, MACHINE, Policy("fp16", weights=Placement(0.5, 0.5, 0.0), prefetch_depth=0),
                      workload, EFF)
    compute = overlapped.step_breakdown_s["accelerator memory"] + overlapped.step_breakdown_s["accelerator compute"] \
        + overlapped.step_breakdown_s["overhead"]
    assert serial.decode_step_s == pytest.approx(compute + overlapped.step_breakdown_s["host link"], rel=1e-6)
    assert serial.decode_step_s > overlapped.decode_step_s


def test_disk_offload_is_disk_bound():
    policy = Policy("fp16", weights=Placement(0.2, 0.3, 0.5), prefetch_depth=2)
    pred = evaluate(LLAMA2_7B, MACHINE, policy, Workload(100, 2), EFF)
    assert pred.bottleneck == "disk"
    disk_per_layer = 0.5 * 404_766_720 / 1e9
    assert pred.step_breakdown_s["disk"] == pytest.approx(32 * disk_per_layer, rel=1e-3)
    assert pred.peak_memory_bytes["disk"] == pytest.approx(0.5 * 32 * 404_766_720, rel=1e-9)


def test_min_compute_bound_batch_follows_the_link_formula():
    # everything streamed over the link: b* = ceil(effective FLOP/s × bytes per weight / (2 × link bandwidth)),
    # here 50 TFLOP/s × 2 B / (2 × 10 GB/s) = 5000 (norms add 0.004%, hence 5001)
    policy = Policy("fp16", weights=Placement(0.0, 1.0, 0.0))
    pred = evaluate(LLAMA2_7B, MACHINE, policy, Workload(100, 2), EFF)
    exact = (404_766_720 / 10e9) * 50e12 / (2 * 202_375_168)
    assert pred.min_compute_bound_batch == math.ceil(exact) == 5001
    assert pred.min_compute_bound_basis == "host link"
    # all resident: the basis is the GPU's own memory; 50 TFLOP/s × 2 B / (2 × 80 GB/s) ≈ 625
    resident = evaluate(LLAMA2_7B, MACHINE, Policy("fp16"), Workload(100, 2), EFF)
    assert resident.min_compute_bound_basis == "GPU memory bandwidth"
    assert resident.min_compute_bound_batch == math.ceil(50e12 * 2 / (2 * 80e9))


def test_decode_attention_grows_with_context():
    short = evaluate(LLAMA2_7B, MACHINE, Policy("fp16", micro_batch_size=16), Workload(100, 2), EFF)
    long = evaluate(LLAMA2_7B, MACHINE, Policy("fp16", micro_batch_size=16), Workload(8000, 2), EFF)
    # 16 sequences × 7900 more tokens × 32 layers × 16 KiB of K/V per token: 66 GB more to read per step
    extra = 16 * 7900 * 32 * 16384 / 80e9
    assert long.decode_step_s - short.decode_step_s == pytest.approx(extra, rel=0.01)


def test_peak_memory_by_hand_and_fit():
    workload = Workload(prompt_len=1000, output_len=24)  # cache of 1024 tokens
    pred = evaluate(LLAMA2_7B, MACHINE, Policy("fp16", micro_batch_size=4), workload, EFF)
    numbers = model_numbers(LLAMA2_7B)
    weights = 13_476_831_232
    cache = 4 * 1024 * 32 * 16384
    hidden_states = 2 * 4 * 1000 * 4096 * 2
    workspace = 4 * 1000 * numbers.workspace_values_per_token * 2 + 4 * 32000 * 4
    assert pred.peak_memory_bytes["gpu"] == pytest.approx(weights + cache + hidden_states + workspace + 10**9, abs=2)
    assert pred.peak_memory_bytes["cpu"] == 10**9  # the framework only
    assert pred.fits
    too_big = evaluate(LLAMA2_7B, MACHINE, Policy("fp16", micro_batch_size=64), Workload(8000, 192), EFF)
    assert too_big.peak_memory_bytes["gpu"] > too_big.capacity_bytes["gpu"] and not too_big.fits


def test_cpu_only_machine_uses_ram_as_the_accelerator():
    pred = evaluate(LLAMA2_7B, CPU_ONLY, Policy("fp32", weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0),
                                               activations=Placement(0, 1, 0)), Workload(100, 2), EFF)
    assert pred.peak_memory_bytes["gpu"] == 0 and pred.peak_memory_bytes["cpu"] > 4 * 202_375_168 * 32
    assert pred.bottleneck == "ram bandwidth"
    # fp32 weights read at the RAM's 50 GB/s × 0.8 (EFF's accelerator set applies to whatever accelerates)
    assert pred.step_breakdown_s["accelerator memory"] == pytest.approx(
        (32 * (4 * 202_375_168 + 4 * 8192 + 101 * 32768) + 4 * 32000 * 4096) / 40e9, rel=1e-9)
    with pytest.raises(InputError, match="one tier"):
        evaluate(LLAMA2_7B, CPU_ONLY, Policy("fp32"), Workload(100, 2), EFF)


def test_sixteen_bit_on_a_cpu_without_half_math_costs_more_than_fp32():
    policy = dict(weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0), activations=Placement(0, 1, 0))
    half = evaluate(LLAMA2_7B, CPU_ONLY, Policy("bf16", **policy), Workload(100, 2), EFF)
    full = evaluate(LLAMA2_7B, CPU_ONLY, Policy("fp32", **policy), Workload(100, 2), EFF)
    # measured: a bf16 decode step takes about 1.5x the fp32 one (weights dominate this step)
    assert 1.3 < half.decode_step_s / full.decode_step_s < 1.5
    assert half.peak_memory_bytes["cpu"] < full.peak_memory_bytes["cpu"]


def test_bitsandbytes_on_a_cpu_is_as_slow_as_measured():
    from hivekeeper.planner.costmodel import CPU_QUANT_SLOWDOWN

    policy = dict(weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0), activations=Placement(0, 1, 0))
    full = evaluate(LLAMA2_7B, CPU_ONLY, Policy("fp32", **policy), Workload(100, 2), EFF)
    for quant in ("int8", "nf4"):
        packed = evaluate(LLAMA2_7B, CPU_ONLY, Policy(quant, **policy), Workload(100, 2), EFF)
        ratio = packed.decode_step_s / full.decode_step_s
        # weights dominate the step: close to the measured factor, a little under it (KV reads, overheads)
        assert 0.8 * CPU_QUANT_SLOWDOWN[quant][0] < ratio <= CPU_QUANT_SLOWDOWN[quant][0]
        assert packed.peak_memory_bytes["cpu"] < full.peak_memory_bytes["cpu"] / 3


def test_policy_batch_curve_matches_evaluate_point_by_point():
    from hivekeeper.planner.costmodel import policy_batch_curve

    policy = Policy("fp16", weights=Placement(0.5, 0.5, 0.0))
    workload = Workload(512, 64)
    curve = policy_batch_curve(LLAMA2_7B, MACHINE, policy, [1, 8, 64, 512], workload, EFF)
    for point in curve:
        single = evaluate(LLAMA2_7B, MACHINE, dataclasses.replace(policy, micro_batch_size=point["batch_size"]),
                          workload, EFF)
        assert point["decode_tokens_per_s"] == pytest.approx(single.decode_tokens_per_s, rel=1e-12)
        assert point["fits"] == single.fits
    speeds = [p["decode_tokens_per_s"] for p in curve]
    assert speeds == sorted(speeds)  # streaming-bound: more sequences share each weight transfer
    assert curve[0]["fits"] and not curve[-1]["fits"]  # 512 × 576 tokens of cache do not fit in 40 GB


def test_bad_inputs_are_input_errors():
    with pytest.raises(InputError, match="prompt-len"):
        Workload(prompt_len=0)
    with pytest.raises(InputError, match="shorter"):
        Workload(prompt_len=100, output_len=100, context_len=150)
    with pytest.raises(InputError, match="sum to 1"):
        Placement(0.5, 0.2, 0.2)
    with pytest.raises(InputError, match="unknown weight format"):
        Policy("fp8")
    with pytest.raises(InputError, match="prefetch"):
        Policy("fp16", prefetch_depth=3)
    with pytest.raises(InputError, match="matmul_fraction"):
        Efficiency("bad", matmul_fraction=1.5, bandwidth_fraction=0.5)


def test_efficiency_classes():
    assert hardware_class(GPU) == "datacenter-gpu"
    assert hardware_class(CPU) == "cpu"
    t4 = ComputeDevice(kind="gpu", name="NVIDIA Tesla T4", memory_bytes=16 * 2**30, memory_bandwidth=320e9,
                       flops={"fp16": 65e12}, power_watts=70.0, host_link_bandwidth=12.9e9)
    geforce = ComputeDevice(kind="gpu", name="NVIDIA GeForce RTX 3090", memory_bytes=24 * 2**30,
                            memory_bandwidth=936e9, flops={"fp16": 71e12}, power_watts=350.0, host_link_bandwidth=25e9)
    assert hardware_class(t4) == "inference-gpu"
    assert hardware_class(geforce) == "consumer-gpu"
    assert default_efficiency(MACHINE).name == "default:datacenter-gpu + default:cpu"
    assert evaluate(LLAMA2_7B, MACHINE, Policy("fp16")).efficiency == "default:datacenter-gpu + default:cpu"


# ---- small-row matmuls on a CPU re-read the weights ---------------------------------------------------------------
CPU_RESIDENT = dict(weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0), activations=Placement(0, 1, 0))


@pytest.mark.parametrize("batch, reads", [(1, 1.0), (2, 5 / 3), (4, 3.0), (8, 3.0)])
def test_cpu_weight_rereads_by_hand(batch, reads):
    rereads = MachineEfficiency(dataclasses.replace(EFF.accelerator, weight_reread_rows=3.0), EFF.host)
    policy = Policy("fp32", micro_batch_size=batch, **CPU_RESIDENT)
    once = evaluate(LLAMA2_7B, CPU_ONLY, policy, Workload(100, 2), EFF)
    pred = evaluate(LLAMA2_7B, CPU_ONLY, policy, Workload(100, 2), rereads)
    # a matmul of one row reads each weight once, of 4 rows (REREAD_ROWS, where the factor is measured) or more 3
    # times, of 2 rows in proportion to its rows beyond the first: 1 + 2 x 1/3
    # 32 blocks of fp32 matrices (read `reads` times), norms, K and V at context 101, and the LM head (read `reads`
    # times), at 50 GB/s × 0.8
    assert pred.step_breakdown_s["accelerator memory"] == pytest.approx(
        (32 * (reads * 4 * 202_375_168 + 4 * 8192 + batch * 101 * 32768) + reads * 4 * 32000 * 4096) / 40e9, rel=1e-9)
    # prefill: 100 × batch rows per block matmul (3 reads), `batch` rows for the LM head
    assert pred.prefill_s - once.prefill_s == pytest.approx(
        (32 * 2 * 4 * 202_375_168 + (reads - 1) * 4 * 32000 * 4096) / 40e9, rel=1e-9)
    assert pred.decode_tokens_per_s <= pred.roofline_decode_tokens_per_s
    if batch > 1:
        assert "re-read" in pred.bottleneck_detail


def test_weight_rereads_are_a_cpu_default_only():
    from hivekeeper.planner.efficiency import DEFAULTS

    assert DEFAULTS["cpu"].weight_reread_rows > 1
    assert all(DEFAULTS[c].weight_reread_rows == 1.0 for c in DEFAULTS if c != "cpu")
    # on a GPU machine the host CPU's set never touches the GPU's matmuls
    host_rereads = MachineEfficiency(EFF.accelerator, dataclasses.replace(EFF.host, weight_reread_rows=8.0))
    policy = Policy("fp16", micro_batch_size=4)
    assert evaluate(LLAMA2_7B, MACHINE, policy, Workload(100, 2), host_rereads).decode_step_s == \
        evaluate(LLAMA2_7B, MACHINE, policy, Workload(100, 2), EFF).decode_step_s
    with pytest.raises(InputError, match="weight_reread_rows"):
        Efficiency("bad", matmul_fraction=0.5, bandwidth_fraction=0.5, weight_reread_rows=0.5)


def test_measured_decode_streaming_sets_the_cpu_factors_and_slows_predictions():
    from hivekeeper.planner.hardware import DecodeStreaming

    streaming = DecodeStreaming(bandwidth_fraction=0.4, small_row_reads=3.5, matmul_start_s=1e-4)
    measured = dataclasses.replace(CPU_ONLY, cpu=dataclasses.replace(CPU_ONLY.cpu, decode_streaming=streaming))
    plain, eff = default_efficiency(CPU_ONLY).accelerator, default_efficiency(measured).accelerator
    assert eff.bandwidth_fraction == 0.4 and eff.weight_reread_rows == 3.5
    assert eff.layer_overhead_s == pytest.approx(plain.layer_overhead_s + 4 * 1e-4)
    policy = Policy("fp32", micro_batch_size=1, **CPU_RESIDENT)
    before = evaluate(LLAMA2_7B, CPU_ONLY, policy, Workload(100, 2), default_efficiency(CPU_ONLY))
    after = evaluate(LLAMA2_7B, measured, policy, Workload(100, 2), default_efficiency(measured))
    assert after.decode_tokens_per_s < before.decode_tokens_per_s
