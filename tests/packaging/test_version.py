"""`hivekeeper --version`: pyproject.toml's version, read back from the installed package's metadata (the one
definition), with the versions of Python, torch and hivemind installed; no module of the app repeats the version."""

from __future__ import annotations

import platform
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_prints_pyprojects_version_and_what_it_runs_on():
    done = subprocess.run([sys.executable, "-m", "hivekeeper.core.cli.main", "--version"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (f"hivekeeper {pyproject_version()} (Python {platform.python_version()}, "
                           f"torch {metadata.version('torch')}, hivemind {metadata.version('hivemind')})\n")


def test_no_module_repeats_the_version():
    version = pyproject_version()
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "planner", "core", "gui"], capture_output=True,
                            text=True, check=True, timeout=60).stdout.split()
    repeating = [name for name in listed if name.endswith(".py")
                 and (f'"{version}"' in (ROOT / name).read_text() or "__version__ =" in (ROOT / name).read_text())]
    assert repeating == []


def test_the_metainfos_newest_release_is_pyprojects_version():
    """Software centres show the AppStream release list: a new version in pyproject.toml needs its release entry."""
    from xml.etree import ElementTree

    tree = ElementTree.parse(ROOT / "packaging" / "linux" / "io.github.hivekeeper.Hivekeeper.metainfo.xml")
    releases = [release.get("version") for release in tree.getroot().iter("release")]
    assert releases and releases[0] == pyproject_version()
