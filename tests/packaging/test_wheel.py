"""The wheel and sdist `make package` builds: the wheel holds every module, the native kernel source, the planner's
data and the desktop files, and no tests; the checker catches a wheel that lacks one of them.

Installing the wheel into a fresh venv and running it (packaging/check_wheel.py --install) takes about half a minute
of torch imports, so `make package` runs that, not the suite.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, str(ROOT / "packaging/build_dists.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    paths = [Path(line) for line in done.stdout.splitlines()]
    return {"wheel": next(p for p in paths if p.suffix == ".whl"), "sdist": next(p for p in paths if p.suffix == ".gz")}


def check(wheel: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "packaging/check_wheel.py"), str(wheel)], capture_output=True,
                          text=True, timeout=120)


def test_the_wheel_holds_the_app_and_no_tests(dists):
    done = check(dists["wheel"])
    assert done.returncode == 0, done.stdout + done.stderr
    listing = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(dists["wheel"])], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    for shipped in ("hivekeeper/core/runtime/kernels/native/decode_kernels.c", "hivekeeper/planner/data/hardware.json",
                    "hivekeeper/desktop/io.github.hivekeeper.Hivekeeper.desktop",
                    "hivekeeper/desktop/icons/hivekeeper-48.png", "hivekeeper/core/cli/install_desktop.py"):
        assert shipped in listing
    assert "tests/" not in listing and "conftest" not in listing
    assert dists["sdist"].stat().st_size > 0


def test_the_checker_names_what_a_wheel_lacks(dists, tmp_path):
    lacking = tmp_path / dists["wheel"].name
    dropped = {"hivekeeper/core/runtime/kernels/native/decode_kernels.c", "hivekeeper/planner/data/hardware.json"}
    with zipfile.ZipFile(dists["wheel"]) as source, zipfile.ZipFile(lacking, "w") as target:
        for item in source.infolist():
            if item.filename not in dropped:
                target.writestr(item, source.read(item))
        target.writestr("tests/test_x.py", "")
    done = check(lacking)
    assert done.returncode == 1
    for name in dropped:
        assert f"missing from the wheel: {name}" in done.stdout
    assert "a test in the wheel: tests/test_x.py" in done.stdout
