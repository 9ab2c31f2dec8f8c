"""The `native` fixture: each kernel test runs on both builds of the native kernels (core/runtime/kernels/
native_kernels.py): "avx2" where this CPU runs it, "portable" everywhere."""

from __future__ import annotations

import pytest

from hivekeeper.core.runtime.kernels import native_kernels


@pytest.fixture(params=["avx2", "portable"])
def native(request, monkeypatch):
    """The kernels' build named by the parameter, loaded for this test (the suite's default again after it)."""
    if native_kernels._compiler() is None:
        pytest.skip("no C compiler here: the kernels cannot be built")
    if request.param == "avx2" and native_kernels.chosen_variant()[0] != "avx2":
        pytest.skip(f"this CPU does not run the avx2 build: {native_kernels.chosen_variant()[1]}")
    monkeypatch.setenv(native_kernels.VARIANT_ENV, "portable" if request.param == "portable" else "auto")
    native_kernels.forget()
    library = native_kernels.library()
    assert library is not None, native_kernels.status()
    assert library.hk_variant().decode() == request.param
    yield library
    monkeypatch.undo()
    native_kernels.forget()
