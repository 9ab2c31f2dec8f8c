"""The rule for what a 16-bit (bf16/fp16) plan computes in on a CPU, from its flags and a measurement; and how the
planner sees the answer. core/machine/cpu_dtype.py applies it to this machine for the engine.

Native bf16 math (AVX512-BF16, AMX) alone does not make a 16-bit plan faster on a CPU. Decode reads every weight once
per token, and fp32 goes through the native decode kernels (core/runtime/kernels/native_kernels.py) while bf16 goes
through torch's kernels on one thread. Measured on an AMD EPYC with AVX512-BF16 (2 cores, 125M demo model, quiet):
fp32 decoded 83 tokens/s through the native kernels (63 through numpy's BLAS), bf16 33 tokens/s through torch (47
with torch on both cores), although bf16 reads half the bytes; with the two cores busy with other work, 21 against
24. So:

- a CPU without native bf16 math computes 16-bit plans in fp32 (16-bit GEMMs would be emulated, prefill ~100x slower);
- with it, the rows a plan's decode steps multiply decide (planner/costmodel.bf16_by_rows, the one rule the planner
  applies too): more rows than the native decode kernels take (PACKED_KERNEL_ROWS, 8: a batch plan's micro-batches
  of 16-512 rows, which like a prefill run torch's matmuls) compute in bf16, where AMX multiplies at its measured
  matmul rate (527 GFLOP/s against fp32's ~100 on this project's AMX VM; session 11's bf16 batch plan made 261-353
  tokens/s where fp32 made 212); a few-row step (a chat plan) computes in bf16 where `hivekeeper measure` saved
  a measurement (measure.measure_half_decode: whole decode steps of the same random blocks in bf16 and in fp32, each
  through the runtime's own decode path, timed in turn) that says a bf16 step is faster, or where the plan itself
  was made for so few rows: the planner names bf16 for them only where it prices the bf16 step (measured, else
  costmodel.UNMEASURED_HALF_DECODE_RATIO fp32 steps) faster than fp32 as placed, e.g. bf16 weights in RAM where
  fp32 ones would stream from disk (widened to fp32, such a plan would hold twice the bytes it placed); else
  (a plan made for more rows run on fewer, a checkpoint's own dtype) fp32. On the AMX VM a one-row bf16 step took
  1.1-2.2x fp32's (bf16's norms, rotary, attention and conversions in torch);
- fp16 has no native path on these CPUs (AVX512-BF16 is bf16 only): fp16 plans compute in fp32 on a CPU.

The answer is as good as the conditions of the measurement: on a machine busy with other work the native kernels'
threads lose more than torch's single thread (the 21 against 24 above; `hivekeeper measure --quick` at load 8 found
bf16 at 0.65x), so the reason quotes the load average the measurement saw.

The planner sees the flags in the CPU's FLOP/s table (`with_choice`, applied by detect_hardware and by
profiles.apply_measurements): 16-bit entries below the fp32 rate are how it models a CPU that converts 16-bit values
to fp32 (costmodel.cpu_native_half), bf16 at or above it one that multiplies bf16 natively; and the measured step in
ComputeDevice.half_decode_ratio. It offers a 16-bit plan only where bf16_by_rows says the engine computes it in bf16
(costmodel.runs_as_planned).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hivekeeper.planner.costmodel import PACKED_KERNEL_ROWS, bf16_by_rows
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import ComputeDevice, HardwareSpec
from hivekeeper.planner.hardware_catalog import CPU_SOFTWARE_HALF_SLOWDOWN

from hivekeeper.core.machine.cpu_features import HALF_MATH_FLAGS, cpu_flags, has_half_math
from hivekeeper.core.machine.measurement import HALF_DECODE_KEY, Measurement
from hivekeeper.core.machine.profile_files import machine_fingerprint, profile_path, saved_measurements

SIXTEEN_BIT = ("bf16", "fp16")
CHOICE_WORDS = "CPU 16-bit plans: "  # opens the decision's line, which with_choice appends to the FLOP/s source
# opens the note a native CPU's FLOP/s source carries where its bf16 entry was raised to the fp32 rate (with_choice)
BF16_AT_FP32_WORDS = "bf16 at the fp32 rate, the least a CPU with native bf16 math is charged: "
# why a plan of few rows may be bf16 where the rule's default for them is fp32 (costmodel.bf16_by_rows)
PLANNED_FEW_WORDS = "where the planner predicts fp32 slower, as where fp32 weights would stream from disk"


@dataclass(frozen=True)
class SixteenBitChoice:
    """What a 16-bit plan computes in on this CPU and why, in words for `hivekeeper detect`: `dtype` ("bf16" or
    "fp32") for a plan whose decode steps multiply up to PACKED_KERNEL_ROWS rows; `native`: whether the CPU
    multiplies bf16 natively (then a plan of more rows computes in bf16); `step_ratio`: the measured bf16 decode step
    over fp32's (None: not measured)."""

    dtype: str
    reason: str
    native: bool = False
    step_ratio: float | None = None

    def at(self, rows: int, planned_rows: int | None = None) -> str:
        """'bf16' or 'fp32': what a 16-bit plan whose decode micro-batches multiply `rows` rows, made for
        micro-batches of `planned_rows` (None: no plan, a checkpoint's own dtype), computes in."""
        return "bf16" if bool(bf16_by_rows(self.native, self.step_ratio, rows, planned_rows)) else "fp32"

    def line(self) -> str:
        if not self.native:
            return f"{CHOICE_WORDS}{self.dtype} ({self.reason})"
        planned = f", bf16 there too in a plan made for so few rows ({PLANNED_FEW_WORDS})" \
            if self.dtype == "fp32" else ""
        return (f"{CHOICE_WORDS}{self.at(PACKED_KERNEL_ROWS + 1)} beyond {PACKED_KERNEL_ROWS} rows a step, "
                f"{self.dtype} up to {PACKED_KERNEL_ROWS} ({self.reason}){planned}")


def half_math_names() -> str:
    """'AVX512-BF16', 'AMX-BF16 and AVX512-BF16': the native bf16 flags this CPU has (as decisions see them)."""
    return " and ".join(sorted(flag.upper().replace("_", "-") for flag in cpu_flags() & HALF_MATH_FLAGS))


def choose(measurements: list[Measurement] | tuple[Measurement, ...] = ()) -> SixteenBitChoice:
    """The decision from the CPU flags and, where there is one, the measured bf16-vs-fp32 decode step."""
    if not has_half_math():
        return SixteenBitChoice("fp32", "no native bf16 math (AVX512-BF16 or AMX): 16-bit matmuls would be emulated")
    measured = next((m for m in measurements if m.key == HALF_DECODE_KEY), None)
    if measured is None:
        return SixteenBitChoice("fp32", f"{half_math_names()}; no measurement says a one-row bf16 decode step beats "
                                        "fp32 here: run `hivekeeper measure`", native=True)
    ratio = float(measured.value)
    faster = bool(bf16_by_rows(True, ratio, 1))
    # the measurement's own detail (widths, paths, medians) is `measure`'s table's: with it this line ran to ~600
    # characters (a newcomer, session 22)
    return SixteenBitChoice("bf16" if faster else "fp32",
                            f"{half_math_names()}; a one-row bf16 decode step measured {ratio:.2f}x the time of fp32 "
                            f"at load {measured.loadavg:.1f}", native=True, step_ratio=ratio)


def choose_from_profile(path) -> SixteenBitChoice:
    """The decision with the measurements of the profile file at `path` (none when there is no file); a profile that
    cannot be read counts as none here (`plan --hardware auto` names its error)."""
    if not has_half_math():
        return choose()
    try:
        return choose(saved_measurements(path))
    except InputError:
        return choose()


def choice_for(detected: HardwareSpec) -> SixteenBitChoice:
    """The decision for a machine as detected here, with its saved profile's measurement."""
    return choose_from_profile(profile_path(machine_fingerprint(detected)))


def with_choice(cpu: ComputeDevice, choice: SixteenBitChoice) -> ComputeDevice:
    """The CPU as the planner should see it under `choice`: 16-bit entries of its FLOP/s table below the fp32 rate
    (as a CPU that converts them, hardware_catalog.CPU_SOFTWARE_HALF_SLOWDOWN) where it has no native bf16 math;
    with it, bf16 at its own (measured) rate and at least fp32's, and the measured bf16 decode step as
    ComputeDevice.half_decode_ratio (the few-row half of the rule; profiles.apply_measurements sets it too). The
    FLOP/s source says why where the table changes (a bf16 entry raised to fp32's: raised_note), and on a CPU with
    native bf16 math always (the rows rule)."""
    fp32 = cpu.flops.get("fp32", 0.0)
    if fp32 <= 0:
        return cpu
    flops, own = dict(cpu.flops), cpu.flops.get("bf16", 0.0)
    if not choice.native:
        for name in SIXTEEN_BIT:
            if flops.get(name, 0.0) >= fp32:
                flops[name] = fp32 / CPU_SOFTWARE_HALF_SLOWDOWN
    else:
        flops["bf16"] = max(own, fp32)
    ratio = choice.step_ratio if choice.native and choice.step_ratio is not None else cpu.half_decode_ratio
    said = cpu.sources.get("flops", "")
    if flops == cpu.flops and (not choice.native or CHOICE_WORDS in said):  # a native CPU's line says the rows rule
        return cpu if ratio == cpu.half_decode_ratio else dataclasses.replace(cpu, half_decode_ratio=ratio)
    base = "" if said.startswith(CHOICE_WORDS) else said.split(f"; {CHOICE_WORDS}")[0]  # one decision's line
    raised = raised_note(own, fp32) if choice.native else ""
    source = "; ".join(part for part in (base, choice.line(), raised) if part)
    return dataclasses.replace(cpu, flops=flops, sources={**cpu.sources, "flops": source}, half_decode_ratio=ratio)


def raised_note(own: float, fp32: float) -> str:
    """Where a native CPU's bf16 FLOP/s entry (`own`, 0: none) is below its fp32 rate, and with_choice raises it:
    the words that say the bf16 figure is fp32's and what bf16's own was; else ""."""
    if own >= fp32:
        return ""
    return f"{BF16_AT_FP32_WORDS}{f'its own {own / 1e9:.3g} GFLOP/s' if own > 0 else 'its own rate not measured'}"
