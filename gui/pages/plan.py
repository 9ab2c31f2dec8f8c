"""Page 2, Plan: pick a model, turn the knobs, and see the prediction change at once.

The Weight format menu lists what applies to the model on the machine chosen (plan_view.quant_choices: a GGUF's own
Q8_0/Q4_0/Q4_1 packed on a CPU, fp32/bf16, bitsandbytes on a CUDA GPU) and plans as `hivekeeper plan --quant` does.
The numbers, the bottleneck and the memory bars are recomputed on the GUI thread (one planner search: a few ms,
up to ~70 ms for the batch goal) a few ms after a knob moves; the two charts (many searches) are computed on a
worker and follow a moment later. The fit of every catalog model is computed on a worker when the machine changes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFormLayout, QGridLayout,
                               QGroupBox, QHBoxLayout, QLabel, QLineEdit, QListWidget, QListWidgetItem, QPushButton,
                               QScrollArea, QSpinBox, QVBoxLayout, QWidget)

from hivekeeper.planner import hardware_catalog, model_catalog
from hivekeeper.planner.calibration import is_calibrated
from hivekeeper.planner.efficiency import MachineEfficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import HardwareSpec, default_headroom
from hivekeeper.planner.models import ModelSpec
from hivekeeper.planner.policy import weighed_words

from hivekeeper.core.runtime.default_model import model_path_or_id

from hivekeeper.gui.viewmodels import plan_view
from hivekeeper.gui.widgets.chart import Chart
from hivekeeper.gui.widgets.memory_bars import MemoryBars
from hivekeeper.gui.widgets.model_menu import model_menu
from hivekeeper.gui.widgets.plan_run import RunPlanBox
from hivekeeper.gui.settings import GOALS, QUANTS, TIERS, PlanSettings
from hivekeeper.gui.style import (ACCENT, BAD, GOOD, MUTED, WARN, StatCard, fmt_bytes, fmt_energy, fmt_rate, fmt_seconds, label,
                    page_layout)
from hivekeeper.gui.services.workers import WorkerThread, run_in_thread

DETECTED = "detected"
FIT_COLORS = {"local": GOOD, "swarm": WARN, "none": BAD}
FIT_MARKS = {"local": "✓", "swarm": "☁", "none": "✗"}
CARD_HEIGHT = 112  # the top cards' least height (pixels); the bottleneck's text may need more
# the charts' least height: with a two-line warning above them they still fit a 1280x800 window whole (axis labels
# included); the results scroll where more text than that needs room, never squeezing a chart into a clipped one;
# the legends take a row or two under the axis label (Chart.legend_below)
CHART_HEIGHT = 180
GOAL_LABELS = {"chat": "chat (one fast stream)", "batch": "batch (most tokens/s)", "serve": "serve (swarm node)"}


@dataclass
class ChartData:
    batch: plan_view.Curve
    budget: plan_view.Curve
    budget_tier: str


def _spin(low: int, high: int, value: int, special: str | None = None, step: int = 1) -> QSpinBox:
    box = QSpinBox()
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setValue(value)
    box.setKeyboardTracking(False)
    if special:
        box.setSpecialValueText(special)
    return box


def _dspin(low: float, high: float, value: float, suffix: str = "", decimals: int = 1,
           special: str | None = None) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(low, high)
    box.setDecimals(decimals)
    box.setValue(value)
    box.setKeyboardTracking(False)
    if suffix:
        box.setSuffix(suffix)
    if special:
        box.setSpecialValueText(special)
    return box


def from_zero(plot: Chart, series) -> None:
    """A tokens/s axis from 0 to a little above the highest value: a flat curve is a flat line, not a zoom into its
    rounding (the memory chart of a model that fits in the least memory drew 29.0-29.6 tokens/s)."""
    finite = [v[np.isfinite(v)] for v in series]
    top = max((float(v.max()) for v in finite if v.size), default=0.0)
    if top > 0:
        plot.setYRange(0, top * 1.08, padding=0)


class PlanPage(QWidget):
    """The plan for the chosen model and knobs. `planChanged(PlanResult)` after each recompute."""

    planChanged = Signal(object)
    settingsChanged = Signal()

    def __init__(self, settings: PlanSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self.settings = settings
        self.detected: HardwareSpec | None = None  # this machine, measured numbers in place
        self.detected_efficiency: MachineEfficiency | None = None  # the cost-model factors that go with them
        self.result: plan_view.PlanResult | None = None
        self.error: str = ""
        self.charts: ChartData | None = None
        self.recomputes = 0  # how many times the prediction was recomputed (tests, benchmarks)
        self._models: dict[str, ModelSpec] = {}
        self._fits: dict[str, plan_view.ModelFit] = {}
        self._chart_job: WorkerThread | None = None
        self._chart_pending = False
        self._fit_job: WorkerThread | None = None
        self._quant_key: tuple | None = None  # (model, machine) the Weight format menu was filled for
        self._loading = True
        self._shut_down = False

        layout = page_layout(self, QHBoxLayout, (16, 14), spacing=14)
        layout.addWidget(self._build_controls(), 0)
        layout.addWidget(self._build_results(), 1)

        self._debounce = QTimer(self)
        self._debounce.setSingleShot(True)
        self._debounce.setInterval(10)
        self._debounce.timeout.connect(self.recompute)
        self._chart_timer = QTimer(self)
        self._chart_timer.setSingleShot(True)
        self._chart_timer.setInterval(150)
        self._chart_timer.timeout.connect(self._charts_due)
        self._load_settings()
        self._loading = False
        self._populate_models()
        QTimer.singleShot(0, self.refresh)

    # ---- building ------------------------------------------------------------------------------------------------
    def _build_controls(self) -> QWidget:
        panel = QWidget()
        column = QVBoxLayout(panel)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(8)
        column.addWidget(self._build_model_box(), 1)
        column.addWidget(self._build_knobs())
        self._connect_knobs()
        self.run_box = RunPlanBox(self._batch_run)  # "Run this plan": a batch over a prompts file (its chart: results)
        column.addWidget(self.run_box)
        scroll = scrolling(panel)
        scroll.setFixedWidth(390)
        panel.setMaximumWidth(375)
        return scroll

    def _build_model_box(self) -> QGroupBox:
        """The catalog (searchable, with each model's fit here), or a model from elsewhere."""
        models = QGroupBox("Model")
        box = QVBoxLayout(models)
        self.model_search = QLineEdit()
        self.model_search.setPlaceholderText("Search the catalog…")
        self.model_search.setClearButtonEnabled(True)
        self.model_search.textChanged.connect(self._filter_models)
        box.addWidget(self.model_search)
        box.addWidget(self._build_model_list(), 1)
        box.addWidget(label(f"<span style='color:{GOOD}'>✓</span> fits here &nbsp; "
                            f"<span style='color:{WARN}'>☁</span> needs the swarm &nbsp; "
                            f"<span style='color:{BAD}'>✗</span> too large", "small"))
        box.addLayout(self._build_model_sources())
        self.model_error = label("", "error", wrap=True)
        self.model_error.hide()
        box.addWidget(self.model_error)
        return models

    def _build_model_list(self) -> QListWidget:
        self.model_list = QListWidget()
        self.model_list.setMinimumHeight(170)
        self.model_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.model_list.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.model_list.currentItemChanged.connect(self._model_picked)
        return self.model_list

    def _build_model_sources(self) -> QHBoxLayout:
        """A model from outside the catalog: the built-in one, a GGUF file, a checkpoint folder, or a hub id in the
        local cache."""
        row = QHBoxLayout()
        self.folder_button = QPushButton("Local model…")
        self.folder_button.setToolTip("The built-in model, a GGUF file, or a checkpoint folder with a config.json")
        self.folder_button.setMenu(model_menu(self, "Model to plan", self.use_model, builtin_as_path=True))
        self.hub_edit = QLineEdit()
        self.hub_edit.setPlaceholderText("or a hub id (org/name) in the local cache")
        self.hub_edit.returnPressed.connect(lambda: self.use_model(self.hub_edit.text().strip()))
        row.addWidget(self.folder_button)
        row.addWidget(self.hub_edit, 1)
        return row

    def _build_knobs(self) -> QGroupBox:
        """Machine, goal, weight format, context, batch, memory to leave free, and the placement override."""
        knobs = QGroupBox("Knobs")
        form = QFormLayout(knobs)
        form.setLabelAlignment(Qt.AlignmentFlag.AlignRight)
        form.setVerticalSpacing(5)
        self._build_choices()
        self.context_spin = _spin(0, 1_000_000, 0, "auto (prompt + output)", 256)
        self.batch_spin = _spin(0, 65536, 0, "auto", 1)
        form.addRow("Machine", self.hardware_combo)
        self.machine_label = label("", "small", wrap=True)  # this machine in words (the combo keeps a short name)
        form.addRow("", self.machine_label)
        form.addRow("Goal", self.goal_combo)
        form.addRow("Weight format", self.quant_combo)
        self.format_label = label("", "small", wrap=True)  # what the weight format became for this model, and why
        form.addRow("", self.format_label)
        form.addRow("Context length", self.context_spin)
        form.addRow("Batch", self.batch_spin)
        form.addRow("Leave free", self._build_reserve_row())
        self.headroom_label = label("", "small", wrap=True)  # what plans keep free anyway (the default headroom)
        form.addRow("", self.headroom_label)
        self.override_check = QCheckBox("Override the placement")
        self.override_check.setToolTip("Place weights and KV cache yourself; the other choices stay the plan's")
        form.addRow(self.override_check)
        form.addRow(self._build_override_box())
        return knobs

    def _build_choices(self) -> None:
        """The machine (this one or a catalog one), the goal and the weight format."""
        self.hardware_combo = QComboBox()
        self.hardware_combo.addItem("This machine", DETECTED)
        for machine_id in hardware_catalog.hardware_ids():
            self.hardware_combo.addItem(f"Catalog: {machine_id}", machine_id)
        self.goal_combo = QComboBox()
        for goal in GOALS:
            self.goal_combo.addItem(GOAL_LABELS[goal], goal)
        self.quant_combo = QComboBox()  # every value until a model and machine narrow it (_fill_quant_choices)
        for quant in QUANTS:
            self.quant_combo.addItem(quant, quant)
        for combo in (self.hardware_combo, self.goal_combo, self.quant_combo):
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(14)

    def _build_reserve_row(self) -> QGridLayout:
        """Memory to leave free per tier (GB)."""
        self.reserve_spins = {tier: _dspin(0, 100_000, 0.0, " GB", 1) for tier in TIERS}
        reserve_row = QGridLayout()
        reserve_row.setHorizontalSpacing(4)
        for c, (tier, name) in enumerate((("gpu", "GPU"), ("cpu", "RAM"), ("disk", "disk"))):
            reserve_row.addWidget(label(name, "small"), 0, c, Qt.AlignmentFlag.AlignCenter)
            reserve_row.addWidget(self.reserve_spins[tier], 1, c)
            self.reserve_spins[tier].setMinimumWidth(70)
        return reserve_row

    def _build_override_box(self) -> QWidget:
        """Weights and KV cache placed by hand: percent per tier."""
        grid = QGridLayout()
        grid.setHorizontalSpacing(4)
        self.weight_spins = {tier: _dspin(0, 100, 0, " %", 0) for tier in TIERS}
        self.cache_spins = {tier: _dspin(0, 100, 0, " %", 0) for tier in TIERS}
        for c, name in enumerate(("GPU", "RAM", "disk")):
            grid.addWidget(label(name, "small"), 0, c + 1, Qt.AlignmentFlag.AlignCenter)
        grid.addWidget(QLabel("weights"), 1, 0)
        grid.addWidget(QLabel("KV cache"), 2, 0)
        for c, tier in enumerate(TIERS):
            grid.addWidget(self.weight_spins[tier], 1, c + 1)
            grid.addWidget(self.cache_spins[tier], 2, c + 1)
        self.override_box = QWidget()
        self.override_box.setLayout(grid)
        return self.override_box

    def _connect_knobs(self) -> None:
        """Every knob recomputes the plan (debounced); the override check also enables its box."""
        for widget in (self.hardware_combo, self.goal_combo, self.quant_combo):
            widget.currentIndexChanged.connect(self._knob_changed)
        for widget in (self.context_spin, self.batch_spin, *self.reserve_spins.values(), *self.weight_spins.values(),
                       *self.cache_spins.values()):
            widget.valueChanged.connect(self._knob_changed)
        self.override_check.toggled.connect(self._override_toggled)

    def _build_results(self) -> QScrollArea:
        panel = QWidget()
        column = QVBoxLayout(panel)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(8)
        self.headline = label("", "title", wrap=True)
        self.fit_label = label("", None, wrap=True)
        self.error_label = label("", "error", wrap=True)
        self.warning_label = label("", None, wrap=True)  # the plan's warnings (very slow, streamed from disk)
        self.warning_label.setStyleSheet(f"color: {WARN};")
        self.warning_label.hide()
        self.error_label.hide()
        self.factors_label = label("", "small")
        column.addWidget(self.headline)
        column.addWidget(self.factors_label)
        column.addWidget(self.fit_label)
        column.addWidget(self.error_label)
        column.addWidget(self.warning_label)

        # fixed heights: text changing length must not re-lay out (and repaint) the charts below
        self.fit_label.setFixedHeight(3 * self.fit_label.fontMetrics().lineSpacing() + 4)
        self.fit_label.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        cards = QHBoxLayout()
        self.decode_card = StatCard("decode tokens/s")
        self.prefill_card = StatCard("prefill tokens/s")
        self.bottleneck_card = StatCard("bottleneck")
        self.bottleneck_card.set_value_style("font-size: 18px; font-weight: 600;")
        cards.addWidget(self.decode_card, 1)
        cards.addWidget(self.prefill_card, 1)
        cards.addWidget(self.bottleneck_card, 2)
        for card in (self.decode_card, self.prefill_card, self.bottleneck_card):
            card.setFixedHeight(CARD_HEIGHT)
        column.addLayout(cards)

        query = QHBoxLayout()
        self.prompt_spin = _spin(1, 1_000_000, 512, None, 64)
        self.output_spin = _spin(1, 1_000_000, 128, None, 16)
        self.price_spin = _dspin(0, 10_000, 0.0, " $/h", 2, "catalog price")
        for widget in (self.prompt_spin, self.output_spin, self.price_spin):
            widget.valueChanged.connect(self._knob_changed)
        query.addWidget(QLabel("A query of"))
        query.addWidget(self.prompt_spin)
        query.addWidget(QLabel("prompt tokens →"))
        query.addWidget(self.output_spin)
        query.addWidget(QLabel("output tokens, at"))
        query.addWidget(self.price_spin)
        query.addStretch(1)
        column.addLayout(query)
        costs = QHBoxLayout()
        self.runtime_card = StatCard("runtime per query")
        self.energy_card = StatCard("energy per query")
        self.cost_card = StatCard("cost per query")
        for widget in (self.runtime_card, self.energy_card, self.cost_card):
            costs.addWidget(widget, 1)
            widget.setFixedHeight(96)
        column.addLayout(costs)

        memory = QGroupBox("Memory at the peak, per tier")
        memory_layout = QVBoxLayout(memory)
        self.memory_bars = MemoryBars()
        memory_layout.addWidget(self.memory_bars)
        column.addWidget(memory)

        charts = QHBoxLayout()
        self.batch_plot = Chart()
        self.budget_plot = Chart()
        # short titles: three charts share the row, each about 220 px wide on a 1280 px window
        for plot, title, x_label in ((self.batch_plot, "tokens/s by batch size", "batch (sequences)"),
                                     (self.budget_plot, "tokens/s by memory", "GPU memory (GB)")):
            plot.setTitle(title, color=MUTED, size="10pt")
            plot.setLabel("bottom", x_label)
            plot.setLabel("left", "tokens/s")
            plot.showGrid(x=True, y=True, alpha=0.2)
            plot.setMenuEnabled(False)
            plot.legend_below()
            plot.getAxis("left").enableAutoSIPrefix(False)
            plot.setLimits(yMin=0)  # tokens/s: the axis never shows negative rates
            charts.addWidget(plot, 1)
        self.batch_plot.setLogMode(x=True, y=False)
        self.batch_curve = self.batch_plot.plot([], [], pen=pg.mkPen(ACCENT, width=2), name="throughput",
                                                symbol="o", symbolSize=5, symbolBrush=ACCENT)
        self.batch_decode = self.batch_plot.plot([], [], pen=pg.mkPen("#9b51e0", width=1, style=Qt.PenStyle.DashLine),
                                                 name="decode")
        self.batch_mark = self.batch_plot.plot([], [], pen=None, symbol="star", symbolSize=16,
                                               symbolBrush=BAD, name="this plan")
        self.budget_curve = self.budget_plot.plot([], [], pen=pg.mkPen(ACCENT, width=2), name="throughput",
                                                  symbol="o", symbolSize=5, symbolBrush=ACCENT)
        self.budget_mark = self.budget_plot.plot([], [], pen=None, symbol="star", symbolSize=16, symbolBrush=BAD,
                                                 name="this plan")
        charts.addWidget(self.run_box.plot, 1)  # "Run this plan": predicted against measured, as it runs
        for plot in (self.batch_plot, self.budget_plot, self.run_box.plot):
            plot.setMinimumHeight(CHART_HEIGHT)
        column.addLayout(charts, 1)
        return scrolling(panel)

    # ---- settings <-> widgets ----------------------------------------------------------------------------------------
    def _load_settings(self) -> None:
        s = self.settings
        index = self.hardware_combo.findData(s.hardware)
        self.hardware_combo.setCurrentIndex(max(0, index))
        self.goal_combo.setCurrentIndex(max(0, self.goal_combo.findData(s.goal)))
        self.quant_combo.setCurrentIndex(max(0, self.quant_combo.findData(s.quant)))
        self.context_spin.setValue(s.context_len)
        self.batch_spin.setValue(s.batch_size)
        for tier in TIERS:
            self.reserve_spins[tier].setValue(s.reserve_gb.get(tier, 0.0))
            self.weight_spins[tier].setValue(s.weights_percent.get(tier, 0.0))
            self.cache_spins[tier].setValue(s.cache_percent.get(tier, 0.0))
        self.prompt_spin.setValue(s.prompt_len)
        self.output_spin.setValue(s.output_len)
        self.price_spin.setValue(s.price_per_hour)
        self.override_check.setChecked(s.override_placement)
        self.override_box.setEnabled(s.override_placement)

    def _read_widgets(self) -> None:
        s = self.settings
        s.hardware = self.hardware_combo.currentData()
        s.goal = self.goal_combo.currentData()
        s.quant = self.quant_combo.currentData()
        s.context_len = self.context_spin.value()
        s.batch_size = self.batch_spin.value()
        s.reserve_gb = {tier: self.reserve_spins[tier].value() for tier in TIERS}
        s.prompt_len = self.prompt_spin.value()
        s.output_len = self.output_spin.value()
        s.price_per_hour = self.price_spin.value()
        s.override_placement = self.override_check.isChecked()
        s.weights_percent = {tier: self.weight_spins[tier].value() for tier in TIERS}
        s.cache_percent = {tier: self.cache_spins[tier].value() for tier in TIERS}

    def _knob_changed(self, *_) -> None:
        if self._loading:
            return
        previous_hardware = self.settings.hardware
        self._read_widgets()
        self.settingsChanged.emit()
        if self.settings.hardware != previous_hardware:
            self._compute_fits()
        self._debounce.start()

    def _override_toggled(self, on: bool) -> None:
        self.override_box.setEnabled(on)
        if on and self.result is not None and self.result.plan.prediction is not None and not self._loading:
            # start from the recommendation, so turning the override on changes nothing by itself
            policy = self.result.plan.prediction.policy
            self._loading = True
            for tier in TIERS:
                self.weight_spins[tier].setValue(100 * getattr(policy.weights, tier))
                self.cache_spins[tier].setValue(100 * getattr(policy.kv_cache, tier))
            self._loading = False
        self._knob_changed()

    # ---- models ------------------------------------------------------------------------------------------------------
    def _populate_models(self) -> None:
        self._loading = True
        self.model_list.clear()
        ids = model_catalog.model_ids()
        current = self.settings.model
        if current and current not in ids:
            ids = [current, *ids]
        for model_id in ids:
            item = QListWidgetItem(model_id)
            item.setData(Qt.ItemDataRole.UserRole, model_id)
            self.model_list.addItem(item)
            if model_id == current:
                self.model_list.setCurrentItem(item)
        self._loading = False
        self._refresh_fit_labels()

    def _filter_models(self, text: str) -> None:
        words = text.lower().split()
        for i in range(self.model_list.count()):
            item = self.model_list.item(i)
            model_id = item.data(Qt.ItemDataRole.UserRole).lower()
            item.setHidden(not all(word in model_id for word in words))

    def _model_picked(self, item: QListWidgetItem | None, _previous=None) -> None:
        if item is None or self._loading:
            return
        self.use_model(item.data(Qt.ItemDataRole.UserRole), from_list=True)

    def use_model(self, model: str, from_list: bool = False) -> None:
        """Plan for a catalog id, a checkpoint folder or a cached hub id; a bad one is reported under the list."""
        if not model:
            return
        try:
            self._model_spec(model)
        except InputError as exc:
            self.model_error.setText(str(exc)[:400])
            self.model_error.show()
            return
        self.model_error.hide()
        self.settings.model = model
        if not from_list:
            self._populate_models()
            self._compute_fits()
        self.settingsChanged.emit()
        self._debounce.start()

    def _model_spec(self, model: str) -> ModelSpec:
        """The model's spec; the built-in model's name means its installed GGUF file (as the CLI reads it)."""
        if model not in self._models:
            self._models[model] = model_catalog.load_model_spec(model_path_or_id(model))
        return self._models[model]

    # ---- hardware ----------------------------------------------------------------------------------------------------
    def set_machine(self, machine) -> None:
        """This machine (a hardware_service.MachineInfo): its spec as the planner uses it and its factors."""
        self.detected = spec = machine.hardware
        self.detected_efficiency = machine.efficiency
        self.hardware_combo.setItemText(0, "This machine")
        self.hardware_combo.setItemData(0, _short_description(spec), Qt.ItemDataRole.ToolTipRole)
        if self.settings.hardware == DETECTED:
            self.refresh()

    def refresh(self) -> None:
        """Recompute everything for the current machine: the fits of the catalog and the plan."""
        if self._shut_down:
            return
        self._compute_fits()
        self._debounce.start()

    def hardware(self) -> HardwareSpec | None:
        if self.settings.hardware == DETECTED:
            return self.detected
        return hardware_catalog.get_hardware(self.settings.hardware)

    def efficiency(self) -> MachineEfficiency | None:
        """Measured or calibrated factors for this machine; catalog machines use the defaults."""
        return self.detected_efficiency if self.settings.hardware == DETECTED else None

    # ---- the prediction ----------------------------------------------------------------------------------------------
    def recompute(self) -> None:
        """Plan for the current knobs and show it (numbers, fit, bottleneck, memory); then refresh the charts."""
        if self._shut_down:
            return
        hardware = self.hardware()
        if hardware is None:
            self.headline.setText("Detecting this machine…")
            self.fit_label.setText("The plan appears as soon as detection ends (or pick a catalog machine).")
            return
        self.machine_label.setText(_short_description(hardware))  # the machine chosen, in words
        self.headroom_label.setText(_headroom_words(hardware))
        try:
            model = self._model_spec(self.settings.model)
            self._fill_quant_choices(hardware)
            result = plan_view.plan_for(model, hardware, self.settings, self.efficiency())
        except InputError as exc:
            self._show_error(str(exc))
            return
        self.error = ""
        self.error_label.hide()
        self.result = result
        self.recomputes += 1
        self._show(model, hardware, result)
        self.planChanged.emit(result)
        # the charts (many searches) wait until the knobs rest, so they never slow the numbers down
        if self._chart_job is not None and self._chart_job.running:
            self._chart_job.abort()
        self._chart_timer.start()

    def _fill_quant_choices(self, hardware: HardwareSpec) -> None:
        """The Weight format menu for this model on this machine (plan_view.quant_choices), refilled when either
        changes; a choice that no longer applies becomes auto."""
        key = (self.settings.model, hardware.id, hardware.has_gpu, tuple(g.unified_memory for g in hardware.gpus))
        if key == self._quant_key:
            return
        choices = plan_view.quant_choices(self.settings.model, hardware)
        self._quant_key = key
        self.quant_combo.blockSignals(True)
        self.quant_combo.clear()
        for quant, text in choices:
            self.quant_combo.addItem(text, quant)
        index = self.quant_combo.findData(self.settings.quant)
        self.quant_combo.setCurrentIndex(max(0, index))
        self.quant_combo.blockSignals(False)
        if index < 0:
            self.settings.quant = self.quant_combo.currentData()
            self.settingsChanged.emit()

    def _fit_label_height(self) -> None:
        """Three lines, or as many as the fit line needs at the label's width (a layout pass only then)."""
        lines = 3 * self.fit_label.fontMetrics().lineSpacing() + 4
        width = self.fit_label.width()
        needed = self.fit_label.heightForWidth(width) if width > 50 else lines
        if self.fit_label.height() != max(lines, needed):
            self.fit_label.setFixedHeight(max(lines, needed))

    def _show_error(self, message: str) -> None:
        self.error = message
        self.error_label.setText(message)
        self.error_label.show()

    def _show(self, model: ModelSpec, hardware: HardwareSpec, result: plan_view.PlanResult) -> None:
        plan, n = result.plan, result.numbers
        name = Path(model.name).name if "/" not in model.name or Path(model.name).exists() else model.name
        where = "this machine" if self.settings.hardware == DETECTED else self.settings.hardware
        self.headline.setText(f"{name} on {where}")
        self.run_box.set_machine(None if self.settings.hardware == DETECTED else where)
        why = (n.get("format_choice") or {}).get("why", "")
        why += weighed_words(n.get("other_formats")) if why else ""
        self.format_label.setText(why[:1].upper() + why[1:])
        calibrated = is_calibrated(plan.efficiency)
        self.factors_label.setText(f"Cost-model factors: {plan.efficiency} "
                                   f"({'calibrated on this machine' if calibrated else 'not calibrated'})")
        fit_words = plan_view.fit_words(plan)
        self.warning_label.setText("\n".join(f"⚠ {text}" for text in plan.warnings))
        self.warning_label.setVisible(bool(plan.warnings))
        prefix = "Your placement: " if result.overridden else ""
        self.fit_label.setText(f"<b style='color:{FIT_COLORS[plan.fit]}'>{FIT_MARKS[plan.fit]} {prefix}{fit_words}"
                               f"</b> — {plan_view.fit_reason(plan)}")
        self.fit_label.setToolTip(plan.reason)
        decode, prefill = n.get("decode_tokens_per_s"), n.get("prefill_tokens_per_s")
        roof_d, roof_p = n.get("roofline_decode_tokens_per_s"), n.get("roofline_prefill_tokens_per_s")
        self.decode_card.set(fmt_rate(decode), f"roofline bound {fmt_rate(roof_d)}" if roof_d else "")
        self.prefill_card.set(fmt_rate(prefill), f"roofline bound {fmt_rate(roof_p)}" if roof_p else "")
        batch_note = ""
        if n.get("min_compute_bound_batch"):
            batch_note = (f"; compute-bound from batch {n['min_compute_bound_batch']} (a step's compute outlasts "
                          f"its weight reads, bounded by the {n.get('min_compute_bound_basis') or ''})")
        self.bottleneck_card.set(n.get("bottleneck") or "–", (n.get("bottleneck_detail") or "") + batch_note)
        self.bottleneck_card.value.setWordWrap(True)
        policy = n.get("policy") or {}
        if plan.goal == "serve" and plan.server is not None:
            sub = (f"serves {plan.server.num_blocks} of {model.num_layers} blocks in {plan.server.weight_format}, "
                   f"advertises {fmt_rate(plan.server.throughput)} rps")
        elif policy:
            sub = f"{policy.get('weight_format')} weights, batch {policy.get('batch_size')}"
        else:
            sub = ""
        self.decode_card.detail.setText(self.decode_card.detail.text() + (f"\n{sub}" if sub else ""))
        runtime = plan.runtime
        batch = plan.prediction.policy.batch_size if plan.prediction is not None and plan.goal != "serve" else 1
        self.runtime_card.caption.setText("runtime per query" if batch == 1 else f"runtime of the batch of {batch}")
        if runtime is not None:
            each = "" if batch == 1 else (f"{batch} queries together, all finish then "
                                          f"({fmt_seconds(runtime.runtime_s / batch)} per query on average); ")
            self.runtime_card.set(fmt_seconds(runtime.runtime_s),
                                  f"{each}first token {fmt_seconds(runtime.alpha_s)}, then "
                                  f"{fmt_seconds(runtime.beta_s)} per token")
            self.energy_card.set(fmt_energy(runtime.energy_j),
                                 f"{fmt_energy(runtime.energy_j_per_1k_tokens)} per 1000 generated tokens "
                                 f"(at {runtime.power_watts:.0f} W rated)")
            if runtime.cost_usd is not None:
                self.cost_card.set(f"${runtime.cost_usd:.3g}", f"${runtime.cost_usd_per_1k_tokens:.3g} per 1000 "
                                   f"generated tokens at ${runtime.price_per_hour:g}/h")
            else:
                self.cost_card.set("–", "set a price per hour to see the cost")
        else:
            for widget in (self.runtime_card, self.energy_card, self.cost_card):
                widget.set("–", "nothing runs locally")
        if plan.missing_bytes:
            self.bottleneck_card.set("memory", f"needs {fmt_bytes(plan.missing_bytes.get('total'))} more memory")
        self.memory_bars.set_bars(plan_view.memory_bars(model, hardware, result))
        self._show_placement(hardware, result)
        self.fit_cards()

    def fit_cards(self) -> None:
        """The top cards as tall as the bottleneck's text needs (at least CARD_HEIGHT), and the fit line as tall as
        its text: never clipped."""
        self._fit_label_height()
        card = self.bottleneck_card
        needed = card.heightForWidth(card.width()) if card.width() > 0 else CARD_HEIGHT
        height = max(CARD_HEIGHT, needed)
        for widget in (self.decode_card, self.prefill_card, self.bottleneck_card):
            if widget.height() != height:
                widget.setFixedHeight(height)

    def _show_placement(self, hardware: HardwareSpec, result: plan_view.PlanResult) -> None:
        """The placement fields show the plan's placement when not overridden; no GPU fields without a GPU."""
        for spins in (self.weight_spins, self.cache_spins):
            spins["gpu"].setEnabled(hardware.has_gpu)
        prediction = result.plan.prediction
        if result.overridden or prediction is None or result.plan.goal == "serve":
            return
        for spins, placement in ((self.weight_spins, prediction.policy.weights),
                                 (self.cache_spins, prediction.policy.kv_cache)):
            for tier in TIERS:
                spins[tier].blockSignals(True)
                spins[tier].setValue(100 * getattr(placement, tier))
                spins[tier].blockSignals(False)

    # ---- "Run this plan" ------------------------------------------------------------------------------------------
    def _batch_run(self, prompts_file: str, max_new_tokens: int):
        """The plan shown as a core.offload.batch_run.BatchRun over `prompts_file`; InputError when it runs nothing
        here (no prompts file, a serving plan, no local policy)."""
        from hivekeeper.core.offload.batch_run import BatchRun
        from hivekeeper.core.offload.local_plan import predicted_figures

        if not prompts_file:
            raise InputError("choose a prompts file (one prompt a line, the same number of tokens each)")
        plan = self.result.plan if self.result is not None else None
        if plan is None or plan.goal == "serve" or plan.prediction is None:
            raise InputError("this plan runs nothing locally (a serving plan, or it does not fit): choose the chat "
                             "or batch goal with a plan that fits")
        where = "" if self.settings.hardware == DETECTED else f", made for {self.settings.hardware}"
        model, hardware, efficiency = self._model_spec(self.settings.model), self.hardware(), self.efficiency()
        settings, policy = copy.deepcopy(self.settings), plan.prediction.policy

        def predict(batch: int, prompt_len: int, new_tokens: int) -> dict | None:  # on the worker: the run's shape
            return predicted_figures(plan_view.predict_run(model, hardware, settings, policy, efficiency, batch,
                                                           prompt_len, new_tokens))

        return BatchRun(model=self.settings.model, prompts_file=prompts_file, policy=policy,
                        predicted=predicted_figures(plan.prediction), max_new_tokens=max_new_tokens,
                        source=f"the Plan page's plan{where}", predict=predict)

    # ---- charts (worker) -------------------------------------------------------------------------------------------
    def _charts_due(self) -> None:
        hardware = self.hardware()
        if self._shut_down or hardware is None or self.result is None:
            return
        try:
            self._start_charts(self._model_spec(self.settings.model), hardware)
        except InputError:
            pass

    def _start_charts(self, model: ModelSpec, hardware: HardwareSpec) -> None:
        if self._chart_job is not None and self._chart_job.running:
            self._chart_pending = True  # the running job was aborted; start again when it has ended
            return
        self._chart_pending = False
        settings, result, efficiency = copy.deepcopy(self.settings), self.result, self.efficiency()

        def compute(report, should_stop) -> ChartData | None:
            batch = plan_view.batch_chart(model, hardware, settings, result, efficiency)
            tier, _ = plan_view.accelerator_memory(hardware)
            budget = plan_view.budget_chart(model, hardware, settings, result, efficiency, should_stop=should_stop)
            return None if budget is None or should_stop() else ChartData(batch, budget, tier)

        self._chart_job = run_in_thread(compute, on_return=self._show_charts, on_error=self._chart_failed,
                                        on_finish=self._charts_done)

    def _charts_done(self) -> None:
        if self._chart_pending and not self._shut_down:
            self._chart_timer.start()

    def _chart_failed(self, message: str) -> None:
        self.batch_plot.setTitle(f"chart failed: {message}", color=BAD, size="9pt")

    def _show_charts(self, data: ChartData | None) -> None:
        if data is None:
            return  # aborted: newer knobs are on their way
        self.charts = data
        b = data.batch
        ok = np.isfinite(b.throughput)
        self.batch_curve.setData(b.x[ok], b.throughput[ok])
        okd = np.isfinite(b.decode)
        self.batch_decode.setData(b.x[okd], b.decode[okd])
        if b.current_x is not None and b.current_y is not None:
            self.batch_mark.setData([b.current_x], [b.current_y])
        else:
            self.batch_mark.setData([], [])
        m = data.budget
        ok = np.isfinite(m.throughput)
        self.budget_curve.setData(m.x[ok], m.throughput[ok])
        if m.current_x is not None and m.current_y is not None:
            self.budget_mark.setData([m.current_x], [m.current_y])
        else:
            self.budget_mark.setData([], [])
        self.budget_plot.setLabel("bottom", "GPU memory (GB)" if data.budget_tier == "gpu" else "RAM (GB)")
        for plot, values in ((self.batch_plot, (b.throughput, b.decode)), (self.budget_plot, (m.throughput,))):
            from_zero(plot, values)

    # ---- fits of the catalog (worker) --------------------------------------------------------------------------------
    def _compute_fits(self) -> None:
        hardware = self.hardware()
        if hardware is None:
            return
        ids = [self.model_list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.model_list.count())]
        specs = {}
        for model_id in ids:
            try:
                specs[model_id] = self._model_spec(model_id)
            except InputError:
                continue

        efficiency = self.efficiency()

        def compute(report, should_stop) -> dict:
            fits = {}
            for model_id, spec in specs.items():
                if should_stop():
                    break
                fits[model_id] = plan_view.model_fit(spec, hardware, model_id, efficiency)
            return fits

        if self._fit_job is not None and self._fit_job.running:
            self._fit_job.abort()
        self._fit_job = run_in_thread(compute, on_return=self._fits_ready)

    def _fits_ready(self, fits: dict) -> None:
        self._fits = fits
        self._refresh_fit_labels()

    def _refresh_fit_labels(self) -> None:
        for i in range(self.model_list.count()):
            item = self.model_list.item(i)
            model_id = item.data(Qt.ItemDataRole.UserRole)
            fit = self._fits.get(model_id)
            if fit is None:
                item.setText(f"    {_short_name(model_id)}")
                item.setToolTip(model_id)
                continue
            item.setText(f"{FIT_MARKS[fit.fit]}  {_short_name(model_id)}")
            item.setForeground(QColor(FIT_COLORS[fit.fit]) if fit.fit != "local" else QColor("#1f2933"))
            item.setToolTip(f"{model_id}\n{fit.words}: {fit.reason}")

    def fit_of(self, model_id: str) -> plan_view.ModelFit | None:
        return self._fits.get(model_id)

    @property
    def busy(self) -> bool:
        """Whether a recompute, the charts or the catalog fits are still on their way."""
        jobs = (self._chart_job, self._fit_job)
        return self._debounce.isActive() or self._chart_timer.isActive() or any(j is not None and j.running
                                                                                for j in jobs)

    def wait_for_workers(self, ms: int = 30_000) -> None:
        """Block until the chart and fit workers end (tests)."""
        for job in (self._chart_job, self._fit_job):
            if job is not None:
                job.wait(ms)

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        super().resizeEvent(event)
        if self.result is not None:
            self.fit_cards()  # narrower cards wrap the bottleneck's text onto more lines

    def shutdown(self) -> None:
        self._shut_down = True
        self.run_box.shutdown()
        self._debounce.stop()
        self._chart_timer.stop()
        for job in (self._chart_job, self._fit_job):
            if job is not None:
                job.abort()
        self.wait_for_workers()


def _short_name(model_id: str) -> str:
    """The name without its org ("meta-llama/Llama-2-7b-hf" -> "Llama-2-7b-hf"); a folder's last part."""
    return Path(model_id).name if Path(model_id).is_absolute() else model_id.split("/")[-1]


def _headroom_words(spec: HardwareSpec) -> str:
    """The default headroom plans keep free on this machine, beyond "Leave free" (planner.hardware)."""
    kept = default_headroom(spec)
    parts = [f"{name} {kept[tier] / 1e9:.3g} GB" for tier, name in (("gpu", "GPU"), ("cpu", "RAM"), ("disk", "disk"))
             if kept[tier] > 0]
    return "plus, always kept free for the system and other programs: " + ", ".join(parts)


def _short_description(spec: HardwareSpec) -> str:
    gpus = ", ".join(g.name for g in spec.gpus) or "no GPU"
    return f"{gpus}, {spec.cpu.memory_bytes / 1e9:.0f} GB RAM"


def scrolling(panel: QWidget) -> QScrollArea:
    """`panel` in a frameless area that scrolls up and down where the page is shorter than the panel needs; the
    page's background shows through (a scroll area paints its own, a darker grey)."""
    scroll = QScrollArea()
    scroll.setWidget(panel)
    for widget in (panel, scroll.viewport()):
        widget.setAutoFillBackground(False)
    scroll.setWidgetResizable(True)
    scroll.setFrameShape(QScrollArea.Shape.NoFrame)
    scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    return scroll
