"""Micro-benchmarks of this machine: RAM and device bandwidth, matmul FLOP/s, host<->device copies, disk reads.

Each function returns the best of a few repeats (the least disturbed run), as bytes/s or FLOP/s, and calls
`progress(fraction, label)` between steps so a GUI or a terminal bar can follow along.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch

Progress = Callable[[float, str], None]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _silent(fraction: float, label: str) -> None:
    pass


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    fn()  # warm-up: first-touch page faults, kernel selection
    _synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class MatmulShape:
    """A matmul [m, k] @ [k, n]; decode multiplies a few rows by a weight matrix, prefill many."""

    m: int
    k: int
    n: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def memory_read_bandwidth(device: str | torch.device = "cpu", size_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Read bandwidth of a device's memory in bytes/s: a reduction over a buffer far larger than the caches."""
    device = torch.device(device)
    buffer = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    seconds = _best_seconds(lambda: buffer.sum(), repeats, device)
    return size_bytes / seconds


def matmul_flops(shape: MatmulShape, dtype: str = "fp32", device: str | torch.device = "cpu", repeats: int = 5) -> float:
    """Achieved FLOP/s of one matmul shape in a dtype on a device."""
    device = torch.device(device)
    torch_dtype = _DTYPES[dtype]
    a = torch.randn(shape.m, shape.k, dtype=torch_dtype, device=device)
    b = torch.randn(shape.k, shape.n, dtype=torch_dtype, device=device)
    out = torch.empty(shape.m, shape.n, dtype=torch_dtype, device=device)
    # Small matmuls finish in microseconds: repeat inside one timing so timer resolution does not dominate.
    inner = max(1, int(2e8 // max(shape.flops, 1.0)))

    def run() -> None:
        for _ in range(inner):
            torch.matmul(a, b, out=out)

    seconds = _best_seconds(run, repeats, device)
    return shape.flops * inner / seconds


def host_device_bandwidth(direction: str, pinned: bool, size_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Copy bandwidth between host RAM and the first CUDA device ("h2d" or "d2h"), in bytes/s."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    device = torch.device("cuda", 0)
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    if direction == "h2d":
        seconds = _best_seconds(lambda: dev.copy_(host, non_blocking=pinned), repeats, device)
    elif direction == "d2h":
        seconds = _best_seconds(lambda: host.copy_(dev, non_blocking=pinned), repeats, device)
    else:
        raise ValueError(f"direction must be 'h2d' or 'd2h', not {direction!r}")
    return size_bytes / seconds


def _drop_from_page_cache(fd: int) -> None:
    """Ask the kernel to forget a file's cached pages so the next read comes from the disk itself.

    posix_fadvise(DONTNEED) evicts clean pages of that one file (we fsync first so all are clean); it needs no
    privileges, unlike writing to /proc/sys/vm/drop_caches.
    """
    os.fsync(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def disk_bandwidth(folder: str | os.PathLike, size_bytes: int = 256 << 20, repeats: int = 3,
                   progress: Progress = _silent) -> tuple[float, float, bool]:
    """Sequential (write, read) bandwidth of the disk holding `folder`, in bytes/s, reading past the page cache.

    Returns (write_bps, read_bps, cache_bypassed): cache_bypassed is False where the platform has no
    posix_fadvise, in which case the read figure may include the page cache and overstates the disk.
    """
    chunk = 8 << 20
    block = os.urandom(chunk)
    best_write = best_read = 0.0
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".hivekeeper-disk-", delete=True) as handle:
        fd = handle.fileno()
        for attempt in range(repeats):
            os.lseek(fd, 0, os.SEEK_SET)
            start = time.perf_counter()
            for _ in range(size_bytes // chunk):
                os.write(fd, block)
            os.fsync(fd)
            best_write = max(best_write, size_bytes / (time.perf_counter() - start))
            _drop_from_page_cache(fd)
            os.lseek(fd, 0, os.SEEK_SET)
            start = time.perf_counter()
            while os.read(fd, chunk):
                pass
            best_read = max(best_read, size_bytes / (time.perf_counter() - start))
            progress((attempt + 1) / repeats, "disk")
    return best_write, best_read, hasattr(os, "posix_fadvise")
