"""Issue 23 (session 16): a decode step's fixed cost beyond its blocks and LM head (embedding, sampling, the loop) is
measured (hardware.DecodeStreaming.step_overhead_s) and replaces Efficiency.step_overhead_s's 1 ms default; a hardware
file carries it as cpu.decode_streaming.step_overhead_ms, and one without it (older profiles) keeps the default.
Fed-in numbers; no host speed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hivekeeper.planner.costmodel import Placement, Policy, Workload, decode_step_terms
from hivekeeper.planner.efficiency import DEFAULTS, default_efficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import ComputeDevice, DecodeStreaming, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.hardware_catalog import hardware_from_dict, hardware_to_json
from hivekeeper.planner.models import ModelSpec

RAM = Placement(gpu=0.0, cpu=1.0, disk=0.0)
THIN = ModelSpec("thin", "llama", 30, 576, 1536, 9, 3, 64, 49152, True, 2048)


def machine(step_s: float | None, attention_bandwidth: float | None = None) -> HardwareSpec:
    """A 2-core CPU measured as `hivekeeper measure` would (test_attention_bandwidth adds its attention rate)."""
    streaming = DecodeStreaming(bandwidth_fraction=0.8, small_row_reads=2.0, matmul_start_s=0.0,
                                block_overhead_s=40e-6, prefill_block_overhead_s=1e-3, row_block_overhead_s=0.0,
                                step_overhead_s=step_s, attention_bandwidth=attention_bandwidth)
    cpu = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=16 * 10**9, memory_bandwidth=25e9,
                        flops={"fp32": 150e9}, power_watts=50.0, cores=2, decode_streaming=streaming,
                        sources={"memory_bandwidth": "measured", "flops": "measured"},
                        packed_kernels={"q4_1": 30e9, "q8_0": 25e9}, packed_block_overhead_s=50e-6)
    return HardwareSpec(id="test-cpu", gpus=(), cpu=cpu,
                        disk=DiskSpec(capacity_bytes=10**11, read_bandwidth=1e9, write_bandwidth=1e9),
                        network=NetworkSpec(upload_bps=1e9, download_bps=1e9, rtt_s=0.01))


def step_terms(hardware: HardwareSpec, weight_format: str) -> dict[str, float]:
    return decode_step_terms(THIN, hardware, Policy(weight_format, weights=RAM, kv_cache=RAM, activations=RAM),
                             Workload(prompt_len=64, output_len=64), default_efficiency(hardware))


def test_a_measured_step_overhead_replaces_the_default():
    assert default_efficiency(machine(0.25e-3)).host.step_overhead_s == pytest.approx(0.25e-3)
    assert default_efficiency(machine(None)).host.step_overhead_s == DEFAULTS["cpu"].step_overhead_s


@pytest.mark.parametrize("weight_format", ["q4_1", "fp32"])
def test_the_step_moves_by_the_overhead_and_nothing_else(weight_format):
    measured, default = step_terms(machine(0.25e-3), weight_format), step_terms(machine(None), weight_format)
    assert measured["step_overhead_s"] == pytest.approx(0.25e-3)
    assert default["step_s"] - measured["step_s"] == pytest.approx(DEFAULTS["cpu"].step_overhead_s - 0.25e-3)
    for term in ("blocks_reads_s", "blocks_compute_s", "blocks_fixed_s", "head_reads_s", "head_compute_s"):
        assert measured[term] == pytest.approx(default[term])


def test_hardware_files_carry_it_and_older_ones_load_without_it():
    spec = machine(0.25e-3)
    doc = json.loads(json.dumps(hardware_to_json(spec)))
    assert doc["cpu"]["decode_streaming"]["step_overhead_ms"] == pytest.approx(0.25)
    assert hardware_from_dict(doc, default_id=spec.id).cpu.decode_streaming.step_overhead_s == pytest.approx(0.25e-3)
    del doc["cpu"]["decode_streaming"]["step_overhead_ms"]
    older = hardware_from_dict(doc, default_id=spec.id)
    assert older.cpu.decode_streaming == dataclasses.replace(spec.cpu.decode_streaming, step_overhead_s=None)
    assert default_efficiency(older).host.step_overhead_s == DEFAULTS["cpu"].step_overhead_s


@pytest.mark.parametrize("value", [-0.1, 101.0, "fast"])
def test_a_bad_step_overhead_names_the_field(value):
    doc = json.loads(json.dumps(hardware_to_json(machine(0.25e-3))))
    doc["cpu"]["decode_streaming"]["step_overhead_ms"] = value
    with pytest.raises(InputError, match="step_overhead_ms"):
        hardware_from_dict(doc, default_id="test-cpu")
