"""What the benchmarks share (not a benchmark itself): demo checkpoints written once into the data folder, a
fixed prompt of token ids, a CPU-bound process to run beside ("busy"), and a child's JSON answer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HOG_DEADLINE_S = 1800  # the hog kills itself after this, should the bench die without killing it
CHILD_DEADLINE_S = 600  # a child_json child is killed after this


def demo_checkpoint(name: str, shape: dict) -> Path:
    """A demo checkpoint of `shape` (demo_model.DemoSpec fields), written once into <data dir>/bench-models/<name>
    and reused. torch is imported only here, so a bench's parent process can stay light until it needs one."""
    from hivekeeper.core.runtime.demo_model import DemoSpec, write_demo_checkpoint
    from hivekeeper.core.machine.detect import default_data_dir

    path = default_data_dir() / "bench-models" / name
    if not (path / "config.json").is_file():
        write_demo_checkpoint(path, DemoSpec(**shape), overwrite=True)
    return path


def demo_preset(preset: str) -> Path:
    """The checkpoint of a demo_model.PRESETS entry ("100m", "1b")."""
    from hivekeeper.core.runtime.demo_model import PRESETS

    return demo_checkpoint(preset, PRESETS[preset])


def fixed_prompt(vocab_size: int, tokens: int) -> list[int]:
    """BOS then a deterministic spread of ordinary token ids: the same prompt for every run and implementation."""
    return [1] + [(7 * i) % (vocab_size - 10) + 10 for i in range(tokens - 1)]


@contextmanager
def busy_core(busy: bool):
    """One CPU-bound child process for the block when `busy` (killed and reaped after it)."""
    if not busy:
        yield
        return
    child = subprocess.Popen([sys.executable, "-c", f"import signal; signal.alarm({HOG_DEADLINE_S})\nwhile 1: pass"])
    try:
        time.sleep(0.2)  # let it start spinning
        yield
    finally:
        child.kill()
        child.wait(timeout=30)


def timed_parts(runner) -> dict[str, list[float]]:
    """Seconds of each call of the runner's blocks (its span) and LM head, appended as they run
    (step_overhead.TimedCall, as the measurement's own loop times them)."""
    from hivekeeper.core.machine.step_overhead import TimedCall

    times: dict[str, list[float]] = {"blocks": [], "head": []}
    runner.span, runner.head = TimedCall(runner.span, times["blocks"]), TimedCall(runner.head, times["head"])
    return times


def child_json(command: list[str], env: dict | None, deadline_s: float = CHILD_DEADLINE_S,
               progress: bool = False) -> dict:
    """The last line of a child's stdout as JSON. The child runs in a process group of its own: past `deadline_s`,
    or when this process is interrupted, the group is killed (its own children too), and on a failure or the
    deadline the output so far is in the error. `progress`: the child's stderr (its progress bars) goes to ours as it
    runs instead of into the error."""
    what = " ".join(command[2:6])
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=None if progress else subprocess.PIPE,
                             text=True, env=env, start_new_session=True)
    try:
        out, err = child.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        out, err = kill_group(child)
        raise SystemExit(f"{what}: no answer in {deadline_s:g} s; output so far:\n{out}{err}") from None
    except BaseException:
        kill_group(child)
        raise
    lines = out.strip().splitlines()
    if child.returncode != 0 or not lines:
        said = err if err is not None else "(its messages are above)\n"
        why = f"failed ({child.returncode})" if child.returncode else "printed nothing"
        raise SystemExit(f"{what} {why}:\n{said}")
    return json.loads(lines[-1])


def kill_group(child: subprocess.Popen) -> tuple[str, str]:
    """Kill a child started in a session of its own, and every process of its group; its output so far."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:  # gone already
        pass
    out, err = child.communicate()
    return out or "", err or ""
