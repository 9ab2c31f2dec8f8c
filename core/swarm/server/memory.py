"""The server's KV-cache memory pool: a hard byte limit shared by all inference sessions.

A session reserves its whole cache (max_length tokens) up front. When the pool is full it waits up to its
alloc_timeout for other sessions to end, then fails with a clear error; a request that could never fit fails at
once. A reservation is returned when the session ends, fails, or its client disappears (the `async with` exits).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

from hivekeeper.core.swarm.protocol import BUSY_MESSAGE


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class AllocationFailed(RuntimeError):
    """The pool could not give a session its cache in time (or ever)."""


class MemoryPool:
    """Counts bytes reserved against `limit_bytes`; waiters are served first come, first served."""

    def __init__(self, limit_bytes: int):
        if limit_bytes < 0:
            raise ValueError(f"memory limit must be >= 0, got {limit_bytes}")
        self.limit_bytes = int(limit_bytes)
        self.used_bytes = 0
        self._waiters: list[tuple[int, asyncio.Future]] = []

    @property
    def free_bytes(self) -> int:
        return self.limit_bytes - self.used_bytes

    @contextlib.asynccontextmanager
    async def reserve(self, nbytes: int, timeout: float) -> AsyncIterator[int]:
        """Hold `nbytes` of the pool for the body of the `async with`; waits at most `timeout` seconds."""
        await self._acquire(int(nbytes), timeout)
        try:
            yield nbytes
        finally:
            self._release(int(nbytes))

    async def _acquire(self, nbytes: int, timeout: float) -> None:
        if nbytes < 0:
            raise ValueError(f"cannot reserve {nbytes} bytes")
        if nbytes > self.limit_bytes:
            raise AllocationFailed(
                f"the session needs {format_bytes(nbytes)} of KV cache, more than this server's whole "
                f"pool ({format_bytes(self.limit_bytes)}); ask for a smaller max_length or batch"
            )
        if not self._waiters and nbytes <= self.free_bytes:
            self.used_bytes += nbytes
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiters.append(entry)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout=max(0.0, timeout))
        except asyncio.TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # granted at the very last moment: keep it
            raise AllocationFailed(  # a busy answer: the client tries another server at once
                f"{BUSY_MESSAGE} no room for {format_bytes(nbytes)} of KV cache within alloc_timeout={timeout:g}s "
                f"({format_bytes(self.free_bytes)} of {format_bytes(self.limit_bytes)} free after "
                f"{time.monotonic() - started:.1f}s); try again later or another server"
            ) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release(nbytes)  # granted, but our caller is gone
            raise
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
                waiter.cancel()
                self._grant_waiters()  # a big waiter leaving may unblock smaller ones behind it

    def _release(self, nbytes: int) -> None:
        self.used_bytes -= nbytes
        self._grant_waiters()

    def _grant_waiters(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free_bytes:
            nbytes, waiter = self._waiters.pop(0)
            if waiter.done():
                continue
            self.used_bytes += nbytes
            waiter.set_result(None)
