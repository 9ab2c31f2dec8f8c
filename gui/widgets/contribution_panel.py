"""The Monitor page's "Contribution" panel: requests and tokens this machine's node served, its uptime and energy,
today and in total (the file `hivekeeper serve` keeps: core/swarm/contribution.py; `hivekeeper node stats` prints
the same). It reads the file when made and on Refresh, and takes the running node's figures from its status lines
("contribution", sent whenever the node saves them)."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QGroupBox, QHBoxLayout, QLabel, QPushButton, QWidget

from hivekeeper.core.swarm.contribution import contribution_summary, fmt_duration, fmt_energy, read_contribution
from hivekeeper.gui.style import MUTED, label
from hivekeeper.planner.errors import InputError

ROWS = (("requests", "requests", lambda v: f"{int(v):,}"), ("tokens", "tokens", lambda v: f"{int(v):,}"),
        ("uptime_s", "uptime", fmt_duration), ("energy_wh", "energy", fmt_energy))


def contribution_table(summary: dict) -> str:
    """Today's and the total figures as a rich-text table."""
    head = "".join(f"<td style='padding: 0 18px 2px 0; color:{MUTED}; font-size:11px'>{caption.upper()}</td>"
                   for _, caption, _ in ROWS)
    rows = []
    for period in ("today", "total"):
        cells = "".join(f"<td style='padding: 0 18px 2px 0; font-size:15px; font-weight:600'>"
                        f"{fmt(summary[period][key])}</td>" for key, _, fmt in ROWS)
        rows.append(f"<tr><td style='padding-right:18px; color:{MUTED}'>{period}</td>{cells}</tr>")
    return f"<table><tr><td></td>{head}</tr>{''.join(rows)}</table>"


class ContributionPanel(QGroupBox):
    """What this machine has given the swarm."""

    def __init__(self, path=None, parent: QWidget | None = None):
        super().__init__("Contribution to the swarm", parent)
        self.path = path  # None: the data folder's contribution.json
        self.summary: dict | None = None
        row = QHBoxLayout(self)
        self.table = QLabel()
        self.table.setTextFormat(Qt.TextFormat.RichText)
        self.note = label("", "small", wrap=True)
        refresh = QPushButton("Refresh")
        refresh.clicked.connect(self.reload)
        row.addWidget(self.table)
        row.addWidget(self.note, 1)
        row.addWidget(refresh, 0, Qt.AlignmentFlag.AlignTop)
        self.reload()

    def reload(self) -> None:
        try:
            self.show_summary(contribution_summary(read_contribution(self.path)))
            self.note.setText("Energy from the plan's power figure (NVML counters on NVIDIA GPUs).")
        except InputError as exc:
            self.note.setText(str(exc))

    def show_summary(self, summary: dict) -> None:
        self.summary = summary
        self.table.setText(contribution_table(summary))

    def record_node_status(self, event: dict) -> None:
        if isinstance(event.get("contribution"), dict):
            self.show_summary(event["contribution"])
