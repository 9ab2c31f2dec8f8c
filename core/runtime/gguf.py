"""GGUF checkpoints (the format of llama.cpp, Ollama, LM Studio, GPT4All), read as if they were Hugging Face ones.

People already hold GGUF files, so a `.gguf` file (or a folder holding exactly one) works wherever a checkpoint
folder does. The file is read with the `gguf` package's GGUFReader (the llama.cpp project's own reader); from it:

- the model config: the metadata (`{arch}.block_count`, `embedding_length`, ...) is turned into a Hugging Face
  config dict and parsed by `ModelConfig.from_hf_config`, so there is one config reader;
- the weights, under Hugging Face names (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`),
  read through the memory map and dequantized to float32 one tensor at a time (so loading a span touches only its
  blocks' bytes), with llama.cpp's Q/K row permutation undone for llama/mistral;
- the tokenizer and chat template (gguf_tokenizer.py, built by tokenizer.Tokenizer.from_gguf);
- packed blocks (`load_packed_block`): for CPU fp32 decode, linear weights stored as Q8_0/Q4_0/Q4_1 stay as their
  block bytes in RAM (QuantizedLinear, multiplied by the native quantized kernels) instead of 4-byte floats; the
  Q/K permutation is undone by reordering packed rows (rows are independent). Other types are dequantized. The LM
  head (or the tied embedding used as one) stays packed too (`load_packed_head`).
  checkpoint.load_span and the local engine (core/offload, resident blocks) do this by default for a GGUF on the
  CPU in fp32 (HIVEKEEPER_GGUF_PACKED=0 or packed=False turns it off: the dequantized path is what transformers
  computes, token for token). Blocks the engine streams from disk stay packed too (core/offload/packed_stream.py).

The torch-free part (finding and opening files, the config dict, tensor names, types and sizes) is the planner's
gguf_metadata.py, so there is one reader. `GGUFCheckpoint` has the interface of `checkpoint.Checkpoint` (`config`,
`has`, `files_for`, `read`, `read_block`, `close`), so the block/embedding/head loaders (`checkpoint.open_checkpoint`)
take either; `GGUFBlockReader` is the offload engine's reader for it. Bad input (wrong magic, truncated file, an unknown
architecture or tensor type, a missing tokenizer) raises InputError with one line naming the file and the problem.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from hivekeeper.planner.errors import InputError
# the runtime's packing switch (HIVEKEEPER_GGUF_PACKED), read torch-free beside the planner's format choice
from hivekeeper.planner.format_choice import PACKED_ENV, packed_by_default  # noqa: F401 (used here and re-exported)
# FUSED_LINEARS: a block's linears as loaded (fused module path -> the HF pieces concatenated by rows into it)
from hivekeeper.planner.gguf_metadata import (FUSED_LINEARS, PERMUTED_ARCHITECTURES, SUPPORTED_TYPES,  # noqa: F401
                                              architecture, check_tensor_types, hf_config_dict, hf_name,
                                              open_reader, packs_together, require_gguf, unsupported_type)

from hivekeeper.core.runtime.block_tensors import block_tensor_names, expected_block_shapes, read_block_tensors
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear, QuantizedMatrix
from hivekeeper.core.runtime.model import Block, Head, ModelConfig, RotaryTable
from hivekeeper.core.runtime.quant.blocks import format_of_ggml_type
from hivekeeper.core.runtime.tokenizer import Tokenizer



def load_gguf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a GGUF file (or a folder holding one)."""
    reader = open_reader(path)
    source = str(require_gguf(path))
    return ModelConfig.from_hf_config(hf_config_dict(reader, source), source=source)


# ---------------------------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------------------------
def torch_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def dequantize(tensor, source: str = "") -> Tensor:
    """A GGUF tensor (a ReaderTensor) as a float32 torch tensor in torch order; its bytes are read from the memory
    map now. InputError for a type this runtime does not dequantize."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    if tensor.tensor_type.name not in SUPPORTED_TYPES:
        raise unsupported_type(source, tensor)
    data = tensor.data
    if tensor.tensor_type == GGMLQuantizationType.F32:
        values = np.array(data, dtype=np.float32)  # a copy: the memory map is read-only and stays the file's
    else:
        values = gguf_dequantize(np.asarray(data), tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(torch_shape(tensor)))


def unpermute_qk(weight: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's converter, which reorders each head's rows of q/k (weight or bias) from the Hugging Face
    half-split RoPE layout to interleaved pairs: reshape(heads, 2, d/2, ...).swapaxes(1, 2)."""
    shape = weight.shape
    return weight.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


class GGUFCheckpoint:
    """A GGUF file opened as a checkpoint: its config, its tensors under Hugging Face names, its tokenizer.

    The same interface as checkpoint.Checkpoint; `read` dequantizes one tensor to float32 from the memory map."""

    def __init__(self, path: str | Path, packed: bool = False):
        self.packed = bool(packed)  # load_block builds CPU fp32 blocks with packed Q8_0/Q4_0/Q4_1 linears
        self.path = require_gguf(path)
        self.source = str(self.path)
        self.reader = open_reader(self.path)
        self.architecture = architecture(self.reader, self.source)
        self.config = ModelConfig.from_hf_config(hf_config_dict(self.reader, self.source), source=self.source)
        check_tensor_types(self.reader, self.source)  # before any weight is loaded
        self.tensors = {}  # Hugging Face name -> ReaderTensor
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self.tensors[name] = tensor
        self.weight_map = {name: self.path.name for name in self.tensors}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def files_for(self, names: list[str]) -> list[str]:
        """[the file name] when every tensor is in the file; a missing one is an InputError (as Checkpoint's)."""
        for name in names:
            if name not in self.tensors:
                raise InputError(f"{self.source}: tensor {name!r} is missing from the GGUF file")
        return [self.path.name] if names else []

    def tensor_type(self, name: str) -> str:
        """How a tensor is stored: 'Q4_1', 'F32', ..."""
        self.files_for([name])
        return self.tensors[name].tensor_type.name

    def stored_bytes(self, name: str) -> int:
        """The bytes a tensor takes in the file (what a packed, still-quantized copy would hold)."""
        self.files_for([name])
        return int(self.tensors[name].n_bytes)

    def read(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> Tensor:
        """One tensor under its Hugging Face name, dequantized (Q/K rows unpermuted), converted to `dtype`."""
        self.files_for([name])
        tensor = dequantize(self.tensors[name], self.source)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise InputError(f"{self.source}: tensor {self.tensors[name].name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(shape)}")
        heads = self.permuted_heads(name)
        if heads:
            tensor = unpermute_qk(tensor, heads)
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    def permuted_heads(self, name: str) -> int:
        """The head count whose rows llama.cpp's converter permuted in tensor `name` (q/k of llama-like
        architectures), or 0 when it is stored in Hugging Face's order."""
        if self.architecture not in PERMUTED_ARCHITECTURES:
            return 0
        if ".self_attn.q_proj." in name:
            return self.config.num_heads
        return self.config.num_kv_heads if ".self_attn.k_proj." in name else 0

    def packable(self, name: str) -> bool:
        """Whether tensor `name` is stored in a block format the quantized kernels multiply as it is."""
        self.files_for([name])
        return format_of_ggml_type(int(self.tensors[name].tensor_type)) is not None

    def read_packed(self, name: str, shape: tuple[int, int]) -> QuantizedMatrix:
        """A Q8_0/Q4_0/Q4_1 tensor's block bytes as they are in the file, copied into RAM (Q/K rows put back in
        Hugging Face's order by reordering whole packed rows)."""
        tensor = self.tensors[name]
        fmt = format_of_ggml_type(int(tensor.tensor_type))
        matrix = QuantizedMatrix.from_gguf(tensor.data, fmt, shape, f"{self.source}: tensor {tensor.name!r}")
        heads = self.permuted_heads(name)
        rows = matrix.packed[unpermute_qk(torch.arange(shape[0]), heads).numpy()] if heads else matrix.packed.copy()
        return QuantizedMatrix(fmt, rows, matrix.outs, matrix.cols)  # a copy: the map is read-only

    def read_block(self, layer: int, dtype: torch.dtype) -> dict[str, Tensor]:
        """Every tensor of one layer, keyed by its name inside the block (`self_attn.q_proj.weight`, ...)."""
        return read_block_tensors(self, layer, dtype)

    def tokenizer(self) -> Tokenizer:
        """The tokenizer and chat template from the metadata."""
        return Tokenizer.from_gguf(self.path)

    def close(self) -> None:
        """Nothing to release per checkpoint: the reader and its memory map are shared (gguf_metadata.cached_reader)."""


def packs(checkpoint: GGUFCheckpoint, layer: int, pieces: tuple[str, ...]) -> bool:
    """Whether the fused linear of `pieces` (HF names inside a block) loads packed: every piece stored in the same
    Q8_0/Q4_0/Q4_1 format (the planner's rule, gguf_metadata.packs_together, which its byte count follows)."""
    return packs_together(checkpoint.tensor_type(f"model.layers.{layer}.{piece}.weight") for piece in pieces)


def packed_linear(checkpoint: GGUFCheckpoint, layer: int, pieces: tuple[str, ...],
                  shapes: dict[str, tuple[int, ...]]) -> QuantizedMatrix | None:
    """The fused weight of `pieces` (HF names inside a block) as one packed matrix (their rows one after
    another), or None unless every piece is stored in the same packable format."""
    if not packs(checkpoint, layer, pieces):
        return None
    names = [f"model.layers.{layer}.{piece}.weight" for piece in pieces]
    parts = [checkpoint.read_packed(name, shapes[f"{piece}.weight"]) for name, piece in zip(names, pieces)]
    packed = parts[0].packed if len(parts) == 1 else np.concatenate([part.packed for part in parts], axis=0)
    return QuantizedMatrix(parts[0].fmt, packed, sum(part.outs for part in parts), parts[0].cols)


def load_packed_block(checkpoint: GGUFCheckpoint, layer: int, rotary: RotaryTable | None = None) -> Block:
    """Decoder layer `layer` on the CPU in fp32 whose linears stored as Q8_0/Q4_0/Q4_1 are QuantizedLinear
    holding the file's block bytes; the rest (norms, biases, linears of other types) dequantized to fp32."""
    config = checkpoint.config
    checkpoint.files_for(block_tensor_names(config, layer))
    shapes = expected_block_shapes(config)
    with torch.device("meta"):
        block = Block(config, layer, rotary)
    state, replaced = {}, set()
    for fused, pieces in FUSED_LINEARS.items():
        matrix = packed_linear(checkpoint, layer, pieces, shapes)
        biases = [f"{piece}.bias" for piece in pieces if checkpoint.has(f"model.layers.{layer}.{piece}.bias")]
        if matrix is None:
            names = [f"{piece}.weight" for piece in pieces] + biases
        else:
            bias = (torch.cat([checkpoint.read(f"model.layers.{layer}.{name}", torch.float32, shapes[name])
                               for name in biases]) if biases else None)
            parent, child = fused.split(".")
            setattr(getattr(block, parent), child, QuantizedLinear(matrix, bias))
            replaced.update({f"{fused}.packed", f"{fused}.bias"})
            names = []
        state.update({name: checkpoint.read(f"model.layers.{layer}.{name}", torch.float32, shapes[name])
                      for name in names})
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        state[name] = checkpoint.read(f"model.layers.{layer}.{name}", torch.float32, shapes[name])
    result = block.load_state_dict(state, strict=False, assign=True)
    missing = set(result.missing_keys) - replaced
    if missing or result.unexpected_keys:
        raise ValueError(f"packed block {layer}: missing {sorted(missing)}, unexpected {result.unexpected_keys}")
    return block.requires_grad_(False)


class PackedHead(Head):
    """The final norm and an LM head whose matrix stays packed (`lm_head`, a QuantizedLinear of the file's Q8_0/Q4_0/
    Q4_1 bytes): at batch 1 the head streams vocab x hidden weights per token, as many as SmolLM2's 30 blocks in
    fp32. `weight` is the tied embedding (shared, for lookups) or None."""

    def forward(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))


def load_packed_head(checkpoint: GGUFCheckpoint, name: str, norm: Tensor, tied: Tensor | None) -> Head | None:
    """A PackedHead from tensor `name` (the LM head, or the tied embedding) and the final norm's weight, or None
    when that tensor is not stored in a packable format. `tied`: the loaded embedding's weight to keep as `weight`."""
    if not checkpoint.packable(name):
        return None
    config = checkpoint.config
    with torch.device("meta"):
        head = PackedHead(config)
    head.load_state_dict({"norm.weight": norm}, strict=False, assign=True)
    head.weight = tied
    head.lm_head = QuantizedLinear(checkpoint.read_packed(name, (config.vocab_size, config.hidden_size)))
    return head.requires_grad_(False)


class GGUFBlockReader:
    """The offload engine's block reader for a GGUF (the interface of weights.BlockReader): a layer is dequantized
    from the memory map and copied into a block's (fused, maybe pinned) weights in place. Thread-safe: the reader
    only reads the map."""

    def __init__(self, checkpoint: GGUFCheckpoint):
        self.checkpoint, self.config = checkpoint, checkpoint.config
        self.bytes_read = 0

    def check_layer(self, layer: int) -> None:
        """Fail early (before any weight is read) on a tensor missing from the file."""
        self.checkpoint.files_for(block_tensor_names(self.config, layer))

    def fill(self, block: Block, layer: int) -> int:
        """Read layer `layer` into `block` (whose shapes match any layer); returns the bytes read from the file."""
        tensors = self.checkpoint.read_block(layer, block.input_layernorm.weight.dtype)
        block.load_state_dict(tensors, strict=True)  # copies into the existing weights; q/k/v and gate/up fused
        block.layer_index = layer
        block.self_attn.window = self.config.window_of(layer)
        stored = sum(self.checkpoint.stored_bytes(name) for name in block_tensor_names(self.config, layer))
        self.bytes_read += stored
        return stored

    def close(self) -> None:
        """Nothing to release: the reader is shared."""

