"""The Measure button: `hivekeeper measure`'s micro-benchmarks on a worker thread, with progress and Cancel.

The benchmarks and the machine profile they are saved in are core's (core/machine/measure.py, core/machine/profiles.py):
the same file `hivekeeper measure` writes and `hivekeeper plan --hardware auto` reads. torch is imported on the
worker when the user asks, never at app start. The result is the hardware probe's answer for the new profile, so
the Hardware and Plan pages take it the same way as a detection.

The benchmarks' sizes are `hivekeeper measure`'s defaults (about a minute on a laptop); HIVEKEEPER_MEASURE_SIZES=quick
runs its `--quick` sizes instead (seconds, rougher numbers: first looks, tests and screenshots). The disk benchmark
runs in the data folder, where models are kept.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import HardwareSpec

from hivekeeper.gui.services.workers import WorkerThread, run_in_thread


SIZES_ENV = "HIVEKEEPER_MEASURE_SIZES"
SIZES_CHOICES = ("full", "quick")


def sizes_from_environment():
    """The BenchmarkSizes that HIVEKEEPER_MEASURE_SIZES names (unset or "full": the defaults; "quick": QUICK)."""
    from hivekeeper.core.machine.measure import QUICK, BenchmarkSizes

    choice = os.environ.get(SIZES_ENV, "").strip().lower() or "full"
    if choice not in SIZES_CHOICES:
        raise InputError(f"{SIZES_ENV}={os.environ[SIZES_ENV]!r}: use one of {', '.join(SIZES_CHOICES)}")
    return QUICK if choice == "quick" else BenchmarkSizes()


def measure_machine(detected: HardwareSpec | None, sizes, disk_folder: Path | None, report, should_stop) -> dict | None:
    """Run every benchmark, save them as this machine's profile, return the probe answer (None when cancelled)."""
    from hivekeeper.core.machine.detect import default_data_dir, detect_hardware
    from hivekeeper.core.offload.offloaded_model import use_physical_cores
    from hivekeeper.core.machine.profiles import new_profile, save_profile
    from hivekeeper.core.machine.measure import run_benchmarks

    from hivekeeper.gui.services.hardware_probe import machine_doc

    sizes = sizes if sizes is not None else sizes_from_environment()
    threads = use_physical_cores()
    if detected is None:
        report((0.0, "detecting"))
        detected = detect_hardware()
    folder = Path(disk_folder) if disk_folder is not None else default_data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    started = time.time()
    measurements = run_benchmarks(sizes, disk_folder=folder,
                                  progress=lambda fraction, label: report((fraction, label)), should_stop=should_stop)
    if should_stop():
        return None
    profile = new_profile(detected)
    profile.measurements, profile.measured_at, profile.threads = measurements, started, threads
    save_profile(profile)
    return machine_doc(detected, profile)


class MeasureService(QObject):
    """Runs the benchmarks on a worker. `measured(doc)` carries the probe answer for the saved profile."""

    progress = Signal(float, str)
    measured = Signal(dict)
    failed = Signal(str)
    runningChanged = Signal(bool)

    def __init__(self, parent: QObject | None = None, *, sizes=None, disk_folder: Path | None = None):
        super().__init__(parent)
        self.sizes = sizes  # a core.machine.measure.BenchmarkSizes; None: as HIVEKEEPER_MEASURE_SIZES says
        self.disk_folder = disk_folder  # None: the data folder, where models are kept
        self._handle: WorkerThread | None = None

    @property
    def running(self) -> bool:
        return self._handle is not None and self._handle.running

    def start(self, detected: HardwareSpec | None = None) -> None:
        if self.running:
            return
        sizes, folder = self.sizes, self.disk_folder
        self._handle = run_in_thread(lambda report, stop: measure_machine(detected, sizes, folder, report, stop),
                                     on_yield=self._on_progress, on_return=self._on_result, on_error=self._on_error,
                                     on_finish=self._on_finish)
        self.runningChanged.emit(True)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.abort()

    def wait(self, ms: int = 60_000) -> bool:
        return self._handle.wait(ms) if self._handle is not None else True

    def _on_progress(self, value) -> None:
        fraction, label = value
        self.progress.emit(float(fraction), str(label))

    def _on_result(self, doc) -> None:
        if doc is not None:  # None: cancelled
            self.measured.emit(doc)

    def _on_error(self, message: str) -> None:
        self.failed.emit(message)

    def _on_finish(self) -> None:
        self.runningChanged.emit(False)
