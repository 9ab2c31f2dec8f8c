"""A GGUF's weights held packed by the offload engine: the slots of streamed blocks, the resident blocks, the LM head
and the embedding hold Q8_0/Q4_0/Q4_1 tensors as the file's block bytes (QuantizedLinear, PackedEmbedding), instead
of fp32 copies, all read with positioned reads into buffers the process owns, never through the memory map.

A streamed block is then read as its packed bytes straight from the file into the slot with positioned reads (one
copy; the Q/K rows llama.cpp permuted are read into a scratch array and put back in Hugging Face's order by taking
whole packed rows), with no dequantizing; the slot holds about a quarter (Q8_0) to an eighth (Q4_0/Q4_1) of an fp32
block, and the step multiplies it with the quantized kernels. `drop_page_cache` evicts what was read from the page
cache, for benchmarks of the disk itself (as weights.BlockReader does). A layer whose linears are stored otherwise
than the slot's (another format, a type that is not packed) gets a block built for it (gguf.load_packed_block) in
place of the slot's.

Why not the memory map: every page of it the process touches counts in its RSS (file-backed, until unmapped or
released), so a model read through it counted once in the copies and once more in the map; against a RAM budget
that was 30% over on SmolLM2 (issue 22). `empty_block` allocates a layer's packed buffers without reading, `fill`
preads into them; `load_outside` preads the head (and the embedding when it is another matrix) and the tied
embedding looks its rows up in the head's bytes (an fp32 copy of SmolLM2's tied matrix is 113 MB against its 30 MB
of Q8_0); `release_mapped_pages` drops what small reads through the map (norms, biases) left mapped. `packed_sizes`
tells the placement what these hold, so a RAM budget is planned with the bytes that are really allocated.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

import numpy as np
import torch

from hivekeeper.core.offload.tiered_cache import drop_mapped_pages
from hivekeeper.core.runtime.block_tensors import block_tensor_names, expected_block_shapes
from hivekeeper.core.runtime.checkpoint import EMBEDDING_TENSOR, FINAL_NORM_TENSOR, LM_HEAD_TENSOR
from hivekeeper.core.runtime.gguf import (FUSED_LINEARS, GGUFCheckpoint, PackedHead, load_packed_block, packs,
                                          unpermute_qk)
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear, QuantizedMatrix
from hivekeeper.core.runtime.model import Block, RotaryTable
from hivekeeper.core.runtime.quant.blocks import format_of_ggml_type

NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


class PackedBlockReader:
    """Reads a GGUF's layers into packed slot blocks (`fill`), counting the bytes read per layer. Thread-safe (the
    streamer's reader thread fills one slot while another computes)."""

    def __init__(self, checkpoint: GGUFCheckpoint, rotary: RotaryTable, drop_page_cache: bool = False):
        self.checkpoint, self.config, self.rotary = checkpoint, checkpoint.config, rotary
        self.drop_page_cache = drop_page_cache
        self._fd = os.open(checkpoint.path, os.O_RDONLY)
        self.shapes = expected_block_shapes(self.config)
        self.bytes_read = 0
        self.reads: Counter[int] = Counter()  # layer -> times its weights were read
        self.rebuilt = 0  # fills that built a block (the slot's layout did not fit the layer)
        self._lock = threading.Lock()

    def empty_block(self, layer: int) -> Block:
        """A block shaped as layer `layer` loads packed, its buffers allocated but not read (`fill` reads them); a
        layer with a linear that does not pack (another type) is loaded whole instead (gguf.load_packed_block)."""
        if not self._packs_whole(layer):
            return self._built(layer)
        with torch.device("meta"):
            block = Block(self.config, layer, self.rotary)
        for fused, pieces in FUSED_LINEARS.items():
            names = [f"model.layers.{layer}.{piece}.weight" for piece in pieces]
            fmt = format_of_ggml_type(int(self.checkpoint.tensors[names[0]].tensor_type))
            outs = sum(self.shapes[f"{piece}.weight"][0] for piece in pieces)
            cols = self.shapes[f"{pieces[0]}.weight"][1]
            matrix = QuantizedMatrix(fmt, np.empty((outs, fmt.row_bytes(cols)), dtype=np.uint8), outs, cols)
            bias = torch.empty(outs) if self._biases(layer, pieces) else None
            parent, child = fused.split(".")
            setattr(getattr(block, parent), child, QuantizedLinear(matrix, bias))
        for module in block.modules():  # the norms
            for name, param in module.named_parameters(recurse=False):
                if param.is_meta:
                    module._parameters[name] = torch.nn.Parameter(torch.empty(param.shape), requires_grad=False)
        block.rotary = self.rotary
        return block.requires_grad_(False)

    def load_block(self, layer: int) -> Block:
        """Layer `layer` as a packed block of its own (a resident block): allocated, then read with pread."""
        if not self._packs_whole(layer):
            return self._built(layer)
        block, _ = self.fill(self.empty_block(layer), layer)
        return block

    def _packs_whole(self, layer: int) -> bool:
        return all(packs(self.checkpoint, layer, pieces) for pieces in FUSED_LINEARS.values())

    def _built(self, layer: int) -> Block:
        """Layer `layer` built by gguf.load_packed_block (through the memory map: a linear stored otherwise is
        dequantized), the map's pages released after it."""
        block = load_packed_block(self.checkpoint, layer, self.rotary)
        release_mapped_pages(self.checkpoint)
        return block

    def read_matrix(self, name: str, shape: tuple[int, int]) -> QuantizedMatrix | None:
        """Tensor `name` (a head or embedding matrix) as its packed bytes read into a buffer of its own, or None when
        it is not stored in a packable format."""
        if not self.checkpoint.packable(name):
            return None
        fmt = format_of_ggml_type(int(self.checkpoint.tensors[name].tensor_type))
        rows = np.empty((shape[0], fmt.row_bytes(shape[1])), dtype=np.uint8)
        self._read_rows(name, rows, shape[0])
        return QuantizedMatrix(fmt, rows, *shape)

    def stored_bytes(self, layer: int) -> int:
        """The bytes layer `layer` takes in the file (what one fill reads)."""
        return sum(self.checkpoint.stored_bytes(name) for name in block_tensor_names(self.config, layer))

    def fill(self, block: Block, layer: int) -> tuple[Block, int]:
        """Layer `layer` into `block` in place when its packed layout fits, else into a block built for it:
        (the block holding the layer, the bytes read)."""
        if not self._fits(block, layer):
            block = self._built(layer)
            with self._lock:
                self.rebuilt += 1
        else:
            self._copy_linears(block, layer)
            self._copy_rest(block, layer)
        block.layer_index = layer
        block.self_attn.window = self.config.window_of(layer)
        stored = self.stored_bytes(layer)
        with self._lock:
            self.bytes_read += stored
            self.reads[layer] += 1
        return block, stored

    def _fits(self, block: Block, layer: int) -> bool:
        """Whether every fused linear of `layer` is packed in the format (and shape) the slot's is."""
        for fused, pieces in FUSED_LINEARS.items():
            module = _module(block, fused)
            if not isinstance(module, QuantizedLinear) or not packs(self.checkpoint, layer, pieces):
                return False
            tensor = self.checkpoint.tensors[f"model.layers.{layer}.{pieces[0]}.weight"]
            if format_of_ggml_type(int(tensor.tensor_type)) != module.fmt:
                return False
            if (module.bias is None) != (not self._biases(layer, pieces)):
                return False
        return True

    def _biases(self, layer: int, pieces: tuple[str, ...]) -> list[str]:
        return [f"{piece}.bias" for piece in pieces if self.checkpoint.has(f"model.layers.{layer}.{piece}.bias")]

    def _copy_linears(self, block: Block, layer: int) -> None:
        """Each piece's packed rows from the file into its rows of the slot's fused matrix, and its biases."""
        for fused, pieces in FUSED_LINEARS.items():
            module = _module(block, fused)
            dest, row = module.packed.numpy(), 0
            for piece in pieces:
                name = f"model.layers.{layer}.{piece}.weight"
                outs = self.shapes[f"{piece}.weight"][0]
                self._read_rows(name, dest[row : row + outs], outs)
                row += outs
            start = 0
            for name in self._biases(layer, pieces):
                outs = self.shapes[name][0]
                self._read_float(f"model.layers.{layer}.{name}", module.bias[start : start + outs])
                start += outs

    def _read_rows(self, name: str, rows: np.ndarray, outs: int) -> None:
        """Tensor `name`'s packed rows into `rows` (Q/K rows that llama.cpp permuted put back in Hugging Face's
        order, through a scratch array)."""
        heads = self.checkpoint.permuted_heads(name)
        if heads:
            scratch = np.empty_like(rows)
            self._read(self.checkpoint.tensors[name], scratch, name)
            np.take(scratch, unpermute_qk(torch.arange(outs), heads).numpy(), axis=0, out=rows)
        else:
            self._read(self.checkpoint.tensors[name], rows, name)

    def _read(self, tensor, dest: np.ndarray, name: str) -> None:
        """A tensor's bytes from the file into `dest` (contiguous, exactly as many bytes) with positioned reads."""
        view, offset = memoryview(dest).cast("B"), int(tensor.data_offset)
        if view.nbytes != int(tensor.n_bytes):
            raise ValueError(f"{self.checkpoint.source}: {name} takes {tensor.n_bytes} bytes, the slot {view.nbytes}")
        done = 0
        while done < view.nbytes:
            count = os.preadv(self._fd, [view[done:]], offset + done)
            if count <= 0:
                raise OSError(f"{self.checkpoint.source}: the file ended inside tensor {name}")
            done += count
        if self.drop_page_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, offset, view.nbytes, os.POSIX_FADV_DONTNEED)

    def _copy_rest(self, block: Block, layer: int) -> None:
        for name in NORMS:
            self._read_float(f"model.layers.{layer}.{name}", block.get_parameter(name))

    def _read_float(self, name: str, dest: torch.Tensor) -> None:
        """A norm or bias into `dest` (fp32, contiguous): an F32 tensor in Hugging Face's order read with pread;
        another (F16, permuted Q/K biases) dequantized through the memory map, whose pages are then released (the
        page cache may hold the file in large folios, and one small read through the map mapped up to 2 MB)."""
        tensor = self.checkpoint.tensors[name]
        if (tensor.tensor_type.name == "F32" and not self.checkpoint.permuted_heads(name)
                and int(tensor.n_bytes) == dest.numel() * 4):
            self._read(tensor, dest.numpy(), name)
            return
        dest.copy_(self.checkpoint.read(name, torch.float32, tuple(dest.shape)))
        release_mapped_pages(self.checkpoint)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _module(block: Block, fused: str):
    parent, child = fused.split(".")
    return getattr(getattr(block, parent), child)


def packed_slot_bytes(block: Block) -> int:
    """The bytes a slot block holds (packed linears at their block bytes, the rest fp32)."""
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in [*block.parameters(), *block.buffers()]}
               .values())


class PackedEmbedding(torch.nn.Module):
    """The token embedding kept as packed rows (`packed`, uint8 [vocab, row bytes]; for a tied model the head's own
    buffer, shared): a lookup dequantizes only the rows asked for, bit for bit the values gguf's dequantizer gives
    (what the fp32 embedding holds)."""

    def __init__(self, matrix: QuantizedMatrix):
        super().__init__()
        self.fmt, self.vocab_size, self.hidden_size = matrix.fmt, matrix.outs, matrix.cols
        self.register_buffer("packed", torch.from_numpy(np.ascontiguousarray(matrix.packed)))

    @property
    def weight(self) -> torch.Tensor:
        """The packed rows: the runners read only its device from it."""
        return self.packed

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        ids = token_ids.reshape(-1).cpu().numpy()
        rows = self.packed.numpy()[ids]  # a copy of the rows asked for, contiguous
        values = QuantizedMatrix(self.fmt, rows, len(ids), self.hidden_size).dequantize()
        return torch.from_numpy(values).view(*token_ids.shape, self.hidden_size)


def head_tensor(checkpoint: GGUFCheckpoint) -> str:
    """The tensor the LM head multiplies with: lm_head, or the tied embedding."""
    untied = checkpoint.has(LM_HEAD_TENSOR) and not checkpoint.config.tie_word_embeddings
    return LM_HEAD_TENSOR if untied else EMBEDDING_TENSOR


def load_outside(reader: PackedBlockReader) -> tuple[torch.nn.Module, PackedHead] | None:
    """(embedding, head) of a GGUF whose head matrix is packed: the head's bytes read with pread; the embedding
    its rows when tied, else its own packed rows (or fp32 when stored otherwise). None when the head matrix does not
    pack (the engine then loads both as checkpoint.py does)."""
    checkpoint, config = reader.checkpoint, reader.config
    shape = (config.vocab_size, config.hidden_size)
    name = head_tensor(checkpoint)
    matrix = reader.read_matrix(name, shape)
    if matrix is None:
        return None
    with torch.device("meta"):
        head = PackedHead(config)
    norm = torch.empty(config.hidden_size)
    reader._read_float(FINAL_NORM_TENSOR, norm)
    head.load_state_dict({"norm.weight": norm}, strict=False, assign=True)
    head.lm_head = QuantizedLinear(matrix)
    head.weight = None
    if name == EMBEDDING_TENSOR:  # tied: the head's rows serve the lookups, and are the head's `weight` (shared)
        embedding = PackedEmbedding(QuantizedMatrix(matrix.fmt, head.lm_head.packed.numpy(), *shape))
        head.weight = torch.nn.Parameter(embedding.packed, requires_grad=False)
    else:
        own = reader.read_matrix(EMBEDDING_TENSOR, shape)
        embedding = PackedEmbedding(own) if own is not None else _fp32_embedding(checkpoint)
    return embedding, head.requires_grad_(False)


def _fp32_embedding(checkpoint: GGUFCheckpoint) -> torch.nn.Module:
    from hivekeeper.core.runtime.checkpoint import load_embedding

    return load_embedding(checkpoint.path)


def outside_held_bytes(checkpoint: GGUFCheckpoint) -> int | None:
    """The bytes load_outside's embedding, final norm and head hold, or None when it would not load them."""
    config = checkpoint.config
    name, fp32 = head_tensor(checkpoint), config.vocab_size * config.hidden_size * 4
    if not checkpoint.packable(name):
        return None
    held = checkpoint.stored_bytes(name) + config.hidden_size * 4
    if name != EMBEDDING_TENSOR:
        held += checkpoint.stored_bytes(EMBEDDING_TENSOR) if checkpoint.packable(EMBEDDING_TENSOR) else fp32
    return held


def release_mapped_pages(checkpoint: GGUFCheckpoint) -> None:
    """Drop the pages of the GGUF's memory map that reads through it (norms, biases, metadata) left mapped into
    this process (madvise MADV_DONTNEED: a read-only shared map refaults them from the page cache when read again),
    so that they leave its RSS. Nothing where madvise is not available."""
    data = getattr(checkpoint.reader, "data", None)
    if isinstance(data, np.ndarray):
        drop_mapped_pages(data.ctypes.data, data.nbytes)


def packed_sizes(model_path, device, dtype: torch.dtype, quant: str) -> dict[str, int]:
    """place_model's held_block_bytes / held_outside_bytes for a run of `model_path` on `device` in `dtype`: a GGUF
    the engine keeps packed (CPU, fp32, no --quant, gguf.packed_by_default) holds its largest block and its head
    (and embedding) at their packed bytes; {} for anything else (the dtype's sizes hold)."""
    from hivekeeper.planner.gguf_metadata import gguf_sizes, is_gguf

    from hivekeeper.core.runtime.gguf import packed_by_default

    if (torch.device(device).type != "cpu" or dtype != torch.float32 or quant != "none" or not packed_by_default()
            or not is_gguf(model_path)):
        return {}
    checkpoint = GGUFCheckpoint(model_path)
    # the one count of a packed block's bytes (gguf_metadata.GGUFSizes.packed_block_bytes), read once for all layers
    sizes = {"held_block_bytes": max(gguf_sizes(checkpoint.path).packed_block_bytes)}
    outside = outside_held_bytes(checkpoint)
    if outside is not None:
        sizes["held_outside_bytes"] = outside
    return sizes
