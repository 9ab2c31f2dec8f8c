"""Independent numpy decoders of GGML's block types, written here from the formats' definitions (ggml-common.h's
block structs and ggml-quants.c's dequantize_row_* loops), for tests of the GGUF reader and the quantized kernels.

They share no code with the `gguf` package, which the runtime uses to dequantize: a wrong nibble order, sign, scale
index or bit position in either shows up as a difference. Also: random well-formed block bytes (every bit pattern of
the quants, finite fp16 scales), so a test reaches every bit of a layout.
"""

from __future__ import annotations

import numpy as np

QK = 32  # weights per block of the simple types
QK_K = 256  # weights per super-block of the K types

# type name -> (weights per block, bytes per block, byte offsets of the fp16 fields)
LAYOUTS = {"Q8_0": (QK, 34, (0,)), "Q4_0": (QK, 18, (0,)), "Q4_1": (QK, 20, (0, 2)), "Q5_0": (QK, 22, (0,)),
           "Q5_1": (QK, 24, (0, 2)), "Q4_K": (QK_K, 144, (0, 2)), "Q5_K": (QK_K, 176, (0, 2)),
           "Q6_K": (QK_K, 210, (208,))}


def f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of each block, as float64 [blocks, 1]."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float64)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [blocks, n] -> low nibbles then high nibbles [blocks, 2n] (weights j and j + n share byte j)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int64)


def high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit j of the little-endian bytes qh [blocks, count / 8], for j < count, as 0/1 [blocks, count]."""
    bits = (qh[:, :, None] >> np.arange(8)) & 1
    return bits.reshape(len(qh), -1)[:, :count].astype(np.int64)


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block from its 12 bytes (get_scale_min_k4)."""
    s = scales.astype(np.int64)
    sc = np.empty((len(s), 8), np.int64)
    mn = np.empty((len(s), 8), np.int64)
    sc[:, :4], mn[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def decode_simple(kind: str, b: np.ndarray) -> np.ndarray:
    d = f16(b, 0)
    if kind == "Q8_0":
        return d * b[:, 2:34].copy().view(np.int8)
    if kind == "Q4_0":
        return d * (nibbles(b[:, 2:18]) - 8)
    if kind == "Q4_1":
        return d * nibbles(b[:, 4:20]) + f16(b, 2)
    if kind == "Q5_0":
        return d * (nibbles(b[:, 6:22]) + 16 * high_bits(b[:, 2:6], 32) - 16)
    # Q5_1
    return d * (nibbles(b[:, 8:24]) + 16 * high_bits(b[:, 4:8], 32)) + f16(b, 2)


def decode_k45(kind: str, b: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 4 chunks of 64; chunk i takes byte 32i + l's low nibble for weight 64i + l (sub-block 2i) and its
    high nibble for 64i + 32 + l (sub-block 2i + 1); Q5_K adds bit 2i / 2i + 1 of qh[l] as the fifth bit."""
    d, dmin = f16(b, 0), f16(b, 2)
    sc, mn = scale_min_k4(b[:, 4:16])
    qs = b[:, 16:144] if kind == "Q4_K" else b[:, 48:176]
    out = np.empty((len(b), QK_K))
    for i in range(4):
        chunk = qs[:, 32 * i:32 * i + 32].astype(np.int64)
        low, high = chunk & 0xF, chunk >> 4
        if kind == "Q5_K":
            qh = b[:, 16:48].astype(np.int64)
            low = low + 16 * ((qh >> (2 * i)) & 1)
            high = high + 16 * ((qh >> (2 * i + 1)) & 1)
        out[:, 64 * i:64 * i + 32] = d * sc[:, 2 * i:2 * i + 1] * low - dmin * mn[:, 2 * i:2 * i + 1]
        out[:, 64 * i + 32:64 * i + 64] = d * sc[:, 2 * i + 1:2 * i + 2] * high - dmin * mn[:, 2 * i + 1:2 * i + 2]
    return out


def decode_q6k(b: np.ndarray) -> np.ndarray:
    """Q6_K: two halves of 128; in half n, ql[64n + l] holds weights l (low) and l + 64 (high), ql[64n + 32 + l]
    weights l + 32 and l + 96; qh[32n + l]'s bit pairs 0-1, 2-3, 4-5, 6-7 are their top bits; int8 scales per 16."""
    ql, qh = b[:, 0:128].astype(np.int64), b[:, 128:192].astype(np.int64)
    scales, d = b[:, 192:208].copy().view(np.int8).astype(np.int64), f16(b, 208)
    out = np.empty((len(b), QK_K))
    for n in range(2):
        low, h = ql[:, 64 * n:64 * n + 64], qh[:, 32 * n:32 * n + 32]
        quarters = [(low[:, :32] & 0xF) | (((h >> 0) & 3) << 4), (low[:, 32:] & 0xF) | (((h >> 2) & 3) << 4),
                    (low[:, :32] >> 4) | (((h >> 4) & 3) << 4), (low[:, 32:] >> 4) | (((h >> 6) & 3) << 4)]
        for k, q in enumerate(quarters):
            for half in range(2):  # 16 weights per scale
                scale = scales[:, 8 * n + 2 * k + half:8 * n + 2 * k + half + 1]
                start = 128 * n + 32 * k + 16 * half
                out[:, start:start + 16] = d * scale * (q[:, 16 * half:16 * half + 16] - 32)
    return out


def decode(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The float64 weights [rows, cols] that block bytes `raw` (uint8, rows of blocks) of type `kind` stand for."""
    per_block, block_bytes, _ = LAYOUTS[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    if kind in ("Q4_K", "Q5_K"):
        values = decode_k45(kind, blocks)
    elif kind == "Q6_K":
        values = decode_q6k(blocks)
    else:
        values = decode_simple(kind, blocks)
    assert values.shape[1] == per_block
    return values.reshape(shape)


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random block bytes [rows, cols / per block x block bytes] of `kind`: every quant bit random, the fp16 scales
    (and mins) random finite values of either sign in [0.01, 1) in magnitude."""
    per_block, block_bytes, halves = LAYOUTS[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // per_block, block_bytes), dtype=np.uint8)
    for at in halves:
        value = (rng.uniform(0.01, 1.0, len(blocks)) * rng.choice([-1, 1], len(blocks))).astype(np.float16)
        blocks[:, at:at + 2] = value.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
