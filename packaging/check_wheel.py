"""Check that a built wheel holds the whole app and nothing of the tests, and (with --install) that it runs alone.

The file list is compared with the source tree the wheel was built from: every module of planner/, core/ and gui/
(a new subpackage missing from pyproject's `packages` shows here), the native kernels' C source, the planner's data
(hardware and model catalogs), the desktop files of packaging/linux, the `hivekeeper` entry point, and no tests.

--install puts the wheel into a fresh virtualenv (its dependencies come from the project venv through a .pth file:
torch cannot be downloaded here) and runs `--version` (the wheel's version), `plan --json`, `install-desktop` (into scratch XDG folders; it must use
the wheel's desktop files), `demo-model` and `generate` from it, outside the checkout.

    python packaging/check_wheel.py dist/hivekeeper-0.1.0-py3-none-any.whl [--source .] [--install]
Prints one line per problem and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> where its files go in the wheel (pyproject.toml, [tool.setuptools.package-dir])
WHEEL_FOLDERS = {"planner": "hivekeeper/planner", "core": "hivekeeper/core", "gui": "hivekeeper/gui",
                 "packaging/linux": "hivekeeper/desktop"}
SHIPPED_SUFFIXES = {".py", ".c", ".json", ".desktop", ".xml", ".service", ".svg", ".png"}
ENTRY_POINT = "hivekeeper = hivekeeper.core.cli.main:main"
STEP_TIMEOUT_S = 600  # one smoke step (pip install, generate) at most; killed and its output shown past it


def expected_files(source: Path) -> set[str]:
    """The wheel paths of every file git tracks in `source` that must ship (untracked work in progress is not
    built by packaging/build_dists.py, so it is not expected either)."""
    listed = subprocess.run(["git", "-C", str(source), "ls-files", "-z", *WHEEL_FOLDERS], capture_output=True,
                            check=True, timeout=60)
    expected = set()
    for name in filter(None, listed.stdout.decode().split("\0")):
        folder = next(folder for folder in WHEEL_FOLDERS if name.startswith(folder + "/"))
        if Path(name).suffix in SHIPPED_SUFFIXES:
            expected.add(WHEEL_FOLDERS[folder] + name[len(folder):])
    return expected


def file_list_problems(wheel: Path, source: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next((archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")),
                            "")
    problems = [f"missing from the wheel: {name}" for name in sorted(expected_files(source) - names)]
    problems += [f"a test in the wheel: {name}" for name in sorted(names)
                 if name.startswith("tests/") or "/tests/" in name or Path(name).name.startswith("conftest")]
    if ENTRY_POINT not in entry_points:
        problems.append(f"the wheel's entry_points.txt lacks the console script '{ENTRY_POINT}'")
    if not any(name.endswith(".c") for name in names):
        problems.append("the wheel holds no native kernel C source")
    return problems


def run_step(words: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"check_wheel: {' '.join(words)} ran over {STEP_TIMEOUT_S} s; output so far:\n"
                         f"{exc.stdout or ''}{exc.stderr or ''}") from None


def wheel_version(wheel: Path) -> str:
    """The version in a wheel's file name (name-version-python-abi-platform.whl)."""
    return wheel.name.split("-")[1]


def install_problems(wheel: Path) -> list[str]:
    """Install `wheel` into a fresh venv (dependencies through a .pth) and run the CLI from it."""
    with tempfile.TemporaryDirectory(prefix="hivekeeper-wheel-") as scratch:
        scratch = Path(scratch)
        venv, work = scratch / "venv", scratch / "work"
        work.mkdir()
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
        # the project venv's packages, but not its editable hivekeeper: a .pth-added folder's .pth files are not run
        (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(XDG_DATA_HOME=str(scratch / "xdg-data"), XDG_CONFIG_HOME=str(scratch / "xdg-config"))
        bin_dir = venv / "bin"
        steps = [[sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "--quiet",
                  "--no-deps", "--no-index", str(wheel.resolve())],
                 [str(bin_dir / "python"), "-c", "import hivekeeper.core, sys; print(hivekeeper.core.__file__)"],
                 [str(bin_dir / "hivekeeper"), "--version"],
                 [str(bin_dir / "hivekeeper"), "plan", "--model", "meta-llama/Llama-2-7b-hf", "--json"],
                 [str(bin_dir / "hivekeeper"), "install-desktop"],  # its files from the wheel's hivekeeper.desktop
                 [str(bin_dir / "hivekeeper"), "demo-model", str(work / "demo")],
                 [str(bin_dir / "hivekeeper"), "generate", "--model", str(work / "demo"), "--prompt", "Hello",
                  "--max-new-tokens", "4", "--json"]]
        problems = []
        for words in steps:
            done = run_step(words, work, env)
            if done.returncode != 0:
                problems.append(f"{' '.join(words[:3])} ... exited {done.returncode}: {done.stderr.strip()[-2000:]}")
                break
            if words[-1].endswith("__file__)") and not done.stdout.startswith(str(venv)):
                problems.append(f"hivekeeper was imported from {done.stdout.strip()}, not from the fresh venv")
            if words[1] == "--version" and not done.stdout.startswith(f"hivekeeper {wheel_version(wheel)} ("):
                problems.append(f"--version says {done.stdout.strip()!r}, the wheel is {wheel_version(wheel)}")
            if words[1] == "plan":
                json.loads(done.stdout)  # the plan is a JSON document
            if words[1] == "install-desktop" and str(venv) not in done.stdout:
                problems.append(f"install-desktop did not use the wheel's desktop files: {done.stdout.strip()}")
        return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--source", type=Path, default=ROOT, help="the tree the wheel was built from")
    parser.add_argument("--install", action="store_true", help="also install it into a fresh venv and run it")
    args = parser.parse_args()
    problems = file_list_problems(args.wheel, args.source)
    if not problems and args.install:
        problems = install_problems(args.wheel)
    for problem in problems:
        print(problem)
    print(f"{args.wheel.name}: {'ok' if not problems else f'{len(problems)} problem(s)'}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
