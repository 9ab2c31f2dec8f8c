"""Fixed-size ring buffers of (time, value) samples for the live plots."""

from __future__ import annotations

import numpy as np


class RingBuffer:
    """The last `capacity` samples of one series; `arrays()` returns them oldest first, without copying twice."""

    def __init__(self, capacity: int = 600):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._t = np.zeros(capacity)
        self._v = np.zeros(capacity)
        self._next = 0  # where the next sample goes
        self._count = 0

    def append(self, t: float, value: float) -> None:
        self._t[self._next] = t
        self._v[self._next] = value
        self._next = (self._next + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)

    def __len__(self) -> int:
        return self._count

    def clear(self) -> None:
        self._next = self._count = 0

    def last(self) -> float | None:
        return None if self._count == 0 else float(self._v[self._next - 1])

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(times, values), oldest first."""
        if self._count < self.capacity:
            return self._t[:self._count].copy(), self._v[:self._count].copy()
        order = np.r_[self._next:self.capacity, 0:self._next]
        return self._t[order], self._v[order]
