"""The block-quantized matrix-vector products (core/runtime/kernels/quant_kernels.py, hk_qgemv in
native/decode_kernels.c) against the dequantized-fp32 reference, in every build of the kernels (the `quant_native`
fixture: avx512vnni and avx2 where the CPU runs them, portable everywhere), and against an exact emulation of what
they are meant to compute; a row's product is the same whatever batch it comes in (the multi-row kernel unpacks
each weight block once for up to 8 rows)."""

from __future__ import annotations

import numpy as np
import pytest

from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedMatrix, activation_error_bound
from hivekeeper.core.runtime.quant.blocks import BLOCK_WEIGHTS, FORMATS

# odd sizes: an output count that is no multiple of a chunk's rows, 13 blocks per row
OUTS, COLS = 1031, 13 * BLOCK_WEIGHTS
FP32_SLACK = 1e-5  # fp32 rounding, relative to sum |w x| (the block sums themselves are exact integers)


def weights(outs: int = OUTS, cols: int = COLS, seed: int = 0) -> np.ndarray:
    """Like a trained layer's: ~1/sqrt(fan-in), a few outliers per row, an all-zero block, a constant block."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0, cols ** -0.5, (outs, cols)).astype(np.float32)
    w[rng.integers(0, outs, 50), rng.integers(0, cols, 50)] *= 20
    w[3, :BLOCK_WEIGHTS] = 0
    w[4, BLOCK_WEIGHTS:2 * BLOCK_WEIGHTS] = 0.25
    return w


def activations(batch: int, cols: int = COLS, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, (batch, cols)).astype(np.float32)
    x[0, :BLOCK_WEIGHTS] = 0  # an all-zero activation block: scale 0
    return x


def emulated(matrix: QuantizedMatrix, x: np.ndarray) -> np.ndarray:
    """What the kernels are meant to compute, in float64 from the same integers: activations rounded per block of
    32 to int8 (scale max|x| / 127 in fp32, half to even), block by block d_w d_x sum(q_w q_x) (+ m d_x sum q_x)."""
    blocks = COLS // BLOCK_WEIGHTS
    xb = x.reshape(x.shape[0], blocks, BLOCK_WEIGHTS)
    scale = (np.abs(xb).max(axis=2) / np.float32(127)).astype(np.float32)
    inverse = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0).astype(np.float32)
    q = np.rint(xb * inverse[..., None]).astype(np.float64)
    x_dequantized = (q * scale[..., None].astype(np.float64)).reshape(x.shape)
    return x_dequantized @ matrix.dequantize().astype(np.float64).T


@pytest.mark.parametrize("batch", [1, 3, 6, native_kernels.MAX_ROWS + 2])
@pytest.mark.parametrize("name", list(FORMATS))
def test_product_within_the_formats_bound_of_the_dequantized_reference(quant_native, name, batch):
    """Against the weights the blocks stand for (fp32), within the activations' rounding bound; against the exact
    emulation of the integer arithmetic, within fp32 rounding. More rows than the kernels take go in groups."""
    w, x = weights(), activations(batch)
    bias = np.random.default_rng(2).normal(0, 1, OUTS).astype(np.float32)
    matrix = QuantizedMatrix.quantize(w, name)
    reference = matrix.dequantize().astype(np.float64)
    y = matrix.matvec(x, bias).astype(np.float64)
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(reference).T + np.abs(bias)
    exact = x.astype(np.float64) @ reference.T + bias
    bound = activation_error_bound(reference, x) + FP32_SLACK * magnitude
    assert y.shape == (batch, OUTS)
    assert (np.abs(y - exact) <= bound).all(), np.max(np.abs(y - exact) - bound)
    assert (np.abs(y - (emulated(matrix, x) + bias)) <= FP32_SLACK * magnitude).all()


@pytest.mark.parametrize("name", list(FORMATS))
def test_one_vector_in_one_vector_out(quant_native, name):
    matrix = QuantizedMatrix.quantize(weights(64, 2 * BLOCK_WEIGHTS), name)
    x = activations(1, 2 * BLOCK_WEIGHTS)
    y = matrix.matvec(x[0])
    assert y.shape == (64,)
    np.testing.assert_array_equal(y, matrix.matvec(x)[0])


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_rows_product_is_the_same_in_any_batch(quant_native, name):
    """Batches of 1 to 8 rows (whole groups of rows and tails): each row's product equals, bit for bit, that row
    multiplied alone, so a sequence's tokens do not depend on which others are decoded beside it."""
    matrix = QuantizedMatrix.quantize(weights(300, 7 * BLOCK_WEIGHTS), name)
    x = activations(native_kernels.MAX_ROWS, 7 * BLOCK_WEIGHTS, seed=4)
    alone = np.stack([matrix.matvec(row) for row in x])
    for batch in range(1, native_kernels.MAX_ROWS + 1):
        assert np.array_equal(matrix.matvec(x[:batch]), alone[:batch]), batch
        assert np.array_equal(matrix.matvec(x[-batch:]), alone[-batch:]), batch


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_vnni_and_avx2_builds_give_the_same_bits(name, kernel_build):
    """VNNI's one-instruction dot product and AVX2's two give the same exact integers, so the same products."""
    matrix = QuantizedMatrix.quantize(weights(), name)
    x = activations(native_kernels.MAX_ROWS)
    kernel_build("avx512vnni")  # skips where this CPU does not run it
    vnni = matrix.matvec(x)
    kernel_build("avx2")
    assert np.array_equal(matrix.matvec(x), vnni)


def test_the_c_block_sizes_are_the_gguf_ones(native):
    for fmt in FORMATS.values():
        assert native.hk_quant_block_bytes(fmt.ggml_type) == fmt.block_bytes
    assert native.hk_quant_block_bytes(0) == 0  # F32 is no block format


def test_the_kernels_refuse_what_they_cannot_take(native):
    """A format they do not know, columns that are not whole blocks, too many rows: -2, output untouched."""
    w = np.zeros((8, 64), dtype=np.uint8)
    x, y = np.ones((1, 64), dtype=np.float32), np.full((1, 8), 7.0, dtype=np.float32)
    for fmt, cols, batch in ((0, 64, 1), (FORMATS["q8_0"].ggml_type, 48, 1),
                             (FORMATS["q8_0"].ggml_type, 64, native_kernels.QUANT_MAX_ROWS + 1)):
        assert native.hk_qgemv(fmt, w.ctypes.data, x.ctypes.data, None, y.ctypes.data, 8, cols, batch) == -2
    assert (y == 7.0).all()
    assert native.hk_quant_max_rows() == native_kernels.QUANT_MAX_ROWS  # the C and Python limits agree


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_prompts_rows_in_one_product_are_each_rows_alone(quant_native, name):
    """A prefill's rows in one product (more than a decode step's MAX_ROWS, and more than one call's QUANT_MAX_ROWS:
    two calls): each row's result equals, bit for bit, that row multiplied alone, as its token decoded would get."""
    matrix = QuantizedMatrix.quantize(weights(40, 3 * BLOCK_WEIGHTS), name)
    x = activations(native_kernels.QUANT_MAX_ROWS + 9, 3 * BLOCK_WEIGHTS, seed=5)
    alone = np.stack([matrix.matvec(row) for row in x])
    assert np.array_equal(matrix.matvec(x), alone)


def test_any_thread_count_and_a_held_worker_give_the_same_product(native):
    """Each output is one chunk's fixed-order sum: the same bits with 1 or 3 threads, and with a worker held back
    (as one whose core went to another process): the product finishes without it."""
    matrix = QuantizedMatrix.quantize(weights(4096, 8 * BLOCK_WEIGHTS), "q4_0")
    x = activations(2, 8 * BLOCK_WEIGHTS)
    try:
        native.hk_set_threads(1)
        expected = matrix.matvec(x)
        native.hk_set_threads(3)
        assert np.array_equal(matrix.matvec(x), expected)
        native.hk_test_hold_worker(1, 120.0, 0)
        for _ in range(10_000):  # until worker 1 has woken to a task and waits before claiming any
            held = matrix.matvec(x)
            assert np.array_equal(held, expected)
            if native.hk_test_worker_held():
                break
        assert native.hk_test_worker_held() == 1
        assert np.array_equal(matrix.matvec(x), expected)
        assert native.hk_test_worker_held() == 1  # still waiting: the product did not wait for it
    finally:
        native.hk_test_release_worker()
        native.hk_set_threads(native_kernels.default_threads())


def test_without_the_kernels_numpy_gives_the_product(monkeypatch):
    """HIVEKEEPER_NATIVE=0 (or no compiler): the dequantized weights in numpy, within the same bound."""
    monkeypatch.setenv(native_kernels.VARIANT_ENV, "0")
    native_kernels.forget()
    try:
        assert native_kernels.library() is None
        matrix = QuantizedMatrix.quantize(weights(), "q4_1")
        x = activations(2)
        reference = matrix.dequantize().astype(np.float64)
        y = matrix.matvec(x)
        assert np.allclose(y, x.astype(np.float64) @ reference.T, rtol=1e-4, atol=1e-4)
    finally:
        monkeypatch.undo()
        native_kernels.forget()


def test_shapes_are_checked():
    matrix = QuantizedMatrix.quantize(weights(8, 64), "q8_0")
    with pytest.raises(ValueError, match=r"takes \[batch, 64\]"):
        matrix.matvec(np.ones((1, 32), dtype=np.float32))
    with pytest.raises(ValueError, match="8 outputs"):
        matrix.matvec(np.ones((1, 64), dtype=np.float32), np.ones(7, dtype=np.float32))


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantized_in_c_bit_for_bit_as_the_reference(native, name):
    """hk_dequantize (prefill's tiles) gives exactly the weights gguf's numpy reference gives, for every row range."""
    from hivekeeper.core.runtime.quant.blocks import dequantize

    matrix = QuantizedMatrix.quantize(weights(), name)
    reference = dequantize(matrix.packed, matrix.fmt)
    assert np.array_equal(matrix.dequantize(), reference)
    assert np.array_equal(matrix.dequantize(5, 700), reference[5:700])


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_prefill_multiplies_on_the_int8_kernels(native, name):
    """More rows than a decode step's (a prompt): QuantizedLinear multiplies them on the int8 kernels in one product,
    not on dequantized weights: each row's output is the kernels' (bit for bit), within the activations' rounding
    bound of the dequantized weight's fp32 product, and not equal to that product."""
    import torch

    from hivekeeper.core.runtime.kernels import quant_kernels

    bias = np.random.default_rng(3).normal(0, 1, OUTS).astype(np.float32)
    matrix = QuantizedMatrix.quantize(weights(), name)
    layer = quant_kernels.QuantizedLinear(matrix, torch.from_numpy(bias))
    rows = activations(2 * native_kernels.MAX_ROWS + 3)
    with torch.inference_mode():
        y = layer(torch.from_numpy(rows).view(1, -1, COLS))
    assert y.shape == (1, 2 * native_kernels.MAX_ROWS + 3, OUTS)
    y = y[0].numpy()
    assert np.array_equal(y, np.stack([matrix.matvec(row, bias) for row in rows]))
    reference = matrix.dequantize().astype(np.float64)
    exact = rows.astype(np.float64) @ reference.T + bias
    magnitude = np.abs(rows.astype(np.float64)) @ np.abs(reference).T + np.abs(bias)
    assert (np.abs(y - exact) <= activation_error_bound(reference, rows) + FP32_SLACK * magnitude).all()
    assert not np.allclose(y, exact, rtol=1e-6, atol=0)


def test_a_compiler_without_vnni_falls_back_to_the_avx2_build(tmp_path, kernel_build, monkeypatch):
    """On a VNNI CPU whose compiler cannot build the avx512vnni build (an older gcc: here a wrapper that refuses the
    flag), the avx2 build loads and the status says why; the kernels are not switched off."""
    real = native_kernels._compiler()
    kernel_build("avx512vnni")  # skips where this CPU does not run it
    compiler = tmp_path / "cc"
    compiler.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -mavx512vnni ] && {{ echo "no avx512vnni" >&2; exit 1; '
                        f'}}; done\nexec {real} "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("HIVEKEEPER_KERNEL_CACHE", str(tmp_path))  # nothing built before: avx2 is compiled here
    monkeypatch.setenv(native_kernels.VARIANT_ENV, "auto")
    native_kernels.forget()
    library = native_kernels.library()
    assert library is not None and library.hk_variant().decode() == "avx2", native_kernels.status()
    assert "the avx512vnni build failed" in native_kernels.status() and "no avx512vnni" in native_kernels.status()
