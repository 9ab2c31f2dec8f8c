"""A packed model's prefill in the planner (issue 14 item 12 / issue 23, session 11): since the runtime multiplies
a prompt's rows with the int8 kernels (up to 512 rows per pass over each packed weight), a packed prefill is priced
at the kernels' measured many-row rate (ComputeDevice.packed_prefill) and reads the packed bytes once per 512 rows,
no longer as dequantized fp32 tiles multiplied at the BLAS rate."""

from __future__ import annotations

import dataclasses

import pytest

from hivekeeper.planner.costmodel import (PACKED_PREFILL_ROWS, Placement, Policy, Workload, evaluate, machine_view,
                                          model_numbers, packed_prefill_rate, packed_traits)
from hivekeeper.planner.formats import get_format
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.hardware_catalog import hardware_from_dict, hardware_to_json
from hivekeeper.planner.models import ModelSpec

THIN = ModelSpec(name="thin", family="llama", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                 num_kv_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                 max_position_embeddings=8192, torch_dtype="bf16")
RESIDENT = dict(weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0), activations=Placement(0, 1, 0))


def machine(prefill: dict[str, float] | None = None, ram_gbps: float = 20.0) -> HardwareSpec:
    """A measured CPU (its numbers' fractions are 1): fp32 at 40 GFLOP/s, q4_1 decode at 10 G weights/s."""
    cpu = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=64 * 10**9, memory_bandwidth=ram_gbps * 1e9,
                        flops={"fp32": 40e9}, power_watts=65.0, cores=2, packed_kernels={"q4_1": 10e9},
                        packed_prefill=dict(prefill or {}), sources={"flops": "measured", "memory_bandwidth": "measured"})
    return HardwareSpec(id="test-cpu", gpus=(), cpu=cpu,
                        disk=DiskSpec(capacity_bytes=10**12, read_bandwidth=1e9, write_bandwidth=1e9),
                        network=NetworkSpec(upload_bps=1e9, download_bps=1e9, rtt_s=0.01))


def prefill_s(hardware: HardwareSpec, prompt_len: int, weight_format: str = "q4_1") -> float:
    return evaluate(THIN, hardware, Policy(weight_format=weight_format, **RESIDENT),
                    Workload(prompt_len=prompt_len, output_len=2)).prefill_s


def test_packed_prefill_is_priced_at_the_measured_kernel_rate_not_the_fp32_one():
    slow, fast = machine({"q4_1": 10e9}), machine({"q4_1": 40e9})  # row-weight products/s: 20 and 80 GFLOP/s
    assert packed_prefill_rate(slow.cpu, "q4_1") == (20e9, True)
    assert packed_prefill_rate(machine().cpu, "q4_1") == (40e9, False)  # unmeasured: the fp32 rate stands in
    # a long prompt is compute-bound: 4x the kernels' rate takes the matmul FLOPs' time down 4x
    p = 400
    numbers = model_numbers(THIN)  # the matmuls' FLOPs and causal attention's, every block
    flops = THIN.num_layers * (2.0 * numbers.matrix_params * p + 4.0 * numbers.q_dim * p * (p + 1) / 2)
    slow_s, fast_s = prefill_s(slow, p), prefill_s(fast, p)
    assert slow_s - fast_s == pytest.approx(flops * (1 / 20e9 - 1 / 80e9), rel=0.02)
    # and the fp32 FLOP/s no longer moves a packed prefill that was measured
    faster_fp32 = dataclasses.replace(slow, cpu=dataclasses.replace(slow.cpu, flops={"fp32": 400e9}))
    assert prefill_s(faster_fp32, p) == pytest.approx(slow_s, rel=1e-9)
    assert prefill_s(faster_fp32, p, "fp32") < prefill_s(slow, p, "fp32")


def test_a_packed_prefill_reads_its_packed_bytes_once_per_pass_of_512_rows():
    traits = packed_traits(machine_view(machine({"q4_1": 10e9})), get_format("q4_1"))
    assert traits.read_bytes_gemm == traits.read_bytes_gemv == get_format("q4_1").bytes_per_param  # no fp32 tiles
    # a RAM-bound machine (tiny bandwidth, fast kernels): the prefill's time is its reads, one per 512 rows
    ram_bound = machine({"q4_1": 1e15}, ram_gbps=0.01)
    one, full, more = (prefill_s(ram_bound, p) for p in (1, PACKED_PREFILL_ROWS, PACKED_PREFILL_ROWS + 1))
    numbers, bandwidth = model_numbers(THIN), 0.01e9
    weights_s = THIN.num_layers * numbers.matrix_params * get_format("q4_1").bytes_per_param / bandwidth
    token_cache_s = THIN.num_layers * 2 * numbers.kv_dim * 4.0 / bandwidth  # one token's fp32 K and V, written
    # 512 rows: one read of the weights still, and 511 more tokens' cache
    assert full - one == pytest.approx((PACKED_PREFILL_ROWS - 1) * token_cache_s, rel=0.02)
    # 513 rows: a second pass over the weights
    assert more - full == pytest.approx(weights_s + token_cache_s, rel=0.02)


def test_the_packed_prefill_rate_goes_through_a_hardware_file_and_back():
    spec = machine({"q4_1": 12.5e9, "q8_0": 9e9})
    doc = hardware_to_json(spec)
    assert doc["cpu"]["packed_prefill_gweights_per_s"] == {"q4_1": 12.5, "q8_0": 9.0}
    assert hardware_from_dict(doc).cpu.packed_prefill == {"q4_1": 12.5e9, "q8_0": 9e9}


def test_a_measured_packed_prefill_pays_no_per_block_prefill_cost_beside_its_rate():
    """The measured rate is whole prefill passes through packed blocks (their own costs in it); the fp32 spans'
    per-block prefill cost (mostly OpenBLAS on thin matrices, which packed blocks skip) is not added again. An
    unmeasured packed prefill, priced at the fp32 rate, pays it as fp32 does."""
    from hivekeeper.planner.efficiency import DEFAULTS, MachineEfficiency, with_overrides

    def with_cost(cost_s: float) -> MachineEfficiency:
        cpu = with_overrides(DEFAULTS["cpu"], prefill_layer_overhead_s=cost_s)
        return MachineEfficiency(cpu, cpu)

    def prefill(hardware: HardwareSpec, cost_s: float, weight_format: str = "q4_1") -> float:
        return evaluate(THIN, hardware, Policy(weight_format=weight_format, **RESIDENT),
                        Workload(prompt_len=32, output_len=2), with_cost(cost_s)).prefill_s

    measured, unmeasured = machine({"q4_1": 10e9}), machine()
    assert prefill(measured, 0.05) == pytest.approx(prefill(measured, 0.0), rel=1e-9)
    assert prefill(unmeasured, 0.05) - prefill(unmeasured, 0.0) == pytest.approx(THIN.num_layers * 0.05)
    assert prefill(measured, 0.05, "fp32") - prefill(measured, 0.0, "fp32") == pytest.approx(THIN.num_layers * 0.05)


def test_a_prompt_of_no_more_rows_than_the_decode_kernels_take_runs_at_their_rate():
    """Session 21: an 8-token prompt of the built-in model runs its packed products on the decode kernels (up to
    PACKED_KERNEL_ROWS rows), at their rate, not at the many-row prefill rate (it was predicted 1.9x too fast). Here
    the kernels multiply 4x slower than the prefill rate: a token of an 8-token prompt costs ~4x one of a 16-token
    prompt, and the 8-token prefill takes about as long as 8 rows at the kernels' rate."""
    from hivekeeper.planner.costmodel import PACKED_KERNEL_ROWS

    hardware = machine({"q4_1": 40e9}, ram_gbps=1000.0)  # kernels 10e9 weights/s a row; prefill 40e9; reads ~free
    rows = PACKED_KERNEL_ROWS
    few, many = prefill_s(hardware, rows) / rows, prefill_s(hardware, 2 * rows) / (2 * rows)
    assert 3.0 < few / many < 4.5
    weights = THIN.num_layers * model_numbers(THIN).matrix_params
    assert prefill_s(hardware, rows) == pytest.approx(weights * rows / 10e9, rel=0.15)
