"""A safetensors file read with positioned reads: a tensor's bytes go straight into a destination tensor.

Not a memory map: no page of a file stays mapped into the process, so reading a streamed block leaves nothing in
RSS beyond the tensor it fills, and a read lands in its final (possibly fused) place with one copy. The offload
engine's block reader (core/offload/weights.py) and the quantized block store (quant/store.py) read through it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from torch import Tensor

from hivekeeper.planner.errors import InputError

# safetensors dtype names -> the torch dtypes the engine reads (others are listed with dtype None)
FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
MAX_HEADER_BYTES = 100 << 20  # a longer header is a corrupt file, not a model


class SafetensorsFile:
    """One safetensors file, read with positioned reads: tensor bytes go straight into a destination tensor."""

    dtypes = FILE_DTYPES  # file dtypes it reads (others are listed with dtype None)

    def __init__(self, path: Path):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise InputError(f"{path}: cannot open ({exc.strerror})") from None
        try:
            self.entries = self._read_header()
        except BaseException:
            os.close(self.fd)
            raise

    def _read_header(self) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
        size = os.fstat(self.fd).st_size
        prefix = os.pread(self.fd, 8, 0)
        if len(prefix) < 8:
            raise InputError(f"{self.path}: truncated safetensors file (no header)")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise InputError(f"{self.path}: corrupt safetensors header (length {length})")
        try:
            header = json.loads(os.pread(self.fd, length, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{self.path}: corrupt safetensors header ({exc})") from None
        data_start = 8 + length
        self.metadata = header.get("__metadata__") or {}  # the file's string-to-string metadata
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                start, end = (int(x) for x in info["data_offsets"])
                entries[name] = (self.dtypes.get(info["dtype"]), tuple(int(d) for d in info["shape"]),
                                 data_start + start, data_start + end)
            except (KeyError, TypeError, ValueError):
                raise InputError(f"{self.path}: corrupt safetensors header entry for {name!r}") from None
            if data_start + end > size:
                raise InputError(f"{self.path}: truncated: tensor {name!r} ends past the end of the file")
        return entries

    def read_into(self, name: str, dest: Tensor) -> int:
        """Read tensor `name` into `dest` (any device; converted to dest's dtype); returns the bytes read."""
        entry = self.entries.get(name)
        if entry is None:
            raise InputError(f"{self.path}: tensor {name!r} is missing")
        dtype, shape, start, end = entry
        if dtype is None:
            raise InputError(f"{self.path}: tensor {name!r} has an unsupported dtype (need F32, BF16 or F16)")
        if shape != tuple(dest.shape):
            raise InputError(f"{self.path}: tensor {name!r} has shape {shape}, expected {tuple(dest.shape)}")
        direct = dest.dtype == dtype and dest.device.type == "cpu" and dest.is_contiguous()
        target = dest if direct else torch.empty(shape, dtype=dtype)
        self._pread_into(target.view(-1).view(torch.uint8).numpy(), start, end - start, name)
        if not direct:
            dest.copy_(target)
        return end - start

    def _pread_into(self, buffer, offset: int, length: int, name: str) -> None:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < length:  # one preadv moves at most ~2 GB
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise InputError(f"{self.path}: short read of tensor {name!r} (file truncated?)")
            done += n

    def drop_from_page_cache(self, names: list[str]) -> None:
        """Ask the OS to forget these tensors' pages, so the next read comes from the disk itself."""
        if not hasattr(os, "posix_fadvise"):
            return
        for name in names:
            _, _, start, end = self.entries[name]
            os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
