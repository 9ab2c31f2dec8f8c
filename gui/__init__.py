"""Hivekeeper's desktop app (PySide6 + pyqtgraph). No torch work on the GUI thread.

- `app`, `main_window`  the application and its window (navigation rail, pages, status bar, tray).
- `pages/`       one module per page: hardware, plan, swarm, chat, monitor.
- `widgets/`     small reusable widgets.
- `services/`    QObjects that run work off the GUI thread: workers, child processes and what they report.
- `viewmodels/`  Qt-free: what the pages show, saved conversations, ring buffers for plots.
- `settings`, `style`, `screenshots`: saved choices, look and feel, PNGs of every page.
"""
