"""The model library for the app: listing (library.scan_library and the planner's fit, on a worker thread),
removing (on a worker), and pulling (`hivekeeper models pull --json` as a child process).

A pull runs as a child process rather than a thread because huggingface_hub fixes its endpoint and offline mode
when it is first imported, and because stopping it is then a kill at any moment: the partial file stays, and the
next pull of the same model resumes from it (core/runtime/hub_library.py).

The last listing is kept (`known_models`) for the model pickers (gui/widgets/model_menu.py), so the menus list what
the Models page lists without scanning on the GUI thread (a GGUF's metadata takes seconds to read the first time).
The page lists when it is first shown, so the pickers show the models once the Models page has been opened.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from hivekeeper.core.child_argv import hivekeeper_command

from hivekeeper.gui.services.child_process import JsonLinesProcess
from hivekeeper.gui.services.workers import WorkerThread, run_in_thread

LAST_LISTING: list = []  # library.LibraryModel objects of the last listing, for the pickers


def known_models() -> list:
    """The models of the last listing (none before the first)."""
    return list(LAST_LISTING)


def list_with_fits(machine, should_stop) -> list:
    """The library with each model's fit on `machine` (the app's MachineInfo: its hardware with measured numbers and
    their efficiency), or on this machine as `hivekeeper models list` and `plan` see it when None
    (library.this_machine_for_fits), stopping between models."""
    from hivekeeper.core.runtime.library import model_fit, scan_library, this_machine_for_fits

    models = scan_library()
    if should_stop():
        return models
    hardware, efficiency = this_machine_for_fits() if machine is None else (machine.hardware, machine.efficiency)
    for model in models:
        if should_stop():
            break
        model.fit, model.fit_reason = model_fit(model.path, hardware, efficiency)
    return models


class ModelsService(QObject):
    """Signals: listed(list of LibraryModel), failed(str) for a listing or removal, removed(id, bytes freed);
    pullProgress(done, total), pulled(path), pullFailed(message) (an abort says so)."""

    listed = Signal(list)
    failed = Signal(str)
    removed = Signal(str, int)
    pullProgress = Signal(int, int)
    pulled = Signal(str)
    pullFailed = Signal(str)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.machine = lambda: None  # the machine the app detected (a MachineInfo), or None: read per listing
        self.listing: WorkerThread | None = None
        self.removing: WorkerThread | None = None
        self.pull_process = JsonLinesProcess(self)
        self.pull_process.event.connect(self._pull_event)
        self.pull_process.exited.connect(self._pull_exited)
        self._pulled_path: str | None = None
        self._aborted = False

    # ---- listing and removing --------------------------------------------------------------------------------------
    def refresh(self) -> None:
        if self.listing is not None and not self.listing.worker.done:
            return
        machine = self.machine()
        self.listing = run_in_thread(lambda report, should_stop: list_with_fits(machine, should_stop),
                                     on_return=self._listed, on_error=self.failed.emit)

    def _listed(self, models: list) -> None:
        LAST_LISTING[:] = models
        self.listed.emit(models)

    def remove(self, model) -> None:
        from hivekeeper.core.runtime.library import remove_model

        # the callbacks run on the GUI thread (run_in_thread), so the listing that follows starts there
        self.removing = run_in_thread(lambda report, should_stop: remove_model(model),
                                      on_return=lambda freed: self._removed(model.id, freed), on_error=self.failed.emit)

    def _removed(self, model_id: str, freed: int) -> None:
        self.removed.emit(model_id, freed)
        self.refresh()

    # ---- pulling ---------------------------------------------------------------------------------------------------
    @property
    def pulling(self) -> bool:
        return self.pull_process.running

    def pull(self, args: list[str]) -> None:
        """Start `hivekeeper ARGS` (viewmodels.models_view.pull_argv_args)."""
        self._pulled_path = None
        self._aborted = False
        self.pull_process.start(hivekeeper_command(*args))

    def abort_pull(self) -> None:
        """Kill the pull at once; its partial file stays for the next pull to resume."""
        self._aborted = True
        self.pull_process.kill()

    def _pull_event(self, event: dict) -> None:
        self.pullProgress.emit(int(event.get("done_bytes", 0)), int(event.get("total_bytes", 0)))
        if event.get("event") == "done":
            self._pulled_path = str(event.get("path", ""))

    def _pull_exited(self, code: int, stderr_tail: str) -> None:
        if self._pulled_path is not None and code == 0:
            self.pulled.emit(self._pulled_path)
            self.refresh()
        elif self._aborted:
            self.pullFailed.emit("Pull stopped; pulling the same model again resumes where it stopped.")
        else:
            lines = [line for line in stderr_tail.splitlines() if line.strip() and "error" in line.lower()]
            self.pullFailed.emit(lines[-1] if lines else (stderr_tail.strip().splitlines() or ["pull failed"])[-1])

    def shutdown(self) -> None:
        """Stop a pull and wait for the workers (closing the app)."""
        if self.pull_process.running:
            self.pull_process.stop_blocking(grace_ms=2_000)
        for handle in (self.listing, self.removing):
            if handle is not None:
                handle.worker.abort()
                handle.thread.wait(30_000)
