"""The serving node as a child process: `hivekeeper serve ... --json-status`, its state, and a clean stop.

hivemind forks and starts p2pd, so the node never runs inside the GUI process. Its JSON status lines drive the
state shown everywhere (page, status bar, tray):

    stopped -> starting -> joining -> online (-> moving -> joining -> online) -> leaving -> stopped
                  any unexpected exit -> error (last error kept; restart() launches the same node again)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PySide6.QtCore import QObject, Signal

from hivekeeper.core.child_argv import hivekeeper_command

from hivekeeper.gui.services.child_process import JsonLinesProcess

STATES = ("stopped", "starting", "joining", "online", "moving", "leaving", "error")
STATE_WORDS = {"stopped": "not serving", "starting": "starting…", "joining": "joining (loading blocks)…",
               "online": "online", "moving": "moving to a weaker span…", "leaving": "leaving…",
               "error": "stopped with an error"}


@dataclass(frozen=True)
class NodeLaunch:
    """What to serve and where: turned into `hivekeeper serve` arguments."""

    model: str
    new_swarm: bool = True
    initial_peers: tuple[str, ...] = ()
    num_blocks: int | None = None  # None: the node decides from its free memory
    quant: str = "none"
    dtype: str = "auto"
    host: str = "0.0.0.0"
    public_name: str = ""
    stats_period: float = 2.0  # a "stats" line this often, for the monitor
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def argv(self) -> list[str]:
        args = ["serve", "--model", self.model, "--json-status", "--host", self.host,
                "--quant", self.quant, "--dtype", self.dtype, "--stats-period", f"{self.stats_period:g}"]
        args += ["--new-swarm"] if self.new_swarm else ["--initial-peers", *self.initial_peers]
        if self.num_blocks:
            args += ["--num-blocks", str(self.num_blocks)]
        if self.public_name:
            args += ["--public-name", self.public_name]
        return hivekeeper_command(*args, *self.extra_args)


def last_error(stderr_tail: str, code: int) -> str:
    """The line of a dead node's stderr that says what went wrong (the CLI's one-line error, else the exception)."""
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("hivekeeper ") and ": error: " in line:
            return line.split(": error: ", 1)[1]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Exception" in line:
            return line
    if lines:
        return lines[-1]
    return f"the node exited with code {code}"


class NodeService(QObject):
    """Start, watch and stop one serving node."""

    stateChanged = Signal(str)
    statusReceived = Signal(dict)  # every JSON status event, as printed by the node

    def __init__(self, parent: QObject | None = None, env: dict[str, str] | None = None):
        super().__init__(parent)
        self.env = env or {}
        self.state = "stopped"
        self.launch: NodeLaunch | None = None
        self.last_event: dict = {}
        self.peer_id: str | None = None
        self.maddrs: list[str] = []
        self.error: str = ""
        self.exit_code: int | None = None
        self._process = JsonLinesProcess(self)
        self._process.event.connect(self._on_event)
        self._process.exited.connect(self._on_exit)

    @property
    def running(self) -> bool:
        return self._process.running

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process.running else None

    def log_tail(self, lines: int = 20) -> str:
        return self._process.stderr_tail(lines)

    # ---- control ---------------------------------------------------------------------------------------------------
    def start(self, launch: NodeLaunch) -> None:
        if self.running:
            raise RuntimeError("the node is already running; leave first")
        self.launch = launch
        self.last_event, self.peer_id, self.maddrs, self.error, self.exit_code = {}, None, [], "", None
        self._set_state("starting")
        self._process.start(launch.argv(), self.env)

    def restart(self) -> None:
        """Launch the last node again (after an error or a leave)."""
        if self.launch is None:
            raise RuntimeError("nothing to restart: the node was never started")
        if self.running:
            self.stop(wait=True)
        self.start(self.launch)

    def stop(self, wait: bool = False, grace_ms: int = 20_000) -> None:
        """Leave the swarm: SIGTERM (the node announces OFFLINE and shuts p2pd down), SIGKILL after grace_ms."""
        if not self.running:
            return
        self._set_state("leaving")
        if wait:
            self._process.stop_blocking(grace_ms)
        else:
            self._process.terminate(grace_ms)

    # ---- events ----------------------------------------------------------------------------------------------------
    def _on_event(self, event: dict) -> None:
        self.last_event = {**self.last_event, **event}
        state = event.get("state")
        if event.get("peer_id"):
            self.peer_id = event["peer_id"]
        if event.get("maddrs"):
            self.maddrs = list(event["maddrs"])
        self.statusReceived.emit(event)
        if self.state == "leaving":
            return  # the node's own 'offline' comes next; the process end makes it 'stopped'
        if state in ("joining", "online", "moving"):
            self._set_state(state)

    def _on_exit(self, code: int, stderr_tail: str) -> None:
        self.exit_code = code
        if self.state == "leaving":
            self._set_state("stopped")
        else:
            self.error = last_error(stderr_tail, code)
            self._set_state("error")

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.stateChanged.emit(state)
