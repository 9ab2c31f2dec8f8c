"""KV caches with a tier per block: each block's keys and values (or, with kv_cache_mode "recompute", its input
hidden states) on the compute device, in RAM (pinned when a GPU computes) or in a memory-mapped file on disk.

`TieredKVCache` copies an off-device block's cache into a device scratch buffer for its turn (unless attention runs
next to the cache); `RecomputeCache` recomputes K and V of the stored prefix every step (block_variants.py).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import tempfile

import torch
from torch import Tensor

from hivekeeper.planner.errors import InputError

from hivekeeper.core.offload.block_variants import forward_recomputing_kv
from hivekeeper.core.offload.placement import itemsize
from hivekeeper.core.runtime.model import Block, ModelConfig


class _TieredStore:
    """Per-block tensors of one session, each block's on its own tier, pre-allocated for max_length tokens.

    "disk" tensors are memory-mapped files (deleted at once, so nothing is left behind); "cpu" ones are pinned when
    a GPU computes. `length` counts the tokens stored, as in KVCache.
    """

    def __init__(self, config: ModelConfig, tiers: tuple[str, ...], batch: int, max_length: int, dtype: torch.dtype,
                 device: str | torch.device, disk_dir: str | os.PathLike | None = None):
        if max_length > config.max_position_embeddings:
            raise InputError(f"max_length {max_length} exceeds the model's context (max_position_embeddings "
                             f"{config.max_position_embeddings})")
        self.device = torch.device(device)
        self.batch, self.max_length, self.length = batch, max_length, 0
        self.tiers, self.dtype, self.disk_dir = tiers, dtype, disk_dir
        self.blocks: list[tuple[Tensor, ...]] = []

    def _allocate(self, shape: tuple[int, ...], tier: str) -> Tensor:
        if tier == "disk":
            return _file_tensor(shape, self.dtype, self.disk_dir)
        if tier == "gpu":
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def off_device(self, index: int) -> bool:
        return self.device.type == "cuda" and self.tiers[index] != "gpu"

    @property
    def nbytes(self) -> int:
        """Bytes of the per-block tensors on their tiers (scratch buffers on the compute device not counted)."""
        return sum(t.nbytes for block in self.blocks for t in block)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise InputError(f"cannot rewind the KV cache to {length} tokens: it holds {self.length}")
        self.length = length

    def release(self, index: int) -> None:
        """After block `index`'s turn: drop its disk-tier tensors' pages from this process (they stay in the file and
        the page cache), so that a session's on-disk cache is not counted in RSS block after block (issue 22: at
        batch 512 the bench's disk K/V, 151 MB, all stayed mapped, 1.59x its RAM budget)."""
        if self.tiers[index] == "disk":
            for tensor in self.blocks[index]:
                drop_mapped_pages(tensor.data_ptr(), tensor.nbytes)

    def close(self) -> None:
        self.blocks = []


class TieredKVCache(_TieredStore):
    """Keys and values of every block, each block's on its own tier.

    When a GPU computes, a block whose cache is in RAM or on disk is copied into a device scratch buffer for its
    turn and the new tokens written back — unless attention runs next to the cache (`attention_at_home`, the
    attention_on_cpu knob), which needs no scratch: block_variants.forward_with_attention_at_cache writes and reads
    the cache where it is.
    """

    def __init__(self, config: ModelConfig, tiers: tuple[str, ...], batch: int, max_length: int, dtype: torch.dtype,
                 device: str | torch.device, disk_dir: str | os.PathLike | None = None, *,
                 attention_at_home: bool = False):
        super().__init__(config, tiers, batch, max_length, dtype, device, disk_dir)
        shape = self.shape = (batch, config.num_kv_heads, max_length, config.head_dim)
        self.blocks = [(self._allocate(shape, tier), self._allocate(shape, tier)) for tier in tiers]
        needs_scratch = not attention_at_home and any(self.off_device(i) for i in range(len(tiers)))
        self._scratch = (torch.empty(shape, dtype=dtype, device=self.device),
                         torch.empty(shape, dtype=dtype, device=self.device)) if needs_scratch else None
        self.native_span = None  # OffloadedModel's PreparedSpan for these caches (False: they cannot take one)

    def load(self, index: int, position: int) -> tuple[Tensor, Tensor]:
        """(k, v) of block `index` on the compute device, holding the first `position` tokens."""
        if not self.off_device(index):
            return self.blocks[index]
        for home, scratch in zip(self.blocks[index], self._scratch):
            scratch[:, :, :position].copy_(home[:, :, :position], non_blocking=True)
        return self._scratch

    def store(self, index: int, position: int, tokens: int, rows: slice = slice(None)) -> None:
        """Write the new tokens' K/V (of these rows) back home when the block computed on a scratch copy."""
        if not self.off_device(index):
            return
        end = position + tokens
        for home, scratch in zip(self.blocks[index], self._scratch):
            home[rows, :, position:end].copy_(scratch[rows, :, position:end])

    def close(self) -> None:
        super().close()
        self._scratch = None


class RecomputeCache(_TieredStore):
    """kv_cache_mode "recompute": each block's INPUT hidden states [batch, max_length, hidden] instead of its K and
    V, on the block's cache tier. Every step recomputes K, V of the stored prefix into one scratch pair on the
    compute device (one micro-batch's rows) and runs the block on them; with a GPU, a prefix kept in RAM or on disk
    is first copied to a device buffer (hidden states, not K and V, cross the link).
    """

    def __init__(self, config: ModelConfig, tiers: tuple[str, ...], batch: int, max_length: int, dtype: torch.dtype,
                 device: str | torch.device, disk_dir: str | os.PathLike | None = None, *, rows: int | None = None):
        super().__init__(config, tiers, batch, max_length, dtype, device, disk_dir)
        shape = self.shape = (batch, max_length, config.hidden_size)
        self.blocks = [(self._allocate(shape, tier),) for tier in tiers]
        rows = min(rows or batch, batch)
        kv_shape = (rows, config.num_kv_heads, max_length, config.head_dim)
        self._keys = torch.empty(kv_shape, dtype=dtype, device=self.device)
        self._values = torch.empty(kv_shape, dtype=dtype, device=self.device)
        off = any(self.off_device(i) for i in range(len(tiers)))
        self._prefix = torch.empty((rows, max_length, config.hidden_size), dtype=dtype, device=self.device) \
            if off else None

    def run_block(self, index: int, block: Block, hidden: Tensor, rows: slice, position: int,
                  rope: tuple[Tensor, Tensor]) -> Tensor:
        """Block `index` on hidden [b, t, hidden] (the micro-batch `rows`) at `position`: store its inputs, then
        recompute K, V of the prefix and run the block."""
        b, t, _ = hidden.shape
        home = self.blocks[index][0][rows]  # [b, max_length, hidden]
        home[:, position : position + t].copy_(hidden)
        prefix = home[:, :position]
        if position and self.off_device(index):
            prefix = self._prefix[:b, :position].copy_(prefix, non_blocking=True)
        return forward_recomputing_kv(block, hidden, prefix, position, rope, self._keys[:b], self._values[:b])

    def close(self) -> None:
        super().close()
        self._keys = self._values = self._prefix = None


def keep_between_blocks(hidden: Tensor, home: torch.device) -> Tensor:
    """Hidden states moved to where they wait for the next block: pinned RAM when they leave a GPU (the
    activations knob), the device when they come from RAM, as they are when already there."""
    if hidden.device.type == home.type:
        return hidden
    if home.type == "cpu":
        pinned = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
        return pinned.copy_(hidden, non_blocking=True)
    return hidden.to(home, non_blocking=True)


def drop_mapped_pages(start: int, nbytes: int) -> None:
    """Drop the whole pages in [start, start + nbytes) of a shared file mapping from this process (madvise
    MADV_DONTNEED: they are refaulted from the page cache or the file when touched again). Nothing where madvise is
    not available."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None or nbytes <= 0:
        return
    page = mmap.PAGESIZE
    first = -(-start // page) * page
    length = (start + nbytes - first) // page * page
    if length > 0:
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(first), ctypes.c_size_t(length),
                                                  ctypes.c_int(advice))


def _file_tensor(shape: tuple[int, ...], dtype: torch.dtype, folder) -> Tensor:
    """A tensor backed by a shared memory-mapped file on disk; the file is unlinked at once (the mapping stays)."""
    numel = math.prod(shape)
    handle, path = tempfile.mkstemp(prefix="hivekeeper-kv-", dir=folder)
    try:
        os.ftruncate(handle, numel * itemsize(dtype))
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    finally:
        os.close(handle)
        os.unlink(path)
    return tensor.view(shape)
