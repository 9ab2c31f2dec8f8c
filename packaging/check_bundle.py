"""Check a frozen bundle (dist/hivekeeper/ from packaging/pyinstaller.spec) runs on its own, away from the checkout.

Runs the bundle's `hivekeeper`: `--version` (pyproject.toml's version), `plan --json`, `install-desktop` (into
scratch XDG folders), `demo-model` and a short `generate`, then opens the app offscreen through the bundle's own
Python (`-c`, packaging/pyinstaller_entry.py), waits for the main window's first paint, grabs it, opens the About
box (every version read from the bundle's package metadata) and quits. Prints the bundle's size, one line per
problem, and exits 1 if there is any. Each step is killed past its time limit and its output so far shown.

    python3 packaging/check_bundle.py dist/hivekeeper
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from hivekeeper.core.version import APP_ID

ROOT = Path(__file__).resolve().parents[1]

STEP_TIMEOUT_S = 300
FIRST_PAINT = """
import sys
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QLabel
app = QApplication(["hivekeeper"])
def painted():
    window = next(w for w in app.topLevelWidgets() if w.isVisible() and hasattr(w, "quit_everything"))
    image = window.grab().toImage()
    print("PAINTED", image.width(), image.height(), flush=True)
    window.show_about()
    print("ABOUT", window.about_box.findChild(QLabel, "versions").text(), flush=True)
    print("DESKTOP FILE", app.desktopFileName(), flush=True)
    window.quit_everything()
QTimer.singleShot(5000, painted)
from hivekeeper.gui.app import main
sys.exit(main([]))
"""


def expected_version() -> str:
    """pyproject.toml's version, in the checkout this script is in: the one the bundle was built from."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def run_step(words: list[str], cwd: Path, env: dict) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); a step past STEP_TIMEOUT_S is killed: exit 124 and its output so far."""
    try:
        done = subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        so_far = lambda out: out.decode(errors="replace") if isinstance(out, bytes) else (out or "")  # noqa: E731
        return 124, so_far(exc.stdout), f"killed after {STEP_TIMEOUT_S} s; stderr so far: {so_far(exc.stderr)}"
    return done.returncode, done.stdout, done.stderr


def first_paint_problems(output: str, errors: str) -> list[str]:
    """The window painted, the About box lists every version, and the app has its desktop entry's id."""
    about = next((line for line in output.splitlines() if line.startswith("ABOUT ")), "")
    if "PAINTED" not in output:
        return [f"first paint: the window was not grabbed: {(output + errors).strip()[-3000:]}"]
    problems = []
    if "not installed" in about or "PySide6" not in about:
        problems.append(f"first paint: the About box lacks versions: {about}")
    if f"DESKTOP FILE {APP_ID}" not in output:
        problems.append(f"first paint: the app is not named {APP_ID} for the desktop: {output.strip()[-500:]}")
    return problems


def bundle_problems(bundle: Path) -> list[str]:
    exe = str((bundle / "hivekeeper").resolve())
    with tempfile.TemporaryDirectory(prefix="hivekeeper-bundle-") as scratch:
        work = Path(scratch)
        env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "HF_HUB_OFFLINE": "1",
               "XDG_DATA_HOME": str(work / "xdg-data"), "XDG_CONFIG_HOME": str(work / "xdg-config"),
               "HIVEKEEPER_CONFIG_DIR": str(work / "config"), "HIVEKEEPER_DATA_DIR": str(work / "data")}
        env.pop("PYTHONPATH", None)
        steps = {"--version": [exe, "--version"],
                 "plan": [exe, "plan", "--model", "meta-llama/Llama-2-7b-hf", "--json"],
                 "install-desktop": [exe, "install-desktop"],
                 "demo-model": [exe, "demo-model", str(work / "demo")],
                 # the swarm's modules (serve, chat --swarm): hivemind compiles TorchScript at import
                 "swarm import": [exe, "-c", "import hivemind, hivekeeper.core.swarm.server.server"],
                 "generate": [exe, "generate", "--model", str(work / "demo"), "--prompt", "Hello",
                              "--max-new-tokens", "4", "--json"],
                 "first paint": [exe, "-c", FIRST_PAINT]}
        problems = []
        for name, words in steps.items():
            code, output, errors = run_step(words, work, env)
            print(f"{name}: exit {code}", file=sys.stderr)
            if code != 0:
                problems.append(f"{name}: exit {code}: {(output + errors).strip()[-3000:]}")
            elif name == "--version" and (not output.startswith(f"hivekeeper {expected_version()} (")
                                          or "not installed" in output):
                problems.append(f"--version says {output.strip()!r}, not pyproject.toml's {expected_version()} "
                                "and the versions of torch and hivemind (their metadata missing from the bundle?)")
            elif name == "plan":
                json.loads(output)  # the plan is one JSON document
            elif name == "first paint":
                problems += first_paint_problems(output, errors)
        return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    bundle = parser.parse_args().bundle
    if not (bundle / "hivekeeper").is_file():
        print(f"check_bundle: {bundle}/hivekeeper: no bundle there (packaging/README.md)", file=sys.stderr)
        return 2
    size = sum(path.stat().st_size for path in bundle.rglob("*") if path.is_file() and not path.is_symlink())
    print(f"bundle size: {size / 2**20:.0f} MiB", file=sys.stderr)
    problems = bundle_problems(bundle)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
