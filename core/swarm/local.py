"""Run `hivekeeper serve` processes on this machine: a loopback swarm for tests, benchmarks and demos.

Each server is a real subprocess (`python -m hivekeeper.core.cli.main serve ... --json-status`) in its own process
group, so kill(SIGKILL) takes its p2pd down with it, as a machine crash would. A reader thread collects its JSON
status lines; stderr goes to a log file, in the folder given (kept: the caller's) or in a temporary folder of the
swarm's own, which `stop()` removes once every server has exited. A server that fails to start puts its log's tail
in the error it raises; where the `with` body raises, the folder is kept and the error names it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from hivekeeper.core.child_argv import die_with_parent, hivekeeper_command


class ServerProcess:
    """One `hivekeeper serve` subprocess and the status events it printed."""

    def __init__(self, args: list[str], env: dict, log_path: Path):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.events: list[dict] = []
        self.terminated = False  # SIGTERM was sent
        self._changed = threading.Condition()
        self.popen = subprocess.Popen(
            die_with_parent(hivekeeper_command("serve", *args, "--json-status")),  # no orphans if we are killed
            stdout=subprocess.PIPE, stderr=self._log, env=env, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, state: str, timeout: float = 60.0, after: int = 0) -> dict:
        """The first event with this state (from index `after` on); raises if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self.events[after:]:
                    if event.get("state") == state:
                        return event
                if self.popen.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"server exited with {self.popen.returncode} before '{state}':\n{self.log()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"server did not reach '{state}' in {timeout:g}s:\n{self.log()}")
                self._changed.wait(min(remaining, 0.5))

    def log(self, tail: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-tail:]

    @property
    def peer_id(self) -> str:
        return self.wait_for("started")["peer_id"]

    @property
    def maddrs(self) -> list[str]:
        return self.wait_for("started")["maddrs"]

    @property
    def blocks(self) -> tuple[int, int] | None:
        """The span of the latest event that names one."""
        for event in reversed(self.events):
            if event.get("blocks"):
                return tuple(event["blocks"])
        return None

    @property
    def started(self) -> bool:
        """It has said "started": its peer id and addresses are known."""
        with self._changed:
            return any(event.get("state") == "started" for event in self.events)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and everything in its process group (its p2pd): a crash, no goodbye."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()
        self._close()

    def terminate(self) -> None:
        """SIGTERM without waiting, once (a second one could land after its handler is gone and kill it): the server
        announces OFFLINE and shuts p2pd down; stop() waits for it."""
        if self.popen.poll() is None and not self.terminated:
            self.terminated = True
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait (the server announces OFFLINE and shuts p2pd down); SIGKILL if it hangs."""
        if self.popen.poll() is None:
            self.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        try:  # anything left in its group (a p2pd whose parent died) goes too
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._close()
        return self.popen.returncode

    def _close(self) -> None:
        self._reader.join(timeout=5)
        if self.popen.stdout:
            self.popen.stdout.close()
        self._log.close()


class LocalSwarm:
    """Servers of one model on 127.0.0.1: the first starts a new swarm (or joins `initial_peers`), the others join it.

    Servers started with wait=None start side by side: a new one joins through the servers already up (it waits
    for the first only when none is), so their imports and loading overlap.
    """

    def __init__(self, model: str | Path, *, extra_args: tuple[str, ...] = (), env: dict | None = None,
                 log_dir: str | Path | None = None, initial_peers: tuple[str, ...] = ()):
        self.model = str(model)
        self.joins = list(initial_peers)  # another swarm's addresses, for servers of ours to join it
        self.extra_args = list(extra_args)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        self.own_log_dir = log_dir is None  # a temporary folder of ours: removed by stop()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="hivekeeper-swarm-"))
        self.servers: list[ServerProcess] = []

    @property
    def initial_peers(self) -> list[str]:
        """Multiaddrs of up to three live servers that are up (to join the swarm through); when none is up yet,
        the first live one's once it is."""
        alive = [s for s in self.servers if s.alive]
        if not alive:
            raise RuntimeError("no live server in this swarm")
        up = [s for s in alive if s.started] or alive[:1]
        return [addr for server in up[:3] for addr in server.maddrs]

    def start(self, *args: str, wait: str | None = "online", timeout: float = 90.0) -> ServerProcess:
        """Start a server with these extra arguments; waits until it reaches state `wait` (None: do not wait)."""
        argv = ["--model", self.model, "--host", "127.0.0.1", *self._join_args(), *self.extra_args, *args]
        server = ServerProcess(argv, self.env, self.log_dir / f"server{len(self.servers) + 1}.log")
        self.servers.append(server)
        if wait:
            try:
                server.wait_for(wait, timeout)
            except BaseException:  # a server that missed its deadline is not left running behind the error
                server.kill()
                raise
        return server

    def _join_args(self) -> list[str]:
        """--initial-peers: the addresses given to join and up to three servers of ours that are up (with neither,
        the first of ours once it is up); --new-swarm for the first server of a new swarm."""
        alive = [server for server in self.servers if server.alive]
        if self.servers and not alive and not self.joins:
            raise RuntimeError("no live server in this swarm")
        up = [server for server in alive if server.started][:3] or ([] if self.joins else alive[:1])
        peers = self.joins + [addr for server in up for addr in server.maddrs]
        return ["--initial-peers", *peers] if peers else ["--new-swarm"]

    def stop(self, keep_logs: bool = False) -> None:
        """Stop every server, side by side: all are asked first (SIGTERM), then each is waited for; then our own log
        folder goes (unless keep_logs: a failure's logs are read after)."""
        for server in self.servers:
            server.terminate()
        for server in reversed(self.servers):
            server.stop()
        if self.own_log_dir and not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        failed = isinstance(error, Exception)
        self.stop(keep_logs=failed)
        if failed and self.own_log_dir:
            error.add_note(f"the servers' logs are kept in {self.log_dir}")
