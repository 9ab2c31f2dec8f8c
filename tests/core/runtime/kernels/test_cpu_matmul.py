"""cpu_matmul.linear: the numpy-BLAS path equals torch's, and steps aside whenever it must."""

import pytest
import torch
import torch.nn.functional as F

from hivekeeper.core.runtime.kernels import cpu_matmul
from hivekeeper.core.runtime.kernels.cpu_matmul import Linear, blas_active, linear, torch_threads


@pytest.fixture
def blas_on():
    with torch_threads(1):
        assert blas_active()
        yield


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blas_linear_equals_torch(blas_on, rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 512, generator=generator)[:1]  # a view with a leading batch dim
    weight = torch.randn(640, 512, generator=generator)  # above BLAS_MIN_WEIGHT_ELEMENTS
    bias = torch.randn(640, generator=generator) if with_bias else None
    with torch.inference_mode():
        ours = linear(x, weight, bias)
    assert ours.shape == (1, rows, 640)
    torch.testing.assert_close(ours, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


def test_torch_keeps_the_matmul_when_it_runs_several_threads(blas_on, monkeypatch):
    torch_calls = []
    real_linear = F.linear
    monkeypatch.setattr(cpu_matmul.F, "linear", lambda *a: torch_calls.append(1) or real_linear(*a))
    x, weight = torch.randn(1, 512), torch.randn(512, 512)
    with torch.inference_mode():
        linear(x, weight)
        assert torch_calls == []  # one torch thread: numpy's BLAS multiplies
        with torch_threads(2):
            assert not blas_active()  # two torch threads would fight OpenBLAS's
            linear(x, weight)
        assert torch_calls == [1]
        linear(torch.randn(1, 64), torch.randn(192, 64))  # a small matrix stays in the caches: torch's kernel
    assert torch_calls == [1, 1]


def test_falls_back_for_autograd_and_other_dtypes(blas_on):
    layer = Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()  # autograd needs torch's op: gradients arrive
    assert x.grad is not None and layer.weight.grad is not None
    bf16 = linear(torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16))
    assert bf16.dtype == torch.bfloat16


def test_disabled_by_environment(monkeypatch, blas_on):
    monkeypatch.setattr(cpu_matmul, "_DISABLED", True)
    assert not blas_active()
    assert cpu_matmul.use_blas_threads() == torch.get_num_threads() >= 1
