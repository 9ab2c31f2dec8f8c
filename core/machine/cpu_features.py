"""This CPU's name and feature flags: the one reader of /proc/cpuinfo, and the one place tests pin them.

Several choices depend on CPU features: the native decode kernels need AVX2 and FMA, 16-bit CPU plans need native
bf16 math (AVX512-BF16 or AMX), and the planner's FLOP/s estimate follows the SIMD width. Machines differ, so the
features can be pinned with HIVEKEEPER_CPU_FLAGS (flags separated by spaces or commas, as /proc/cpuinfo spells them,
e.g. "avx2 fma avx512f avx512_bf16"; "none" for a CPU without any): the test suite runs each case on every machine.
Pinned flags replace what the CPU reports for every decision, except that code which would execute an instruction
(the native kernels) also checks the real CPU, so pinning a flag the CPU lacks can switch a path off, never on.

The last-level cache's size (from /sys) is read here too and pinned the same way (HIVEKEEPER_LLC_MIB): whether a
model's weights fit it decides which measured decode rate the planner takes (issue 23), and the benchmarks size
their spans by it.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

FLAGS_ENV = "HIVEKEEPER_CPU_FLAGS"
LLC_ENV = "HIVEKEEPER_LLC_MIB"
CPU_CACHE_SYS = Path("/sys/devices/system/cpu/cpu0/cache")
LLC_FALLBACK_BYTES = 32 << 20  # where /sys does not say: a typical desktop L3
CPUINFO = Path("/proc/cpuinfo")
HALF_MATH_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
NATIVE_KERNEL_FLAGS = frozenset({"avx2", "fma"})


@lru_cache(maxsize=1)
def cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo, keys lower-cased (empty off Linux)."""
    fields: dict[str, str] = {}
    try:
        text = CPUINFO.read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    return fields


def pinned_flags() -> frozenset[str] | None:
    """The flags HIVEKEEPER_CPU_FLAGS pins, or None when it is unset."""
    value = os.environ.get(FLAGS_ENV)
    if value is None:
        return None
    flags = frozenset(value.replace(",", " ").lower().split())
    return flags - {"none"}


def reported_flags() -> frozenset[str]:
    """What the CPU itself reports (x86 'flags', Arm 'features'; 'neon' for an Arm machine that lists none)."""
    info = cpuinfo_fields()
    flags = frozenset((info.get("flags") or info.get("features") or "").split())
    if not flags and platform.machine().lower() in ("arm64", "aarch64"):
        return frozenset({"neon"})
    return flags


def cpu_flags() -> frozenset[str]:
    """The flags every decision uses: the pinned ones when HIVEKEEPER_CPU_FLAGS is set, else the reported ones."""
    pinned = pinned_flags()
    return reported_flags() if pinned is None else pinned


def cpu_model_name() -> str:
    """'AMD EPYC 7B13', or what platform knows when /proc/cpuinfo has no name."""
    info = cpuinfo_fields()
    name = info.get("model name") or info.get("hardware") or platform.processor() or platform.machine() or "CPU"
    return " ".join(name.split())


def has_half_math(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX); without it 16-bit GEMMs are emulated."""
    return bool((cpu_flags() if flags is None else flags) & HALF_MATH_FLAGS)


def native_kernel_flags_missing(flags: frozenset[str] | None = None) -> list[str]:
    """Which of AVX2 and FMA the decision flags lack (empty when the native kernels may run)."""
    flags = cpu_flags() if flags is None else flags
    return sorted(NATIVE_KERNEL_FLAGS - flags)


def describe() -> str:
    """One line for `hivekeeper detect`: the flags that matter here, and whether they are pinned."""
    flags = cpu_flags()
    shown = sorted(flags & {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "neon"})
    origin = f"pinned by {FLAGS_ENV}" if pinned_flags() is not None else "reported by the CPU"
    return f"{' '.join(shown) or 'no SIMD flags of interest'} ({origin})"


def last_level_cache_bytes() -> int:
    """The largest CPU cache (the last level, e.g. L3) in bytes: HIVEKEEPER_LLC_MIB where set, else /sys (Linux),
    else LLC_FALLBACK_BYTES."""
    pinned = os.environ.get(LLC_ENV)
    if pinned:
        return int(float(pinned) * (1 << 20))
    sizes = []
    for index in CPU_CACHE_SYS.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=LLC_FALLBACK_BYTES)
