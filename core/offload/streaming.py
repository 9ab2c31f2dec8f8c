"""Streaming: a pool of block buffers ("slots") that load the next streamed blocks while the current one computes.

The pool holds prefetch depth + 1 slots. A reader thread fills a free slot from disk (and on CUDA copies it to the
device on a copy stream, with events ordering the copy against the compute), so the pool size bounds what streaming
holds in memory: a streamed block never stays after its turn.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hivekeeper.core.runtime.model import Block


class Slot:
    """A block buffer on the compute device; on CUDA also a pinned staging twin (for disk reads) and events."""

    def __init__(self, block: Block, staging: Block | None = None):
        self.block, self.staging = block, staging
        self.loaded = torch.cuda.Event() if staging is not None or _is_cuda(block) else None  # copy done
        self.released = torch.cuda.Event() if self.loaded is not None else None  # compute done with it
        self.has_released = False


def _is_cuda(block: Block) -> bool:
    return block.input_layernorm.weight.device.type == "cuda"


class BlockStreamer:
    """Loads streamed blocks into `depth + 1` slots, in the order the blocks run, cycling from step to step.

    acquire(layer) returns the block (waiting for its load); release(layer) hands the slot back, and every free
    slot immediately starts loading the next streamed block — the following step's first ones after the last.
    """

    def __init__(self, layers: tuple[int, ...], slots: list[Slot], load):
        self.layers = layers
        self.free: deque[Slot] = deque(slots)
        self.pending: deque[tuple[int, Slot, Future]] = deque()
        self.in_use: Slot | None = None
        self._load = load  # load(layer, slot): runs on the reader thread
        self._next = 0  # index into `layers` of the next block to request
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hivekeeper-reader")

    def _request_more(self) -> None:
        while self.free:
            layer = self.layers[self._next]
            self._next = (self._next + 1) % len(self.layers)
            slot = self.free.popleft()
            self.pending.append((layer, slot, self._executor.submit(self._load, layer, slot)))

    def _restart(self, layer: int) -> None:
        """Out of order (first use, or a step that failed halfway): drop what was prefetched, start at `layer`."""
        self._drain()
        self._next = self.layers.index(layer)

    def _drain(self) -> None:
        while self.pending:
            _, slot, future = self.pending.popleft()
            try:
                future.result()
            except BaseException:
                pass
            self.free.append(slot)
        if self.in_use is not None:
            self.free.append(self.in_use)
            self.in_use = None

    def acquire(self, layer: int) -> Block:
        if self.in_use is not None or not self.pending or self.pending[0][0] != layer:
            self._restart(layer)
            self._request_more()
        _, slot, future = self.pending.popleft()
        self.in_use = slot
        try:
            future.result()
        except BaseException:
            self._restart(layer)
            raise
        if slot.loaded is not None:
            torch.cuda.current_stream().wait_event(slot.loaded)
        self._request_more()
        return slot.block

    def release(self, layer: int) -> None:
        slot, self.in_use = self.in_use, None
        if slot is None:
            return
        if slot.released is not None:
            slot.released.record()
            slot.has_released = True
        self.free.append(slot)
        self._request_more()

    def close(self) -> None:
        self._drain()
        self._executor.shutdown(wait=True)
