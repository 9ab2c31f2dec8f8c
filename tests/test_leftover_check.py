"""The suite's leftover check (tests/conftest.py) kills what a test left behind and collects the exit statuses that come
to the test process, the subreaper: a compiler driver orphaned by a killed server left its cc1 as zombies, and every
later test of that pytest-xdist worker that asserted it had no child processes failed."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil


def test_a_killed_orphan_and_its_child_leave_no_zombie(pytestconfig):
    checks = pytestconfig.pluginmanager.get_plugin(str(Path(__file__).with_name("conftest.py")))
    # the outer shell exits at once: the inner one (a driver) is orphaned and adopted, with its `sleep` (a cc1)
    outer = subprocess.run(["sh", "-c", "sh -c 'sleep 60; true' >/dev/null 2>&1 & echo $!"], capture_output=True,
                           text=True, timeout=30)
    driver = psutil.Process(int(outer.stdout))
    deadline = time.monotonic() + 30
    while not driver.children() and time.monotonic() < deadline:
        time.sleep(0.02)
    (worker,) = driver.children()
    while worker.name() != "sleep" and time.monotonic() < deadline:  # forked, but still the shell until it execs
        time.sleep(0.02)
    assert driver.ppid() == psutil.Process().pid  # adopted by the test process

    described = checks.kill_and_describe([driver.pid, worker.pid])

    assert [line.split()[1] for line in described] == ["sh", "sleep"]
    assert {driver.pid, worker.pid}.isdisjoint(child.pid for child in psutil.Process().children(recursive=True))


def test_descendants_are_found_under_a_live_child_and_a_zombie_child_is_not_reaped_by_the_look(pytestconfig):
    """The check lists descendants only when the process has a child (one waitid call instead of reading every
    process's /proc entry, twice per test): a grandchild under a live child, and a zombie child, are both still seen."""
    checks = pytestconfig.pluginmanager.get_plugin(str(Path(__file__).with_name("conftest.py")))
    before = checks.watched_processes()
    assert before == {child.pid for child in psutil.Process().children(recursive=True)}
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.02)
        (grandchild,) = psutil.Process(parent.pid).children()
        assert checks.watched_processes() - before == {parent.pid, grandchild.pid}
        grandchild.kill()
        grandchild.wait(10)  # reaped by the shell, which then exits: a zombie until we wait for it
        deadline = time.monotonic() + 30
        while psutil.Process(parent.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert parent.pid in checks.watched_processes()  # a zombie is still a child: the listing is not skipped
    finally:
        parent.kill()
        parent.wait(10)
    assert checks.watched_processes() == before
