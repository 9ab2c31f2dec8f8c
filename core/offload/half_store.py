"""A disk copy of a checkpoint's streamed blocks in the plan's 16-bit dtype, written once, that the engine streams from.

A bf16 plan over an fp32 checkpoint read every streamed block's fp32 bytes at every step and converted them on the
reader thread's core: twice the bytes of what it computes with, and a core busy converting (issue 22: the offload
bench's reader converted 1.4 GB a run). The first run that streams such blocks writes each of them, as the engine
holds it (q/k/v and gate/up fused), to one safetensors file in the plan's dtype; later runs read those files with
positioned reads straight into the streaming slots: half the bytes, no conversion.

    <data dir>/half-blocks/<model>-<hash of its path>-half-<dtype>/
        manifest.json               the checkpoint's files (size, mtime) it was made from, and each block file's size
                                    and CRC-32 of its tensor bytes
        block-00003.safetensors     layer 3's tensors under the Block's own names

Files are written with the project's safetensors writer (safetensors.torch.save_file, as the quantized store does)
to a temp file and renamed into place, the manifest after each block, under a lock file; a store made from other
files is rebuilt, and a block file of the wrong size or tensors is rewritten. A block whose bytes do not match its
CRC-32 (checked the first time a process reads it, as it is read) is never used: that read is redone from the
checkpoint and the file rewritten from it, with a warning. Opening a store removes the other 16-bit stores whose
checkpoint is gone or whose files changed (quant.store.remove_orphaned_stores). `HIVEKEEPER_HALF_STORE=0` turns it
off (the engine then converts as it reads, for an A/B).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from collections import Counter
from pathlib import Path

import torch

from hivekeeper.planner.errors import InputError

from hivekeeper.core.atomic_file import folder_lock, write_json_atomic
from hivekeeper.core.offload.weights import BlockReader, empty_block
from hivekeeper.core.runtime.checkpoint import Checkpoint
from hivekeeper.core.runtime.model import Block, RotaryTable
from hivekeeper.core.runtime.quant.store import (remove_orphaned_stores, source_identity, store_folder,
                                               write_block_file)
from hivekeeper.core.runtime.safetensors_file import SafetensorsFile

log = logging.getLogger(__name__)

HALF_STORE_ENV = "HIVEKEEPER_HALF_STORE"
FORMAT_VERSION = 2  # 2: each block's CRC-32 (session 12); a version-1 store is rebuilt
MANIFEST = "manifest.json"


def wanted(checkpoint: Checkpoint, dtype: torch.dtype) -> bool:
    """Whether streamed blocks of a `dtype` plan should come from a half store: a 16-bit plan over a checkpoint
    whose block weights are stored in another dtype (an fp32 file), unless HIVEKEEPER_HALF_STORE=0."""
    if os.environ.get(HALF_STORE_ENV, "1") == "0" or dtype not in (torch.bfloat16, torch.float16):
        return False
    name = "model.layers.0.mlp.down_proj.weight"
    (file_name,) = checkpoint.files_for([name])
    handle = SafetensorsFile(checkpoint.path / file_name)
    try:
        stored = handle.entries.get(name, (None,))[0]
    finally:
        handle.close()
    return stored is not None and stored != dtype


class HalfStore:
    """The blocks of one checkpoint in one 16-bit dtype. Use `HalfStore.open`; then `fill(block, layer)` reads a
    layer into a block of that dtype (the engine's slots), as weights.BlockReader does from the checkpoint."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, folder: Path, drop_page_cache: bool):
        self.checkpoint, self.config, self.dtype, self.folder = checkpoint, checkpoint.config, dtype, folder
        self.drop_page_cache = drop_page_cache
        self.manifest: dict = {}
        self.built: list[int] = []  # layers this process wrote (none when the store was reused)
        self.rebuilt: list[int] = []  # layers whose file failed its CRC-32 when read, and were written again
        self.bytes_read = 0
        self.reads: Counter[int] = Counter()
        self._files: dict[int, SafetensorsFile] = {}
        self._verified: set[int] = set()
        self._reader: BlockReader | None = None  # the checkpoint's, for a block that failed its check
        self._lock = threading.Lock()

    @classmethod
    def open(cls, checkpoint: Checkpoint, dtype: torch.dtype, layers: tuple[int, ...] | list[int], *,
             root: str | Path | None = None, drop_page_cache: bool = False) -> "HalfStore":
        """The store for these layers, writing (once) the block files it lacks or finds damaged."""
        if root is None:
            from hivekeeper.core.machine.detect import default_data_dir

            root = default_data_dir() / "half-blocks"
        folder = store_folder(checkpoint.path, "half", dtype, root)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"{folder}: cannot create the 16-bit block store ({exc.strerror or exc})") from None
        remove_orphaned_stores(folder.parent, keep=folder, what="16-bit block")
        store = cls(checkpoint, dtype, folder, drop_page_cache)
        try:
            with folder_lock(folder):
                store._load_manifest()
                missing = [layer for layer in layers if not store._usable(layer)]
                if missing:
                    log.warning("writing %d block(s) in %s once, into %s (later runs stream them from there)",
                                len(missing), str(dtype).removeprefix("torch."), folder)
                    store._build(missing)
        except BaseException:
            store.close()
            raise
        return store

    def _header(self) -> dict:
        return {"format": FORMAT_VERSION, "dtype": str(self.dtype).removeprefix("torch."),
                "source": source_identity(self.checkpoint)}

    def _load_manifest(self) -> None:
        expected, path, doc = self._header(), self.folder / MANIFEST, None
        try:
            doc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            log.warning("%s: unreadable manifest (%s); rewriting every block", path, exc)
        if not isinstance(doc, dict) or not isinstance(doc.get("blocks"), dict) \
                or any(doc.get(key) != value for key, value in expected.items()):
            for old in self.folder.glob("block-*.safetensors"):
                old.unlink(missing_ok=True)
            doc = {**expected, "blocks": {}}
        for tmp in self.folder.glob(".block-*.tmp"):  # a build interrupted before its rename
            tmp.unlink(missing_ok=True)
        self.manifest = doc

    def _usable(self, layer: int) -> bool:
        """Whether layer's file is there with the manifest's size and a block's tensors in this dtype."""
        entry = self.manifest["blocks"].get(str(layer))
        if not isinstance(entry, dict) or not isinstance(entry.get("crc32"), int):
            return False
        path = self.folder / str(entry.get("file"))
        shapes = {name: (self.dtype, tuple(p.shape)) for name, p in self._shape_block().named_parameters()}
        try:
            if path.stat().st_size != entry.get("bytes"):
                raise InputError(f"{path}: {path.stat().st_size} bytes, the manifest says {entry.get('bytes')}")
            handle = SafetensorsFile(path)
            if {name: (d, s) for name, (d, s, _, _) in handle.entries.items()} != shapes:
                handle.close()
                raise InputError(f"{path}: its tensors are not a block of this model in this dtype")
        except (OSError, InputError) as exc:
            log.warning("%s; rewriting block %d", exc if isinstance(exc, InputError) else f"{path}: {exc}", layer)
            del self.manifest["blocks"][str(layer)]
            return False
        self._files[layer] = handle
        return True

    def _shape_block(self) -> Block:
        if not hasattr(self, "_meta_block"):
            with torch.device("meta"):
                self._meta_block = Block(self.config, 0, RotaryTable(self.config))
        return self._meta_block

    def _build(self, layers: list[int]) -> None:
        """Read each layer from the checkpoint in this dtype (one reused block) and write it."""
        reader = BlockReader(self.checkpoint)
        block = empty_block(self.config, RotaryTable(self.config), self.dtype, "cpu")
        try:
            for layer in layers:
                reader.fill(block, layer)
                self._write(block, layer)
                self.built.append(layer)
        finally:
            reader.close()

    def _write(self, block: Block, layer: int) -> None:
        """Write `block` as layer's file (quant/store.write_block_file: temp file, CRC-32 read back, rename), then
        the manifest."""
        tensors = {name: p.detach() for name, p in block.named_parameters()}
        entry = write_block_file(self.folder, layer, tensors, {"layer": str(layer)}, "16-bit")
        self.manifest["blocks"][str(layer)] = entry
        write_json_atomic(self.folder / MANIFEST, self.manifest)
        with self._lock:
            old = self._files.pop(layer, None)
            self._files[layer] = SafetensorsFile(self.folder / entry["file"])
            self._verified.add(layer)  # just read back
        if old is not None:
            old.close()

    def fill(self, block: Block, layer: int) -> int:
        """Read layer `layer` into `block` (a block of this dtype); returns the bytes read. The first read of a
        layer in this process checks its CRC-32: a mismatch is read again from the checkpoint and rewritten."""
        handle = self._files.get(layer)
        if handle is None:
            raise InputError(f"{self.folder}: block {layer} is not in the 16-bit store (it was not opened for it)")
        params = dict(block.named_parameters())
        verify = layer not in self._verified
        crc, total = 0, 0
        for name in sorted(params, key=lambda n: handle.entries[n][2]):  # file order: the CRC's order
            total += handle.read_into(name, params[name])
            if verify:
                crc = zlib.crc32(params[name].detach().reshape(-1).view(torch.uint8).numpy(), crc)
        if verify and crc != self.manifest["blocks"][str(layer)]["crc32"]:
            total = self._rebuild(block, layer, handle.path)
        elif verify:
            with self._lock:
                self._verified.add(layer)
        if self.drop_page_cache:
            handle.drop_from_page_cache(list(handle.entries))
        block.layer_index = layer
        block.self_attn.window = self.config.window_of(layer)
        with self._lock:
            self.bytes_read += total
            self.reads[layer] += 1
        return total

    def _rebuild(self, block: Block, layer: int, path: Path) -> int:
        """Layer's file failed its CRC-32: fill `block` from the checkpoint instead and write the file again from it.
        Returns the bytes read from the checkpoint."""
        log.warning("%s: damaged 16-bit block (CRC-32 mismatch); reading layer %d from the checkpoint and writing the "
                    "block again", path, layer)
        with self._lock:
            if self._reader is None:
                self._reader = BlockReader(self.checkpoint)
            reader = self._reader
        total = reader.fill(block, layer)
        with folder_lock(self.folder):
            self._write(block, layer)
        self.rebuilt.append(layer)
        return total

    def close(self) -> None:
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()
            if self._reader is not None:
                self._reader.close()
                self._reader = None
