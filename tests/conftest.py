"""Suite-wide fixtures: no test may leave a process behind (p2pd included), and nothing reaches the hub."""

from __future__ import annotations

import os
import time

import psutil
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

_WATCHED_NAMES = ("p2pd",)


def _watched_processes() -> set[int]:
    """PIDs of our descendants plus every p2pd on the machine (a p2pd outlives its parent when orphaned)."""
    me = psutil.Process()
    pids = {child.pid for child in me.children(recursive=True)}
    for proc in psutil.process_iter(["name"]):
        if (proc.info["name"] or "") in _WATCHED_NAMES:
            pids.add(proc.pid)
    return pids


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test that leaves child processes or p2pd daemons running; kill them so the next test is clean."""
    before = _watched_processes()
    yield
    deadline = time.monotonic() + 5.0
    leftovers = {pid for pid in _watched_processes() - before if _alive(pid)}
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.1)
        leftovers = {pid for pid in leftovers if _alive(pid)}
    if leftovers:
        described = []
        for pid in leftovers:
            try:
                proc = psutil.Process(pid)
                described.append(f"{pid} {proc.name()} {' '.join(proc.cmdline()[:4])}")
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if described:
            pytest.fail("processes left behind: " + "; ".join(described))
