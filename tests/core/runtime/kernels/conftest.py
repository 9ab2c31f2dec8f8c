"""The `native` fixture: each kernel test runs on both fp32-relevant builds of the native kernels
(core/runtime/kernels/native_kernels.py): "avx2" where this CPU runs it, "portable" everywhere. `quant_native` adds
"avx512vnni" (the block-quantized products' VNNI path) where this CPU runs it, with the CPU flags pinned to allow it."""

from __future__ import annotations

import pytest

from hivekeeper.core.runtime.kernels import native_kernels

VNNI_FLAGS = "sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni"  # what the avx512vnni build needs pinned


def load_build(build: str, monkeypatch):
    """The kernels' `build`, loaded (skips where this machine cannot build or run it)."""
    if native_kernels._compiler() is None:
        pytest.skip("no C compiler here: the kernels cannot be built")
    if build == "avx512vnni":
        monkeypatch.setenv("HIVEKEEPER_CPU_FLAGS", VNNI_FLAGS)
    monkeypatch.setenv(native_kernels.VARIANT_ENV, build)
    native_kernels.forget()
    if native_kernels.chosen_variant()[0] != build:
        pytest.skip(f"this CPU does not run the {build} build: {native_kernels.chosen_variant()[1]}")
    library = native_kernels.library()
    assert library is not None, native_kernels.status()
    assert library.hk_variant().decode() == build
    return library


@pytest.fixture(params=["avx2", "portable"])
def native(request, monkeypatch):
    """The kernels' build named by the parameter, loaded for this test (the suite's default again after it)."""
    yield load_build(request.param, monkeypatch)
    monkeypatch.undo()
    native_kernels.forget()


@pytest.fixture(params=["avx512vnni", "avx2", "portable"])
def quant_native(request, monkeypatch):
    """As `native`, with the avx512vnni build too (its VNNI dot products serve the block-quantized products only)."""
    yield load_build(request.param, monkeypatch)
    monkeypatch.undo()
    native_kernels.forget()


@pytest.fixture
def kernel_build(monkeypatch):
    """`kernel_build(name)` loads that build of the kernels in a test (skipping where it cannot run); the suite's
    default again after the test."""
    yield lambda build: load_build(build, monkeypatch)
    monkeypatch.undo()
    native_kernels.forget()
