"""The Measure button: `hivekeeper measure`'s micro-benchmarks on a worker thread, with progress and Cancel.

The benchmarks and the machine profile they are saved in are core's (core/machine/measure.py, core/machine/profiles.py):
the same file `hivekeeper measure` writes and `hivekeeper plan --hardware auto` reads. torch is imported on the
worker when the user asks, never at app start. The result is the hardware probe's answer for the new profile, so
the Hardware and Plan pages take it the same way as a detection.

The button's sizes are `hivekeeper measure`'s defaults (about a minute on a laptop). The first plan for a machine
that was never measured needs its numbers, so the app measures it once by itself with `--quick` sizes
(measurement.QUICK_TAKES, each step shown in the status bar: `start(quick=True)`, issue 14 item 12).
HIVEKEEPER_MEASURE_SIZES (measurement.SIZES_ENV) overrides both, as it does for the commands: "full", "quick", or
"tiny" (a few megabytes, ignoring the caches: tests and screenshots, where only the wiring matters). The disk benchmark
runs in the
data folder, where models are kept.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from hivekeeper.planner.hardware import HardwareSpec

from hivekeeper.core.machine.measurement import QUICK_TAKES, SIZES_ENV, busy_words, load_now, quiet_load  # noqa: F401

from hivekeeper.gui.services.workers import WorkerThread, run_in_thread


# the progress label while another process (a command, an API child's first plan) measures this machine
WAITING_FOR_ANOTHER = "waiting for another hivekeeper process's measurement of this machine"


def measure_machine(detected: HardwareSpec | None, sizes, disk_folder: Path | None, report, should_stop) -> dict | None:
    """Run every benchmark, save them as this machine's profile, return the probe answer (None when cancelled).
    sizes: a BenchmarkSizes, None (as HIVEKEEPER_MEASURE_SIZES says, else full) or "quick" (as it says, else
    QUICK)."""
    from hivekeeper.core.machine.detect import default_data_dir, detect_hardware
    from hivekeeper.core.offload.offloaded_model import use_physical_cores
    from hivekeeper.core.machine.profiles import new_profile, save_profile
    from hivekeeper.core.machine.measure import run_benchmarks, sizes_from_environment
    from hivekeeper.core.machine.profile_files import machine_fingerprint, measuring

    from hivekeeper.gui.services.hardware_probe import machine_doc

    if sizes is None or sizes == "quick":
        sizes = sizes_from_environment("quick" if sizes == "quick" else "full")
    threads = use_physical_cores()
    if detected is None:
        report((0.0, "detecting"))
        detected = detect_hardware()
    folder = Path(disk_folder) if disk_folder is not None else default_data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with measuring(machine_fingerprint(detected), waiting=lambda: report((0.0, WAITING_FOR_ANOTHER)),
                   should_stop=should_stop):
        started = time.time()
        measurements = [] if should_stop() else run_benchmarks(
            sizes, disk_folder=folder, progress=lambda fraction, label: report((fraction, label)),
            should_stop=should_stop)
    if should_stop():
        return None
    profile = new_profile(detected)
    profile.measurements, profile.measured_at, profile.threads = measurements, started, threads
    save_profile(profile)
    return {**machine_doc(detected, profile), "busy": busy_words(measurements, os.cpu_count() or 1)}


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

    def start(self, detected: HardwareSpec | None = None, quick: bool = False) -> None:
        """Measure on the worker: `hivekeeper measure`'s sizes, or with quick=True its --quick ones (unless
        HIVEKEEPER_MEASURE_SIZES names others)."""
        if self.running:
            return
        sizes, folder = ("quick" if quick and self.sizes is None else self.sizes), self.disk_folder
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


MEASURING_QUICK = f"Measuring this machine once, quickly ({QUICK_TAKES})…"  # then each step and how far
FIRST_MEASURE_ENV = "HIVEKEEPER_FIRST_MEASURE"  # "0": the app never measures by itself (the GUI tests' default)


def first_measure_enabled() -> bool:
    return os.environ.get(FIRST_MEASURE_ENV, "").strip() != "0"


class FirstMeasure(QObject):
    """Issue 14 item 12: a machine never measured gets plans from estimates that can be several times off (RAM
    bandwidth guessed, decode's real rate unknown). The first time a plan for it is needed, measure it once with
    the quick sizes, on the MeasureService's worker, saying so in the status bar, then the result. The measured
    profile reaches the pages the way the Measure button's does (the Hardware page remembers it)."""

    def __init__(self, measure: MeasureService, status_bar, parent: QObject | None = None):
        super().__init__(parent or measure)
        self.measure, self.status_bar = measure, status_bar
        self.started_at: float | None = None  # when it started (None: not yet, this run of the app)
        self.message = ""  # what the status bar was last told
        self.quick = False  # the quick measurement runs (its progress goes to the status bar)
        self.heading = MEASURING_QUICK  # what the status bar says while it runs
        measure.progress.connect(self._on_progress)
        measure.measured.connect(self._on_measured)
        measure.failed.connect(self._on_failed)
        measure.runningChanged.connect(self._on_running)

    @property
    def active(self) -> bool:
        return self.started_at is not None and self.measure.running

    def maybe_start(self, machine) -> bool:
        """Start the quick measurement when `machine` (a MachineInfo) was never measured, or was measured busy and
        the machine is quiet now, and none ran or runs in this app; True when it started. A busy
        profile while still busy is kept, and the status bar says so."""
        if self.started_at is not None or self.measure.running:
            return False
        cpus = os.cpu_count() or 1
        busy = machine.measured_at is not None and machine.measured_load > cpus
        if machine.measured_at is not None and not busy:
            return False
        now = load_now()
        if busy and now > quiet_load(cpus):
            self._say(f"This machine's profile was measured busy (load {machine.measured_load:.1f} on {cpus} CPUs): "
                      f"plans may be too slow; it is measured again when the load is at most {quiet_load(cpus):g}.",
                      30_000)
            return False
        self.started_at = time.time()
        self.quick = True
        self.heading = MEASURING_QUICK if not busy else \
            f"Measuring this machine again, quickly (its profile was measured at load {machine.measured_load:.1f})…"
        self._say(self.heading, 0)
        self.measure.start(machine.detected, quick=True)
        return True

    def _say(self, text: str, ms: int) -> None:
        self.message = text
        self.status_bar.showMessage(text, ms)

    def _on_progress(self, fraction: float, label: str) -> None:
        if self.quick:
            self._say(f"{self.heading} {label}, {100 * fraction:.0f}%", 0)

    def _on_measured(self, doc: dict) -> None:
        if not self.quick:
            return
        self.quick = False
        took = f"Measured this machine quickly in {time.time() - self.started_at:.1f} s{measured_summary(doc)}"
        busy = doc.get("busy") or ""  # a load above the CPU count: plans now read a busy moment's figures
        self._say(f"{took} {busy}." if busy else f"{took}: plans now use the measured numbers.",
                  60_000 if busy else 30_000)  # fits at 1280 px

    def _on_failed(self, message: str) -> None:
        if self.quick:
            self.quick = False
            self._say(f"Quick measurement of this machine failed: {message}", 30_000)

    def _on_running(self, running: bool) -> None:
        if not running and self.quick:  # cancelled: neither measured nor failed
            self.quick = False
            self._say("Quick measurement of this machine cancelled: plans use estimates.", 15_000)


def measured_summary(doc: dict) -> str:
    """" (RAM 34 GB/s, decode reads 30 GB/s)" from a probe answer's measured spec; "" when it says neither."""
    cpu = (doc.get("hardware") or {}).get("cpu") or {}
    ram = cpu.get("ram_bandwidth_gbps")
    fraction = (cpu.get("decode_streaming") or {}).get("bandwidth_fraction")
    if not isinstance(ram, (int, float)):
        return ""
    decode = f", decode reads {ram * fraction:.3g} GB/s" if isinstance(fraction, (int, float)) else ""
    return f" (RAM {ram:.3g} GB/s{decode})"
