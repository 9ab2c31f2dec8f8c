"""Issue 23: how the cost model prices a decode step of each shape of model and batch on a measured CPU, and what a
calibration on one model may change for another; every figure is fed in (nothing here is timed)."""

from __future__ import annotations

import pytest

from hivekeeper.core.machine.measurement import (BLOCK_OVERHEAD_KEY, PREFILL_BLOCK_KEY, PREFILL_FLOPS_KEY,
                                                 Measurement, SMALL_ROWS_READS_KEY, WEIGHT_STREAM_KEY)
from hivekeeper.core.machine.profiles import apply_measurements
from hivekeeper.planner.calibration import measured_efficiency
from hivekeeper.planner.costmodel import PACKED_KERNEL_ROWS, Placement, Policy, Workload, evaluate
from hivekeeper.planner.hardware_catalog import get_hardware
from hivekeeper.planner.models import ModelSpec

THIN = ModelSpec("thin", "llama", 30, 576, 1536, 9, 3, 64, 49152, True, 2048)
WIDE = ModelSpec("wide", "llama", 2, 2048, 5632, 32, 8, 64, 8192, False, 2048)


def measured_cpu(prefill_block_s: float, decode_block_s: float = 0.3e-3):
    """A CPU as `hivekeeper measure` leaves it: RAM 12 GB/s, decode steps at 11 GB/s with `decode_block_s` a
    block, prefill passes at 90 GFLOP/s with `prefill_block_s` a block."""
    records = [Measurement("ram_read", "RAM read", 12e9, "B/s", 0.0, 3, 0.0),
               Measurement("cpu_matmul_fp32_prefill", "fp32 matmul", 40e9, "FLOP/s", 0.0, 3, 0.0),
               Measurement(WEIGHT_STREAM_KEY, "decode weight streaming", 11e9, "B/s", 0.0, 3, 0.0),
               Measurement(BLOCK_OVERHEAD_KEY, "fixed cost of a block", decode_block_s, "s", 0.0, 3, 0.0),
               Measurement(SMALL_ROWS_READS_KEY, "4-row reads", 1.5, "x", 0.0, 3, 0.0),
               Measurement(PREFILL_FLOPS_KEY, "fp32 prefill", 90e9, "FLOP/s", 0.0, 3, 0.0),
               Measurement(PREFILL_BLOCK_KEY, "prefill block", prefill_block_s, "s", 0.0, 3, 0.0)]
    return apply_measurements(get_hardware("cpu-generic"), records, when=1.7e9)


def step_seconds(model: ModelSpec, hardware, batch: int) -> float:
    ram = Placement(gpu=0.0, cpu=1.0, disk=0.0)
    policy = Policy(weight_format="fp32", weights=ram, kv_cache=ram, activations=ram, micro_batch_size=batch)
    prediction = evaluate(model, hardware, policy, Workload(prompt_len=8, output_len=8), measured_efficiency(hardware))
    return batch / prediction.decode_tokens_per_s


@pytest.mark.parametrize("model", [THIN, WIDE], ids=["thin", "wide"])
def test_a_decode_of_more_rows_than_the_kernels_take_pays_the_prefills_block_cost(model):
    """Up to PACKED_KERNEL_ROWS rows the native kernels run the whole span in one call (the decode steps' measured
    block cost); more rows run block by block through torch and BLAS, as a prefill does: the prefill passes'
    measured block cost, once per block."""
    cheap, dear = measured_cpu(prefill_block_s=1e-3), measured_cpu(prefill_block_s=5e-3)
    many = 64
    assert step_seconds(model, dear, many) - step_seconds(model, cheap, many) == pytest.approx(
        model.num_layers * 4e-3, rel=1e-6)
    # within the kernels' rows the prefill's block cost plays no part, the decode steps' does
    for rows in (1, 4, PACKED_KERNEL_ROWS):
        assert step_seconds(model, dear, rows) == pytest.approx(step_seconds(model, cheap, rows), rel=1e-9)
    slow_blocks = measured_cpu(prefill_block_s=1e-3, decode_block_s=0.8e-3)
    assert step_seconds(model, slow_blocks, 1) - step_seconds(model, cheap, 1) == pytest.approx(
        model.num_layers * 0.5e-3, rel=1e-6)
    assert step_seconds(model, slow_blocks, many) == pytest.approx(step_seconds(model, cheap, many), rel=1e-9)
