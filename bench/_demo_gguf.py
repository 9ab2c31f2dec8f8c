"""A ~1B-parameter llama GGUF with random weights, written once into the bench cache (not a benchmark itself), for
bench/decode_vs_llamacpp.py: both runtimes read the same file.

The shape is demo_model's "1b" preset (16 blocks, hidden 2048, MLP 8192, 32 heads, 8 KV heads); the tokenizer, its
vocabulary (49,152) and chat template are the built-in SmolLM2 file's, copied field by field, so llama.cpp accepts
the file. The weights (the tied embedding too) are random blocks of one format (Q8_0 or Q4_0) written directly:
random codes under one fp16 scale giving weights of about 1/sqrt(fan-in) (norms 1). Quantizing 1B normal weights
with the gguf package's numpy quantizer took many minutes on the shared 2-core machine; the speed of a product does
not depend on the values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def tensor_shapes(shape: dict, vocab: int) -> dict[str, tuple[int, int] | tuple[int]]:
    """GGUF tensor name -> torch shape [out, in] (norms [hidden])."""
    h, i, heads, kv = shape["hidden"], shape["intermediate"], shape["heads"], shape["kv_heads"]
    kv_dim = h // heads * kv
    per_block = {"attn_q": (h, h), "attn_k": (kv_dim, h), "attn_v": (kv_dim, h), "attn_output": (h, h),
                 "ffn_gate": (i, h), "ffn_up": (i, h), "ffn_down": (h, i), "attn_norm": (h,), "ffn_norm": (h,)}
    out = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    for layer in range(shape["layers"]):
        out.update({f"blk.{layer}.{name}.weight": size for name, size in per_block.items()})
    return out


def copy_tokenizer(writer, reader) -> int:
    """The tokenizer.* fields of `reader` into `writer`; returns the vocabulary size."""
    from gguf import GGUFValueType

    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    return len(reader.fields["tokenizer.ggml.tokens"].contents())


def random_blocks(rng, size: tuple[int, int], kind) -> np.ndarray:
    """uint8 [out, in / 32 x block bytes]: random codes, and a scale putting the weights' spread near 1/sqrt(in)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_weights, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = size[0] * size[1] // block_weights
    codes = rng.integers(0, 256, (blocks, block_bytes - 2), dtype=np.uint8)  # int8 codes or two nibbles a byte
    steps = 64 if kind == GGMLQuantizationType.Q8_0 else 4  # the codes' spread, in steps of the scale
    scale = np.full((blocks, 1), size[1] ** -0.5 / steps, dtype=np.float16).view(np.uint8)
    return np.concatenate([scale, codes], axis=1).reshape(size[0], -1)


def write_demo_gguf(path: Path, fmt: str, shape: dict, tokenizer_from: Path, seed: int = 0) -> Path:
    """The file at `path` in block format `fmt` ("q8_0", "q4_0"), unless it is there already."""
    if path.is_file():
        return path
    import gguf

    kind = gguf.GGMLQuantizationType[fmt.upper()]
    reader = gguf.GGUFReader(str(tokenizer_from))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    for key, value in {"block_count": shape["layers"], "embedding_length": shape["hidden"],
                       "feed_forward_length": shape["intermediate"], "attention.head_count": shape["heads"],
                       "attention.head_count_kv": shape["kv_heads"], "context_length": 2048}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    vocab = copy_tokenizer(writer, reader)
    rng = np.random.default_rng(seed)
    for name, size in tensor_shapes(shape, vocab).items():
        if len(size) == 1:
            writer.add_tensor(name, np.ones(size, dtype=np.float32))
            continue
        writer.add_tensor(name, random_blocks(rng, size, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    return path
