"""Build the wheel and the sdist from the files git tracks, as a clean clone would, offline.

`make package` runs this. The tracked files of the working tree are copied into a scratch folder (so neither the
checkout's build/ and egg-info nor anyone's untracked files get in), and setuptools' own PEP 517 backend builds both
there with the project venv's setuptools (no isolated build env: it would need the network). Prints one path a line.

    python packaging/build_dists.py --out dist
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 300  # a build takes seconds; a hung one is killed and its output shown


def copy_tracked_files(root: Path, dest: Path) -> None:
    """The files git tracks in `root` (as they are in the working tree; deleted ones skipped), copied into `dest`."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True, timeout=60)
    for name in listed.stdout.decode().split("\0"):
        source = root / name
        if name and source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def build(source: Path, out: Path) -> list[Path]:
    """The wheel and sdist of the project in `source`, written into `out` (one process each: setuptools' commands
    keep options between calls, and an sdist built after a wheel in one process lands in the wheel's folder)."""
    out.mkdir(parents=True, exist_ok=True)
    return [build_one(source, out.resolve(), hook) for hook in ("build_wheel", "build_sdist")]


def build_one(source: Path, out: Path, hook: str) -> Path:
    code = f"import sys; from setuptools import build_meta; print('BUILT', build_meta.{hook}(sys.argv[1]))"
    try:
        done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"build_dists: {hook} took over {BUILD_TIMEOUT_S} s; its output so far:\n"
                         f"{exc.stdout or ''}{exc.stderr or ''}") from None
    built = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("BUILT ")]
    if done.returncode != 0 or not built or not (out / built[0]).is_file():
        raise SystemExit(f"build_dists: {hook} failed:\n{done.stdout[-5000:]}{done.stderr[-5000:]}")
    return out / built[0]


def build_dists(out: Path, root: Path = ROOT) -> list[Path]:
    with tempfile.TemporaryDirectory(prefix="hivekeeper-build-") as scratch:
        copy_tracked_files(root, Path(scratch))
        return build(Path(scratch), out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="folder for the wheel and sdist")
    for path in build_dists(parser.parse_args().out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
