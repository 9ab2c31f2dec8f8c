"""Matrix-vector products with block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1) on the native kernels.

Why: a CPU decode step at batch 1 streams every weight once, so it runs at RAM bandwidth over bytes per weight. fp32
is at that bound already (native_kernels); only fewer bytes make it faster: Q8_0 reads 3.8x fewer, Q4_0 7.1x.
The weights stay packed in RAM (core/runtime/quant/blocks.py: GGUF's own block bytes), and the C kernels
(native/decode_kernels.c, hk_qgemv) quantize the activations per block of 32 to int8 and take integer dot products
(AVX512-VNNI in the "avx512vnni" build, AVX2 in the "avx2" one, plain C in the "portable" one), as llama.cpp does.
Several rows (a continuous batch, or a prefill's prompt: up to QUANT_MAX_ROWS a call) share one pass over the
weights: each weight block is unpacked once and multiplied with every row's activations, and a row's result is the
same bits whatever batch it is in. So a prefill is integer dot products too, each weight block read once for the
whole prompt: against dequantizing tiles for BLAS (the path before), a 64-token prompt's Q4_0 products ran 2.5-4x
faster at load 7-13, and BLAS's threads collapse on a busy machine (a 2048x8192 product took 4 s instead of 40 ms);
its products also equal the prompt's tokens decoded one by one, bit for bit.

Accuracy: the weights are exactly what their blocks say (`dequantize`); the product adds only the activations'
rounding, at most half a block's activation scale (max |x| / 254) per element, so for output o
|y_o - sum_j w_oj x_j| <= sum over blocks b of max_b|x| / 254 * sum_{j in b} |w_oj|, plus fp32 rounding
(tests/core/runtime/kernels/test_quant_kernels.py checks that bound per format and per build).
Without the native kernels (no C compiler, HIVEKEEPER_NATIVE=0) `matvec` multiplies the dequantized weights in numpy:
the same result within that bound, much slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.quant.blocks import (BLOCK_WEIGHTS, BlockFormat, dequantize, format_named, from_gguf,
                                                 quantize)


@dataclass(frozen=True)
class QuantizedMatrix:
    """A weight [outs, cols] packed in a block format: `packed` is uint8 [outs, cols / 32 x block bytes]."""

    fmt: BlockFormat
    packed: np.ndarray
    outs: int
    cols: int

    @classmethod
    def quantize(cls, weight: np.ndarray, fmt: str | BlockFormat, what: str = "weight") -> "QuantizedMatrix":
        """fp32 weights [outs, cols] quantized into `fmt` ("q8_0", "q4_0", "q4_1"), as llama.cpp quantizes them."""
        fmt = format_named(fmt) if isinstance(fmt, str) else fmt
        weight = np.asarray(weight, dtype=np.float32)
        return cls(fmt, quantize(weight, fmt, what), *weight.shape)

    @classmethod
    def from_gguf(cls, data: np.ndarray, fmt: str | BlockFormat, shape: tuple[int, int],
                  what: str = "tensor") -> "QuantizedMatrix":
        """A GGUF tensor's raw block bytes (its `data` from the gguf reader) of torch shape [outs, cols], kept as
        they are (a view of the memory map when contiguous)."""
        fmt = format_named(fmt) if isinstance(fmt, str) else fmt
        return cls(fmt, from_gguf(data, fmt, shape, what), int(shape[0]), int(shape[1]))

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes)

    def dequantize(self, start: int = 0, stop: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """The fp32 weights of rows [start, stop) (default: all [outs, cols]) the blocks stand for, bit for bit as
        gguf's reference computes them: in C on the native kernels (into `out` when given, a C-contiguous fp32
        array of that shape), else in numpy."""
        stop = self.outs if stop is None else stop
        native = native_kernels.library()
        if native is None:
            return dequantize(self.packed[start:stop], self.fmt)
        out = np.empty((stop - start, self.cols), dtype=np.float32) if out is None else out
        packed = np.ascontiguousarray(self.packed[start:stop])
        if native.hk_dequantize(self.fmt.ggml_type, packed.ctypes.data, out.ctypes.data, stop - start, self.cols):
            raise ValueError(f"the native kernels refused to dequantize a {self.fmt.name} [{self.outs}, {self.cols}]")
        return out

    def matvec(self, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """x [batch, cols] (or [cols]) times the weight's transpose, plus bias: [batch, outs] (or [outs]) in fp32."""
        x = np.asarray(x, dtype=np.float32)
        single = x.ndim == 1
        rows = np.ascontiguousarray(x.reshape(1, -1) if single else x)
        if rows.ndim != 2 or rows.shape[1] != self.cols:
            raise ValueError(f"x has shape {x.shape}; this {self.fmt.name} weight takes [batch, {self.cols}]")
        if bias is not None:
            bias = np.ascontiguousarray(bias, dtype=np.float32)
            if bias.shape != (self.outs,):
                raise ValueError(f"bias has shape {bias.shape}; this weight has {self.outs} outputs")
        native = native_kernels.library()
        y = self._native(native, rows, bias) if native is not None else self._numpy(rows, bias)
        return y[0] if single else y

    def _native(self, native, rows: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        y = np.empty((rows.shape[0], self.outs), dtype=np.float32)
        packed = np.ascontiguousarray(self.packed)
        for start in range(0, rows.shape[0], native_kernels.QUANT_MAX_ROWS):  # a long prompt in parts
            part = rows[start:start + native_kernels.QUANT_MAX_ROWS]
            status = native.hk_qgemv(self.fmt.ggml_type, packed.ctypes.data, part.ctypes.data,
                                     None if bias is None else bias.ctypes.data, y[start:].ctypes.data, self.outs,
                                     self.cols, part.shape[0])
            if status == -1:
                raise MemoryError("the native kernels found no memory for the quantized activations")
            if status != 0:
                raise ValueError(f"the native kernels refused a {self.fmt.name} [{self.outs}, {self.cols}] product")
        return y

    def _numpy(self, rows: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        y = rows @ self.dequantize().T
        return y if bias is None else y + bias


def activation_error_bound(weight: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The most the activations' per-block int8 rounding can move each output of weight [outs, cols] times
    x [batch, cols]: sum over blocks of max|x in block| / 254 times sum |w| over the block. [batch, outs]."""
    outs, cols = weight.shape
    blocks = cols // BLOCK_WEIGHTS
    half_step = np.abs(x.reshape(-1, blocks, BLOCK_WEIGHTS)).max(axis=2) / 254.0  # [batch, blocks]
    weight_mass = np.abs(weight.astype(np.float64)).reshape(outs, blocks, BLOCK_WEIGHTS).sum(axis=2)  # [outs, blocks]
    return half_step @ weight_mass.T


class QuantizedLinear(nn.Module):
    """A linear layer whose weight stays block-quantized in RAM (`packed`, a uint8 buffer [out, in / 32 x block
    bytes]). Any number of rows (a decode step, a prefill's prompt) multiply on the native kernels' integer dot
    products; a machine without the kernels multiplies the whole weight dequantized in torch (made for that call,
    not kept). A decode step of a block
    whose layers are all these or fp32 Linear runs in one native call (cpu_decode)."""

    def __init__(self, matrix: QuantizedMatrix, bias: Tensor | None = None):
        super().__init__()
        self.fmt = matrix.fmt
        self.in_features, self.out_features = matrix.cols, matrix.outs
        self.register_buffer("packed", torch.from_numpy(np.ascontiguousarray(matrix.packed)))
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias.detach().to(torch.float32).contiguous(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str | BlockFormat) -> "QuantizedLinear":
        """The layer's weight quantized into `fmt` (its bias kept in fp32)."""
        weight = linear.weight.detach().to(torch.float32).contiguous().numpy()
        return cls(QuantizedMatrix.quantize(weight, fmt), linear.bias)

    @property
    def matrix(self) -> QuantizedMatrix:
        return QuantizedMatrix(self.fmt, self.packed.numpy(), self.out_features, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features
        native = (native_kernels.library() is not None and x.dtype is torch.float32 and x.device.type == "cpu"
                  and not (torch.is_grad_enabled() and x.requires_grad))
        if native:
            bias = None if self.bias is None else self.bias.detach().numpy()
            y = self.matrix.matvec(x.detach().reshape(rows, self.in_features).numpy(), bias)
            return torch.from_numpy(y).view(*x.shape[:-1], self.out_features)
        weight = torch.from_numpy(self.matrix.dequantize()).to(x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}"
