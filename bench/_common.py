"""What the benchmarks share (not a benchmark itself): demo checkpoints written once into the data folder, a
fixed prompt of token ids, a CPU-bound process to run beside ("busy"), and a child's JSON answer."""

from __future__ import annotations

import json
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


def child_json(command: list[str], env: dict | None) -> dict:
    """The last line of a child's stdout as JSON; on failure or past CHILD_DEADLINE_S (run() kills the child), the
    output so far in the error."""
    what = " ".join(command[2:6])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_DEADLINE_S, env=env)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"{what}: no answer in {CHILD_DEADLINE_S} s; output so far:\n"
                         f"{exc.stdout or ''}{exc.stderr or ''}") from None
    if done.returncode != 0:
        raise SystemExit(f"{what} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])
