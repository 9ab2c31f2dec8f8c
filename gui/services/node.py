"""The serving node as a child process: `hivekeeper serve ... --json-status`, its state, and a clean stop.

hivemind forks and starts p2pd, so the node never runs inside the GUI process. Its JSON status lines drive the
state shown everywhere (page, status bar, tray):

    stopped -> starting -> joining -> online (-> moving -> joining -> online) -> leaving -> stopped
                             online -> paused (why: `pause_reason`) -> joining -> online
                  any unexpected exit -> error (last error kept; restart() launches the same node again)

A node that crashes (any exit not asked for, except exit 2: bad input, which a restart would only repeat) is started
again after a backoff: RESTART_BACKOFF_S doubling up to RESTART_MAX_S, reset once it has served for STABLE_S. The
owner's "Pause for 1 h" and "Resume" go to the node as JSON lines on its stdin (serve --control-stdin). `notify`
says what the owner should hear about: a join, a crash and its restart, a pause.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from PySide6.QtCore import QObject, QTimer, Signal

from hivekeeper.core.child_argv import hivekeeper_command

from hivekeeper.gui.services.child_process import ChildService, last_error

STATES = ("stopped", "starting", "joining", "online", "moving", "paused", "leaving", "error")
STATE_WORDS = {"stopped": "not serving", "starting": "starting…", "joining": "joining (loading blocks)…",
               "online": "online", "moving": "moving to a weaker span…", "paused": "paused", "leaving": "leaving…",
               "error": "stopped with an error"}
RESTART_BACKOFF_S = 5.0  # the first restart after a crash; doubled for each crash after it
RESTART_MAX_S = 600.0
STABLE_S = 600.0  # serving this long resets the backoff
BAD_INPUT_EXIT = 2  # the CLI's InputError exit: a restart would fail the same way
__all__ = ["STATES", "STATE_WORDS", "NodeLaunch", "NodeService", "last_error"]


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
    owner_args: tuple[str, ...] = ()  # pause conditions and limits (the Settings page: NodeSettings.serve_args)
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def argv(self) -> list[str]:
        args = ["serve", "--model", self.model, "--json-status", "--control-stdin", *self.owner_args, "--host", self.host,
                "--quant", self.quant, "--dtype", self.dtype, "--stats-period", f"{self.stats_period:g}"]
        args += ["--new-swarm"] if self.new_swarm else ["--initial-peers", *self.initial_peers]
        if self.num_blocks:
            args += ["--num-blocks", str(self.num_blocks)]
        if self.public_name:
            args += ["--public-name", self.public_name]
        return hivekeeper_command(*args, *self.extra_args)


class NodeService(ChildService):
    """Start, watch and stop one serving node; pause and resume it; start it again after a crash."""

    statusReceived = Signal(dict)  # every JSON status event, as printed by the node
    notify = Signal(str, str)  # (title, text): a join, a crash and restart, a pause

    def __init__(self, parent: QObject | None = None, env: dict[str, str] | None = None,
                 restart_backoff_s: float = RESTART_BACKOFF_S):
        super().__init__(parent, env)
        self.launch: NodeLaunch | None = None
        self.last_event: dict = {}
        self.peer_id: str | None = None
        self.maddrs: list[str] = []
        self.exit_code: int | None = None
        self.pause_reason = ""
        self.owner_args: tuple[str, ...] = ()  # the Settings page's pause conditions and limits, for every start
        self.restart_backoff_s = restart_backoff_s
        self.crashes = 0  # crashes since the node last served for STABLE_S
        self.restart_in: float | None = None  # seconds until the restart after a crash, while one is due
        self._online_since: float | None = None
        self._restart_timer = QTimer(self)
        self._restart_timer.setSingleShot(True)
        self._restart_timer.timeout.connect(self._restart_after_crash)

    def log_tail(self, lines: int = 20) -> str:
        return self._process.stderr_tail(lines)

    # ---- control ---------------------------------------------------------------------------------------------------
    def start(self, launch: NodeLaunch) -> None:
        if self.running:
            raise RuntimeError("the node is already running; leave first")
        self._restart_timer.stop()
        if self.owner_args and not launch.owner_args:
            launch = replace(launch, owner_args=self.owner_args)
        self.launch, self.restart_in = launch, None
        self.last_event, self.peer_id, self.maddrs, self.error, self.exit_code = {}, None, [], "", None
        self.pause_reason, self._online_since = "", None
        self._set_state("starting")
        self._process.start(launch.argv(), self.env)

    def pause_for(self, seconds: float) -> None:
        """The owner's pause: the node leaves gracefully and rejoins after `seconds` (or on resume())."""
        self._process.send({"command": "pause", "seconds": seconds})

    def resume(self) -> None:
        """End the owner's pause (the Settings page's conditions may still hold the node paused)."""
        self._process.send({"command": "resume"})

    def restart(self) -> None:
        """Launch the last node again (after an error or a leave)."""
        if self.launch is None:
            raise RuntimeError("nothing to restart: the node was never started")
        if self.running:
            self.stop(wait=True)
        self.start(self.launch)

    def stop(self, wait: bool = False, grace_ms: int = 20_000) -> None:
        """Leave the swarm: SIGTERM (the node announces OFFLINE and shuts p2pd down), SIGKILL after grace_ms."""
        self._restart_timer.stop()
        self.restart_in = None
        if not self.running:
            if self.state == "error":
                self._set_state("stopped")
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
        if state == "paused":
            self.pause_reason = str(event.get("reason", ""))
            self.notify.emit("Node paused", f"The node stepped aside: {self.pause_reason}.")
        elif state == "online" and self.state != "online":
            self._online_since = time.monotonic()
            blocks = event.get("blocks") or ["?", "?"]
            self.notify.emit("Node joined", f"Serving blocks {blocks[0]}:{blocks[1]} of {event.get('dht_prefix', '')}.")
        if state in ("joining", "online", "moving", "paused"):
            self._set_state(state)

    def _on_exit(self, code: int, stderr_tail: str) -> None:
        self.exit_code = code
        if self.state == "leaving":
            self._set_state("stopped")
            return
        self.error = last_error(stderr_tail, code)
        if code != BAD_INPUT_EXIT and self.launch is not None:
            self._schedule_restart()
        self._set_state("error")

    def _schedule_restart(self) -> None:
        if self._online_since is not None and time.monotonic() - self._online_since >= STABLE_S:
            self.crashes = 0
        delay = min(RESTART_MAX_S, self.restart_backoff_s * 2 ** self.crashes)
        self.crashes += 1
        self.restart_in = delay
        self.notify.emit("Node crashed", f"{self.error[:160]} — restarting in {delay:.0f} s.")
        self._restart_timer.start(int(delay * 1000))

    def _restart_after_crash(self) -> None:
        if self.state == "error" and not self.running and self.launch is not None:
            self.start(self.launch)
