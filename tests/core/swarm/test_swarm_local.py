"""LocalSwarm's servers die with the process that started them, even when it is killed with SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from hivekeeper.core.swarm.local import LocalSwarm

from ...child_output import ChildOutput

PARENT = """
import sys, time
from hivekeeper.core.swarm.local import LocalSwarm
swarm = LocalSwarm(sys.argv[1], extra_args=("--balance-period", "0"), log_dir=sys.argv[2])  # killed: cannot clean up
swarm.__enter__()
server = swarm.start("--num-blocks", "2", wait="online")
print(server.popen.pid, flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    """True once `pid` has exited (reaping it: this test process adopts orphans, see tests/conftest.py)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:
        pass
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_killed_parent_takes_its_servers_along(tiny_checkpoint, tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_checkpoint), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = ChildOutput(parent)
    try:
        server_pid = int(child.readline(timeout=180))
        p2pd = [p.pid for p in psutil.Process(server_pid).children(recursive=True) if p.name() == "p2pd"]
        assert p2pd, "the server runs its p2pd daemon"
    finally:
        child.close()  # SIGKILL: no chance to clean up, only the kernel's signal can stop the server
    deadline = time.monotonic() + 30
    while not (gone(server_pid) and all(gone(pid) for pid in p2pd)):
        assert time.monotonic() < deadline, "the server outlived its killed parent"
        time.sleep(0.1)


def test_a_server_that_misses_its_deadline_is_killed_before_the_error(tiny_checkpoint):
    swarm = LocalSwarm(tiny_checkpoint, extra_args=("--balance-period", "0"))  # no `with`: nothing else cleans up
    with pytest.raises(TimeoutError, match="did not reach 'no-such-state'"):
        swarm.start("--num-blocks", "2", wait="no-such-state", timeout=3)
    server = swarm.servers[-1]
    assert not server.alive, "the server was left running behind the TimeoutError"
    assert server.popen.returncode == -9
    swarm.stop()  # its log folder goes too


def test_its_own_log_folder_goes_with_it_unless_a_failure_needs_it(tiny_checkpoint, tmp_path):
    """209 `hivekeeper-swarm-*` folders were left in /tmp by test and bench runs: a swarm's own log folder is removed
    when it stops, a folder given is the caller's (kept), and where the `with` body fails the logs are kept and the
    error names where."""
    import shutil

    with LocalSwarm(tiny_checkpoint, extra_args=("--balance-period", "0")) as swarm:
        swarm.start("--num-blocks", "2", wait="started")
        assert (swarm.log_dir / "server1.log").is_file()
    assert swarm.log_dir.name.startswith("hivekeeper-swarm-") and not swarm.log_dir.exists()

    with LocalSwarm(tiny_checkpoint, log_dir=tmp_path):
        pass
    assert tmp_path.is_dir()

    with pytest.raises(TimeoutError) as failure:
        with LocalSwarm(tiny_checkpoint, extra_args=("--balance-period", "0")) as failing:
            failing.start("--num-blocks", "2", wait="no-such-state", timeout=3)
    try:
        assert (failing.log_dir / "server1.log").is_file()
        assert f"the servers' logs are kept in {failing.log_dir}" in failure.value.__notes__
    finally:
        shutil.rmtree(failing.log_dir, ignore_errors=True)
