"""Cache-resident against streamed packed weights in the planner (issue 23): a packed model whose weights fit the CPU's
last-level cache is planned at the kernels' in-cache rate, one of twice the cache or more at their streamed rate, and
one between at a blend; the cache size comes from the hardware spec (detected, or a hardware file's cache_mib)."""

from __future__ import annotations

import dataclasses

import pytest

from hivekeeper.planner.costmodel import (Placement, Policy, Workload, cached_share, evaluate, get_format,
                                          model_numbers, packed_cached_rate, packed_kernel_rate)
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.hardware_catalog import hardware_from_dict, hardware_to_json
from hivekeeper.planner.models import ModelSpec

THIN = ModelSpec(name="thin", family="llama", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                 num_kv_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
                 torch_dtype="bf16")
STREAMED, CACHED = 2e9, 8e9  # weights/s of every format's kernels, beyond the cache and in it
RESIDENT = dict(weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0), activations=Placement(0, 1, 0))


def machine(cache_bytes: int | None) -> HardwareSpec:
    """A CPU whose RAM is so fast that the packed kernels' compute is every step's limit."""
    rates = {name: STREAMED for name in ("q8_0", "q4_0", "q4_1")}
    cpu = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=64 * 10**9, memory_bandwidth=4e13,
                        flops={"fp32": 200e9}, power_watts=65.0, cores=2, packed_kernels=rates,
                        packed_kernels_cached={name: CACHED for name in rates}, cache_bytes=cache_bytes)
    return HardwareSpec(id="test-cpu", gpus=(), cpu=cpu, disk=DiskSpec(10**12, 1e9, 1e9),
                        network=NetworkSpec(1e9, 1e9, 0.01))


def step_s(hardware: HardwareSpec, fmt: str = "q4_1") -> float:
    prediction = evaluate(THIN, hardware, Policy(weight_format=fmt, **RESIDENT), Workload(prompt_len=8, output_len=8))
    return 1.0 / prediction.decode_tokens_per_s


def working_bytes(fmt: str = "q4_1") -> float:
    """What one decode step of THIN reads in turn: its packed blocks, norms in fp32, and the Q8_0 head."""
    numbers = model_numbers(THIN)
    blocks = numbers.layers * (numbers.matrix_params * get_format(fmt).bytes_per_param + numbers.vector_params * 4)
    return blocks + numbers.head_params * get_format("q8_0").bytes_per_param


def weights_per_step() -> float:
    numbers = model_numbers(THIN)
    return numbers.layers * numbers.matrix_params + numbers.head_params


def test_a_model_in_the_cache_is_planned_at_the_cached_rate_and_one_beyond_twice_it_at_the_streamed_rate():
    working = working_bytes()
    streamed = step_s(machine(None))  # cache unknown: every weight streamed
    assert step_s(machine(int(working / 3))) == pytest.approx(streamed, rel=1e-12)  # 3x the cache: streamed
    in_cache = step_s(machine(int(working * 1.01)))
    # only the kernels' time changes, by every weight of a step at 1/CACHED instead of 1/STREAMED (and attention's
    # few FLOPs, a fraction of a percent here, which the planner counts at the kernels' rate too)
    assert streamed - in_cache == pytest.approx(weights_per_step() * (1 / STREAMED - 1 / CACHED), rel=0.01)
    # 1.5x the cache: half of the step's weights from it, half from RAM
    half = step_s(machine(int(working / 1.5)))
    assert streamed - half == pytest.approx(0.5 * (streamed - in_cache), rel=1e-3)


def test_the_share_follows_the_cache_size_and_the_formats_bytes():
    assert list(cached_share([50, 100, 150, 200, 400], 100)) == [1.0, 1.0, 0.5, 0.0, 0.0]
    assert list(cached_share([50], None)) == [0.0]
    # the same cache holds all of a Q4_0 model and only part of the Q8_0 one (more bytes a weight)
    def gain(fmt: str, cache: int) -> float:
        return step_s(machine(None), fmt) - step_s(machine(cache), fmt)

    cache = int(working_bytes("q4_0")) + 1
    assert gain("q4_0", cache) == pytest.approx(gain("q4_0", 10**12), rel=1e-12)
    assert 0 < gain("q8_0", cache) < 0.5 * gain("q8_0", 10**12)


def test_the_rates_fall_back_to_each_other_and_the_cache_travels_in_a_hardware_file():
    cpu = machine(48 << 20).cpu
    quick = dataclasses.replace(cpu, packed_kernels={})  # `measure --quick` timed the cached spans only (< session 15)
    assert packed_kernel_rate(quick, "q4_1") == (CACHED, True) and packed_cached_rate(quick, "q4_1") == CACHED
    full_only = dataclasses.replace(cpu, packed_kernels_cached={})  # a profile measured before the cached spans
    assert packed_cached_rate(full_only, "q4_1") == STREAMED
    doc = hardware_to_json(machine(48 << 20))
    assert doc["cpu"]["cache_mib"] == 48 and doc["cpu"]["packed_kernels_cached_gweights_per_s"]["q4_1"] == 8
    again = hardware_from_dict(doc, where="test.json").cpu
    assert again.cache_bytes == 48 << 20 and again.packed_kernels_cached == cpu.packed_kernels_cached
