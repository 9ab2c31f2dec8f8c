"""This machine for the app: detected (and its saved measurements applied) by a child process, cached on disk.

Detection imports torch and talks to the GPU driver, and reading a machine profile imports torch too, so both run
in `python -m hivekeeper.gui.services.hardware_probe`, outside the GUI process. The app starts from the answer cached by
the last run (machine.json in the config folder) and replaces it when the probe ends.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, Signal

from hivekeeper.planner.efficiency import Efficiency, MachineEfficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import HardwareSpec
from hivekeeper.planner.hardware_catalog import hardware_from_dict

from hivekeeper.core.child_argv import die_with_parent
from hivekeeper.core.atomic_file import write_json_atomic

from hivekeeper.gui.services.child_process import end_process
from hivekeeper.gui.settings import config_dir


@dataclass(frozen=True)
class MachineInfo:
    """This machine as the planner sees it: `hardware` has measured numbers in place (when there are some),
    `detected` is the plain detection, `efficiency` the cost-model factors that go with `hardware` (None:
    defaults)."""

    detected: HardwareSpec
    hardware: HardwareSpec
    efficiency: MachineEfficiency | None = None
    calibrated: bool = False
    profile: str | None = None
    measured_at: float | None = None
    measured_load: float = 0.0  # the highest load average while it was measured (above the CPU count: busy)

    @property
    def factors(self) -> str:
        """Which cost-model factors predictions on this machine use, in words."""
        if self.calibrated:
            return "calibrated on this machine (hivekeeper profile)"
        if self.efficiency is not None and "measured" in self.efficiency.name:
            return "defaults, with fractions of 1 for measured numbers (not calibrated)"
        return "defaults (not calibrated)"


def machine_from_doc(doc, where: str) -> MachineInfo:
    """A MachineInfo from the probe's JSON line (or the cache); InputError names what is wrong."""
    if not isinstance(doc, dict) or not isinstance(doc.get("detected"), dict):
        raise InputError(f"{where}: expected the hardware probe's JSON object")
    detected = hardware_from_dict(doc["detected"], where=f"{where}: detected", default_source="detected")
    hardware = hardware_from_dict(doc.get("hardware") or doc["detected"], where=f"{where}: hardware",
                                  default_source="detected")
    efficiency = None
    factors = doc.get("efficiency")
    if factors is not None:
        try:
            efficiency = MachineEfficiency(Efficiency(**factors["accelerator"]), Efficiency(**factors["host"]))
        except (KeyError, TypeError) as exc:
            raise InputError(f"{where}: field 'efficiency' is malformed ({exc})") from None
    measured_at, load = doc.get("measured_at"), doc.get("measured_load")
    return MachineInfo(detected, hardware, efficiency, bool(doc.get("calibrated")),
                       doc.get("profile") if isinstance(doc.get("profile"), str) else None,
                       float(measured_at) if isinstance(measured_at, (int, float)) else None,
                       float(load) if isinstance(load, (int, float)) else 0.0)


class DetectService(QObject):
    """detect() runs the probe; `detected(MachineInfo)` or `failed(message)` follows. `machine` is the latest."""

    detected = Signal(object)
    failed = Signal(str)

    def __init__(self, parent: QObject | None = None, folder: Path | None = None, env: dict[str, str] | None = None):
        super().__init__(parent)
        self.folder = Path(folder) if folder is not None else config_dir()
        self.cache_path = self.folder / "machine.json"
        self.env = env or {}
        self.machine: MachineInfo | None = self.load_cached()
        self._process: QProcess | None = None

    @property
    def running(self) -> bool:
        return self._process is not None

    def load_cached(self) -> MachineInfo | None:
        try:
            return machine_from_doc(json.loads(self.cache_path.read_text(encoding="utf-8")), str(self.cache_path))
        except (OSError, ValueError, InputError):
            return None

    def remember(self, doc: dict) -> MachineInfo:
        """Take a probe answer (from the probe or from a measurement): parse, cache, announce."""
        machine = machine_from_doc(doc, "hardware probe")
        self.machine = machine
        try:
            write_json_atomic(self.cache_path, doc)
        except OSError:
            pass  # the cache only saves time at the next start
        self.detected.emit(machine)
        return machine

    def detect(self) -> None:
        if self._process is not None:
            return
        process = QProcess(self)
        argv = die_with_parent([sys.executable, "-m", "hivekeeper.gui.services.hardware_probe"])
        process.setProgram(argv[0])
        process.setArguments(argv[1:])
        if self.env:
            environment = QProcessEnvironment.systemEnvironment()
            for key, value in self.env.items():
                environment.insert(key, value)
            process.setProcessEnvironment(environment)
        process.finished.connect(self._finished)
        process.errorOccurred.connect(self._error)
        self._process = process
        process.start()

    def wait(self, ms: int = 60_000) -> bool:
        """Block until detection ends (tests and shutdown)."""
        if self._process is None:
            return True
        return self._process.waitForFinished(ms)

    def stop(self) -> None:
        """Kill a running probe and reap it (closing the app: no probe outlives it, not even as a zombie)."""
        if self._process is not None:
            end_process(self._process)

    def _finished(self, code: int, status) -> None:
        process, self._process = self._process, None
        out = bytes(process.readAllStandardOutput()).decode("utf-8", errors="replace")
        err = bytes(process.readAllStandardError()).decode("utf-8", errors="replace").strip()
        process.deleteLater()
        if code != 0 or status != QProcess.ExitStatus.NormalExit:
            self.failed.emit(err.splitlines()[-1] if err else f"hardware detection exited with code {code}")
            return
        try:
            self.remember(json.loads(out.strip().splitlines()[-1]))
        except (ValueError, IndexError, InputError) as exc:
            self.failed.emit(f"cannot read the hardware probe's answer: {exc}")

    def _error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart and self._process is not None:
            process, self._process = self._process, None
            process.deleteLater()
            self.failed.emit(f"cannot run the hardware probe: {process.errorString()}")
