"""A disk store of int8/nf4 blocks, quantized once, that the offloading engine streams (and on a CPU loads) from.

Streaming a quantized block from the checkpoint would mean reading its fp16/fp32 weights and quantizing them again
at every step. Instead, the first run that streams int8/nf4 blocks quantizes each of them once (bitsandbytes, on
the CPU) and writes its packed tensors to one safetensors file per block; later runs read those files with
positioned reads straight into the streaming slots' tensors, which the slots' bitsandbytes layers compute with.
A CPU run loads its resident quantized blocks from the store too: bitsandbytes quantizes slowly on a CPU (~6 s for
the blocks of a 125M model), and reading the packed bytes takes a fraction of a second.

    <data dir>/quantized/<model>-<hash of its path>-<quant>-<dtype>/
        manifest.json               what was quantized from what: the checkpoint's files (size, mtime), the
                                    bitsandbytes version, the block layout, and each block file's size and CRC-32
        block-00003.safetensors     the quantized tensors of layer 3 (int8 weight + SCB; nf4 packed weight +
                                    absmax, nested absmax, code tables, offset), norms and biases

Every file is written to a temp file and renamed into place; the manifest is rewritten after each block, so an
interrupted build keeps what it finished. A store made from other files (the checkpoint changed) or another
bitsandbytes is rebuilt. A block file that is missing, of the wrong size or with a bad header is re-quantized when
the store opens (with a warning); one whose bytes do not match its CRC-32 (checked the first time a process reads
it) raises InputError and is removed, so the next run re-quantizes it. Opening a store removes the other stores
whose checkpoint folder no longer exists or whose checkpoint files changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import zlib
from pathlib import Path

import torch

from hivekeeper.planner.errors import InputError

from hivekeeper.core.atomic_file import folder_lock, write_json_atomic
from hivekeeper.core.runtime.checkpoint import INDEX_FILE, Checkpoint, load_block
from hivekeeper.core.runtime.model import Block, RotaryTable
from hivekeeper.core.runtime.quant.bnb import check_quant, empty_quantized_block, quantized_layout, quantized_tensors
from hivekeeper.core.runtime.safetensors_file import FILE_DTYPES, SafetensorsFile

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_CRC_CHUNK = 16 << 20


class StoreFile(SafetensorsFile):
    """A block file of the store: like a checkpoint file, plus the int8/uint8 tensors of quantized weights."""

    dtypes = {**FILE_DTYPES, "I8": torch.int8, "U8": torch.uint8}


def store_folder(checkpoint_path: str | Path, quant: str, dtype: torch.dtype, root: str | Path | None = None) -> Path:
    """Where the blocks of this checkpoint, quantized to `quant` with norms in `dtype`, are kept."""
    if root is None:
        from hivekeeper.core.machine.detect import default_data_dir

        root = default_data_dir() / "quantized"
    path = Path(checkpoint_path).resolve()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", path.name)[:60] or "model"
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return Path(root) / f"{name}-{digest}-{quant}-{_dtype_name(dtype)}"


def source_identity(checkpoint: Checkpoint) -> dict:
    """The checkpoint's files as the store saw them: a changed size or mtime means the store is stale."""
    names = {"config.json", *checkpoint.weight_map.values()}
    if (checkpoint.path / INDEX_FILE).is_file():
        names.add(INDEX_FILE)
    files = {}
    for name in sorted(names):
        try:
            stat = (checkpoint.path / name).stat()
        except OSError:
            raise InputError(f"{checkpoint.path / name}: missing (listed in the checkpoint)") from None
        files[name] = [stat.st_size, stat.st_mtime_ns]
    return {"path": str(checkpoint.path.resolve()), "files": files}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bitsandbytes_version() -> str:
    import bitsandbytes

    return str(getattr(bitsandbytes, "__version__", "unknown"))


def _data_crc(handle: SafetensorsFile) -> int:
    """CRC-32 of a file's tensor bytes, tensor after tensor in file order (what `fill` checks as it reads, and the
    16-bit half store's fill as it reads its own blocks)."""
    crc = 0
    for _, _, start, end in sorted(handle.entries.values(), key=lambda entry: entry[2]):
        offset = start
        while offset < end:
            chunk = os.pread(handle.fd, min(_CRC_CHUNK, end - offset), offset)
            if not chunk:
                raise InputError(f"{handle.path}: truncated")
            crc = zlib.crc32(chunk, crc)
            offset += len(chunk)
    return crc


def write_block_file(folder: Path, layer: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                     what: str) -> dict:
    """Write one block's tensors as `folder`/block-NNNNN.safetensors, whole or not at all: a temp file flushed to
    disk, its CRC-32 read back from it, then the rename. Returns the block's manifest entry (file, bytes, crc32).
    The quantized store and the 16-bit half store (core/offload/half_store.py) write their blocks with it."""
    from safetensors.torch import save_file

    path = folder / f"block-{layer:05d}.safetensors"
    handle, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.stem}.", suffix=".tmp")
    os.close(handle)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb+") as written:
            os.fsync(written.fileno())
        check = StoreFile(Path(tmp))
        try:
            crc, size = _data_crc(check), os.fstat(check.fd).st_size
        finally:
            check.close()
        os.replace(tmp, path)
    except OSError as exc:
        raise InputError(f"{path}: cannot write the {what} block ({exc.strerror or exc})") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return {"file": path.name, "bytes": size, "crc32": crc}


def remove_orphaned_stores(root: Path, keep: Path, what: str = "quantized") -> list[Path]:
    """Delete the stores under `root` whose checkpoint folder is gone (moved, deleted, an evicted hub cache) or whose
    checkpoint files changed since the store was made from them (source_identity): nothing could ever read them
    again, and the one that would be rebuilt in place. Stores whose manifest cannot be read are left alone. Returns
    what was removed; `what` names the kind of store in the warning."""
    removed = []
    for manifest in sorted(root.glob(f"*/{MANIFEST}")):
        folder = manifest.parent
        if folder == keep:
            continue
        try:
            source = json.loads(manifest.read_text(encoding="utf-8"))["source"]
            path, files = Path(source["path"]), dict(source["files"])
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
            continue
        why = stale_reason(path, files)
        if why is None:
            continue
        with folder_lock(folder):  # not while another process writes it
            shutil.rmtree(folder, ignore_errors=True)
        log.warning("removed the %s store %s: %s", what, folder, why)
        removed.append(folder)
    return removed


def stale_reason(path: Path, files: dict) -> str | None:
    """Why a store made from checkpoint `path` with `files` ({name: [size, mtime_ns]}, source_identity) can no
    longer be read, or None while the checkpoint is as it was."""
    if not (path / "config.json").is_file():
        return f"its checkpoint {path} is gone"
    for name, seen in files.items():
        try:
            stat = (path / name).stat()
        except OSError:
            return f"its checkpoint's file {path / name} is gone"
        if [stat.st_size, stat.st_mtime_ns] != list(seen):
            return f"its checkpoint's file {path / name} changed since the store was made"
    return None


class QuantStore:
    """The quantized blocks of one checkpoint for one quantization and norm dtype (see the module docstring).

    Use `QuantStore.open`; then `empty_block` for a block buffer and `fill(block, layer)` to read a layer into it.
    `quantized` lists the layers this process quantized (none when the store was reused).
    """

    def __init__(self, checkpoint: Checkpoint, quant: str, dtype: torch.dtype, folder: Path):
        self.checkpoint, self.config = checkpoint, checkpoint.config
        self.quant, self.dtype, self.folder = quant, dtype, folder
        self.manifest_path = folder / MANIFEST
        self.manifest: dict = {}
        self.quantized: list[int] = []
        self.bytes_read = 0
        self.drop_page_cache = False
        self._files: dict[int, StoreFile] = {}
        self._verified: set[int] = set()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, checkpoint: Checkpoint, quant: str, dtype: torch.dtype, layers: tuple[int, ...] | list[int], *,
             root: str | Path | None = None, drop_page_cache: bool = False) -> "QuantStore":
        """The store for these layers of `checkpoint`, quantizing (once) the ones it lacks or finds damaged."""
        quant = check_quant(quant)
        if quant == "none":
            raise InputError("a quantized block store needs --quant int8 or nf4")
        folder = store_folder(checkpoint.path, quant, dtype, root)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"{folder}: cannot create the quantized block store ({exc.strerror or exc})") from None
        remove_orphaned_stores(folder.parent, keep=folder)
        store = cls(checkpoint, quant, dtype, folder)
        store.drop_page_cache = drop_page_cache
        try:
            with folder_lock(folder):
                store._load_manifest()
                missing = [layer for layer in layers if not store._usable(layer)]
                if missing:
                    log.warning("quantizing %d block(s) to %s once, into %s (later runs read them from there)",
                                len(missing), quant, folder)
                for layer in missing:
                    store._build(layer)
        except BaseException:
            store.close()
            raise
        return store

    # ---- the manifest and its checks ----------------------------------------------------------------------------
    def _expected_header(self) -> dict:
        return {"format": FORMAT_VERSION, "quant": self.quant, "dtype": _dtype_name(self.dtype),
                "bitsandbytes": _bitsandbytes_version(), "source": source_identity(self.checkpoint)}

    def _load_manifest(self) -> None:
        expected = self._expected_header()
        doc = None
        if self.manifest_path.is_file():
            try:
                doc = json.loads(self.manifest_path.read_text(encoding="utf-8"))
                if not isinstance(doc, dict) or not isinstance(doc.get("blocks"), dict):
                    raise ValueError("not a store manifest")
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                log.warning("%s: corrupt quantized-store manifest (%s); re-quantizing every block", self.manifest_path,
                            exc)
                doc = None
            else:
                stale = [key for key, value in expected.items() if doc.get(key) != value]
                if stale:
                    log.warning("%s: made from other %s; re-quantizing every block", self.folder, ", ".join(stale))
                    doc = None
        if doc is None:
            for old in self.folder.glob("block-*.safetensors"):
                old.unlink(missing_ok=True)
            doc = {**expected, "layout": None, "tensors": None, "blocks": {}}
        for tmp in self.folder.glob(".block-*.tmp"):  # a build interrupted before its rename
            tmp.unlink(missing_ok=True)
        self.manifest = doc

    def _tensor_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        specs = self.manifest["tensors"]
        return {name: (getattr(torch, dtype), tuple(shape)) for name, (dtype, shape) in specs.items()}

    def _usable(self, layer: int) -> bool:
        """Whether layer's block file is there and sound (size and header; the bytes are checked on first read)."""
        entry = self.manifest["blocks"].get(str(layer))
        if entry is None or self.manifest.get("tensors") is None:
            return False
        path = self.folder / str(entry.get("file"))
        try:
            if path.stat().st_size != entry.get("bytes"):
                raise InputError(f"{path}: {path.stat().st_size} bytes, the manifest says {entry.get('bytes')}")
            handle = StoreFile(path)
            found = {name: (dtype, shape) for name, (dtype, shape, _, _) in handle.entries.items()}
            if found != self._tensor_specs():
                handle.close()
                raise InputError(f"{path}: its tensors do not match the store's block layout")
        except (OSError, InputError) as exc:
            reason = str(exc) if isinstance(exc, InputError) else f"{path}: {exc.strerror or exc}"
            log.warning("%s; the quantized block is damaged, re-quantizing block %d", reason, layer)
            del self.manifest["blocks"][str(layer)]
            return False
        self._files[layer] = handle
        return True

    # ---- building -------------------------------------------------------------------------------------------------
    def _build(self, layer: int) -> None:
        """Quantize one block from the checkpoint and write it (write_block_file; the manifest after)."""
        rotary = RotaryTable(self.config)
        block = load_block(self.checkpoint, layer, dtype=self.dtype, device="cpu", quant=self.quant, rotary=rotary)
        tensors = {name: t.detach().contiguous().clone() for name, t in quantized_tensors(block).items()}
        layout = quantized_layout(block)
        specs = {name: [_dtype_name(t.dtype), list(t.shape)] for name, t in tensors.items()}
        if self.manifest.get("tensors") is None:
            self.manifest["layout"], self.manifest["tensors"] = layout, specs
        elif self.manifest["layout"] != layout or self.manifest["tensors"] != specs:
            raise InputError(f"{self.checkpoint.path}: block {layer} quantizes to a different layout than the "
                             "other blocks; streaming quantized blocks needs every block alike")
        entry = write_block_file(self.folder, layer, tensors, {"quant": self.quant, "layer": str(layer)}, "quantized")
        self.manifest["blocks"][str(layer)] = entry
        write_json_atomic(self.manifest_path, self.manifest)
        self._files[layer] = StoreFile(self.folder / entry["file"])
        self._verified.add(layer)  # just checked against what was written
        self.quantized.append(layer)

    # ---- reading --------------------------------------------------------------------------------------------------
    def empty_block(self, rotary: RotaryTable, device: str | torch.device, pin: bool = False,
                    cpu_repack: bool = False) -> Block:
        """A block buffer (unfilled) with this store's quantized layout, on `device` (cpu_repack: for a block filled
        once and kept, see quant.empty_quantized_block)."""
        return empty_quantized_block(self.config, rotary, self.manifest["layout"], self._tensor_specs(), device,
                                     pin=pin, cpu_repack=cpu_repack)

    def fill(self, block: Block, layer: int) -> int:
        """Read layer `layer`'s quantized tensors into `block` (an `empty_block` on the CPU); returns bytes read."""
        handle = self._files.get(layer)
        if handle is None:
            raise InputError(f"{self.folder}: block {layer} is not in the quantized store (it was not opened for it)")
        destinations = quantized_tensors(block)
        verify = layer not in self._verified
        crc, total = 0, 0
        for name in sorted(destinations, key=lambda n: handle.entries[n][2]):  # file order: the CRC's order
            dest = destinations[name]
            total += handle.read_into(name, dest)
            if verify:
                crc = zlib.crc32(dest.reshape(-1).view(torch.uint8).numpy(), crc)
        if verify:
            if crc != self.manifest["blocks"][str(layer)]["crc32"]:
                self._discard(layer)
                raise InputError(f"{handle.path}: corrupt quantized block (CRC-32 mismatch); it was removed and "
                                 "is quantized again on the next run")
            with self._lock:
                self._verified.add(layer)
        if self.drop_page_cache:
            handle.drop_from_page_cache(list(handle.entries))
        block.layer_index = layer
        block.self_attn.window = self.config.window_of(layer)
        with self._lock:
            self.bytes_read += total
        return total

    def _discard(self, layer: int) -> None:
        with self._lock:
            handle = self._files.pop(layer, None)
        if handle is not None:
            handle.close()
        with folder_lock(self.folder):
            entry = self.manifest["blocks"].pop(str(layer), None)
            write_json_atomic(self.manifest_path, self.manifest)
            if entry is not None:
                (self.folder / entry["file"]).unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()
