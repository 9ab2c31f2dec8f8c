"""Weight and cache formats: how many bytes a parameter takes in each, with quantization overhead."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError


@dataclass(frozen=True)
class WeightFormat:
    """A storage format for weights (or the KV cache).

    bits_per_param includes the format's own overhead (block statistics of 4-bit formats, row scales of int8).
    compute_dtype is the dtype matmuls run in after dequantization.
    """

    name: str
    bits_per_param: float
    compute_dtype: str
    quantized: bool

    @property
    def bytes_per_param(self) -> float:
        return self.bits_per_param / 8.0


# nf4 as bitsandbytes stores it: 4-bit codes, one absmax per 64 weights kept as 8 bits ("double quantization"),
# plus one fp32 scale and offset per 256 of those absmax values: 4 + 8/64 + 64/(64*256) ≈ 4.129 bits.
_NF4_BITS = 4.0 + 8.0 / 64 + 64.0 / (64 * 256)
# int8 (LLM.int8 weights): one byte per weight plus an fp32 scale per output row; the row term is negligible
# for the matrix sizes of real models, but keep a small allowance for it.
_INT8_BITS = 8.0 + 0.02

FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat("fp32", 32.0, "fp32", False),
    "bf16": WeightFormat("bf16", 16.0, "bf16", False),
    "fp16": WeightFormat("fp16", 16.0, "fp16", False),
    "int8": WeightFormat("int8", _INT8_BITS, "fp16", True),
    "nf4": WeightFormat("nf4", _NF4_BITS, "fp16", True),
}


def get_format(name: str) -> WeightFormat:
    """Look up a format by name ('fp32', 'bf16', 'fp16', 'int8', 'nf4')."""
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise InputError(f"unknown weight format {name!r}; choose one of {', '.join(FORMATS)}") from None
