"""Which dtype a 16-bit (bf16/fp16) plan computes in on this CPU: the one decision the planner and the engine follow.

Native bf16 math (AVX512-BF16, AMX) alone does not make a 16-bit plan faster on a CPU. Decode reads every weight once
per token, and fp32 goes through the native decode kernels (core/runtime/kernels/native_kernels.py) while bf16 goes
through torch's kernels on one thread. Measured on an AMD EPYC with AVX512-BF16 (2 cores, 125M demo model, quiet):
fp32 decoded 83 tokens/s through the native kernels (63 through numpy's BLAS), bf16 33 tokens/s through torch (47
with torch on both cores), although bf16 reads half the bytes; with the two cores busy with other work, 21 against
24. So:

- a CPU without native bf16 math computes 16-bit plans in fp32 (16-bit GEMMs would be emulated, prefill ~100x slower);
- with it, bf16 is used only where `hivekeeper measure` saved a measurement (measure.measure_half_decode: the same
  decode-shaped chain of layer matrices in bf16 and in fp32, each through the kernel the runtime uses) that says a
  bf16 step is faster; without one, fp32;
- fp16 has no native path on these CPUs (AVX512-BF16 is bf16 only): fp16 plans compute in fp32 on a CPU.

`sixteen_bit_choice()` is this machine's decision (its saved profile's measurement, read once per process, pinned
flags and config folder; saving a profile makes it read again); `detect_hardware` applies `choice_for` the machine
it detects. `local_plan.compute_dtype` and the engine's `cpu_attention_dtype` ask `runs_natively_on_cpu`; the
planner sees the decision in the CPU's FLOP/s table (`with_choice`): 16-bit entries below the fp32 rate are how it
models a CPU that converts 16-bit values to fp32 (costmodel.cpu_native_half).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import ComputeDevice, HardwareSpec
from hivekeeper.planner.hardware_catalog import CPU_SOFTWARE_HALF_SLOWDOWN

from hivekeeper.core.machine.cpu_features import FLAGS_ENV, HALF_MATH_FLAGS, cpu_flags, has_half_math
from hivekeeper.core.machine.measurement import HALF_DECODE_KEY, Measurement

SIXTEEN_BIT = ("bf16", "fp16")
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


@dataclass(frozen=True)
class SixteenBitChoice:
    """What a 16-bit plan computes in on this CPU ("bf16" or "fp32") and why, in words for `hivekeeper detect`."""

    dtype: str
    reason: str

    def line(self) -> str:
        return f"CPU 16-bit plans: {self.dtype} ({self.reason})"


def half_math_names() -> str:
    """'AVX512-BF16', 'AMX-BF16 and AVX512-BF16': the native bf16 flags this CPU has (as decisions see them)."""
    return " and ".join(sorted(flag.upper().replace("_", "-") for flag in cpu_flags() & HALF_MATH_FLAGS))


def choose(measurements: list[Measurement] | tuple[Measurement, ...] = ()) -> SixteenBitChoice:
    """The decision from the CPU flags and, where there is one, the measured bf16-vs-fp32 decode step."""
    if not has_half_math():
        return SixteenBitChoice("fp32", "no native bf16 math (AVX512-BF16 or AMX): 16-bit matmuls would be emulated")
    measured = next((m for m in measurements if m.key == HALF_DECODE_KEY), None)
    if measured is None:
        return SixteenBitChoice("fp32", f"{half_math_names()}, but no measurement says a bf16 decode step beats "
                                        "fp32 here: run `hivekeeper measure`")
    faster = measured.value < 1.0
    return SixteenBitChoice("bf16" if faster else "fp32",
                            f"{half_math_names()}, {'and' if faster else 'but'} a bf16 decode step measured "
                            f"{measured.value:.2f}x the time of fp32 ({measured.detail})")


def choice_for(detected: HardwareSpec) -> SixteenBitChoice:
    """The decision for this machine as detected (`detect_hardware` applies it), with its saved profile's
    measurement; a profile that cannot be read counts as none here (`plan --hardware auto` names its error)."""
    if not has_half_math():
        return choose()
    from hivekeeper.core.machine.profiles import load_machine_profile

    try:
        profile = load_machine_profile(detected)
    except InputError:
        profile = None
    return choose(profile.measurements if profile is not None else ())


@lru_cache(maxsize=8)
def saved_choice(flags: str | None, config_dir: str | None) -> SixteenBitChoice:
    """choice_for this machine, detected once per pinned flags and config folder (the arguments are only the
    cache's key: the engine asks for every block of every step)."""
    from hivekeeper.core.machine.detect import detect_hardware

    return choice_for(detect_hardware())


def sixteen_bit_choice() -> SixteenBitChoice:
    """This machine's decision: the flags, then its saved `hivekeeper measure` profile (looked up only with native
    bf16 math, where the measurement can change the answer)."""
    if not has_half_math():
        return choose()
    from hivekeeper.core.machine.profiles import config_dir

    return saved_choice(os.environ.get(FLAGS_ENV), str(config_dir()))


def forget() -> None:
    """Decide again at the next call (profiles.save_profile calls it; tests that pin flags)."""
    saved_choice.cache_clear()


def dtype_name(dtype) -> str:
    """'bf16', 'fp16' or 'fp32' for a torch dtype or a name ('bfloat16', 'torch.float16', 'bf16', ...)."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_NAMES.get(name, name)


def runs_natively_on_cpu(dtype) -> bool:
    """Whether a CPU computes in `dtype` itself (fp32 always; bf16 where chosen); else it computes in fp32."""
    name = dtype_name(dtype)
    return name == "fp32" or name == sixteen_bit_choice().dtype


def with_choice(cpu: ComputeDevice, choice: SixteenBitChoice) -> ComputeDevice:
    """The CPU as the planner should see it under `choice`: 16-bit entries of its FLOP/s table below the fp32 rate
    (as a CPU that converts them, hardware_catalog.CPU_SOFTWARE_HALF_SLOWDOWN) when 16-bit plans compute in fp32,
    bf16 at least at the fp32 rate when bf16 is chosen; the FLOP/s source says why when the table changes."""
    fp32 = cpu.flops.get("fp32", 0.0)
    if fp32 <= 0:
        return cpu
    flops = dict(cpu.flops)
    if choice.dtype == "fp32":
        for name in SIXTEEN_BIT:
            if flops.get(name, 0.0) >= fp32:
                flops[name] = fp32 / CPU_SOFTWARE_HALF_SLOWDOWN
    else:
        flops["bf16"] = max(flops.get("bf16", 0.0), fp32)
    if flops == cpu.flops:
        return cpu
    source = "; ".join(part for part in (cpu.sources.get("flops", ""), choice.line()) if part)
    return dataclasses.replace(cpu, flops=flops, sources={**cpu.sources, "flops": source})
