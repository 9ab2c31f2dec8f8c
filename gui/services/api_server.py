"""The app's OpenAI-compatible API: `hivekeeper api --model M --port N --json-status` as a child process, its
state, and a clean stop (on the switch, and when the app quits).

The API runs its own copy of the model in a child process, so a client's requests never stall the window and the
model the Chat page holds is not shared across threads. Its JSON status lines drive the state:

    stopped -> loading -> serving -> stopping -> stopped
                  any exit not asked for -> error (the command's one-line error kept)
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QObject

from hivekeeper.core.child_argv import hivekeeper_command

from hivekeeper.gui.services.child_process import ChildService, last_error

STOP_GRACE_MS = 10_000  # the server cancels running requests (503), then closes the model


@dataclass(frozen=True)
class ApiLaunch:
    """What to serve and where: turned into `hivekeeper api` arguments (loopback only)."""

    model: str
    port: int

    def argv(self) -> list[str]:
        return hivekeeper_command("api", "--model", self.model, "--port", str(self.port), "--json-status")


class ApiServerService(ChildService):
    """Start, watch and stop one `hivekeeper api` child."""

    def __init__(self, parent: QObject | None = None, env: dict[str, str] | None = None):
        super().__init__(parent, env)
        self.launch: ApiLaunch | None = None
        self.url = ""

    def start(self, launch: ApiLaunch) -> None:
        if self.running:
            raise RuntimeError("the API is already running; stop it first")
        self.launch, self.url, self.error = launch, "", ""
        self._set_state("loading")
        self._process.start(launch.argv(), self.env)

    def stop(self, wait: bool = False) -> None:
        """SIGTERM (the server finishes, closes the model, says 'stopped'); SIGKILL after a grace period."""
        if not self.running:
            return
        self._set_state("stopping")
        if wait:
            self._process.stop_blocking(STOP_GRACE_MS)
        else:
            self._process.terminate(STOP_GRACE_MS)

    def _on_event(self, event: dict) -> None:
        if event.get("state") == "serving" and self.state == "loading":
            self.url = str(event.get("url", ""))
            self._set_state("serving")

    def _on_exit(self, code: int, stderr_tail: str) -> None:
        self.url = ""
        if self.state == "stopping":
            self._set_state("stopped")
        else:
            self.error = last_error(stderr_tail, code, "the API")
            self._set_state("error")
