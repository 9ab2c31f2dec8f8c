"""GGUF's block formats packed for the native kernels (core/runtime/quant/blocks.py): the quantizer's error within
each format's bound, GGUF files' tensors taken as they are, bad input named in one line."""

from __future__ import annotations

import numpy as np
import pytest

from hivekeeper.core.runtime.quant.blocks import BLOCK_WEIGHTS, FORMATS, dequantize, format_named, from_gguf, quantize
from hivekeeper.planner.errors import InputError


def weights(outs: int = 300, cols: int = 8 * BLOCK_WEIGHTS, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0, 0.05, (outs, cols)).astype(np.float32)
    w[rng.integers(0, outs, 40), rng.integers(0, cols, 40)] *= 30  # outliers set their blocks' scales
    w[0, :BLOCK_WEIGHTS] = 0  # an all-zero block
    w[1, :BLOCK_WEIGHTS] = -0.5  # a constant block
    w[2, :BLOCK_WEIGHTS] = np.linspace(-1, 1, BLOCK_WEIGHTS)  # the largest magnitude positive and negative
    return w


def error_bound(w: np.ndarray, name: str) -> np.ndarray:
    """Each weight's largest quantization error in `name`, from its block's values: half a step (Q4_0: a whole
    step at the clipped end of its range), plus what rounding the scale (and min) to fp16 moves the largest code."""
    blocks = w.reshape(w.shape[0], -1, BLOCK_WEIGHTS).astype(np.float64)
    if name == "q8_0":
        d = np.abs(blocks).max(axis=2) / 127
        bound = d / 2 + 127 * np.abs(d.astype(np.float16) - d)
    elif name == "q4_0":
        index = np.abs(blocks).argmax(axis=2)[..., None]
        d = np.abs(np.take_along_axis(blocks, index, axis=2)[..., 0]) / 8
        bound = d + 8 * np.abs(d.astype(np.float16) - d)
    else:
        low, d = blocks.min(axis=2), (blocks.max(axis=2) - blocks.min(axis=2)) / 15
        bound = d / 2 + 15 * np.abs(d.astype(np.float16) - d) + np.abs(low.astype(np.float16) - low)
    slack = 1e-6 * np.abs(blocks).max(axis=2)  # fp32 arithmetic of the quantizer
    return np.repeat(bound + slack, BLOCK_WEIGHTS, axis=1)


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_weights_within_the_formats_bound(name):
    fmt = FORMATS[name]
    w = weights()
    packed = quantize(w, fmt)
    assert packed.dtype == np.uint8 and packed.shape == (300, 8 * fmt.block_bytes)
    assert packed.nbytes == w.size * fmt.bytes_per_weight
    restored = dequantize(packed, fmt)
    assert restored.shape == w.shape and restored.dtype == np.float32
    error = np.abs(restored.astype(np.float64) - w)
    assert (error <= error_bound(w, name)).all()
    assert (restored[0, :BLOCK_WEIGHTS] == 0).all()


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_gguf_files_tensors_are_taken_as_they_are(tmp_path, name):
    """Written by the gguf package's writer, read by its reader (as core/runtime/gguf.py reads files): the raw
    block bytes become the packed weight unchanged, of the torch shape [outs, cols]."""
    import gguf

    fmt = FORMATS[name]
    w = weights(96, 4 * BLOCK_WEIGHTS)
    packed = quantize(w, fmt)
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_up.weight", packed, raw_dtype=fmt.gguf_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(path).tensors[0]
    assert tensor.tensor_type == fmt.gguf_type
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    assert shape == w.shape
    taken = from_gguf(tensor.data, fmt, shape)
    assert np.array_equal(taken, packed)
    assert np.array_equal(dequantize(taken, fmt), gguf.quants.dequantize(tensor.data, tensor.tensor_type))


def test_bad_input_is_named_in_one_line():
    fmt = FORMATS["q4_0"]
    with pytest.raises(InputError, match=r"attn_q\.weight: 100 uint8 values where Q4_0 \[4, 64\] takes 144 bytes"):
        from_gguf(np.zeros(100, dtype=np.uint8), fmt, (4, 64), "blk.1.attn_q.weight")
    with pytest.raises(InputError, match=r"up: shape \(4, 48\) is not \[outs, cols\] with cols a multiple of 32"):
        quantize(np.zeros((4, 48), dtype=np.float32), fmt, "up")
    nan = np.zeros((4, 64), dtype=np.float32)
    nan[1, 3] = np.nan
    with pytest.raises(InputError, match="down: holds NaN or infinite values"):
        quantize(nan, fmt, "down")
    with pytest.raises(InputError, match="unknown block format 'q3_x': expected one of q8_0, q4_0, q4_1"):
        format_named("q3_x")
    assert format_named("Q4_1") is FORMATS["q4_1"]
