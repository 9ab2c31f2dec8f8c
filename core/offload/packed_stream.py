"""Streaming a GGUF's blocks packed: the slots of streamed blocks hold Q8_0/Q4_0/Q4_1 linears as the file's block
bytes (QuantizedLinear), as resident blocks and swarm spans do, instead of fp32 copies.

A streamed block is then read as its packed bytes straight from the file into the slot with positioned reads (one
copy; the Q/K rows llama.cpp permuted are read into a scratch array and put back in Hugging Face's order by taking
whole packed rows), with no dequantizing; the slot holds about a quarter (Q8_0) to an eighth (Q4_0/Q4_1) of an fp32
block, and the step multiplies it with the quantized kernels. Reading with pread rather than through the memory map
keeps the file's pages out of the process's RSS (a RAM budget is checked against RSS), and `drop_page_cache` evicts
what was read from the page cache, for benchmarks of the disk itself (as weights.BlockReader does). A layer whose linears are stored otherwise than the slot's (another format, a type that is not
packed) gets a block built for it (gguf.load_packed_block) in place of the slot's.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

import numpy as np
import torch

from hivekeeper.core.runtime.block_tensors import block_tensor_names, expected_block_shapes
from hivekeeper.core.runtime.gguf import FUSED_LINEARS, GGUFCheckpoint, load_packed_block, packs, unpermute_qk
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear
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
        """A slot: layer `layer` loaded packed (later fills overwrite its bytes)."""
        return load_packed_block(self.checkpoint, layer, self.rotary)

    def stored_bytes(self, layer: int) -> int:
        """The bytes layer `layer` takes in the file (what one fill reads)."""
        return sum(self.checkpoint.stored_bytes(name) for name in block_tensor_names(self.config, layer))

    def fill(self, block: Block, layer: int) -> tuple[Block, int]:
        """Layer `layer` into `block` in place when its packed layout fits, else into a block built for it:
        (the block holding the layer, the bytes read)."""
        if not self._fits(block, layer):
            block = load_packed_block(self.checkpoint, layer, self.rotary)
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
        """Each piece's packed rows from the map into its rows of the slot's fused matrix."""
        checkpoint = self.checkpoint
        for fused, pieces in FUSED_LINEARS.items():
            module = _module(block, fused)
            dest, row = module.packed.numpy(), 0
            for piece in pieces:
                name = f"model.layers.{layer}.{piece}.weight"
                outs = self.shapes[f"{piece}.weight"][0]
                rows = dest[row : row + outs]
                heads = checkpoint.permuted_heads(name)
                if heads:
                    scratch = np.empty_like(rows)
                    self._read(checkpoint.tensors[name], scratch, name)
                    np.take(scratch, unpermute_qk(torch.arange(outs), heads).numpy(), axis=0, out=rows)
                else:
                    self._read(checkpoint.tensors[name], rows, name)
                row += outs
            biases = self._biases(layer, pieces)
            if biases:
                module.bias.copy_(torch.cat([checkpoint.read(f"model.layers.{layer}.{name}", torch.float32,
                                                             self.shapes[name]) for name in biases]))

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
            block.get_parameter(name).copy_(self.checkpoint.read(f"model.layers.{layer}.{name}", torch.float32, self.shapes[name]))

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
