"""Page 3, Swarm: one button to serve a span of the model from this machine, its live state, and the coverage chart;
and the models the swarm serves (its registry) with their coverage and where this machine would help, joined with one
click (`SwarmPage.join_best`). Without peers given, the swarm is the public Petals one (core/swarm/bootstrap.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import PurePath

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QAbstractItemView, QCheckBox, QFormLayout, QGroupBox, QHBoxLayout, QHeaderView,
                               QLabel, QLineEdit, QPlainTextEdit, QPushButton, QSpinBox, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from hivekeeper.core.swarm.bootstrap import bootstrap_peers, is_public
from hivekeeper.core.swarm.server.throughput import BlockSpeed
from hivekeeper.planner.swarm import ServerPlan, span_throughput
from hivekeeper.planner.words import counted

from hivekeeper.gui.services.coverage import CoverageService
from hivekeeper.gui.services.node import STATE_WORDS, NodeLaunch, NodeService
from hivekeeper.gui.settings import SwarmSettings
from hivekeeper.gui.style import (ACCENT, BAD, MUTED, OTHERS, STATE_COLORS, StatCard, fmt_rate, label,
                                  page_layout)
from hivekeeper.gui.widgets.chart import Chart
from hivekeeper.gui.widgets.model_menu import model_menu



BUSY_STATES = ("starting", "joining", "online", "moving", "paused", "leaving")  # a node in these is running
NO_COVERAGE = "No coverage yet: once the node is online, each block's servers and their throughput show here."
MODEL_COLUMNS = ("model", "servers", "covered", "weakest blocks", "you could serve")

FIELD_CAPTIONS = {"span": "span", "servers": "servers online", "cache": "cache left (tokens)",
                  "served": "requests served"}


def quant_and_dtype(weight_format: str) -> tuple[str, str]:
    """`hivekeeper serve` --quant and --dtype for a planner weight format (a packed GGUF span: none and auto, the
    CPU's fp32, which load_span keeps packed)."""
    if weight_format in ("int8", "nf4"):
        return weight_format, "auto"
    if weight_format in ("fp32", "bf16", "fp16"):
        return "none", weight_format
    return "none", "auto"


def model_cells(row: dict) -> list[str]:
    """A swarm model's row (core/swarm/directory.py) in words, one string per MODEL_COLUMNS."""
    weakest = row.get("weakest") or {}
    if weakest:
        span = f"{weakest['start']}:{weakest['end']}"
        weak = f"{span}: no server" if not weakest["throughput"] else f"{span}: {fmt_rate(weakest['throughput'])} req/s"
    else:
        weak = "–"
    helps = row.get("help") or {}
    if helps.get("blocks"):
        start, end = helps["blocks"]
        can = f"{start}:{end}, ~{fmt_rate(helps['rps'])} req/s"
    else:
        can = helps.get("reason") or "no block fits here"
    return [model_name(row), str(row["servers"]), f"{row['covered_blocks']} of {row['num_blocks']}", weak, can]


def model_name(row: dict) -> str:
    """A swarm model's name as people know it: the repository it registered (a hub id), or a local folder's name;
    never its swarm prefix (the hub id's name with '-hf' appended, which only the swarm's keys use)."""
    repository = row["repository"]
    return PurePath(repository).name if PurePath(repository).is_absolute() else repository


def counted_rps(server: dict) -> float:
    """What the swarm counts of a server's claim, in requests/s (core/swarm/status.py's "counted_throughput": the
    claim capped at THROUGHPUT_CAP_FACTOR x the other servers' median); the claim itself in older reports."""
    counted = server.get("counted_throughput")
    return float(server.get("throughput") or 0.0) if counted is None else float(counted)


def coverage_arrays(report: dict, my_peer_id: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block indices, others' throughput, this node's throughput) per block, from a swarm status report: the
    throughput the swarm counts (the blocks' totals), so this node's bar is what it counts, not what it claims."""
    n = int(report.get("num_blocks") or len(report.get("blocks", [])))
    mine, total = np.zeros(n), np.zeros(n)
    for block in report.get("blocks", []):
        total[block["index"]] = block.get("throughput") or 0.0
    for server in report.get("servers", []):
        if server.get("peer_id") == my_peer_id and server.get("state") in ("online", "joining"):
            mine[server["start"]:server["end"]] += counted_rps(server)
    others = np.maximum(0.0, total - mine)
    return np.arange(n), others, np.minimum(mine, total) if total.any() else mine


def advertised_words(advertised: float | None, counted: float | None) -> str:
    """The node card's line on its speed: what it advertises and, where the swarm counts less (a claim far above
    the other servers' is capped), what the swarm counts, which the coverage chart draws."""
    if advertised is None:
        return ""
    words = f"advertises {fmt_rate(advertised)} requests/s"
    if counted is not None and counted < 0.999 * advertised:
        words += (f"; the swarm counts {fmt_rate(counted)} of it (a claim far above the other servers' is capped), "
                  "as the chart draws")
    return words


def advertised_estimate(server: ServerPlan, measured: BlockSpeed | None, blocks: int) -> str:
    """'about 523 requests/s advertised (measured by `serve` on ...)': Petals' advertised throughput for a span of
    `blocks` blocks, from one definition (planner.swarm.span_throughput over a block's forward_rps), as Join's
    `serve` announces it (no --network-mbps: compute only); the block's rate measured by serve where it has timed
    such a block here, else the planner's estimate from this machine's profile."""
    if measured is not None:
        forward, source = measured.forward_rps, measured.source_words()
    else:
        forward, source = server.forward_rps, "estimated from this machine's profile; `serve` measures a block " \
                                              "when it starts"
    return f"about {fmt_rate(span_throughput(forward, blocks, None))} requests/s advertised ({source})"


class SwarmPage(QWidget):
    """Join / Leave, the node's state, and who covers which block."""

    settingsChanged = Signal()

    def __init__(self, settings: SwarmSettings, node: NodeService, coverage: CoverageService,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.settings = settings
        self.node = node
        self.coverage = coverage
        self.default_model = ""  # the plan's model, used when the model field is empty
        self.joined_prefix: str | None = None  # the swarm model joined from the models list
        self.recommendation: ServerPlan | None = None
        self.coverage_data: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.counted_rps: float | None = None  # what the swarm counts of this node's throughput (last report)
        self._loading = False

        layout = page_layout(self, QVBoxLayout, (24, 18), spacing=10)
        layout.addWidget(label("Swarm", "title"))
        layout.addWidget(label("Serve a span of the model's blocks to a Petals-compatible swarm. The node runs as "
                               "a separate process; Leave announces it offline and stops it.", "subtitle", wrap=True))
        top = QHBoxLayout()
        self.setup_box, self.status_box = self._build_setup(), self._build_status()
        top.addWidget(self.setup_box, 1)
        top.addWidget(self.status_box, 1)
        layout.addLayout(top, 0)

        chart_box = QGroupBox("Coverage: the throughput the swarm counts for each block")
        chart_layout = QVBoxLayout(chart_box)
        self.coverage_plot = Chart()
        self.coverage_plot.setLabel("bottom", "block")
        self.coverage_plot.setLabel("left", "counted throughput (requests/s)")
        self.coverage_plot.showGrid(x=False, y=True, alpha=0.2)
        self.coverage_plot.setMenuEnabled(False)
        self.coverage_plot.setMinimumHeight(180)
        self.coverage_plot.getAxis("left").enableAutoSIPrefix(False)
        self.others_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=OTHERS, pen=None)
        self.mine_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=ACCENT, pen=None)
        self.gap_marks = self.coverage_plot.plot([], [], pen=None, symbol="x", symbolSize=12, symbolBrush=BAD,
                                                 symbolPen=BAD)
        self.coverage_plot.addItem(self.others_bars)
        self.coverage_plot.addItem(self.mine_bars)
        legend = (f"<span style='color:{ACCENT}'>■</span> this node &nbsp; "
                  f"<span style='color:{OTHERS}'>■</span> other servers &nbsp; "
                  f"<span style='color:{BAD}'>✕</span> no server")
        chart_layout.addWidget(label(legend, "small"))
        self.coverage_note = label("", "small", wrap=True)
        self.coverage_plot.show_note(NO_COVERAGE)
        chart_layout.addWidget(self.coverage_plot, 1)
        chart_layout.addWidget(self.coverage_note)
        bottom = QHBoxLayout()  # the swarm's models beside the coverage of the one served
        bottom.addWidget(self._build_models(), 3)
        bottom.addWidget(chart_box, 2)
        layout.addLayout(bottom, 1)

        node.stateChanged.connect(self._on_state)
        node.statusReceived.connect(self._on_status)
        coverage.reportReceived.connect(self._on_report)
        coverage.errorReceived.connect(self._on_coverage_error)
        coverage.directoryReceived.connect(self._on_directory)
        coverage.directoryError.connect(self._on_directory_error)
        self._load_settings()
        self._on_state(node.state)

    # ---- building ------------------------------------------------------------------------------------------------
    def _build_setup(self) -> QWidget:
        box = QGroupBox("Serve")
        form = QFormLayout(box)
        model_row = QHBoxLayout()
        self.model_edit = QLineEdit()
        self.model_edit.setPlaceholderText("the plan's model")
        browse = QPushButton("Model…")
        browse.setToolTip("The built-in model, the plan's, a GGUF file or a checkpoint folder")
        browse.setMenu(model_menu(self, "Model to serve", self._choose_model, extra=self._plan_entry))
        model_row.addWidget(self.model_edit, 1)
        model_row.addWidget(browse)
        self.recommendation_label = label("", "small", wrap=True)
        self.blocks_spin = QSpinBox()
        self.blocks_spin.setRange(0, 10_000)
        self.blocks_spin.setSpecialValueText("the plan's recommendation")
        self.new_swarm_check = QCheckBox("Start a new private swarm")
        self.peers_edit = QPlainTextEdit()
        self.peers_edit.setPlaceholderText("Initial peers, one per line (empty: the public Petals swarm)\n"
                                           "/ip4/203.0.113.5/tcp/31337/p2p/Qm…")
        self.peers_edit.setFixedHeight(58)
        self.name_edit = QLineEdit()
        self.name_edit.setPlaceholderText("optional: a name or link shown to the swarm")
        form.addRow("Model", model_row)
        form.addRow(self.recommendation_label)  # the whole width: two lines, not three
        form.addRow("Blocks", self.blocks_spin)
        form.addRow("", self.new_swarm_check)
        form.addRow("Join", self.peers_edit)
        form.addRow("Public name", self.name_edit)
        buttons = QHBoxLayout()
        self.join_button = QPushButton("Join the swarm")
        self.join_button.setObjectName("primary")
        self.join_button.setMinimumHeight(36)
        self.join_button.clicked.connect(self.join)
        self.leave_button = QPushButton("Leave")
        self.leave_button.setObjectName("danger")
        self.leave_button.setMinimumHeight(36)
        self.leave_button.clicked.connect(self.leave)
        buttons.addWidget(self.join_button, 2)
        buttons.addWidget(self.leave_button, 1)
        form.addRow(buttons)
        self.form_error = label("", "error", wrap=True)
        self.form_error.hide()
        form.addRow(self.form_error)
        for widget in (self.model_edit, self.name_edit):
            widget.editingFinished.connect(self._read_widgets)
        self.new_swarm_check.toggled.connect(self._read_widgets)
        self.blocks_spin.valueChanged.connect(self._read_widgets)
        self.peers_edit.textChanged.connect(self._read_widgets)
        return box

    def _build_models(self) -> QWidget:
        box = QGroupBox("Models in the swarm")
        column = QVBoxLayout(box)
        row = QHBoxLayout()
        self.find_button = QPushButton("Find models")
        self.find_button.setToolTip("Read the swarm's model registry and each model's coverage")
        self.find_button.clicked.connect(self.find_models)
        self.directory_note = label("The models the swarm serves, and where this machine would help.", "small",
                                    wrap=True)
        self.join_best_button = QPushButton("Join where this machine helps most")
        self.join_best_button.setObjectName("primary")
        self.join_best_button.setEnabled(False)
        self.join_best_button.clicked.connect(self.join_best)
        row.addWidget(self.find_button)
        row.addWidget(self.directory_note, 1)
        column.addLayout(row)
        self.models_table = QTableWidget(0, len(MODEL_COLUMNS))
        self.models_table.setHorizontalHeaderLabels(list(MODEL_COLUMNS))
        header = self.models_table.horizontalHeader()
        for index in range(len(MODEL_COLUMNS)):  # the whole name; the spans share what it and the counts leave
            fit = index in (0, 1, 2)
            header.setSectionResizeMode(index, QHeaderView.ResizeMode.ResizeToContents if fit else
                                        QHeaderView.ResizeMode.Stretch)
        self.models_table.verticalHeader().setVisible(False)
        self.models_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.models_table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        column.addWidget(self.models_table, 1)
        column.addWidget(self.join_best_button, 0, Qt.AlignmentFlag.AlignRight)
        self.directory_rows: list[dict] = []
        self.best_prefix: str | None = None
        return box

    def _build_status(self) -> QWidget:
        box = QGroupBox("This node")
        column = QVBoxLayout(box)
        self.state_card = StatCard("state")
        self.state_card.set_value_style("font-size: 22px; font-weight: 600;")
        column.addWidget(self.state_card)
        # one rich-text label (a table) rather than a grid of labels: it never gets squeezed into clipping
        self.field_values: dict[str, tuple[str, str]] = {key: ("–", "") for key in FIELD_CAPTIONS}
        self.node_info = QLabel()
        self.node_info.setTextFormat(Qt.TextFormat.RichText)
        column.addWidget(self.node_info)
        self._render_fields()
        self.address_label = label("", "small", wrap=True)
        self.address_box = QPlainTextEdit()
        self.address_box.setReadOnly(True)
        self.address_box.setFixedHeight(46)
        self.address_box.setPlaceholderText("The address to share appears here once the node is up.")
        self.copy_button = QPushButton("Copy address")
        self.copy_button.clicked.connect(self._copy_address)
        self.error_label = label("", "error", wrap=True)
        self.restart_button = QPushButton("Restart the node")
        self.restart_button.clicked.connect(self.restart)
        column.addWidget(self.address_label)
        column.addWidget(self.address_box)
        row = QHBoxLayout()
        row.addWidget(self.copy_button)
        row.addStretch(1)
        row.addWidget(self.restart_button)
        column.addLayout(row)
        column.addWidget(self.error_label)
        column.addStretch(1)
        return box

    def set_field(self, key: str, value: str, detail: str = "") -> None:
        self.field_values[key] = (value, detail)
        self._render_fields()

    def _render_fields(self) -> None:
        cells = []
        for key, caption in FIELD_CAPTIONS.items():
            value, detail = self.field_values[key]
            cells.append(f"<td style='padding: 2px 24px 2px 0'><span style='color:{MUTED}; font-size:11px'>"
                         f"{caption.upper()}</span><br><span style='font-size:17px; font-weight:600'>{value}</span>"
                         f" <span style='color:{MUTED}; font-size:12px'>{detail}</span></td>")
        self.node_info.setText(f"<table><tr>{cells[0]}{cells[1]}</tr><tr>{cells[2]}{cells[3]}</tr></table>")

    def showEvent(self, event) -> None:
        self._pin_box_heights()
        super().showEvent(event)

    def _pin_box_heights(self) -> None:
        """Word-wrapped labels make the boxes report a height-for-width that is too small: pin the polished height
        (again when a label's text changes its line count, or the box would overlap the one below)."""
        for box in (self.setup_box, self.status_box):
            box.setMinimumHeight(0)
            box.setMinimumHeight(box.sizeHint().height())

    # ---- settings --------------------------------------------------------------------------------------------------
    def _load_settings(self) -> None:
        s = self.settings
        self._loading = True
        self.model_edit.setText(s.model)
        self.blocks_spin.setValue(s.num_blocks)
        self.new_swarm_check.setChecked(s.new_swarm)
        self.peers_edit.setPlainText("\n".join(s.initial_peers))
        self.name_edit.setText(s.public_name)
        self.peers_edit.setEnabled(not s.new_swarm)
        self._loading = False

    def _read_widgets(self, *_) -> None:
        if self._loading:
            return
        s = self.settings
        s.model = self.model_edit.text().strip()
        s.num_blocks = self.blocks_spin.value()
        s.new_swarm = self.new_swarm_check.isChecked()
        s.initial_peers = [line.strip() for line in self.peers_edit.toPlainText().split() if line.strip()]
        s.public_name = self.name_edit.text().strip()
        self.peers_edit.setEnabled(not s.new_swarm)
        self.settingsChanged.emit()

    def _choose_model(self, model: str) -> None:
        self.model_edit.setText(model)
        self._read_widgets()

    def _plan_entry(self) -> list[tuple[str, str]]:
        return [(f"The plan's model: {self.default_model}", "")] if self.default_model else []  # "": the plan's

    def model_to_serve(self) -> str:
        return self.settings.model or self.default_model

    def set_recommendation(self, server: ServerPlan | None, note: str = "", measured: BlockSpeed | None = None) -> None:
        """The plan's serving recommendation for this machine (blocks and format), shown and used by Join, with the
        requests/s `serve` will advertise for it: from `measured` (serve's cached measurement of such a block) when
        there is one, else the planner's estimate, saying which."""
        self.recommendation = server
        if server is not None and server.num_blocks:
            blocks = self.settings.num_blocks or server.num_blocks  # what Join serves: Blocks, else the plan's
            chosen = "," if blocks == server.num_blocks else f"; with the {blocks} set below,"
            self.recommendation_label.setText(
                f"The plan for this machine: {server.span_words()}{chosen} "
                f"{advertised_estimate(server, measured, blocks)}. {note}".strip())
        else:
            self.recommendation_label.setText(note or "No recommendation yet (waiting for the plan).")
        self._pin_box_heights()

    # ---- actions ---------------------------------------------------------------------------------------------------
    def launch(self, model: str | None = None) -> NodeLaunch:
        """What Join starts: `model` (default: the field's, else the plan's) as the form and the plan say."""
        self._read_widgets()
        s = self.settings
        model = model or self.model_to_serve()
        if not model:
            raise ValueError("choose a model to serve (a checkpoint folder or a hub id)")
        peers = () if s.new_swarm else self.swarm_peers()
        rec = self.recommendation
        num_blocks = s.num_blocks or (rec.num_blocks if rec is not None and rec.num_blocks else None)
        quant, dtype = quant_and_dtype(rec.weight_format) if rec is not None else ("none", "auto")
        return NodeLaunch(model=model, new_swarm=s.new_swarm, initial_peers=peers,
                          num_blocks=num_blocks, quant=quant, dtype=dtype, host=s.host, public_name=s.public_name)

    def swarm_peers(self) -> tuple[str, ...]:
        """The peers of the swarm to join: the field's, else the default swarm's (the public one; tests replace it
        with HIVEKEEPER_BOOTSTRAP_PEERS). Raises ValueError for a line that is not a multiaddr."""
        self._read_widgets()
        peers = tuple(self.settings.initial_peers)
        bad = [a for a in peers if not a.startswith("/")]
        if bad:
            raise ValueError(f"not a multiaddr: {bad[0]!r} (expected /ip4/…/tcp/…/p2p/…)")
        try:
            return peers or bootstrap_peers()
        except Exception as exc:  # noqa: BLE001 - an empty HIVEKEEPER_BOOTSTRAP_PEERS, or the public list in a test
            raise ValueError(str(exc)) from None

    def find_models(self) -> None:
        """Start listing the swarm's models (its registry), their coverage and where this machine would help."""
        try:
            peers = self.swarm_peers()
        except ValueError as exc:
            self.directory_note.setText(str(exc))
            return
        where = "the public Petals swarm" if is_public(peers) else f"the swarm at {peers[0]}"
        self.directory_note.setText(f"Reading {where}…")
        self.coverage.watch_directory(peers)

    def join_best(self) -> None:
        """One click: serve the span of the model where this machine adds the most, fetching that span only."""
        row = next((r for r in self.directory_rows if r["dht_prefix"] == self.best_prefix), None)
        if row is None or self.node.state in BUSY_STATES:
            return
        start, end = row["help"]["blocks"]
        self.joined_prefix = row["dht_prefix"]
        try:
            peers = self.coverage.directory_peers or self.swarm_peers()
            base = self.launch(row["repository"])  # the page's launch (host, name, what else it carries) ...
        except ValueError as exc:
            self.form_error.setText(str(exc))
            self.form_error.show()
            return
        launch = replace(base, new_swarm=False, initial_peers=tuple(peers), num_blocks=None, quant="none",
                         dtype="auto",  # ... for this model, span and swarm
                         extra_args=("--block-indices", f"{start}:{end}", "--dht-prefix", row["dht_prefix"]))
        self.form_error.hide()
        self.node.start(launch)

    def join(self) -> None:
        try:
            launch = self.launch()
        except ValueError as exc:
            self.form_error.setText(str(exc))
            self.form_error.show()
            return
        self.form_error.hide()
        self.node.start(launch)

    def leave(self) -> None:
        self.coverage.stop()
        self.node.stop()

    def restart(self) -> None:
        self.error_label.setText("")
        self.node.restart()

    def _copy_address(self) -> None:
        QGuiApplication.clipboard().setText(" ".join(self.node.maddrs))

    # ---- node and swarm updates --------------------------------------------------------------------------------------
    def _on_state(self, state: str) -> None:
        busy = state in BUSY_STATES
        self.join_button.setEnabled(not busy)
        self.join_best_button.setEnabled(not busy and self.best_prefix is not None)
        self.leave_button.setEnabled(busy and state != "leaving")
        # only a node that died is restarted from here; after Leave, Join starts it again
        self.restart_button.setVisible(state == "error")
        self.state_card.set(STATE_WORDS.get(state, state), "", STATE_COLORS.get(state))
        if state == "error":
            self.error_label.setText(f"The node stopped: {self.node.error}")
            self.coverage.stop()
        elif state in ("starting", "joining"):
            self.error_label.setText("")
        if state == "online":
            self._watch_coverage()
        if state == "stopped":
            self.coverage.stop()
            self.state_card.detail.setText("")
            self.clear_swarm_view()

    def _watch_coverage(self) -> None:
        launch = self.node.launch
        if launch is None:
            return
        peers = list(launch.initial_peers) if not launch.new_swarm else self.node.maddrs
        prefix = self.joined_prefix if "--dht-prefix" in launch.extra_args else None
        if peers:
            self.coverage.watch(launch.model, peers, prefix)

    def _on_status(self, event: dict) -> None:
        node = self.node
        if node.maddrs:
            share = " ".join(node.maddrs)
            self.address_label.setText("Others join this swarm with:" if node.launch and node.launch.new_swarm
                                       else "This node's address:")
            self.address_box.setPlainText(f"--initial-peers {share}")
        ev = node.last_event
        blocks = ev.get("blocks")
        if blocks:
            self.set_field("span", f"blocks {blocks[0]}:{blocks[1]}", f"of {ev.get('num_model_blocks', '?')}")
        if ev.get("cache_tokens_left") is not None:
            self.set_field("cache", f"{ev['cache_tokens_left']:,}")
        if ev.get("requests_served") is not None:
            self.set_field("served", f"{ev['requests_served']:,}", counted(ev.get("sessions", 0), "open session"))
        if ev.get("throughput") is not None:
            self._show_speed()

    def _show_speed(self) -> None:
        """The node card's line: what the node advertises (its status lines) beside what the swarm counts of it
        (the last coverage report), and its peer id."""
        node = self.node
        counted = self.counted_rps if self.coverage_data is not None else None
        source = node.last_event.get("throughput_source")
        self.state_card.detail.setText(f"{advertised_words(node.last_event.get('throughput'), counted)}"
                                       f"{f' ({source})' if source else ''}; peer …{(node.peer_id or '')[-8:]}")

    def clear_swarm_view(self) -> None:
        """After Leave: no coverage, span, cache or request counts of a node that is gone (nothing stale)."""
        self.coverage_data, self.counted_rps = None, None
        empty = np.zeros(0)
        self.others_bars.setOpts(x=empty, height=empty, y0=empty, width=0.8)
        self.mine_bars.setOpts(x=empty, height=empty, y0=empty, width=0.8)
        self.gap_marks.setData([], [])
        self.coverage_note.setText("")
        self.coverage_plot.show_note(NO_COVERAGE)
        for key in FIELD_CAPTIONS:
            self.field_values[key] = ("–", "")
        self._render_fields()
        self.address_label.setText("")
        self.address_box.setPlainText("")

    def _on_report(self, report: dict) -> None:
        if self.coverage.watching is None:
            return  # a report the watcher read before it was stopped (the node left): stale now
        x, others, mine = coverage_arrays(report, self.node.peer_id)
        self.coverage_data = (x, others, mine)
        me = [s for s in report.get("servers", []) if s.get("peer_id") == self.node.peer_id]
        self.counted_rps = counted_rps(me[0]) if me else None
        if self.node.last_event.get("throughput") is not None:
            self._show_speed()
        self.coverage_plot.hide_note()
        self.others_bars.setOpts(x=x, height=others, y0=np.zeros_like(others), width=0.8)
        self.mine_bars.setOpts(x=x, height=mine, y0=others, width=0.8)
        if len(x) <= 48:  # whole block numbers under each bar
            step = 1 if len(x) <= 24 else 2
            self.coverage_plot.getAxis("bottom").setTicks([[(int(i), str(int(i))) for i in x[::step]], []])
        else:
            self.coverage_plot.getAxis("bottom").setTicks(None)
        self.coverage_plot.setXRange(-0.6, max(len(x), 1) - 0.4, padding=0)
        gaps = report.get("gaps") or []
        self.gap_marks.setData(gaps, [0.0] * len(gaps))
        servers = report.get("servers", [])
        online = sum(s.get("state") == "online" for s in servers)
        self.set_field("servers", str(online), f"{len(servers)} announced")
        bottleneck = report.get("bottleneck")
        note = f"{counted(report.get('num_blocks', 0), 'block')}, {counted(online, 'server')} online"
        if bottleneck:
            note += f"; weakest block {bottleneck['block']} ({fmt_rate(bottleneck['throughput'])} requests/s)"
        if gaps:
            note += f"; no server for blocks {', '.join(map(str, gaps))}"
        self.coverage_note.setText(note)

    def _on_directory(self, event: dict) -> None:
        rows = event.get("models") or []
        self.directory_rows, self.best_prefix = rows, event.get("best")
        table = self.models_table
        table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, text in enumerate(model_cells(row)):
                item = QTableWidgetItem(text)
                item.setToolTip(f"{row['repository']} (swarm prefix {row['dht_prefix']})" if c == 0 else text)
                table.setItem(r, c, item)
        servers = sum(row["servers"] for row in rows)
        self.directory_note.setText(f"{counted(len(rows), 'model')} served by {counted(servers, 'server')}" if rows
                                    else "No model is listed in this swarm's registry yet.")
        best = next((row for row in rows if row["dht_prefix"] == self.best_prefix), None)
        self.join_best_button.setEnabled(best is not None and self.node.state not in BUSY_STATES)
        if best is not None:
            start, end = best["help"]["blocks"]
            self.join_best_button.setText(f"Join {model_name(best)}, blocks {start}:{end}")
            self.join_best_button.setToolTip(f"{best['repository']}, served under the swarm prefix "
                                             f"{best['dht_prefix']}")
        else:
            self.join_best_button.setText("Join where this machine helps most")

    def _on_directory_error(self, message: str) -> None:
        self.directory_note.setText(message.splitlines()[0] if message else "reading the swarm failed")
        self.join_best_button.setEnabled(False)

    def _on_coverage_error(self, message: str) -> None:
        self.coverage_note.setText(f"Reading the swarm failed: {message}")
