"""Page 1, Hardware: what was detected, every number with where it came from, and the Measure button.

Below the machine as the planner uses it, a second table puts every measured number beside the catalog figure or
estimate it replaced, with the spread of its repeats: read from this machine's saved profile
(core.machine_profile, the file `hivekeeper measure` writes too), which loads without torch.
"""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QHBoxLayout, QHeaderView, QProgressBar, QPushButton, QTableWidget, QTableWidgetItem,
                               QVBoxLayout, QWidget)

from hivekeeper.core.machine.flops_words import flops_source, split_source
from hivekeeper.core.machine.measurement import BLOCK_OVERHEAD_KEY, Measurement
from hivekeeper.core.machine.profiles import ComparisonRow, MachineProfile, comparison_rows, load_machine_profile
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import GIB, HEADROOM_RULE, HardwareSpec, default_headroom

from hivekeeper.gui.services.hardware import DetectService, MachineInfo
from hivekeeper.gui.services.measure import WAITING_FOR_ANOTHER, MeasureService
from hivekeeper.gui.style import SOURCE_COLORS, label, page_layout

COLUMNS = ("Part", "Quantity", "Value", "Source", "Before measuring")
COMPARE_COLUMNS = ("Part", "Quantity", "Catalog / estimate", "Measured", "Measured ÷ catalog", "Spread of repeats")


HEADROOM_RULE_WORDS = {tier: f"larger of {minimum / GIB:g} GiB and {fraction:.0%}"
                       for tier, (minimum, fraction) in HEADROOM_RULE.items()}


def digits(x: float) -> str:
    """Three significant digits, never in exponent form: "0.142", "36.6", "1,008"."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _gbps(x: float | None) -> str:
    return "–" if not x else f"{digits(x / 1e9)} GB/s"


FLOPS_ORDER = ("fp32", "bf16", "fp16", "int8")


def compute_rows(part: str, device) -> list[tuple[str, str, str, str]]:
    """One row per dtype of a device's FLOP/s table ("fp32 compute": the rate the planner charges, which after
    Measure is the runtime's prefill passes through blocks, not a bare matmul's), each in its own unit with where it
    came from: a spec sheet's or the CPU's theoretical peak, a measured rate, or the rate the planner charges 16-bit
    matmuls on a CPU that computes 16-bit plans in fp32 (core/machine/cpu_dtype_rule.with_choice): flops_words."""
    flops, source = device.flops, device.sources.get("flops", "")
    return [(part, f"{dtype} compute", format_quantity(flops[dtype], "FLOP/s"), flops_source(dtype, flops, source))
            for dtype in sorted(flops, key=lambda d: FLOPS_ORDER.index(d) if d in FLOPS_ORDER else 9)]


def hardware_rows(spec: HardwareSpec) -> list[tuple[str, str, str, str]]:
    """(part, quantity, value, source) for every number the planner uses."""
    rows = []
    for index, gpu in enumerate(spec.gpus):
        part = f"GPU {index}: {gpu.name}"
        src = gpu.sources
        rows += [
            (part, "memory", f"{gpu.memory_bytes / 1e9:.3g} GB", src.get("memory_bytes", "")),
            (part, "memory bandwidth", _gbps(gpu.memory_bandwidth), src.get("memory_bandwidth", "")),
            *compute_rows(part, gpu),
            (part, "host link", "unified memory" if gpu.unified_memory else _gbps(gpu.host_link_bandwidth),
             src.get("host_link_bandwidth", "")),
            (part, "power", f"{gpu.power_watts:.0f} W", src.get("power_watts", "")),
        ]
    cpu, disk, net = spec.cpu, spec.disk, spec.network
    rows += [
        (f"CPU: {cpu.name}", "cores", str(cpu.cores or "–"), cpu.sources.get("cores", "")),
        *compute_rows(f"CPU: {cpu.name}", cpu),
        ("RAM", "size", f"{cpu.memory_bytes / 1e9:.3g} GB", cpu.sources.get("memory_bytes", "")),
        ("RAM", "bandwidth", _gbps(cpu.memory_bandwidth), cpu.sources.get("memory_bandwidth", "")),
        ("Disk", "capacity", f"{disk.capacity_bytes / 1e9:.4g} GB", disk.sources.get("capacity_bytes", "")),
        ("Disk", "read", _gbps(disk.read_bandwidth), disk.sources.get("read_bandwidth", "")),
        ("Disk", "write", _gbps(disk.write_bandwidth), disk.sources.get("write_bandwidth", "")),
        ("Network", "upload", f"{net.upload_bps / 1e6:.4g} Mbit/s", net.sources.get("upload_bps", "")),
        ("Network", "download", f"{net.download_bps / 1e6:.4g} Mbit/s", net.sources.get("download_bps", "")),
        ("Network", "round trip", f"{net.rtt_s * 1e3:.3g} ms", net.sources.get("rtt_s", "")),
    ]
    return rows + kept_free_rows(spec)


def kept_free_rows(spec: HardwareSpec) -> list[tuple[str, str, str, str]]:
    """What plans leave free on each tier by default (planner.hardware.default_headroom), and why: a default (the
    Plan page's Leave free adds to it), not a catalog figure."""
    kept = default_headroom(spec)
    parts = (("gpu", "GPU"), ("cpu", "RAM"), ("disk", "Disk")) if spec.gpus else (("cpu", "RAM"), ("disk", "Disk"))
    in_use = {"cpu": spec.cpu.in_use_bytes, "gpu": spec.gpus[0].in_use_bytes if spec.gpus else 0, "disk": 0}
    return [(part, "kept free", f"{kept[tier] / 1e9:.3g} GB",
             f"default headroom: {HEADROOM_RULE_WORDS[tier]}" + (f" + {in_use[tier] / 1e9:.3g} GB other programs held"
                                                         if in_use[tier] else ""))
            for tier, part in parts]


def format_quantity(value: float | None, unit: str) -> str:
    """A number of a comparison row in the unit people read: GB/s, GFLOP/s or TFLOP/s, ms, Mbit/s."""
    if value is None:
        return "–"
    if unit == "B/s":
        return _gbps(value)
    if unit == "FLOP/s":
        return f"{digits(value / 1e12)} TFLOP/s" if value >= 1e12 else f"{digits(value / 1e9)} GFLOP/s"
    if unit == "s":
        return f"{value * 1e3:.3g} ms"
    if unit == "bit/s":
        return f"{value / 1e6:.4g} Mbit/s"
    return f"{value:.4g} {unit}"


def comparison_cells(row: ComparisonRow, m: Measurement | None = None) -> tuple[str, str, str, str, str, str]:
    """The cells of one measured-beside-catalog row; `m` is its measurement, which says what a fitted number's
    cells can honestly show (fitted_cells)."""
    ratio = ""
    if row.catalog and row.measured is not None:
        ratio = f"{row.measured / row.catalog:.2f}×"
    measured = format_quantity(row.measured, row.unit)
    spread = "" if row.spread is None else f"{100 * row.spread:.0f}%"
    if m is not None and m.key in FITTED_KEYS:
        measured, ratio, spread = fitted_cells(m, measured, ratio, spread)
    return row.part, row.quantity, format_quantity(row.catalog, row.unit), measured, ratio, spread


FITTED_KEYS = (BLOCK_OVERHEAD_KEY,)  # measurements fitted to two kinds of run, not timed: they can fail to resolve
NOT_MEASURED = "not measured"


def fitted_cells(m: Measurement, measured: str, ratio: str, spread: str) -> tuple[str, str, str]:
    """(measured, ratio, spread) of a fitted number: "not measured" where the fit fell below the noise (saved as
    0, which plans take), and no spread where the profile kept no fits of its repeats (profiles saved before the
    spread was measured held a constant 0)."""
    if m.value <= 0:
        return NOT_MEASURED, "", "–"
    return measured, ratio, spread if m.samples else "–"


def machine_rows(machine: MachineInfo) -> list[tuple[str, str, str, str, str]]:
    """The rows of the machine as the planner uses it, with the detected (catalog or estimated) value beside each
    number that a measurement replaced."""
    before = {(part, quantity): value for part, quantity, value, _ in hardware_rows(machine.detected)}
    rows = []
    for part, quantity, value, source in hardware_rows(machine.hardware):
        old_value = before.get((part, quantity), "")
        rows.append((part, quantity, value, source, old_value if old_value != value else ""))
    return rows


def comparison_item(column: int, text: str, row: ComparisonRow, m: Measurement | None) -> QTableWidgetItem:
    """One cell of the measured-beside-catalog table: the catalog figure grey with its source, the measured one
    bold (unless not measured) with its measurement's story."""
    item = QTableWidgetItem(text)
    item.setFlags(Qt.ItemFlag.ItemIsEnabled)
    if column in (3, 5) and m is not None:
        item.setToolTip(f"{m.label}: {m.detail}" if m.detail else m.label)
    if column == 2:
        item.setToolTip(row.catalog_source or "")
        item.setForeground(QColor("#9aa5b1"))
    if column == 3 and text != NOT_MEASURED:
        font = item.font()
        font.setBold(True)
        item.setFont(font)
        item.setForeground(QColor(SOURCE_COLORS["measured"]))
    return item


class HardwarePage(QWidget):
    """Shows this machine. `machineChanged(MachineInfo)` fires when detection or a measurement changes what the
    planner uses."""

    machineChanged = Signal(object)

    def __init__(self, detect: DetectService, measure: MeasureService, parent: QWidget | None = None):
        super().__init__(parent)
        self.detect = detect
        self.measure = measure
        self.machine: MachineInfo | None = None
        self.profile: MachineProfile | None = None  # this machine's saved measurements, when there are some
        self.rows: list[tuple[str, str, str, str, str]] = []
        self.comparison: list[ComparisonRow] = []  # measured rows only

        layout = page_layout(self, QVBoxLayout, (24, 20), spacing=10)
        layout.addWidget(label("Hardware", "title"))
        self.description = label("Detecting this machine…", "subtitle", wrap=True)
        layout.addWidget(self.description)
        self.profile_label = label("", "small", wrap=True)
        layout.addWidget(self.profile_label)

        bar = QHBoxLayout()
        self.detect_button = QPushButton("Detect again")
        self.detect_button.clicked.connect(self.start_detection)
        self.measure_button = QPushButton("Measure")
        self.measure_button.setObjectName("primary")
        self.measure_button.setToolTip("Run the micro-benchmarks of `hivekeeper measure` in the background (RAM, "
                                       "matmuls, disk, GPU and its link); measured numbers replace estimates and "
                                       "catalog figures in every plan for this machine")
        self.measure_button.clicked.connect(self.start_measure)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.measure.cancel)
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setValue(0)
        self.progress.setFormat("not measured yet")
        self.progress_label = label("", "small")
        for widget in (self.detect_button, self.measure_button, self.cancel_button):
            bar.addWidget(widget)
        bar.addWidget(self.progress, 1)
        bar.addWidget(self.progress_label)
        layout.addLayout(bar)

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.SelectionMode.NoSelection)
        header = self.table.horizontalHeader()
        for column in (0, 1, 2, 4):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        layout.addWidget(self.table, 3)
        self.compare_title = label("Measured beside the catalog", "subtitle")
        self.compare_table = QTableWidget(0, len(COMPARE_COLUMNS))
        self.compare_table.setHorizontalHeaderLabels(COMPARE_COLUMNS)
        self.compare_table.verticalHeader().setVisible(False)
        self.compare_table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.compare_table.setSelectionMode(QTableWidget.SelectionMode.NoSelection)
        compare_header = self.compare_table.horizontalHeader()
        for column in range(len(COMPARE_COLUMNS) - 1):
            compare_header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        compare_header.setSectionResizeMode(len(COMPARE_COLUMNS) - 1, QHeaderView.ResizeMode.Stretch)
        layout.addWidget(self.compare_title)
        layout.addWidget(self.compare_table, 2)
        self.compare_title.hide()
        self.compare_table.hide()
        layout.addWidget(label("Sources: catalog = published spec sheets; detected = read from this system; "
                               "derived = computed from other numbers; estimated/default = a guess until "
                               "measured; measured = the Measure button or `hivekeeper measure` (hover a source for "
                               "the whole story).", "small", wrap=True))

        detect.detected.connect(self._on_machine)
        detect.failed.connect(self._on_detect_failed)
        measure.progress.connect(self._on_progress)
        measure.measured.connect(self._on_measured)
        measure.failed.connect(self._on_measure_failed)
        measure.runningChanged.connect(self._on_measure_running)
        if detect.machine is not None:
            self._show(detect.machine)

    @property
    def spec(self) -> HardwareSpec | None:
        """The machine as the planner uses it (measured numbers in place), or None before the first detection."""
        return self.machine.hardware if self.machine is not None else None

    # ---- actions ---------------------------------------------------------------------------------------------------
    def start_detection(self) -> None:
        self.detect_button.setEnabled(False)
        if self.machine is None:
            self.description.setText("Detecting this machine…")
        self.detect.detect()

    def start_measure(self) -> None:
        self.progress.setValue(0)
        self.progress.setFormat("%p%")
        self.progress_label.setText("starting…")
        self.measure.start(self.machine.detected if self.machine is not None else None)

    # ---- updates ---------------------------------------------------------------------------------------------------
    def _show(self, machine: MachineInfo) -> None:
        self.machine = machine
        spec = machine.hardware
        self.description.setText(spec.description or spec.id)
        if machine.measured_at:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(machine.measured_at))
            text = f"Measured {when}; plans for this machine use the measured numbers."
            self.progress.setValue(100)
            self.progress.setFormat(f"measured {when}")
        else:
            text = "Not measured yet: estimates and catalog figures are in use."
        self.profile_label.setText(f"{text} Cost-model factors: {machine.factors}.")
        self.profile_label.setToolTip(machine.profile or "")
        self._show_comparison(machine)
        rows = self.rows = machine_rows(machine)
        self.table.setRowCount(len(rows))
        previous_part = None
        for r, (part, quantity, value, source, before) in enumerate(rows):
            kind, detail = split_source(source)
            cells = (part if part != previous_part else "", quantity, value,
                     f"{kind}  ·  {detail}" if detail else kind, before)
            previous_part = part
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if c == 3:
                    item.setToolTip(source or "unknown")
                    item.setForeground(QColor(SOURCE_COLORS.get(kind, "#616e7c")))
                if c == 2:
                    font = item.font()
                    font.setBold(True)
                    item.setFont(font)
                if c == 4:
                    item.setForeground(QColor("#9aa5b1"))
                item.setFlags(Qt.ItemFlag.ItemIsEnabled)
                self.table.setItem(r, c, item)
        self.machineChanged.emit(machine)

    def _show_comparison(self, machine: MachineInfo) -> None:
        """Measured numbers beside what they replaced, from the saved profile (read here: no torch needed)."""
        try:
            self.profile = load_machine_profile(machine.detected)
        except InputError as exc:  # a broken profile file: say so, the detected numbers still stand
            self.profile = None
            self.profile_label.setText(f"{self.profile_label.text()} The saved measurements cannot be read: {exc}")
        self.comparison = [row for row in comparison_rows(machine.detected, self.profile) if row.measured is not None]
        visible = bool(self.comparison)
        self.compare_title.setVisible(visible)
        self.compare_table.setVisible(visible)
        if self.profile is not None and self.profile.measurements:
            low, high = (f"{f([m.loadavg for m in self.profile.measurements]):.1f}" for f in (min, max))
            load = low if low == high else f"{low}–{high}"
            self.compare_title.setText(
                f"Measured beside the catalog (best of the repeats; load average {load} while measuring"
                f"{'; calibrated with hivekeeper profile' if self.profile.calibrated else ''})")
        self.compare_table.setRowCount(len(self.comparison))
        for r, row in enumerate(self.comparison):
            m = self.profile.measurement(row.key) if self.profile is not None and row.key else None
            for c, text in enumerate(comparison_cells(row, m)):
                self.compare_table.setItem(r, c, comparison_item(c, text, row, m))

    def _on_machine(self, machine: MachineInfo) -> None:
        self.detect_button.setEnabled(True)
        self._show(machine)

    def _on_detect_failed(self, message: str) -> None:
        self.detect_button.setEnabled(True)
        self.description.setText(f"Detection failed: {message}")

    def _on_progress(self, fraction: float, what: str) -> None:
        self.progress.setValue(int(round(fraction * 100)))
        if what == "done":
            self.progress_label.setText(what)
        elif what == WAITING_FOR_ANOTHER:
            self.progress_label.setText(f"{what}…")
        else:
            self.progress_label.setText(f"measuring {what}…")

    def _on_measured(self, doc: dict) -> None:
        self.progress_label.setText("done")
        try:
            self.detect.remember(doc)  # the same path as a detection: cache, Hardware and Plan pages
        except InputError as exc:
            self._on_measure_failed(str(exc))

    def _on_measure_failed(self, message: str) -> None:
        self.progress_label.setText("")
        self.progress.setFormat("failed")
        self.profile_label.setText(f"Measurement failed: {message}")

    def _on_measure_running(self, running: bool) -> None:
        self.measure_button.setEnabled(not running)
        self.cancel_button.setEnabled(running)
        if not running and self.progress_label.text().startswith(("measuring", WAITING_FOR_ANOTHER)):
            self.progress_label.setText("cancelled")
