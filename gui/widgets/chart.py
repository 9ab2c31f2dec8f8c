"""A chart (pyqtgraph's PlotWidget) that fits a page: it asks for no more height than its minimum, and it can say in
words why it has nothing to draw.

A PlotWidget asks for 480 px of height; a page whose column holds wrapped text beside charts lays out by those
wishes, so a chart asking for 480 px either pushes the page into scrolling or, squeezed, loses its x-axis label
below the window's edge. `Chart` asks for its minimum height and takes whatever room is left above that.

`show_note(text)` replaces empty axes (a meaningless 0-1 grid) with a sentence; `hide_note()` brings the axes back
when there is data.

`legend_below()` puts the legend under the x-axis label, outside the plotted area: a legend inside it (pyqtgraph's
addLegend) covers whatever curve passes under it, and on the Plan page's narrow charts every corner had one.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QSize, Qt
from PySide6.QtWidgets import QLabel

from hivekeeper.gui.style import MUTED

NOTE_MARGIN = 12  # pixels between the note and the chart's edges
LEGEND_ROW = 4  # of a PlotItem's grid: 0 title, 1 top axis, 2 the plot, 3 the bottom axis and its label


class Chart(pg.PlotWidget):
    """A PlotWidget whose size hint is its minimum height, with an optional note in place of its axes."""

    note: QLabel | None = None  # made after PlotWidget's __init__, which already resizes the widget

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.note = QLabel(self)
        self.note.setWordWrap(True)
        self.note.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.note.setStyleSheet(f"color: {MUTED};")
        self.note.hide()

    def legend_below(self, columns: int = 2) -> pg.LegendItem:
        """A legend in its own row under the x-axis label (never over the curves); plot(name=...) adds to it."""
        item = self.getPlotItem()
        legend = pg.LegendItem(labelTextSize="8pt", colCount=columns, frame=False, verSpacing=-6, horSpacing=2)
        item.legend = legend
        item.layout.addItem(legend, LEGEND_ROW, 0, 1, 3)  # the whole width: the left axis' column too
        return legend

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        return QSize(super().sizeHint().width(), self.minimumHeight())

    def show_note(self, text: str) -> None:
        """Say why there is nothing to draw, in place of the axes and the legend (the title stays)."""
        self.note.setText(text)
        self._axes_visible(False)
        self._place_note()
        self.note.show()

    def hide_note(self) -> None:
        self.note.hide()
        self._axes_visible(True)

    def _axes_visible(self, visible: bool) -> None:
        item = self.getPlotItem()
        for side in ("left", "bottom"):
            item.showAxis(side, visible)
        if item.legend is not None:
            item.legend.setVisible(visible)

    def _place_note(self) -> None:
        self.note.setGeometry(self.rect().adjusted(NOTE_MARGIN, NOTE_MARGIN, -NOTE_MARGIN, -NOTE_MARGIN))

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        if self.note is not None:
            self._place_note()
