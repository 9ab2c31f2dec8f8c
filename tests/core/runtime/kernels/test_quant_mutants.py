"""The Python side of the quantized kernels (core/runtime/kernels/quant_kernels.py, core/runtime/quant/blocks.py),
checked where the mutation runs found it untested: each format's blocks against an independent decoder of its
layout (tests/core/runtime/ggml_reference.py), sizes, shape and format checks at their limits, packed bytes taken
without a copy, the activation error bound against a loop, and QuantizedLinear's two paths (native kernels for a
few rows, dequantized torch for more rows, a float64 input or autograd) against F.linear."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear, QuantizedMatrix, activation_error_bound
from hivekeeper.core.runtime.quant.blocks import (BLOCK_WEIGHTS, FORMATS, dequantize, format_named,
                                                 format_of_ggml_type, from_gguf, quantize)
from hivekeeper.planner.errors import InputError

from .. import ggml_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# name -> (GGML type id, bytes per block) from the formats' definitions (ggml-common.h)
DEFINED = {"q8_0": (8, 34), "q4_0": (2, 18), "q4_1": (3, 20)}


def weights(outs: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 0.3, (outs, cols)).astype(np.float32)


@pytest.mark.parametrize("name", list(DEFINED))
def test_formats_have_their_defined_type_and_size(name):
    fmt = FORMATS[name]
    assert (fmt.ggml_type, fmt.block_bytes) == DEFINED[name]
    assert fmt.bytes_per_weight == DEFINED[name][1] / 32
    assert fmt.row_bytes(3 * BLOCK_WEIGHTS) == 3 * DEFINED[name][1]
    assert format_named(name.upper()) is fmt and format_of_ggml_type(DEFINED[name][0]) is fmt
    assert int(fmt.gguf_type) == fmt.ggml_type


def test_other_types_are_no_block_format():
    assert format_of_ggml_type(0) is None and format_of_ggml_type(6) is None  # F32, Q5_0
    with pytest.raises(InputError, match="q5_0"):
        format_named("q5_0")


@pytest.mark.parametrize("name", list(DEFINED))
def test_packed_blocks_decode_as_their_layout_says(name):
    """Random block bytes (every quant bit) dequantize to what the format's definition says, exactly, in fp32."""
    raw = ggml_reference.random_blocks(name.upper(), 5, 3 * BLOCK_WEIGHTS, seed=DEFINED[name][0])
    values = dequantize(raw, FORMATS[name])
    assert values.dtype == np.float32 and values.shape == (5, 3 * BLOCK_WEIGHTS)
    assert np.array_equal(values, ggml_reference.decode(name.upper(), raw, (5, 3 * BLOCK_WEIGHTS)).astype(np.float32))
    matrix = QuantizedMatrix(FORMATS[name], raw, 5, 3 * BLOCK_WEIGHTS)
    assert np.array_equal(matrix.dequantize(), values) and matrix.nbytes == raw.nbytes


@pytest.mark.parametrize("name", list(DEFINED))
def test_quantize_packs_rows_of_blocks(name):
    """[outs, cols] -> uint8 [outs, cols / 32 x block bytes]; each row quantized on its own (a row of 10x the scale
    leaves the others' bytes as they were)."""
    w = weights(4, 2 * BLOCK_WEIGHTS)
    packed = quantize(w, FORMATS[name])
    assert packed.dtype == np.uint8 and packed.shape == (4, 2 * DEFINED[name][1]) and packed.flags.c_contiguous
    louder = w.copy()
    louder[1] *= 10
    again = quantize(louder, FORMATS[name])
    assert np.array_equal(again[[0, 2, 3]], packed[[0, 2, 3]]) and not np.array_equal(again[1], packed[1])
    matrix = QuantizedMatrix.quantize(w, name)
    assert (matrix.outs, matrix.cols, matrix.fmt) == (4, 2 * BLOCK_WEIGHTS, FORMATS[name])
    assert np.array_equal(matrix.packed, packed)


@pytest.mark.parametrize("shape", [(0, 32), (4, 0), (4, 48), (32,), (2, 2, 32)])
def test_shapes_the_formats_cannot_hold_are_named(shape):
    with pytest.raises(InputError) as error:
        quantize(np.zeros(shape, np.float32), FORMATS["q8_0"], "layer 3")
    assert "layer 3" in str(error.value) and str(tuple(shape)) in str(error.value)
    with pytest.raises(InputError, match="^tensor 'q': shape"):
        from_gguf(np.zeros(64, np.uint8), FORMATS["q8_0"], shape, "tensor 'q'")


def test_the_smallest_shape_is_held():
    assert quantize(np.ones((1, 32), np.float32), FORMATS["q4_0"]).shape == (1, 18)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_values_that_are_not_finite_are_refused(bad):
    w = np.ones((2, 32), np.float32)
    w[1, 5] = bad
    with pytest.raises(InputError, match="w7: holds NaN or infinite"):
        quantize(w, FORMATS["q4_1"], "w7")


def test_gguf_bytes_are_taken_as_they_are():
    """Contiguous bytes of the right count: the same memory, shaped [outs, row bytes]; a wrong count or dtype is
    named with both counts."""
    fmt = FORMATS["q4_1"]
    raw = ggml_reference.random_blocks("Q4_1", 3, 64).reshape(-1)
    packed = from_gguf(raw, fmt, (3, 64))
    assert packed.shape == (3, 40) and np.shares_memory(packed, raw)
    matrix = QuantizedMatrix.from_gguf(raw, "q4_1", (3, 64))
    assert (matrix.outs, matrix.cols, matrix.fmt) == (3, 64, fmt) and np.shares_memory(matrix.packed, raw)
    with pytest.raises(InputError) as error:
        from_gguf(raw[:-1], fmt, (3, 64), "tensor 'x'")
    assert all(word in str(error.value) for word in ("tensor 'x'", "119", "Q4_1 [3, 64]", "120 bytes"))
    with pytest.raises(InputError, match="int8"):
        from_gguf(raw.view(np.int8), fmt, (3, 64), "t")
    with pytest.raises(InputError, match="tensor 'y'"):
        QuantizedMatrix.from_gguf(raw[:-1], fmt, (3, 64), "tensor 'y'")


def test_the_activation_bound_is_the_sum_over_blocks():
    """By loops: for each output, over blocks, max |x in block| / 254 times the block's sum of |w|."""
    w, x = weights(3, 3 * BLOCK_WEIGHTS, 1), weights(2, 3 * BLOCK_WEIGHTS, 2)
    expected = np.zeros((2, 3))
    for b in range(2):
        for o in range(3):
            for k in range(3):
                part = slice(k * BLOCK_WEIGHTS, (k + 1) * BLOCK_WEIGHTS)
                expected[b, o] += np.abs(x[b, part]).max() / 254 * np.abs(w[o, part].astype(np.float64)).sum()
    np.testing.assert_allclose(activation_error_bound(w, x), expected, rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# matvec and QuantizedLinear
# ---------------------------------------------------------------------------------------------------------------
def test_matvec_adds_the_bias_and_keeps_a_single_vector_single():
    matrix = QuantizedMatrix.quantize(weights(40, 64, 3), "q8_0")
    x, bias = weights(2, 64, 4), np.linspace(-5, 5, 40).astype(np.float32)
    reference = x.astype(np.float64) @ matrix.dequantize().T + bias
    bound = activation_error_bound(matrix.dequantize(), x) + 1e-4
    y = matrix.matvec(x, bias)
    assert y.dtype == np.float32 and y.shape == (2, 40) and (np.abs(y - reference) <= bound).all()
    one = matrix.matvec(x[1], bias)
    assert one.shape == (40,) and np.array_equal(one, matrix.matvec(x[1:2], bias)[0])
    assert np.array_equal(matrix.matvec(x.astype(np.float64)), matrix.matvec(x))  # any float input: fp32
    assert np.array_equal(matrix.matvec(x, bias.astype(np.float64)), y)  # and any float bias
    with pytest.raises(ValueError):
        matrix.matvec(np.ones((2, 2, 64), np.float32))


def test_without_the_kernels_the_bias_is_added_too(monkeypatch):
    monkeypatch.setenv(native_kernels.VARIANT_ENV, "0")
    native_kernels.forget()
    try:
        matrix = QuantizedMatrix.quantize(weights(8, 32, 5), "q4_0")
        x, bias = weights(1, 32, 6), np.arange(8, dtype=np.float32)
        np.testing.assert_allclose(matrix.matvec(x, bias), x @ matrix.dequantize().T + bias, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(matrix.matvec(x), x @ matrix.dequantize().T, rtol=1e-5, atol=1e-5)
    finally:
        monkeypatch.undo()
        native_kernels.forget()


def linear_pair(fmt: str = "q4_1", bias: bool = True) -> tuple[QuantizedLinear, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24, bias=bias)
    layer = QuantizedLinear.from_linear(linear, fmt)
    weight = torch.from_numpy(layer.matrix.dequantize())
    return layer, weight, None if linear.bias is None else linear.bias.detach()


@pytest.mark.parametrize("bias", [True, False])
def test_quantized_linear_on_few_and_many_rows(bias):
    """Decode rows (the kernels) and prefill rows (dequantized torch) both give F.linear of the dequantized weight
    plus the bias, in the input's shape."""
    layer, weight, b = linear_pair(bias=bias)
    assert layer.packed.dtype == torch.uint8 and tuple(layer.packed.shape) == (24, 2 * 20)
    assert (layer.in_features, layer.out_features, layer.fmt.name) == (64, 24, "q4_1")
    assert repr(layer) == "QuantizedLinear(in_features=64, out_features=24, format=q4_1)"
    for rows in (1, native_kernels.MAX_ROWS, native_kernels.MAX_ROWS + 1):
        x = torch.randn(1, rows, 64)
        expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
        with torch.inference_mode():
            y = layer(x)
        assert y.dtype == torch.float32 and tuple(y.shape) == (1, rows, 24)
        bound = activation_error_bound(weight.numpy(), x.reshape(rows, 64).numpy()) + 1e-4
        assert ((y.double() - expected).abs().reshape(rows, 24).numpy() <= bound).all(), rows


def test_quantized_linear_follows_the_input_dtype_and_autograd():
    """A float64 input runs in float64 (no kernels); an input that needs gradients gets them through the
    dequantized weight."""
    layer, weight, b = linear_pair("q8_0")
    x = torch.randn(2, 64, dtype=torch.float64)
    y = layer(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, F.linear(x, weight.double(), b.double()))
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(2, 64))


def test_without_a_bias_the_torch_path_adds_none():
    """A layer without a bias on the dequantized torch path (a float64 input): F.linear of the weight alone."""
    layer, weight, _ = linear_pair("q8_0", bias=False)
    x = torch.randn(2, 64, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, weight.double()))


def test_quantized_linear_keeps_its_bias_in_fp32_without_gradients():
    matrix = QuantizedMatrix.quantize(weights(8, 32), "q8_0")
    layer = QuantizedLinear(matrix, torch.arange(8, dtype=torch.float16))
    assert layer.bias.dtype == torch.float32 and not layer.bias.requires_grad
    assert torch.equal(layer.bias, torch.arange(8, dtype=torch.float32))
    assert QuantizedLinear(matrix).bias is None
    assert np.array_equal(layer.matrix.packed, matrix.packed) and layer.matrix.fmt is matrix.fmt
