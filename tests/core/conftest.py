"""Fixtures for core tests: a tiny demo checkpoint written once per session, and a CPU whose 16-bit choice is bf16.

`bf16_measured_cpu` is the one way these tests make this machine a CPU whose 16-bit choice is bf16 (or, measured
slower, fp32 with native bf16 math): pinned flags and a saved profile with a measured bf16-vs-fp32 decode step
(cpu_dtype decides from both).
"""

from __future__ import annotations

from pathlib import Path

import pytest

BF16_CPU = "sse2 avx avx2 fma avx512f avx512_bf16"  # native bf16 math (pinned, see tests/conftest.py)
NO_16_BIT_CPU = "sse2 avx avx2 fma"  # no native 16-bit math


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random-weight Llama checkpoint (2 layers, hidden 64, 4 heads / 2 KV heads, vocab 512, fp32, seed 0)
    in Hugging Face format, with tokenizer and chat template. Treat it as read-only: it is shared by all tests."""
    from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

    return make_demo_checkpoint(tmp_path_factory.mktemp("demo") / "tiny-llama")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: intra-op threads only add synchronisation (and on a busy shared machine, long stalls).
    Modules of tiny-model tests use it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def bf16_measured_cpu(tmp_path, monkeypatch, cpu_flags):
    """A function: pin_cpu(native_bf16=True, step_ratio=0.6) pins the CPU flags (with or without native bf16 math)
    and saves that CPU's profile, a bf16 decode step measured at `step_ratio` times fp32's (below 1: bf16 faster), in
    a config folder of this test (HIVEKEEPER_CONFIG_DIR, which child processes inherit)."""
    from hivekeeper.core.machine import cpu_dtype
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.measurement import HALF_DECODE_KEY, Measurement
    from hivekeeper.core.machine.profiles import new_profile, save_profile

    def pin_cpu(native_bf16: bool = True, step_ratio: float = 0.6) -> None:
        cpu_flags(BF16_CPU if native_bf16 else NO_16_BIT_CPU)
        monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path / "config"))
        profile = new_profile(detect_hardware())
        profile.measured_at = 1.7e9
        profile.measurements = [Measurement(HALF_DECODE_KEY, "bf16 decode step / fp32 one", step_ratio, "x", 0.0, 3,
                                            0.0, "simulated")]
        save_profile(profile)
        cpu_dtype.forget()

    return pin_cpu
