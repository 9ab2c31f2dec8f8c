"""Each CPU case the code decides on, simulated on every machine with pinned flags (the `cpu_flags` fixture,
HIVEKEEPER_CPU_FLAGS) and HIVEKEEPER_NATIVE: the planner's FLOP/s estimate per SIMD width, VNNI's int8 rate, the
native decode kernels' AVX2 build not used (with the reason) or switched off: the same tokens, and what a 16-bit plan
computes in on a CPU with and without native bf16 math, with no measurement, one that says bf16 is faster and one
that says it is slower (core/machine/cpu_dtype.py) - in the planner, the engine and `hivekeeper detect` alike."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hivekeeper.core.cli.main import main
from hivekeeper.core.machine import cpu_dtype
from hivekeeper.core.machine.detect import detect_cpu_section, detect_hardware
from hivekeeper.core.machine.measurement import HALF_DECODE_KEY, PREFILL_BF16_KEY, PREFILL_FLOPS_KEY, Measurement
from hivekeeper.core.machine.profiles import (MachineProfile, apply_measurements, comparison_rows, load_profile,
                                              new_profile, save_profile)
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import cpu_attention_dtype
from hivekeeper.core.offload.local_plan import PolicyChoice, compute_dtype, engine_plan, fallback_policy
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.model import ModelConfig
from hivekeeper.planner.costmodel import PACKED_KERNEL_ROWS, cpu_bf16_at, cpu_native_half

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AVX2 = "sse2 avx avx2 fma"  # the suite's CPU (tests/conftest.py)
AVX512 = f"{AVX2} avx512f"
BF16 = f"{AVX512} avx512_bf16"  # native bf16 math: the CPU that broke the suite (AMD EPYC with AVX512-BF16)


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """A config folder of its own: no saved profile unless the test saves one."""
    folder = tmp_path / "config"
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(folder))
    cpu_dtype.forget()
    yield folder
    cpu_dtype.forget()


def save_half_decode_measurement(ratio: float) -> None:
    """A saved `hivekeeper measure` profile whose bf16 decode step took `ratio` times the fp32 one."""
    profile = new_profile(detect_hardware())
    profile.measured_at = 1.7e9
    detail = ("simulated as `measure` words it: one-row decode steps through 3 random blocks of width 768: fp32 "
              "(73 MiB, the native kernels (on (2 threads, avx512vnni, decode_kernels.so))) 3.49 ms, bf16 (36 MiB, "
              "torch block by block) 6.05 ms (medians of 7) (steps timed in turn)")
    profile.measurements = [Measurement(HALF_DECODE_KEY, "bf16 decode step / fp32 one", ratio, "x", 0.0, 3, 0.0,
                                        detail)]
    save_profile(profile)  # the engine's decision reads the changed file at its next call


def save_profile_without_half_step(suite_profile) -> None:
    """A saved profile of the suite's fixed figures (tests/conftest.py) under the pinned flags' fingerprint, with no
    16-bit step among them: plans decide by the flags alone, and `generate` does not measure the host first."""
    profile = new_profile(detect_hardware())
    profile.measured_at, profile.measurements = 1.7e9, load_profile(suite_profile).measurements
    assert HALF_DECODE_KEY not in {m.key for m in profile.measurements}
    save_profile(profile)


def detect_text(capsys) -> str:
    assert main(["detect"]) == 0
    return capsys.readouterr().out


# ---- SIMD width and VNNI: the planner's FLOP/s estimate follows the flags ----------------------------------------
@pytest.mark.parametrize("flags, level, per_cycle", [
    ("sse2", "sse", 8), ("sse2 avx", "avx", 16), (AVX2, "avx2", 32), (AVX512, "avx512", 64),
])
def test_the_cpu_section_follows_the_pinned_simd_width(cpu_flags, flags, level, per_cycle):
    cpu_flags(flags)
    section = detect_cpu_section()
    assert f"x {level} FLOP/cycle" in section["sources"]["flops"]
    cpu_flags(AVX2)
    avx2 = detect_cpu_section()["flops_tflops"]["fp32"]
    assert section["flops_tflops"]["fp32"] == pytest.approx(avx2 * per_cycle / 32, rel=0.2)  # clocks move a little


@pytest.mark.parametrize("vnni", ["avx512_vnni", "avx_vnni"])
def test_vnni_gives_an_int8_rate_and_its_absence_none(cpu_flags, vnni):
    cpu_flags(f"{AVX512} {vnni}")
    with_vnni = detect_cpu_section()["flops_tflops"]
    assert with_vnni["int8"] == pytest.approx(4 * with_vnni["fp32"], rel=1e-6)
    cpu_flags(AVX512)
    assert "int8" not in detect_cpu_section()["flops_tflops"]


def test_detect_says_which_flags_decide_and_a_child_process_sees_the_pinned_ones(cpu_flags, capsys):
    cpu_flags(BF16)
    assert "CPU flags: avx2 avx512_bf16 avx512f fma (pinned by HIVEKEEPER_CPU_FLAGS)" in detect_text(capsys)
    child = subprocess.run([sys.executable, "-m", "hivekeeper.core.cli.main", "detect"], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert "CPU flags: avx2 avx512_bf16 avx512f fma (pinned" in child.stdout
    assert "CPU 16-bit plans: bf16 beyond 8 rows a step, fp32 up to 8 (AVX512-BF16; no measurement" in child.stdout


# ---- native decode kernels on and off ----------------------------------------------------------------------------
def greedy_tokens(checkpoint) -> list[int]:
    config = ModelConfig.from_folder(checkpoint)
    choice = PolicyChoice(fallback_policy("fp32", 1), "test", "all in RAM")
    model = OffloadedModel(checkpoint, engine_plan(config, choice, batch=1, max_length=32, device="cpu"))
    try:
        return generate(model, [1, 17, 42, 99, 7], max_new_tokens=12, ignore_eos=True).token_ids[0]
    finally:
        model.close()


@pytest.mark.parametrize("switch, why", [
    ({"flags": "sse2 avx"}, "this CPU lacks AVX2 and FMA (flags pinned by HIVEKEEPER_CPU_FLAGS)"),
    ({"flags": "sse2 avx avx2"}, "this CPU lacks FMA (flags pinned by HIVEKEEPER_CPU_FLAGS)"),
    ({"HIVEKEEPER_NATIVE": "0"}, "off (HIVEKEEPER_NATIVE=0)"),
])
def test_without_avx2_and_fma_or_the_native_kernels_the_tokens_are_the_same(tiny_checkpoint, cpu_flags, monkeypatch,
                                                                            switch, why):
    """The AVX2 kernels are not used (the status says why) and decoding gives the same greedy tokens. Where the host
    itself cannot run them, both runs take the same path: the tokens still agree."""
    before = native_kernels.status()
    on = greedy_tokens(tiny_checkpoint)
    if "flags" in switch:
        cpu_flags(switch["flags"])
    else:
        monkeypatch.setenv("HIVEKEEPER_NATIVE", switch["HIVEKEEPER_NATIVE"])
        native_kernels.forget()
        assert native_kernels.library() is None  # the numpy path
    assert why in native_kernels.status()
    assert greedy_tokens(tiny_checkpoint) == on, f"native kernels {before} -> {native_kernels.status()}"
    # cpu_flags forgets the kernels' state after the test, and monkeypatch restores HIVEKEEPER_NATIVE


# ---- 16-bit plans: the one decision, followed by the engine, the planner and `detect` ------------------------------
MANY_ROWS = PACKED_KERNEL_ROWS + 1  # a decode micro-batch beyond the native kernels' rows (a batch plan's)


def assert_few_row_plans_compute_in_fp32() -> None:
    """A checkpoint's own bf16 (no plan), or a plan made for more rows run in as few as the kernels take."""
    assert compute_dtype("bf16", "cpu") == (torch.float32, "none")
    assert compute_dtype("bf16", "cpu", PACKED_KERNEL_ROWS) == (torch.float32, "none")
    assert compute_dtype("bf16", "cpu", 3, planned_rows=MANY_ROWS) == (torch.float32, "none")
    assert compute_dtype("fp16", "cpu", MANY_ROWS) == (torch.float32, "none")  # no native fp16 math at any rows
    assert compute_dtype("bf16", "cuda") == (torch.bfloat16, "none")  # a GPU plan is not the CPU's decision


def assert_sixteen_bit_plans_compute_in_fp32() -> None:
    assert_few_row_plans_compute_in_fp32()
    assert compute_dtype("bf16", "cpu", 1, planned_rows=1) == (torch.float32, "none")  # whatever the plan
    assert compute_dtype("bf16", "cpu", 512) == (torch.float32, "none")
    assert cpu_attention_dtype(torch.bfloat16) == torch.float32
    assert not cpu_native_half(detect_hardware().cpu)  # the planner costs 16-bit as converted to fp32


def assert_many_row_plans_compute_in_bf16() -> None:
    """On a CPU with native bf16 math, whatever was measured of one-row steps; and a plan made for as few rows as the
    kernels take (the planner names bf16 there only where it predicts fp32 slower, as streamed from disk)."""
    assert compute_dtype("bf16", "cpu", MANY_ROWS) == (torch.bfloat16, "none")
    for rows in (1, PACKED_KERNEL_ROWS):
        assert compute_dtype("bf16", "cpu", rows, planned_rows=rows) == (torch.bfloat16, "none")
    assert compute_dtype("fp16", "cpu", 1, planned_rows=1) == (torch.float32, "none")  # no native fp16 math
    assert cpu_attention_dtype(torch.bfloat16) is None and cpu_attention_dtype(torch.float16) == torch.float32
    cpu = detect_hardware().cpu
    assert cpu_native_half(cpu) and list(cpu_bf16_at(cpu, [1, PACKED_KERNEL_ROWS, MANY_ROWS])) == [
        cpu_dtype.sixteen_bit_choice().at(rows) == "bf16" for rows in (1, PACKED_KERNEL_ROWS, MANY_ROWS)]


def test_without_half_math_16_bit_plans_compute_in_fp32(config_dir):
    choice = cpu_dtype.sixteen_bit_choice()
    assert choice.dtype == "fp32" and "no native bf16 math" in choice.reason and not choice.native
    assert_sixteen_bit_plans_compute_in_fp32()


def test_a_measurement_cannot_make_a_cpu_without_half_math_use_bf16(config_dir):
    save_half_decode_measurement(0.5)
    assert cpu_dtype.sixteen_bit_choice().at(MANY_ROWS) == "fp32"
    assert_sixteen_bit_plans_compute_in_fp32()


def test_half_math_without_a_measurement_uses_bf16_only_beyond_the_kernels_rows(config_dir, cpu_flags, capsys):
    cpu_flags(BF16)
    detected = detect_hardware()
    assert detected.cpu.flops["bf16"] >= detected.cpu.flops["fp32"]  # native: bf16 at its own rate
    assert detected.cpu.half_decode_ratio is None
    assert_few_row_plans_compute_in_fp32()
    assert_many_row_plans_compute_in_bf16()
    assert (f"CPU 16-bit plans: bf16 beyond {PACKED_KERNEL_ROWS} rows a step, fp32 up to {PACKED_KERNEL_ROWS} "
            "(AVX512-BF16; no measurement says a one-row bf16 decode step beats fp32 here: run `hivekeeper measure`)"
            ", bf16 there too in a plan made for so few rows (where the planner predicts fp32 slower") \
        in detect_text(capsys)


def test_half_math_with_a_slower_measured_bf16_step_uses_bf16_only_beyond_the_kernels_rows(config_dir, cpu_flags,
                                                                                         capsys):
    cpu_flags(BF16)
    save_half_decode_measurement(1.7)
    assert_few_row_plans_compute_in_fp32()
    assert_many_row_plans_compute_in_bf16()
    line = next(text for text in detect_text(capsys).splitlines() if text.startswith("CPU 16-bit plans: "))
    assert line.startswith(f"CPU 16-bit plans: bf16 beyond {PACKED_KERNEL_ROWS} rows a step, fp32 up to "
                           f"{PACKED_KERNEL_ROWS} (AVX512-BF16; a one-row bf16 decode step measured 1.70x the time of "
                           "fp32 at load ")
    assert len(line) < 300, line  # the measurement's detail is `measure`'s (a newcomer read ~600 characters)
    # the planner sees the measured bf16 matmul rate (for many rows) and the measured step (for a few)
    rates = [Measurement("cpu_matmul_fp32_prefill", "fp32", 1e11, "FLOP/s", 0.0, 1, 0.0),
             Measurement("cpu_matmul_bf16_prefill", "bf16", 5e11, "FLOP/s", 0.0, 1, 0.0),
             Measurement(HALF_DECODE_KEY, "bf16 / fp32", 1.7, "x", 0.0, 1, 0.0)]
    measured = apply_measurements(detect_hardware(), rates).cpu
    assert measured.flops == {**measured.flops, "fp32": 1e11, "bf16": 5e11} and measured.half_decode_ratio == 1.7
    assert list(cpu_bf16_at(measured, [1, PACKED_KERNEL_ROWS, MANY_ROWS])) == [False, False, True]


def test_a_measured_bf16_prefill_through_blocks_is_the_planners_bf16_rate(config_dir, cpu_flags):
    """Issue 22: where the runtime's bf16 blocks were timed (measure_half_prefill), their rate is bf16's in the table,
    not the bf16 matmul's alone, which they do not reach; still at least fp32's (a native CPU's rule, with_choice)."""
    cpu_flags(BF16)
    matmuls = [Measurement("cpu_matmul_fp32_prefill", "fp32", 1e11, "FLOP/s", 0.0, 1, 0.0),
               Measurement("cpu_matmul_bf16_prefill", "bf16", 5e11, "FLOP/s", 0.0, 1, 0.0)]
    blocks = Measurement(PREFILL_BF16_KEY, "bf16 prefill", 2e11, "FLOP/s", 0.0, 3, 0.0)
    measured = apply_measurements(detect_hardware(), [*matmuls, blocks]).cpu
    assert measured.flops["bf16"] == 2e11 and measured.flops["fp32"] == 1e11
    assert "bf16 200 GFLOP/s (the runtime's prefill passes through decoder blocks)" in measured.sources["flops"]
    assert apply_measurements(detect_hardware(), matmuls).cpu.flops["bf16"] == 5e11  # not timed: the matmul's
    # the Hardware page shows the blocks' rate beside the matmul's (and no such row where it was not timed)
    profile = MachineProfile("x", {}, 1.7e9, [*matmuls, blocks])
    rows = {r.quantity: r for r in comparison_rows(detect_hardware(), profile)}
    assert rows["bf16 prefill through blocks"].measured == 2e11 and rows["bf16 matmul"].measured == 5e11
    assert "bf16 prefill through blocks" not in {r.quantity for r in comparison_rows(
        detect_hardware(), MachineProfile("x", {}, 1.7e9, matmuls))}
    faster_fp32 = Measurement(PREFILL_FLOPS_KEY, "fp32 prefill", 3e11, "FLOP/s", 0.0, 3, 0.0)
    assert apply_measurements(detect_hardware(), [*matmuls, blocks, faster_fp32]).cpu.flops["bf16"] == 3e11


def test_half_math_with_a_faster_measured_bf16_step_uses_bf16_at_every_rows(config_dir, cpu_flags, capsys):
    cpu_flags(BF16)
    save_half_decode_measurement(0.6)
    assert compute_dtype("bf16", "cpu") == (torch.bfloat16, "none")
    assert compute_dtype("fp16", "cpu") == (torch.float32, "none")  # AVX512-BF16 has no fp16 math
    assert_many_row_plans_compute_in_bf16()
    assert list(cpu_bf16_at(detect_hardware().cpu, [1, MANY_ROWS])) == [True, True]
    assert "CPU 16-bit plans: bf16 beyond 8 rows a step, bf16 up to 8 (AVX512-BF16; a one-row bf16 decode step " \
        "measured 0.60x the time of fp32" in detect_text(capsys)


@pytest.fixture(scope="module")
def wide_bf16_checkpoint(tmp_path_factory):
    """8 blocks 512 wide: 46 MB of bf16 blocks, 93 MB in fp32."""
    return make_demo_checkpoint(tmp_path_factory.mktemp("bf16") / "wide-bf16", layers=8, hidden=512, dtype="bf16")


def pin_case(monkeypatch, cpu_flags, flags, ratio, suite_machine_profile) -> None:
    """The CPU flags pinned and a saved profile with this bf16/fp32 step ratio (None: without one), for a `generate`
    run in this process."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # keeps `generate` from changing this process's thread count
    cpu_flags(flags)
    if ratio is not None:
        save_half_decode_measurement(ratio)
    else:
        save_profile_without_half_step(suite_machine_profile)


@pytest.mark.parametrize("ratio", [None, 1.7])
def test_a_chat_plan_whose_fp32_weights_exceed_the_ram_budget_plans_and_runs_bf16_from_ram(
        wide_bf16_checkpoint, config_dir, cpu_flags, capsys, monkeypatch, suite_machine_profile, ratio):
    """The issue: with native bf16 math and no one-row bf16 step measured faster, a chat plan was fp32 even where its
    fp32 weights overflow the RAM budget (streamed from disk) and bf16 ones fit: now the planner prices the bf16 step
    (the measured one, else the slowest seen), plans bf16 all in RAM, and the engine runs the plan's bf16."""
    pin_case(monkeypatch, cpu_flags, BF16, ratio, suite_machine_profile)
    assert main(["generate", "--model", str(wide_bf16_checkpoint), "--prompt", "hello", "--max-new-tokens", "3",
                 "--ignore-eos", "--json", "--ram-budget-gb", "0.07"]) == 0
    result = json.loads(capsys.readouterr().out)
    policy, engine = result["plan"]["policy"], result["plan"]["engine"]
    assert policy["weight_format"] == "bf16" and policy["weights"]["disk"] == 0, result["plan"]
    assert engine["dtype"] == "bfloat16" and engine["blocks"] == {"cpu": 8} and not engine["disk_blocks"]
    assert result["new_tokens"] == 3


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return make_demo_checkpoint(tmp_path_factory.mktemp("bf16") / "tiny-bf16", dtype="bf16")


@pytest.mark.parametrize("flags, ratio, batch, planned, runs", [
    (AVX2, 0.6, 1, "fp32", "float32"),  # no half math: whatever was measured, at any batch
    (AVX2, 0.6, 64, "fp32", "float32"),
    (BF16, None, 1, "fp32", "float32"),  # the case that broke the suite: a 16-bit chat plan by flag alone
    (BF16, 1.7, 1, "fp32", "float32"),  # the AMX VM: a one-row bf16 step measured slower
    (BF16, 1.7, 64, "bf16", "bfloat16"),  # ... and a batch plan's 64-row steps multiply in bf16 (issue 22)
    (BF16, 0.6, 1, "bf16", "bfloat16"),
])
def test_generate_plans_and_runs_what_the_decision_says(bf16_checkpoint, config_dir, cpu_flags, capsys, monkeypatch,
                                                        suite_machine_profile, flags, ratio, batch, planned, runs):
    """`hivekeeper generate --plan auto` on a bf16 checkpoint: the planner picks and the engine runs one dtype, by
    the rows the plan's decode steps multiply. Never from the host's own measurement (a machine never measured would
    be measured quickly first, and its bf16 step decide): each case has a saved profile."""
    pin_case(monkeypatch, cpu_flags, flags, ratio, suite_machine_profile)
    assert main(["generate", "--model", str(bf16_checkpoint), "--prompt", "hello", "--batch", str(batch),
                 "--max-new-tokens", "3", "--ignore-eos", "--json"]) == 0
    said = capsys.readouterr()
    result = json.loads(said.out)
    assert "measuring it quickly" not in said.err
    policy = result["plan"]["policy"]
    assert policy["weight_format"] == planned, result["plan"]
    if planned == "bf16" and ratio == 1.7:  # bf16 by its rows: its micro-batches are beyond the kernels' rows
        assert policy["micro_batch_size"] > PACKED_KERNEL_ROWS
    assert result["plan"]["engine"]["dtype"] == runs and result["new_tokens"] == 3 * batch
