"""Session 25: a CPU decode step's KV cache reads are priced at the rate `hivekeeper measure` timed the runtime's decode
attention at (hardware.DecodeStreaming.attention_bandwidth), not at the weights' RAM rate; a profile without it (older
ones) keeps the RAM rate. The built-in model's decode over an 8k-token context was predicted ~1.8x its tokens/s: its
attention read the cache at ~14.5 GB/s beside 42 GB/s of RAM. Fed-in numbers; no host speed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hivekeeper.core.machine.measurement import ATTENTION_KEY, BLOCK_OVERHEAD_KEY, SMALL_ROWS_READS_KEY, \
    WEIGHT_STREAM_KEY, Measurement
from hivekeeper.core.machine.profiles import decode_streaming
from hivekeeper.planner.costmodel import Policy, Workload, decode_step_terms
from hivekeeper.planner.efficiency import default_efficiency
from hivekeeper.planner.hardware import HardwareSpec
from hivekeeper.planner.hardware_catalog import hardware_from_dict, hardware_to_json

from .test_step_overhead import RAM, THIN
from .test_step_overhead import machine as step_overhead_machine

KV_TOKEN = 30 * 2 * 3 * 64 * 4.0  # one token's fp32 K and V over every block


def machine(attention_bandwidth: float | None) -> HardwareSpec:
    return step_overhead_machine(0.2e-3, attention_bandwidth)


def step_s(hardware: HardwareSpec, weight_format: str, workload: Workload, batch: int = 1) -> float:
    policy = Policy(weight_format, weights=RAM, kv_cache=RAM, activations=RAM, micro_batch_size=batch)
    return float(decode_step_terms(THIN, hardware, policy, workload, default_efficiency(hardware))["step_s"])


SHORT, LONG = Workload(prompt_len=1, output_len=2048), Workload(prompt_len=1, output_len=8191)
TINY = Workload(prompt_len=1, output_len=2)  # a step the q4_1 kernels' products bound (their FLOPs outlast the reads)


@pytest.mark.parametrize("weight_format", ["q4_1", "fp32"])
@pytest.mark.parametrize("rate", [8e9, 14.5e9])
def test_the_cache_term_grows_at_the_measured_rate(weight_format, rate):
    """Between two contexts a step grows by the extra K and V bytes over the measured attention rate."""
    grown = step_s(machine(rate), weight_format, LONG) - step_s(machine(rate), weight_format, SHORT)
    extra = KV_TOKEN * (LONG.decode_context - SHORT.decode_context)
    assert grown == pytest.approx(extra / rate, rel=1e-6)


def test_the_attention_runs_after_the_products_not_beside_them():
    """Session 26: the measured attention time was bytes among the weights' reads, which a packed step overlaps with
    its kernels' FLOPs, so from a compute-bound short step the cache's first gigabytes cost nothing (SmolLM2 at a
    3000-token context predicted 1.16x its tokens/s). The measured rate is whole steps' difference: it adds."""
    hardware = machine(14.5e9)
    policy = Policy("q4_1", weights=RAM, kv_cache=RAM, activations=RAM)
    short = decode_step_terms(THIN, hardware, policy, TINY, default_efficiency(hardware))
    assert short["blocks_compute_s"] > short["blocks_reads_s"]  # the products bound the short step
    grown = step_s(hardware, "q4_1", SHORT) - step_s(hardware, "q4_1", TINY)
    assert grown == pytest.approx(KV_TOKEN * (SHORT.decode_context - TINY.decode_context) / 14.5e9, rel=1e-6)


@pytest.mark.parametrize("weight_format", ["q4_1", "fp32"])
def test_without_the_measurement_the_cache_is_read_at_the_weights_rate(weight_format):
    hardware = machine(None)
    weights_rate = 25e9 * default_efficiency(hardware).host.bandwidth_fraction
    grown = step_s(hardware, weight_format, LONG) - step_s(hardware, weight_format, SHORT)
    assert grown == pytest.approx(KV_TOKEN * (LONG.decode_context - SHORT.decode_context) / weights_rate, rel=1e-6)


def test_a_batch_beyond_the_kernels_rows_keeps_the_weights_rate():
    """The measurement timed the kernels' one-row attention; a micro-batch of more rows runs through torch."""
    workload = Workload(prompt_len=1, output_len=2048)
    assert step_s(machine(5e9), "fp32", workload, batch=16) == pytest.approx(step_s(machine(None), "fp32", workload,
                                                                                    batch=16))


def measurement(key: str, value: float, unit: str) -> Measurement:
    return Measurement(key, key, value, unit, 0.0, 1, 0.5)


def test_a_profile_carries_the_measured_rate_and_an_older_one_none():
    older = [measurement("ram_read", 40e9, "B/s"), measurement(WEIGHT_STREAM_KEY, 30e9, "B/s"),
             measurement(SMALL_ROWS_READS_KEY, 2.0, "x"), measurement(BLOCK_OVERHEAD_KEY, 40e-6, "s")]
    assert decode_streaming(older).attention_bandwidth is None
    measured = decode_streaming([*older, measurement(ATTENTION_KEY, 14.5e9, "B/s")])
    assert measured.attention_bandwidth == pytest.approx(14.5e9)
    assert dataclasses.replace(measured, attention_bandwidth=None) == decode_streaming(older)


def test_hardware_files_carry_it_and_older_ones_load_without_it():
    spec = machine(14.5e9)
    doc = json.loads(json.dumps(hardware_to_json(spec)))
    assert doc["cpu"]["decode_streaming"]["attention_gbps"] == pytest.approx(14.5)
    assert hardware_from_dict(doc, default_id=spec.id).cpu.decode_streaming == spec.cpu.decode_streaming
    del doc["cpu"]["decode_streaming"]["attention_gbps"]
    assert hardware_from_dict(doc, default_id=spec.id).cpu.decode_streaming.attention_bandwidth is None
