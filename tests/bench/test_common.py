"""bench/_common.py's child_json, which every bench that runs a child waits on: the child's last line as JSON, its
stderr passed through or kept for the error, and past its deadline the child and its own children killed with the
output so far in the error (real children, a deadline of seconds)."""

from __future__ import annotations

import os
import sys
import time

import pytest

def test_the_last_line_is_the_answer_and_progress_goes_to_our_stderr(bench_common, capfd):
    script = "import sys; print('working', file=sys.stderr, flush=True); print('{\"a\": 0}'); print('{\"a\": 1}')"
    assert bench_common.child_json([sys.executable, "-c", script], None, progress=True) == {"a": 1}
    assert "working" in capfd.readouterr().err


def test_a_child_past_its_deadline_goes_with_its_children_and_its_output_so_far(bench_common, tmp_path):
    pid_file = tmp_path / "grandchild"
    script = ("import subprocess as s, sys, time\n"
              "g = s.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(g.pid))\n"
              "print('half done', flush=True); print('stuck', file=sys.stderr, flush=True); time.sleep(60)")
    started = time.monotonic()
    with pytest.raises(SystemExit) as failed:
        bench_common.child_json([sys.executable, "-c", script], None, deadline_s=3)
    assert time.monotonic() - started < 30
    message = str(failed.value)
    assert "no answer in 3 s" in message and "half done" in message and "stuck" in message
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(grandchild):
        time.sleep(0.1)
    assert not alive(grandchild)
    reap(grandchild)


def test_a_failing_or_silent_child_is_named_with_what_it_said(bench_common):
    with pytest.raises(SystemExit, match=r"failed \(3\):\nbad input"):
        bench_common.child_json([sys.executable, "-c", "import sys; sys.stderr.write('bad input'); sys.exit(3)"],
                                None)
    with pytest.raises(SystemExit, match="printed nothing"):
        bench_common.child_json([sys.executable, "-c", "pass"], None)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as gone: it is dead, waiting for a parent that is not this test)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def reap(pid: int) -> None:
    """Collect a killed grandchild's exit status where this process adopted it (the suite's subreaper, tests/conftest.py:
    left a zombie, it would be a child of every later test), else init has."""
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
