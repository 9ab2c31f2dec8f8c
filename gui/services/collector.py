"""Python's cyclic garbage collected on the GUI thread only, while a window is open or a worker runs.

A Qt object held in a reference cycle (a widget whose connected lambda refers back to it, a timer in a closure) is
deleted when Python's collector finds the cycle, on whatever thread allocates at that moment. On a worker (the
quick measurement, a chat reply, a chart) its C++ destructor then runs off the GUI thread: "QBasicTimer::start:
Timers cannot be started from another thread", and a crash at worst. CI saw eight such warnings during the first
quick measurement (session 20): the collection ran on the measurement's worker, inside torch. So while a holder is
open (each MainWindow is one, and each running worker: workers._Relay), automatic collection is off, and a timer on the GUI thread collects whenever Python's
own thresholds say a collection is due (the generation they name), with CPython's own brake on full collections: one
only when the objects the younger collections moved to the oldest generation since the last full one are at least a
quarter of those it kept (a full collection of a process with torch loaded takes 0.1-0.5 s). When the last holder
stops, automatic collection is on again, as it was.
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

TICK_MS = 250  # how often the GUI thread looks at the allocation counts
FULL_BRAKE = 0.25  # CPython's: a full collection once the oldest generation grew by this fraction since the last


def due_generation() -> int | None:
    """The generation the automatic collector would collect now, None when none: it runs once the youngest
    generation's count passes its threshold (gc.get_threshold()), and collects the oldest generation whose count
    does (the oldest subject to the brake, which the caller decides)."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    if thresholds[0] <= 0 or counts[0] <= thresholds[0]:
        return None
    return max(generation for generation in range(3) if generation == 0 or counts[generation] > thresholds[generation])


class GuiThreadCollector(QObject):
    """Holds automatic collection off from its creation until `stop()`, collecting on its timer instead. Create it
    on the GUI thread (its timer runs there)."""

    _holders = 0
    _was_enabled = True
    # the brake's state is the process's, as the collector's is: set when the first holder opens, so a worker's
    # start (a Plan page chart at every knob move) does not list the oldest generation (20 ms per 200k objects)
    _kept_by_full = 0  # the oldest generation after the last full collection
    _brake_recheck_at = 0  # the oldest generation's count at which the brake is looked at again

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        if GuiThreadCollector._holders == 0:
            GuiThreadCollector._was_enabled = gc.isenabled()
            gc.disable()
            GuiThreadCollector._kept_by_full, GuiThreadCollector._brake_recheck_at = len(gc.get_objects(2)), 0
        GuiThreadCollector._holders += 1
        self._holding = True
        self.collections = 0  # collections this holder ran
        self._timer = QTimer(self)
        self._timer.setInterval(TICK_MS)
        self._timer.timeout.connect(self.collect_if_due)
        self._timer.start()

    def collect_if_due(self) -> None:
        generation = due_generation()
        if generation == 2 and not self._full_allowed():
            generation = 1
        if generation is not None:
            gc.collect(generation)
            self.collections += 1
        if generation == 2:
            GuiThreadCollector._kept_by_full, GuiThreadCollector._brake_recheck_at = len(gc.get_objects(2)), 0

    def _full_allowed(self) -> bool:
        """The brake: the oldest generation grew a quarter since the last full collection. Counting it lists the
        generation (20 ms for 200k objects), so once braked it is counted again only after as many younger
        collections as the oldest generation's threshold (the count gc.get_count() gives it)."""
        count = gc.get_count()[2]
        if count < self._brake_recheck_at:
            return False
        if len(gc.get_objects(2)) - self._kept_by_full >= FULL_BRAKE * self._kept_by_full:
            return True
        GuiThreadCollector._brake_recheck_at = count + gc.get_threshold()[2]
        return False

    def stop(self) -> None:
        """Give automatic collection back when no other holder is open. Idempotent. No collection here: a full one
        at every window's end made tests/gui 12% slower (158 s against 142 s), and the window's garbage outlives it."""
        if not self._holding:
            return
        self._holding = False
        self._timer.stop()
        GuiThreadCollector._holders -= 1
        if GuiThreadCollector._holders == 0 and GuiThreadCollector._was_enabled:
            gc.enable()
