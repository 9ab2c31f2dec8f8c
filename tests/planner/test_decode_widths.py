"""Issue 23 (session 15): a one-row CPU decode step is priced per block as its bytes at the measured rate plus the
block's fixed cost, both fitted to spans of a thin model's blocks (576 wide) and a wide one's (2048): per byte of
weights that is 1 / rate + cost / block bytes, the spans' own figures at their widths and between them for a model
whose width lies between. Fed-in numbers; no host speed."""

from __future__ import annotations

import pytest

from hivekeeper.planner.costmodel import Placement, Policy, Workload, decode_step_terms
from hivekeeper.planner.efficiency import default_efficiency
from hivekeeper.planner.hardware import ComputeDevice, DecodeStreaming, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.models import ModelSpec

RAM = Placement(gpu=0.0, cpu=1.0, disk=0.0)
RATE, BLOCK_S = 20e9, 0.25e-3  # as a measurement fitted them: bytes/s of the reads, seconds a block


def machine(block_s: float) -> HardwareSpec:
    streaming = DecodeStreaming(bandwidth_fraction=RATE / 25e9, small_row_reads=2.0, matmul_start_s=0.0,
                                block_overhead_s=block_s, prefill_block_overhead_s=1e-3, row_block_overhead_s=0.0)
    cpu = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=16 * 10**9, memory_bandwidth=25e9,
                        flops={"fp32": 150e9}, power_watts=50.0, cores=2, decode_streaming=streaming,
                        sources={"memory_bandwidth": "measured", "flops": "measured"})
    return HardwareSpec(id="test-cpu", gpus=(), cpu=cpu,
                        disk=DiskSpec(capacity_bytes=10**11, read_bandwidth=1e9, write_bandwidth=1e9),
                        network=NetworkSpec(upload_bps=1e9, download_bps=1e9, rtt_s=0.01))


def model(hidden: int, layers: int) -> ModelSpec:
    """Blocks shaped as the measurement's spans (heads of 64, a quarter as many KV heads, MLP 2.75x wide)."""
    heads = hidden // 64
    return ModelSpec(f"w{hidden}", "llama", layers, hidden, int(hidden * 2.75) // 64 * 64, heads, max(1, heads // 4),
                     64, 8192, False, 1024)


def seconds_per_byte(hardware: HardwareSpec, spec: ModelSpec) -> float:
    """A one-row step's blocks (reads and fixed costs) over their bytes."""
    terms = decode_step_terms(spec, hardware, Policy("fp32", weights=RAM, kv_cache=RAM, activations=RAM),
                              Workload(prompt_len=8, output_len=2), default_efficiency(hardware))
    return (terms["blocks_reads_s"] + terms["blocks_fixed_s"]) / terms["blocks_bytes_min"]


def test_a_model_between_the_measured_widths_is_priced_between_them():
    hardware = machine(BLOCK_S)
    thin, middle, wide = (seconds_per_byte(hardware, model(h, n)) for h, n in ((576, 30), (1024, 10), (2048, 2)))
    assert thin > middle > wide > 1 / RATE
    # each width's figure is the measured terms': 1 / rate + a block's cost over a block's bytes
    for hidden, layers, figure in ((576, 30, thin), (2048, 2, wide)):
        spec = model(hidden, layers)
        terms = decode_step_terms(spec, hardware, Policy("fp32", weights=RAM, kv_cache=RAM, activations=RAM),
                                  Workload(prompt_len=8, output_len=2), default_efficiency(hardware))
        per_block_bytes = terms["blocks_bytes_min"] / layers
        assert figure == pytest.approx(1 / RATE + BLOCK_S / per_block_bytes, rel=1e-6)


def test_without_a_blocks_fixed_cost_every_width_reads_at_the_one_rate():
    hardware = machine(0.0)
    figures = [seconds_per_byte(hardware, model(h, n)) for h, n in ((576, 30), (1024, 10), (2048, 2))]
    assert figures == pytest.approx([1 / RATE] * 3, rel=1e-6)
