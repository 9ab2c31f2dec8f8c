"""The packed CPU formats (GGUF Q8_0/Q4_0/Q4_1) in the planner (issue 16 item 3): their bytes, a decode step bound by
the slower of RAM reads and the kernels' measured (or default) speed, the bottleneck in words, and --quant auto that
never picks bitsandbytes on a CPU."""

from __future__ import annotations

import dataclasses

import pytest

from hivekeeper.planner.costmodel import (DEFAULT_PACKED_WEIGHTS_PER_CORE_S, Placement, Policy, Workload,
                                          block_weight_bytes, evaluate, model_numbers, packed_kernel_rate)
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.formats import PACKED_FORMATS, get_format
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.hardware_catalog import hardware_from_dict, hardware_to_json
from hivekeeper.planner.models import ModelSpec
from hivekeeper.planner.policy import Constraints, candidate_formats, search
from hivekeeper.planner.costmodel import PACKED_KERNEL_ROWS, machine_view, rows_words

LLAMA_7B = ModelSpec(name="llama-7b", family="llama", num_layers=32, hidden_size=4096, intermediate_size=11008,
                     num_heads=32, num_kv_heads=32, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                     max_position_embeddings=4096, torch_dtype="fp16")
DISK = DiskSpec(capacity_bytes=2000 * 10**9, read_bandwidth=1e9, write_bandwidth=1e9)
NET = NetworkSpec(upload_bps=1e9, download_bps=1e9, rtt_s=0.01)


def cpu_machine(ram_gbps: float = 20.0, kernels: dict[str, float] | None = None, cores: int = 4) -> HardwareSpec:
    cpu = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=64 * 10**9, memory_bandwidth=ram_gbps * 1e9,
                        flops={"fp32": 200e9}, power_watts=65.0, cores=cores, packed_kernels=dict(kernels or {}))
    return HardwareSpec(id="test-cpu", gpus=(), cpu=cpu, disk=DISK, network=NET)


GPU = ComputeDevice(kind="gpu", name="Test GPU", memory_bytes=24 * 10**9, memory_bandwidth=1000e9,
                    flops={"fp16": 100e12, "bf16": 100e12, "fp32": 20e12}, power_watts=300.0, host_link_bandwidth=25e9)
GPU_MACHINE = dataclasses.replace(cpu_machine(), id="test-gpu", gpus=(GPU,))
RESIDENT = dict(weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0), activations=Placement(0, 1, 0))
WORKLOAD = Workload(prompt_len=32, output_len=32)


def decode(hardware: HardwareSpec, weight_format: str):
    return evaluate(LLAMA_7B, hardware, Policy(weight_format=weight_format, **RESIDENT), WORKLOAD)


@pytest.mark.parametrize("name, block_bytes", [("q8_0", 34), ("q4_0", 18), ("q4_1", 20)])
def test_packed_formats_take_their_block_bytes_per_32_weights_as_the_runtime_stores_them(name, block_bytes):
    from hivekeeper.core.runtime.quant.blocks import FORMATS

    assert get_format(name).bytes_per_param == block_bytes / 32 == FORMATS[name].bytes_per_weight
    numbers = model_numbers(LLAMA_7B)
    # matrices packed, norms in fp32 (the runtime computes packed blocks in fp32)
    assert block_weight_bytes(LLAMA_7B, name) == numbers.matrix_params * block_bytes / 32 + numbers.vector_params * 4


def test_memory_bound_decode_is_faster_the_fewer_bytes_a_format_reads():
    fast_kernels = cpu_machine(ram_gbps=10.0, kernels={name: 1e12 for name in PACKED_FORMATS})
    speeds = {name: decode(fast_kernels, name).decode_tokens_per_s for name in ("fp32", "q8_0", "q4_1", "q4_0")}
    assert speeds["fp32"] < speeds["q8_0"] < speeds["q4_1"] < speeds["q4_0"]
    # bytes per weight 4 : 1.0625 is most of the step (norms, head and cache aside)
    assert speeds["q8_0"] / speeds["fp32"] > 2.5
    for name in ("q8_0", "q4_1", "q4_0"):
        assert decode(fast_kernels, name).bottleneck == "ram bandwidth"


def test_a_slow_kernel_makes_the_packed_kernels_the_bottleneck_in_words():
    slow = cpu_machine(ram_gbps=50.0, kernels={"q4_0": 2e9, "q8_0": 2e9})
    four = decode(slow, "q4_0")
    assert four.bottleneck == "packed kernel compute"
    assert four.bottleneck_detail.startswith("CPU 4-bit kernel compute: per decode step the q4_0 kernels")
    assert "2 G weights/s (measured)" in four.bottleneck_detail and "RAM bandwidth" not in four.bottleneck_detail
    eight = decode(slow, "q8_0")
    assert eight.bottleneck == "packed kernel compute" and eight.bottleneck_detail.startswith("CPU 8-bit kernel")
    # the step is the kernels' time: 6.5e9 weights at 2e9/s, reads overlapped, plus the fixed costs
    weights = LLAMA_7B.num_layers * model_numbers(LLAMA_7B).matrix_params
    # the blocks' weights named apart from the LM head and from attention, whose products grow with the context: the
    # same weights for a longer prompt (`plan`'s 512 + 128 tokens beside a short `generate`)
    longer = evaluate(LLAMA_7B, slow, Policy(weight_format="q4_0", **RESIDENT),
                      Workload(prompt_len=512, output_len=128))
    for detail in (four.bottleneck_detail, longer.bottleneck_detail):
        assert f"unpack the blocks' {weights / 1e9:.3g} G packed weights and multiply them by 1 row (the LM head's " \
               f"{model_numbers(LLAMA_7B).head_params / 1e6:.3g} M weights on their own q8_0 kernel)" in detail, detail
    assert four.bottleneck_detail != longer.bottleneck_detail  # the attention products
    assert weights / 2e9 < four.decode_step_s < weights / 2e9 * 1.3


def test_the_kernel_bound_line_names_the_rows_a_step_runs_not_two_passes_where_the_cpu_runs_one():
    """A newcomer (session 22) read "2 micro-batches of 4 rows" as two passes; a CPU with K/V kept runs the 8 rows as
    one step (decode_parts), and a plan that recomputes K/V runs its micro-batches in turn."""
    slow = cpu_machine(ram_gbps=50.0, kernels={"q4_0": 2e9})
    split = dict(micro_batch_size=4, num_micro_batches=2, **RESIDENT)
    kept = evaluate(LLAMA_7B, slow, Policy(weight_format="q4_0", **split), WORKLOAD).bottleneck_detail
    assert "multiply them by 8 rows (the plan's 2 micro-batches of 4, run as one step) (the LM head" in kept, kept
    assert rows_words(machine_view(slow), Policy(kv_recompute=True, **split)) == "2 micro-batches of 4 rows"
    assert rows_words(machine_view(GPU_MACHINE), Policy(**split)) == "2 micro-batches of 4 rows"
    assert rows_words(machine_view(slow), Policy(micro_batch_size=3, **RESIDENT)) == "3 rows"


@pytest.mark.parametrize("kernel_rate", [2e9, 5e10, 1.2e11, 2.5e11, 1e12])
def test_compute_bound_from_the_batch_whose_step_the_kernels_bound(kernel_rate):
    """`plan`'s "compute-bound from batch N" agrees with the why line of each batch: below N the reads bound a step,
    at N the packed kernels (within their rows) or the prefill kernels' compute beyond them. A newcomer (session 22)
    read "compute-bound from batch 2" beside a why line naming the kernels at batch 1."""
    machine = cpu_machine(ram_gbps=50.0, kernels={"q4_0": kernel_rate})

    def bottleneck(rows: int) -> str:
        policy = Policy(weight_format="q4_0", micro_batch_size=rows, **RESIDENT)
        return evaluate(LLAMA_7B, machine, policy, WORKLOAD).bottleneck

    first = decode(machine, "q4_0").min_compute_bound_batch
    assert all(bottleneck(rows) == "ram bandwidth" for rows in range(1, min(first, PACKED_KERNEL_ROWS + 1)))
    assert bottleneck(first) == ("packed kernel compute" if first <= PACKED_KERNEL_ROWS else "cpu compute")
    # the slowest kernels bound one row, the fastest none within their rows, those between some count of rows
    assert (first == 1) == (kernel_rate == 2e9) and (first > PACKED_KERNEL_ROWS) == (kernel_rate == 1e12)


def test_decode_follows_the_measured_kernel_rate_and_else_the_per_core_default():
    base = decode(cpu_machine(ram_gbps=100.0, cores=4), "q4_1")
    rate, measured = packed_kernel_rate(cpu_machine(cores=4).cpu, "q4_1")
    assert not measured and rate == 4 * DEFAULT_PACKED_WEIGHTS_PER_CORE_S["q4_1"]
    assert "default estimate" in base.bottleneck_detail
    twice = decode(cpu_machine(ram_gbps=100.0, kernels={"q4_1": 2 * rate}), "q4_1")
    assert packed_kernel_rate(cpu_machine(kernels={"q4_1": 2 * rate}).cpu, "q4_1") == (2 * rate, True)
    assert 1.6 < twice.decode_tokens_per_s / base.decode_tokens_per_s <= 2.0


def test_cpu_auto_never_picks_bitsandbytes_and_picks_a_packed_format_only_where_the_runtime_holds_it():
    machine = machine_view(cpu_machine())
    plain = candidate_formats(LLAMA_7B, machine, "auto")
    assert not {"int8", "nf4"} & set(plain) and not set(PACKED_FORMATS) & set(plain)
    assert "q4_0" in candidate_formats(LLAMA_7B, machine, "auto", ("q4_0",))
    small_ram = dataclasses.replace(cpu_machine(ram_gbps=20.0), cpu=dataclasses.replace(cpu_machine().cpu,
                                                                                          memory_bytes=8 * 10**9))
    plan = search(LLAMA_7B, small_ram, "chat", Constraints(quant="auto"), WORKLOAD)
    assert plan.prediction is not None and plan.prediction.policy.weight_format not in ("int8", "nf4")
    packed = search(LLAMA_7B, small_ram, "chat", Constraints(quant="auto", packed_formats=("q4_0",),
                                                             file_format="q4_0"), WORKLOAD)
    assert packed.prediction.policy.weight_format == "q4_0" and packed.prediction.policy.weights.disk == 0


def test_a_gpu_keeps_bitsandbytes_and_refuses_the_cpu_formats():
    machine = machine_view(GPU_MACHINE)
    assert {"int8", "nf4"} <= set(candidate_formats(LLAMA_7B, machine, "auto", ("q4_0",)))
    assert "q4_0" not in candidate_formats(LLAMA_7B, machine, "auto", ("q4_0",))
    with pytest.raises(InputError, match="q4_0 is a CPU format"):
        candidate_formats(LLAMA_7B, machine, "q4_0")
    with pytest.raises(InputError, match="CPU format"):
        evaluate(LLAMA_7B, GPU_MACHINE, Policy(weight_format="q4_1"), WORKLOAD)


def test_the_files_own_format_has_no_quality_margin():
    """A packed format the model's file does not store must win by its margin (18% for q4_1); the file's own wins
    on speed alone. Here q4_1 is a little faster than fp32, less than the margin."""
    fp32 = decode(cpu_machine(ram_gbps=400.0), "fp32")
    weights = LLAMA_7B.num_layers * model_numbers(LLAMA_7B).matrix_params
    hardware = cpu_machine(ram_gbps=400.0, kernels={"q4_1": weights / (0.85 * fp32.decode_step_s)})
    q41 = decode(hardware, "q4_1")
    assert 1.0 < q41.decode_tokens_per_s / fp32.decode_tokens_per_s < 1.18
    margin = search(LLAMA_7B, hardware, "chat", Constraints(quant="auto", packed_formats=("q4_1",)), WORKLOAD)
    own = search(LLAMA_7B, hardware, "chat", Constraints(quant="auto", packed_formats=("q4_1",),
                                                         file_format="q4_1"), WORKLOAD)
    assert margin.prediction.policy.weight_format != "q4_1" and own.prediction.policy.weight_format == "q4_1"


def test_measured_kernel_rates_round_trip_through_a_hardware_file_and_bad_ones_name_the_field():
    hardware = cpu_machine(kernels={"q8_0": 7.5e9, "q4_1": 9e9})
    doc = hardware_to_json(hardware)
    assert doc["cpu"]["packed_kernels_gweights_per_s"] == {"q8_0": 7.5, "q4_1": 9}
    assert hardware_from_dict(doc, where="test.json").cpu.packed_kernels == {"q8_0": 7.5e9, "q4_1": 9e9}
    doc["cpu"]["packed_kernels_gweights_per_s"] = {"q5_0": 3}
    with pytest.raises(InputError, match=r"test.json.*cpu.packed_kernels_gweights_per_s.q5_0.*not a packed format"):
        hardware_from_dict(doc, where="test.json")
    doc["cpu"]["packed_kernels_gweights_per_s"] = {"q4_0": -1}
    with pytest.raises(InputError, match=r"packed_kernels_gweights_per_s.q4_0"):
        hardware_from_dict(doc, where="test.json")


def test_the_planners_kernel_row_limit_is_the_runtimes():
    from hivekeeper.core.runtime.kernels import native_kernels
    from hivekeeper.planner.costmodel import PACKED_KERNEL_ROWS

    assert PACKED_KERNEL_ROWS == native_kernels.MAX_ROWS
