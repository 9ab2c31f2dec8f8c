"""A CPU whose measurement chose bf16 for 16-bit plans (issue 23): the planner takes a one-row bf16 decode step at the
measured ratio of an fp32 step, not at half the fp32 bytes (bf16 goes through torch on one thread, fp32 through the
native kernels: the demo decoded at a third of the speed predicted for half the bytes). Where not measured, the
slowest step seen; and since the search weighs every bf16 candidate by that price, a chat plan is bf16 from RAM where
its fp32 weights would stream from disk (the issue of the 2-core AVX512-BF16 EPYC with 24 GB), fp32 where they fit."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from hivekeeper.core.machine.measurement import HALF_DECODE_KEY, Measurement
from hivekeeper.core.machine.profiles import apply_measurements
from hivekeeper.planner.costmodel import (PACKED_KERNEL_ROWS, UNMEASURED_HALF_DECODE_RATIO, Placement, Policy, Workload,
                                          bf16_by_rows, evaluate)
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.hardware_catalog import hardware_from_dict, hardware_to_json
from hivekeeper.planner.models import ModelSpec
from hivekeeper.planner.policy import Constraints, evaluate_grid, search

MODEL = ModelSpec(name="wide", family="llama", num_layers=8, hidden_size=4096, intermediate_size=11008, num_heads=32,
                  num_kv_heads=8, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                  max_position_embeddings=4096, torch_dtype="bf16")
CPU = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=64 * 10**9, memory_bandwidth=20e9,
                    flops={"fp32": 1e12, "bf16": 1e12}, power_watts=65.0, cores=2)  # native bf16, compute never binds
RAM = dict(weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0), activations=Placement(0, 1, 0))


def step_s(cpu: ComputeDevice, fmt: str) -> float:
    hardware = HardwareSpec(id="t", gpus=(), cpu=cpu, disk=DiskSpec(10**12, 1e9, 1e9), network=NetworkSpec(1e9, 1e9, 0.01))
    return 1.0 / evaluate(MODEL, hardware, Policy(weight_format=fmt, **RAM), Workload(8, 8)).decode_tokens_per_s


def test_a_measured_bf16_step_takes_its_ratio_of_the_fp32_step_not_half_its_bytes():
    fp32 = step_s(CPU, "fp32")
    # not measured: the slowest bf16 step measured on the project's machines, not half the bytes (the blocks' reads
    # dominate; the head and KV cache read their bf16 bytes)
    assert step_s(CPU, "bf16") == pytest.approx(UNMEASURED_HALF_DECODE_RATIO * fp32, rel=0.1)
    measured = dataclasses.replace(CPU, half_decode_ratio=0.9)
    # the blocks' reads dominate (the head and fixed costs aside): 0.9 of the fp32 step, within a few percent
    assert step_s(measured, "bf16") == pytest.approx(0.9 * step_s(measured, "fp32"), rel=0.05)
    assert step_s(measured, "fp32") == fp32  # fp32 plans are as before


def test_the_ratio_comes_from_the_measurement_and_travels_in_a_hardware_file():
    hardware = HardwareSpec(id="t", gpus=(), cpu=CPU, disk=DiskSpec(10**12, 1e9, 1e9), network=NetworkSpec(1e9, 1e9, 0.01))
    measured = apply_measurements(hardware, [Measurement(HALF_DECODE_KEY, "bf16 / fp32", 0.8, "x", 0.0, 3, 0.5)])
    assert measured.cpu.half_decode_ratio == 0.8
    assert hardware_from_dict(hardware_to_json(measured), where="t.json").cpu.half_decode_ratio == 0.8


# ---- issue 22: the 16-bit decision by the rows a step multiplies --------------------------------------------------
def hardware_with(cpu: ComputeDevice) -> HardwareSpec:
    return HardwareSpec(id="t", gpus=(), cpu=cpu, disk=DiskSpec(10**12, 1e9, 1e9), network=NetworkSpec(1e9, 1e9, 0.01))


def step_at(cpu: ComputeDevice, fmt: str, rows: int) -> float:
    policy = Policy(weight_format=fmt, micro_batch_size=rows, **RAM)
    return rows / evaluate(MODEL, hardware_with(cpu), policy, Workload(8, 8)).decode_tokens_per_s


@pytest.mark.parametrize("native, ratio, bf16_rows", [
    (False, 0.5, ()),  # no native bf16 math: fp32 at any rows, whatever was measured
    (True, None, (9, 64, 512)),  # not measured: bf16 only beyond the native kernels' 8 rows
    (True, 1.7, (9, 64, 512)),  # the AMX VM: a one-row bf16 step measured slower
    (True, 1.0, (9, 64, 512)),  # as fast is not faster
    (True, 0.6, (1, 4, 8, 9, 64, 512)),
])
def test_bf16_by_rows_is_bf16_beyond_the_kernels_rows_and_below_only_where_measured_faster(native, ratio, bf16_rows):
    rows = np.array([1, 4, PACKED_KERNEL_ROWS, PACKED_KERNEL_ROWS + 1, 64, 512])
    assert PACKED_KERNEL_ROWS == 8
    assert list(rows[bf16_by_rows(native, ratio, rows)]) == list(bf16_rows)
    assert bool(bf16_by_rows(native, ratio, 9)) == (9 in bf16_rows)  # one row count: one answer


def test_a_bf16_plan_is_charged_the_measured_step_up_to_the_kernels_rows_and_the_bf16_rate_beyond():
    measured = dataclasses.replace(CPU, half_decode_ratio=0.9)
    for rows in (2, PACKED_KERNEL_ROWS):  # reads dominate: the measured step ratio, not half the bytes (0.5)
        assert step_at(measured, "bf16", rows) == pytest.approx(0.9 * step_at(measured, "fp32", rows), rel=0.05)
    # many rows on a CPU whose matmuls bind: bf16 at its own (measured) rate, 5x fp32's here
    slow = dataclasses.replace(CPU, flops={"fp32": 2e10, "bf16": 1e11}, half_decode_ratio=1.7)
    fp32_step, bf16_step = step_at(slow, "fp32", 64), step_at(slow, "bf16", 64)
    assert bf16_step < 0.3 * fp32_step
    flat = dataclasses.replace(slow, flops={"fp32": 2e10, "bf16": 2e10})  # the same rate: only the bytes differ
    assert step_at(flat, "bf16", 64) > 0.8 * fp32_step


def test_the_planner_offers_bf16_only_where_the_engine_computes_bf16():
    """On a CPU with native bf16 math whose one-row bf16 step measured slower (the AMX VM): a chat plan whose fp32
    weights fit in RAM is fp32 (priced at the measured step, bf16 is slower), a batch plan bf16 at micro-batches
    beyond the kernels' rows; every bf16 candidate is its own plan, which the engine computes in bf16 at any rows.
    Without native bf16 math both are fp32."""
    amx = dataclasses.replace(CPU, memory_bandwidth=10e9, flops={"fp32": 1e11, "bf16": 5e11}, half_decode_ratio=1.7)
    workload = Workload(prompt_len=32, output_len=32)
    chat = search(MODEL, hardware_with(amx), "chat", Constraints(quant="none"), workload)
    batch = search(MODEL, hardware_with(amx), "batch", Constraints(quant="none", batch_size=128), workload)
    assert chat.prediction.policy.weight_format == "fp32"
    assert batch.prediction.policy.weight_format == "bf16"
    assert batch.prediction.policy.micro_batch_size > PACKED_KERNEL_ROWS
    grid = evaluate_grid(MODEL, hardware_with(amx), "batch", Constraints(quant="none"), workload)
    bf16 = grid.feasible & (np.array(grid.formats)[grid.cols["fmt"]] == "bf16")
    assert (grid.cols["b"][bf16] > PACKED_KERNEL_ROWS).any() and (grid.cols["b"][bf16] <= PACKED_KERNEL_ROWS).any()
    converting = dataclasses.replace(amx, flops={"fp32": 1e11, "bf16": 1e10})  # no native bf16 math
    for goal, size in (("chat", None), ("batch", 128)):
        plan = search(MODEL, hardware_with(converting), goal, Constraints(quant="none", batch_size=size), workload)
        assert plan.prediction.policy.weight_format == "fp32"


# ---- a chat plan whose fp32 weights would stream from disk where bf16 ones fit in RAM -----------------------------
# MODEL's 8 blocks: 3.1 GB in fp32, 1.6 GB in bf16 (with its head and embeddings 3.6 and 1.8 GB)
SMALL_RAM = dict(memory_bytes=5 * 10**9, memory_bandwidth=10e9, flops={"fp32": 1e11, "bf16": 2e11})
SLOW_DISK = DiskSpec(10**12, 0.5e9, 0.5e9)


def chat_machine(ratio: float | None, ram_bytes: int = SMALL_RAM["memory_bytes"]) -> HardwareSpec:
    """A 2-core-like CPU with native bf16 math, `ram_bytes` of RAM and a slow disk."""
    cpu = dataclasses.replace(CPU, **{**SMALL_RAM, "memory_bytes": ram_bytes}, half_decode_ratio=ratio)
    return HardwareSpec(id="t", gpus=(), cpu=cpu, disk=SLOW_DISK, network=NetworkSpec(1e9, 1e9, 0.01))


CHAT = Workload(prompt_len=64, output_len=64)


def best_of(grid, fmt: str) -> int:
    """The index of the grid's best feasible candidate in `fmt`."""
    mine = np.where(grid.feasible & (np.array(grid.formats)[grid.cols["fmt"]] == fmt))[0]
    return int(mine[np.argmax(grid.score[mine])])


@pytest.mark.parametrize("ratio", [None, 1.0, 1.25, 1.7])
def test_a_chat_plan_is_bf16_in_ram_where_fp32_would_stream_from_disk(ratio):
    """The issue: on a CPU with native bf16 math and no one-row bf16 step measured faster, every chat plan was fp32,
    its weights streamed from disk where bf16 ones fit in RAM. Priced at the measured bf16 step (or the slowest seen,
    not measured), bf16 from RAM is predicted faster than fp32 from disk, so the plan is bf16, all in RAM."""
    hardware = chat_machine(ratio)
    plan = search(MODEL, hardware, "chat", Constraints(quant="none"), CHAT)
    policy = plan.prediction.policy
    assert policy.weight_format == "bf16" and policy.weights.disk == 0 and policy.micro_batch_size == 1
    step = ratio or UNMEASURED_HALF_DECODE_RATIO
    charged = f"its bf16 step runs through torch, charged {step:.3g}x the fp32 kernels'"
    assert charged in plan.reason  # the reason says the step is priced above its bytes, and why
    # ... and the time that makes (the step's reads are most of it): not the bf16 bytes' time times the factor
    step_s = float(re.search(r"twice these bytes\): (\S+) s a step", plan.reason).group(1))
    assert step_s == pytest.approx(1.0 / plan.prediction.decode_tokens_per_s, rel=0.1)
    grid = evaluate_grid(MODEL, hardware, "chat", Constraints(quant="none"), CHAT)
    bf16, fp32 = best_of(grid, "bf16"), best_of(grid, "fp32")
    assert grid.cols["wd"][fp32] > 0.3  # fp32's best streams a third of its weights from disk
    assert grid.out["runtime_s"][bf16] < 0.7 * grid.out["runtime_s"][fp32]
    # the plan says what it weighed: fp32's best, its speed and its share on disk (`plan`'s "weighed:")
    (other,) = plan.other_formats
    assert other.weight_format == "fp32" and other.on_disk == pytest.approx(grid.cols["wd"][fp32])
    assert other.decode_tokens_per_s == pytest.approx(grid.out["decode_tps"][fp32])


@pytest.mark.parametrize("ratio", [None, 1.25, 1.7])
def test_a_chat_plan_stays_fp32_where_its_fp32_weights_fit_in_ram(ratio):
    """The native kernels' fp32 step beats torch's bf16 one (measured 1.0-2.5x its time): where fp32 fits in RAM a
    chat plan stays fp32, as before."""
    plan = search(MODEL, chat_machine(ratio, ram_bytes=64 * 10**9), "chat", Constraints(quant="none"), CHAT)
    assert plan.prediction.policy.weight_format == "fp32" and plan.prediction.policy.weights.disk == 0


def test_a_few_row_bf16_plan_runs_in_bf16_a_plan_made_for_more_rows_run_on_few_in_fp32():
    """The rule the engine follows (core/machine/cpu_dtype_rule): a plan made for at most the kernels' rows computes in
    the bf16 it names (the planner priced it so); a batch plan made for more rows, run in micro-batches of as few,
    in fp32 (issue 22), unless a measured bf16 step is faster; no plan (a checkpoint's own dtype): fp32."""
    assert bool(bf16_by_rows(True, None, 1, planned_rows=1))
    assert bool(bf16_by_rows(True, 1.7, PACKED_KERNEL_ROWS, planned_rows=PACKED_KERNEL_ROWS))
    assert not bf16_by_rows(True, 1.7, 3, planned_rows=64) and not bf16_by_rows(True, None, 1)
    assert bool(bf16_by_rows(True, 0.6, 3, planned_rows=64))
    assert not bf16_by_rows(False, 0.6, 1, planned_rows=1)  # no native bf16 math: fp32 whatever the plan


def test_a_cpu_server_is_bf16_only_where_a_few_row_step_is():
    from hivekeeper.planner.costmodel import machine_view
    from hivekeeper.planner.efficiency import default_efficiency
    from hivekeeper.planner.swarm import choose_server_format

    def server_format(ratio):
        hardware = hardware_with(dataclasses.replace(CPU, half_decode_ratio=ratio))
        return choose_server_format(MODEL, machine_view(hardware), "auto", 512, default_efficiency(hardware))

    assert [server_format(r) for r in (None, 1.7, 0.6)] == ["fp32", "fp32", "bf16"]
