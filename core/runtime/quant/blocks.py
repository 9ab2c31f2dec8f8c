"""Block-quantized weights in GGUF's own layouts (Q8_0, Q4_0, Q4_1), packed for the native kernels, in numpy.

Why these formats: at batch 1 a CPU decode step streams every weight from RAM once, so its speed is bytes per
weight; fp32 is 4 bytes, Q8_0 1.06, Q4_1 0.625, Q4_0 0.5625. They are llama.cpp's formats, so a GGUF file's tensors
are used as they are (no re-quantization, no second error), and fp32 checkpoints are quantized by the reference
code of the same project (the `gguf` package's numpy port, bit-exact with ggml-quants.c):

    Q8_0  blocks of 32 weights: fp16 scale d, 32 int8 q                          w = d q          34 bytes
    Q4_0  fp16 scale d, 16 bytes of 4-bit q (low nibbles: weights 0-15, high: 16-31)  w = d (q - 8)    18 bytes
    Q4_1  fp16 scale d, fp16 min m, 16 bytes of 4-bit q as in Q4_0                 w = d q + m      20 bytes

A packed weight [outs, cols] is a uint8 array [outs, cols / 32 x block bytes]: each row its blocks, rows one after
another (GGUF's order, and the order the kernels read). The kernels that multiply them are in
core/runtime/kernels/quant_kernels.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hivekeeper.planner.errors import InputError

BLOCK_WEIGHTS = 32  # weights per block in every format here


@dataclass(frozen=True)
class BlockFormat:
    """One block format: its name, its GGML type id (a GGUF tensor's type, and the native kernels' format number)
    and its bytes per block of BLOCK_WEIGHTS weights."""

    name: str
    ggml_type: int
    block_bytes: int

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / BLOCK_WEIGHTS

    def row_bytes(self, cols: int) -> int:
        """Bytes of one packed row of `cols` weights (a multiple of BLOCK_WEIGHTS)."""
        return cols // BLOCK_WEIGHTS * self.block_bytes

    @property
    def gguf_type(self):
        """The gguf package's GGMLQuantizationType of this format."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type)


def _formats() -> dict[str, BlockFormat]:
    """The formats, their sizes as the gguf package defines them (the one definition)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    out = {}
    for name in ("q8_0", "q4_0", "q4_1"):
        kind = GGMLQuantizationType[name.upper()]
        weights, block_bytes = GGML_QUANT_SIZES[kind]
        assert weights == BLOCK_WEIGHTS, (name, weights)
        out[name] = BlockFormat(name, int(kind), block_bytes)
    return out


FORMATS: dict[str, BlockFormat] = _formats()


def format_named(name: str) -> BlockFormat:
    """The format called `name` ("q8_0", "Q4_0", ...); InputError naming the known ones otherwise."""
    found = FORMATS.get(name.lower())
    if found is None:
        raise InputError(f"unknown block format {name!r}: expected one of {', '.join(FORMATS)}")
    return found


def format_of_ggml_type(ggml_type: int) -> BlockFormat | None:
    """The format of a GGUF tensor type id, or None when it is not one of these."""
    return next((f for f in FORMATS.values() if f.ggml_type == int(ggml_type)), None)


def _check_shape(shape: tuple[int, ...], what: str) -> tuple[int, int]:
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1 or shape[1] % BLOCK_WEIGHTS:
        raise InputError(f"{what}: shape {tuple(shape)} is not [outs, cols] with cols a multiple of {BLOCK_WEIGHTS}")
    return int(shape[0]), int(shape[1])


def quantize(weights: np.ndarray, fmt: BlockFormat, what: str = "weight") -> np.ndarray:
    """fp32 weights [outs, cols] packed in `fmt` (llama.cpp's reference quantizer); InputError for a shape the
    formats cannot hold, or a weight that is not finite."""
    outs, cols = _check_shape(weights.shape, what)
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    if not np.isfinite(weights).all():
        raise InputError(f"{what}: holds NaN or infinite values; they cannot be quantized")
    from gguf.quants import quantize as gguf_quantize

    packed = gguf_quantize(weights, fmt.gguf_type)
    return np.ascontiguousarray(packed, dtype=np.uint8).reshape(outs, fmt.row_bytes(cols))


def dequantize(packed: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    """The fp32 weights [outs, cols] that packed blocks stand for (exactly: each weight is d q (+ m) in fp32)."""
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(np.ascontiguousarray(packed, dtype=np.uint8), fmt.gguf_type).astype(np.float32, copy=False)


def from_gguf(data: np.ndarray, fmt: BlockFormat, shape: tuple[int, int], what: str = "tensor") -> np.ndarray:
    """A GGUF tensor's raw block bytes (the gguf reader's `tensor.data`: uint8, any shape holding the right count)
    as a packed weight of torch shape [outs, cols], without copying when they are contiguous. InputError naming
    `what` when the byte count does not match the shape."""
    outs, cols = _check_shape(tuple(shape), what)
    raw = np.asarray(data)
    expected = outs * fmt.row_bytes(cols)
    if raw.dtype != np.uint8 or raw.size != expected:
        raise InputError(f"{what}: {raw.size} {raw.dtype} values where {fmt.name.upper()} [{outs}, {cols}] takes "
                         f"{expected} bytes")
    return np.ascontiguousarray(raw).reshape(outs, fmt.row_bytes(cols))
