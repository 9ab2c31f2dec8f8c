"""The main window: a navigation rail, the seven pages, a status bar with the node's state, the tray icon, a Help menu.

It owns the services (detection, measurement, the node, the coverage watcher, chat) and wires pages to them.
Only the page on screen is built before the first paint; the others (and pyqtgraph, numpy, the planner search)
are built right after it, so the window appears fast. Closing the window while a node serves asks whether to keep
serving in the background (tray icon) or stop.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QSize, QTimer, Signal
from PySide6.QtGui import QAction, QIcon
from PySide6.QtWidgets import (QHBoxLayout, QLayout, QListWidget, QListWidgetItem, QMainWindow, QMessageBox,
                               QStackedWidget, QVBoxLayout, QWidget)

from hivekeeper.planner.errors import InputError

from hivekeeper.gui.services.chat import ChatService
from hivekeeper.gui.services.collector import GuiThreadCollector
from hivekeeper.gui.services.coverage import CoverageService
from hivekeeper.gui.services.hardware import DetectService
from hivekeeper.gui.services.measure import FirstMeasure, MeasureService, first_measure_enabled
from hivekeeper.gui.services.node import NodeService
from hivekeeper.gui.settings import Settings, SettingsStore
from hivekeeper.gui.style import STATE_COLORS
from hivekeeper.gui.services.workers import WorkerThread
from hivekeeper.gui.widgets.tray import NodeTray, dot_icon

PAGES = ("Hardware", "Plan", "Swarm", "Chat", "Monitor", "Models", "Settings")


class MainWindow(QMainWindow):
    """Everything the app shows. `store` decides where settings (and the caches beside them) live."""

    closed = Signal()

    def __init__(self, store: SettingsStore | None = None, settings: Settings | None = None,
                 settings_error: str | None = None, detect_on_start: bool = True,
                 conversations_dir: Path | None = None):
        super().__init__()
        self.store = store or SettingsStore()
        self.settings = settings or self.store.load_or_default()[0]
        self.conversations_dir = conversations_dir or self.store.folder / "conversations"
        self.setWindowTitle("Hivekeeper")
        self.setWindowIcon(dot_icon("#2f80ed", 64))
        self.resize(1280, 800)
        self._quitting = False
        self._shut_down = False
        self.collector = GuiThreadCollector(self)  # cyclic garbage (Qt objects in it) dies on this thread only

        folder = self.store.folder
        self.detect = DetectService(self, folder)
        self.measure = MeasureService(self)
        self.first_measure = FirstMeasure(self.measure, self.statusBar())
        self.detect.detected.connect(self._measure_first_time)
        self.node = NodeService(self)
        self.node.owner_args = self.settings.node.serve_args()  # the Settings page's pause conditions and limits
        self.coverage = CoverageService(self)
        self.chat = ChatService(self)

        self.nav = QListWidget()
        self.nav.setObjectName("nav")
        self.nav.setFixedWidth(170)
        self.nav.setIconSize(QSize(10, 10))
        for name in PAGES:
            self.nav.addItem(QListWidgetItem(name))
        self.stack = QStackedWidget()
        self._holders: dict[str, QWidget] = {}
        self._built: dict[str, QWidget] = {}
        for name in PAGES:  # empty holders; a page is built into its holder the first time it is needed
            holder = QWidget()
            holder.setLayout(QVBoxLayout())
            holder.layout().setContentsMargins(0, 0, 0, 0)
            self._holders[name] = holder
            self.stack.addWidget(holder)
        self.nav.currentRowChanged.connect(self._show_page)
        central = QWidget()
        layout = QHBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self.nav)
        layout.addWidget(self.stack, 1)
        self.setCentralWidget(central)
        # A fixed minimum instead of one that follows the pages' layouts: the minimum would change as pages are
        # built after the first paint, and resizing constraints of a shown window is a round trip to the platform.
        self.layout().setSizeConstraint(QLayout.SizeConstraint.SetNoConstraint)
        self.setMinimumSize(1024, 680)

        # the node's state in the status bar and the tray icon (gui/widgets/tray.py), with Pause 1 h / Resume / Quit
        self.node_tray = NodeTray(self, self.node, self.show_from_tray, self.quit_everything)
        self.node_status, self.tray = self.node_tray.label, self.node_tray.tray
        if settings_error:
            self.statusBar().showMessage(f"Settings were reset: {settings_error}", 20_000)
        self.about_box = None  # the About box, once opened (Help -> About Hivekeeper)
        self._make_menus()

        self._save_timer = QTimer(self)
        self._save_timer.setSingleShot(True)
        self._save_timer.setInterval(500)
        self._save_timer.timeout.connect(self.save_settings)
        self.node.stateChanged.connect(self._node_state_changed)
        self._node_state_changed(self.node.state)

        self.nav.setCurrentRow(min(self.settings.page, len(PAGES) - 1))
        self._painted = False
        QTimer.singleShot(2000, self._build_next_page)  # in case the window is never painted (hidden, tests)
        if detect_on_start:
            QTimer.singleShot(0, self.hardware_page.start_detection)

    # ---- pages, built on demand ------------------------------------------------------------------------------------
    def page(self, name: str) -> QWidget:
        """The page called `name`, built (and wired) the first time it is asked for."""
        if name not in self._built:
            widget = getattr(self, f"_build_{name.lower()}")()
            self._built[name] = widget
            self._holders[name].layout().addWidget(widget)
        return self._built[name]

    def build_all_pages(self) -> None:
        for name in PAGES:
            self.page(name)

    def paintEvent(self, event) -> None:
        super().paintEvent(event)
        if not self._painted:  # the window is on screen: now build the other pages, one per event-loop turn
            self._painted = True
            QTimer.singleShot(0, self._build_next_page)

    def _build_next_page(self) -> None:
        missing = [name for name in PAGES if name not in self._built]
        if missing and not self._shut_down:
            self.page(missing[0])
            QTimer.singleShot(0, self._build_next_page)

    @property
    def hardware_page(self):
        return self.page("Hardware")

    @property
    def plan_page(self):
        return self.page("Plan")

    @property
    def swarm_page(self):
        return self.page("Swarm")

    @property
    def chat_page(self):
        return self.page("Chat")

    @property
    def monitor_page(self):
        return self.page("Monitor")

    @property
    def models_page(self):
        return self.page("Models")

    @property
    def settings_page(self):
        return self.page("Settings")

    def _build_hardware(self) -> QWidget:
        from hivekeeper.gui.pages.hardware import HardwarePage

        page = HardwarePage(self.detect, self.measure)
        page.machineChanged.connect(self._machine_changed)
        if page.machine is not None:
            QTimer.singleShot(0, lambda: self._machine_changed(page.machine))
        return page

    def _build_plan(self) -> QWidget:
        from hivekeeper.gui.pages.plan import PlanPage

        page = PlanPage(self.settings.plan)
        page.planChanged.connect(self._plan_changed)
        page.settingsChanged.connect(self.save_settings_soon)
        if self.hardware_page.machine is not None:
            page.set_machine(self.hardware_page.machine)
        return page

    def _build_swarm(self) -> QWidget:
        from hivekeeper.gui.pages.swarm import SwarmPage

        page = SwarmPage(self.settings.swarm, self.node, self.coverage)
        page.settingsChanged.connect(self._swarm_settings_changed)
        page.default_model = self.settings.plan.model
        page.model_edit.setPlaceholderText(f"the plan's model: {self.settings.plan.model}")
        QTimer.singleShot(0, self._update_recommendation)
        return page

    def _build_chat(self) -> QWidget:
        from hivekeeper.gui.pages.chat import ChatPage

        page = ChatPage(self.settings.chat, self.chat, self.conversations_dir)
        page.settingsChanged.connect(self.save_settings_soon)
        page.peers_provider = self.swarm_for_chat
        page.set_default_model(self.settings.plan.model)
        page.replyMeasured.connect(lambda tps, ms: self.monitor_page.record_chat_reply(tps, ms))
        return page

    def _build_models(self) -> QWidget:
        from hivekeeper.gui.pages.models import ModelsPage
        from hivekeeper.gui.services.models import ModelsService

        service = ModelsService(self)
        service.machine = lambda: self.hardware_page.machine
        return ModelsPage(service)

    def _build_settings(self) -> QWidget:
        from hivekeeper.gui.pages.settings import SettingsPage

        page = SettingsPage(self.settings.node)
        page.settingsChanged.connect(self._node_settings_changed)
        return page

    def _node_settings_changed(self) -> None:
        self.node.owner_args = self.settings.node.serve_args()
        self.save_settings_soon()

    def _build_monitor(self) -> QWidget:
        from hivekeeper.gui.pages.monitor import MonitorPage

        return MonitorPage(self.node)

    def _show_page(self, index: int) -> None:
        self.page(PAGES[index])
        self.stack.setCurrentIndex(index)
        self.settings.page = index
        self.save_settings_soon()

    def show_page(self, name: str) -> None:
        self.nav.setCurrentRow(PAGES.index(name))

    # ---- wiring ----------------------------------------------------------------------------------------------------
    def _machine_changed(self, machine) -> None:
        if machine is None:
            return
        self.chat.hardware, self.chat.efficiency = machine.hardware, machine.efficiency
        if "Plan" in self._built:
            self.plan_page.set_machine(machine)
        self._update_recommendation()

    def _measure_first_time(self, machine) -> None:
        """A fresh detection of a machine never measured, or measured busy and quiet now, while the Plan page plans
        for this machine: measure it quickly, once (issue 14 item 12; FirstMeasure says so in the status bar)."""
        from hivekeeper.gui.pages.plan import DETECTED

        if self.settings.plan.hardware == DETECTED and first_measure_enabled():
            self.first_measure.maybe_start(machine)

    def _plan_changed(self, result) -> None:
        model = self.settings.plan.model
        if "Swarm" in self._built:
            self.swarm_page.default_model = model
            self.swarm_page.model_edit.setPlaceholderText(f"the plan's model: {model}")
            self._update_recommendation()
        if "Chat" in self._built:
            self.chat_page.set_default_model(model)

    def _swarm_settings_changed(self) -> None:
        self._update_recommendation()
        self.save_settings_soon()

    def _update_recommendation(self) -> None:
        """The serving plan for THIS machine (not a catalog one) and the model the Swarm page would serve."""
        if "Swarm" not in self._built:
            return
        from hivekeeper.planner.format_choice import plan_model_server

        from hivekeeper.core.runtime.default_model import model_path_or_id
        from hivekeeper.core.swarm.server.throughput import measured_block_speed

        machine = self.hardware_page.machine
        page = self.swarm_page
        model = page.model_to_serve()
        if machine is None or not model:
            page.set_recommendation(None, "Waiting for hardware detection…" if machine is None else "")
            return
        try:
            server = plan_model_server(model_path_or_id(model), machine.hardware, efficiency=machine.efficiency)
        except InputError as exc:  # the span as `hivekeeper serve` loads it (a GGUF's packed on a CPU)
            page.set_recommendation(None, f"No plan for {model}: {exc}")
            return
        page.set_recommendation(server, measured=measured_block_speed(model_path_or_id(model), server))

    def swarm_for_chat(self) -> tuple[str, tuple[str, ...]]:
        """(model, initial peers) for chatting through the swarm: our node's when it serves, else the Swarm page's."""
        launch = self.node.launch
        if self.node.running and launch is not None:
            peers = tuple(launch.initial_peers) if not launch.new_swarm else tuple(self.node.maddrs)
            return launch.model, peers
        return self.swarm_page.model_to_serve(), tuple(self.settings.swarm.initial_peers)

    # ---- node state ------------------------------------------------------------------------------------------------
    def _node_state_changed(self, state: str) -> None:
        color = STATE_COLORS.get(state, "#616e7c")
        self.nav.item(PAGES.index("Swarm")).setIcon(dot_icon(color) if state != "stopped" else QIcon())
        if state == "online":  # serve has timed a block now (or read its cache): the page says the same figure
            self._update_recommendation()

    def _make_menus(self) -> None:
        help_menu = self.menuBar().addMenu("&Help")
        about = QAction("&About Hivekeeper", self)
        about.setMenuRole(QAction.MenuRole.AboutRole)  # macOS puts it in the application menu
        about.triggered.connect(self.show_about)
        help_menu.addAction(about)

    def show_about(self) -> None:
        """Open the About box (window-modal, not blocking)."""
        from hivekeeper.gui.widgets.about_dialog import about_box

        if self.about_box is None:
            self.about_box = about_box(self)
        self.about_box.open()

    # ---- settings --------------------------------------------------------------------------------------------------
    def save_settings_soon(self) -> None:
        self._save_timer.start()

    def save_settings(self) -> None:
        try:
            self.store.save(self.settings)
        except (OSError, InputError) as exc:
            self.statusBar().showMessage(f"Cannot save settings: {exc}", 10_000)

    # ---- closing ---------------------------------------------------------------------------------------------------
    def ask_on_close(self) -> str:
        """'background', 'stop' or 'cancel': what to do with a running node when the window closes. Serving in the
        background needs a system tray (to bring the window back); without one the choice is stop or cancel."""
        box = QMessageBox(self)
        box.setWindowTitle("The node is serving")
        stop = box.addButton("Stop and quit", QMessageBox.ButtonRole.DestructiveRole)
        box.addButton(QMessageBox.StandardButton.Cancel)
        keep = None
        if self.tray is not None:
            box.setText("This machine is serving the swarm. Keep serving in the background?")
            box.setInformativeText("Keep serving: the window closes and the node keeps running; the tray icon "
                                   "brings the window back. Stop: the node announces it is leaving, then the app "
                                   "quits.")
            keep = box.addButton("Keep serving", QMessageBox.ButtonRole.AcceptRole)
            box.setDefaultButton(keep)
        else:
            box.setText("This machine is serving the swarm. Stop the node and quit?")
            box.setInformativeText("There is no system tray here to keep it running in the background: the node "
                                   "announces it is leaving, then the app quits.")
        box.exec()
        clicked = box.clickedButton()
        if keep is not None and clicked is keep:
            return "background"
        return "stop" if clicked is stop else "cancel"

    def closeEvent(self, event) -> None:
        if not self._quitting and self.node.running:
            choice = self.ask_on_close()
            if choice == "cancel":
                event.ignore()
                return
            if choice == "background" and self.tray is not None:
                self.tray.show()
                self.hide()
                event.ignore()
                return
        self.shutdown()
        event.accept()
        self.closed.emit()

    def show_from_tray(self) -> None:
        self.show()
        self.raise_()
        self.activateWindow()

    def quit_everything(self) -> None:
        self._quitting = True
        self.close()

    def shutdown(self) -> None:
        """Stop everything this window started: node, watcher, detection, workers; save settings. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        self._save_timer.stop()
        self.save_settings()
        self.statusBar().showMessage("Stopping…")
        if "Chat" in self._built:
            self.chat_page.shutdown()
        self.chat.shutdown()
        self.coverage.stop(wait=True)
        self.node.stop(wait=True)
        self.detect.stop()
        self.measure.cancel()
        if "Plan" in self._built:
            self.plan_page.shutdown()
        if "Monitor" in self._built:
            self.monitor_page.shutdown()
        if "Models" in self._built:
            self.models_page.shutdown()
        WorkerThread.stop_all()
        if self.tray is not None:
            self.tray.hide()
        self.collector.stop()
