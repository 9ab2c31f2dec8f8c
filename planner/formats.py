"""Weight and cache formats: how many bytes a parameter takes in each, with quantization overhead.

Two families of quantized formats, each where its kernels run well:
- bitsandbytes' int8 and nf4 (CUDA): dequantized on every use, fast on a GPU, ~17x slower than fp32 on a CPU;
- GGUF's block formats Q8_0, Q4_0 and Q4_1 (CPU): kept packed in RAM and multiplied by hivekeeper's native kernels
  (core/runtime/kernels/quant_kernels.py), which read fewer bytes per weight than fp32 at the cost of unpacking
  them. A decode step on them is bound by RAM bandwidth or by the kernels' own speed (`hivekeeper measure` times
  them: hardware.ComputeDevice.packed_kernels), whichever is slower.
"""

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

    @property
    def packed(self) -> bool:
        """A GGUF block format the CPU kernels multiply as it is stored (PACKED_FORMATS)."""
        return self.name in PACKED_FORMATS


# nf4 as bitsandbytes stores it: 4-bit codes, one absmax per 64 weights kept as 8 bits ("double quantization"),
# plus one fp32 scale and offset per 256 of those absmax values: 4 + 8/64 + 64/(64*256) ≈ 4.129 bits.
_NF4_BITS = 4.0 + 8.0 / 64 + 64.0 / (64 * 256)
# int8 (LLM.int8 weights): one byte per weight plus an fp32 scale per output row; the row term is negligible
# for the matrix sizes of real models, but keep a small allowance for it.
_INT8_BITS = 8.0 + 0.02
# GGUF's block formats: bytes of one block of BLOCK_WEIGHTS weights, scales included (Q8_0: fp16 scale + 32 int8;
# Q4_0: fp16 scale + 16 bytes of nibbles; Q4_1: fp16 scale and min + 16 bytes). The runtime's sizes come from the
# gguf package (core/runtime/quant/blocks.py); tests/planner/test_packed_formats.py checks they agree.
BLOCK_WEIGHTS = 32
PACKED_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
PACKED_FORMATS = tuple(PACKED_BLOCK_BYTES)
BITSANDBYTES_FORMATS = ("int8", "nf4")  # CUDA's quantization; never chosen for a CPU plan

FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat("fp32", 32.0, "fp32", False),
    "bf16": WeightFormat("bf16", 16.0, "bf16", False),
    "fp16": WeightFormat("fp16", 16.0, "fp16", False),
    "int8": WeightFormat("int8", _INT8_BITS, "fp16", True),
    "nf4": WeightFormat("nf4", _NF4_BITS, "fp16", True),
    **{name: WeightFormat(name, 8.0 * size / BLOCK_WEIGHTS, "fp32", True) for name, size in PACKED_BLOCK_BYTES.items()},
}


def get_format(name: str) -> WeightFormat:
    """Look up a format by name ('fp32', 'bf16', 'fp16', 'int8', 'nf4', 'q8_0', 'q4_0', 'q4_1')."""
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise InputError(f"unknown weight format {name!r}; choose one of {', '.join(FORMATS)}") from None


def bits_of(name: str) -> int:
    """The nominal bits of a quantized format's codes (8 or 4), for sentences ("4-bit kernel compute")."""
    return 8 if name in ("int8", "q8_0") else 4


def packed_words(name: str) -> str:
    """How weights kept packed in a format are named to people ("q4_1 (packed)"): `generate`'s placement line and
    `plan`'s "in memory" row say the same."""
    return f"{name.lower()} (packed)"
