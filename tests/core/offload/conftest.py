"""Fixtures shared by the offload engine's tests.

`bf16_measured_cpu` is the one way these tests make this machine a CPU whose 16-bit choice is bf16: pinned flags
with native bf16 math and a saved profile saying a bf16 decode step took 0.6x fp32's (cpu_dtype decides from both).
"""

from __future__ import annotations

import pytest

BF16_CPU = "sse2 avx avx2 fma avx512f avx512_bf16"  # native bf16 math (pinned, see tests/conftest.py)
NO_16_BIT_CPU = "sse2 avx avx2 fma"  # no native 16-bit math


@pytest.fixture
def bf16_measured_cpu(tmp_path, monkeypatch, cpu_flags):
    """A function: pin_cpu(native_bf16=True) pins the CPU flags (with or without native bf16 math) and saves that
    CPU's profile, measured bf16 faster, in a config folder of this test (HIVEKEEPER_CONFIG_DIR, which child
    processes inherit)."""
    from hivekeeper.core.machine import cpu_dtype
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.measurement import HALF_DECODE_KEY, Measurement
    from hivekeeper.core.machine.profiles import new_profile, save_profile

    def pin_cpu(native_bf16: bool = True) -> None:
        cpu_flags(BF16_CPU if native_bf16 else NO_16_BIT_CPU)
        monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path / "config"))
        profile = new_profile(detect_hardware())
        profile.measured_at = 1.7e9
        profile.measurements = [Measurement(HALF_DECODE_KEY, "bf16 decode step / fp32 one", 0.6, "x", 0.0, 3, 0.0,
                                            "simulated")]
        save_profile(profile)
        cpu_dtype.forget()

    return pin_cpu
