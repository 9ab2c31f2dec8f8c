"""The server's one compute thread, taking work by priority: inference steps before forward/backward.

All compute runs on one thread so the event loop keeps answering the DHT and other peers. A plain executor serves
first come first served, so 20 queued 8 MiB forwards delayed a session's next token by seconds; here a step of an
inference session waits at most for the task already running. Within a priority, work runs in arrival order.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from concurrent.futures import Future
from typing import Callable

INFERENCE = 0  # a session's step: someone is waiting for the next token
FORWARD = 1  # forward and backward passes (training, fine-tuning, long prompts without a cache)


class PriorityWorker:
    """A single daemon thread running submitted functions, lowest priority number first."""

    def __init__(self, name: str = "hivekeeper-compute"):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, priority: int, fn: Callable, *args) -> Future:
        future: Future = Future()
        if self._closed:
            future.cancel()
        else:
            self._queue.put((priority, next(self._order), fn, args, future))
        return future

    async def run(self, priority: int, fn: Callable, *args):
        """fn(*args) on the worker thread, awaited from the event loop."""
        return await asyncio.wrap_future(self.submit(priority, fn, *args))

    def pending(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        """Cancel queued work and let the thread end after the task it runs now."""
        self._closed = True
        while True:
            try:
                *_, future = self._queue.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.cancel()
        self._queue.put((-1, -1, None, (), None))  # wakes the thread to end it

    def _work(self) -> None:
        while True:
            _, _, fn, args, future = self._queue.get()
            if fn is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)
