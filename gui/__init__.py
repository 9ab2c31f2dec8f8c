"""Hivekeeper's desktop app (PySide6 + pyqtgraph)."""
