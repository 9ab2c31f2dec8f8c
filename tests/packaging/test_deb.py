"""packaging/deb/build_deb.sh and packaging/check_deb.py: the .deb made from a bundle folder installs with `dpkg --root`
into a scratch root (maintainer scripts run too, without a chroot), holds the bundle's files unchanged, the desktop
files and the node service, validates, and is removed cleanly; the checker names a file that differs from the bundle.

The bundle here is a stand-in folder (a script named hivekeeper, a data file, a link): a real frozen bundle is over a
GB of torch and takes minutes to build (packaging/README.md; `make bundle` builds and checks it), and the layout of
the package does not depend on it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_DEB = ROOT / "packaging" / "deb" / "build_deb.sh"
CHECK_DEB = ROOT / "packaging" / "check_deb.py"

pytestmark = pytest.mark.skipif(not (shutil.which("dpkg-deb") and shutil.which("dpkg")),
                                reason="dpkg and dpkg-deb are not installed (a Debian-family tool)")


def stand_in_bundle(folder: Path) -> Path:
    (folder / "_internal").mkdir(parents=True)
    (folder / "hivekeeper").write_text('#!/bin/sh\necho "bundle ran: $*"\n')
    (folder / "hivekeeper").chmod(0o755)
    (folder / "_internal" / "data.bin").write_bytes(os.urandom(1000))
    (folder / "_internal" / "data.so").symlink_to("data.bin")
    return folder


def build_deb(bundle: Path, out: Path) -> Path:
    built = subprocess.run([str(BUILD_DEB), str(bundle), str(out)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    return Path(built.stdout.strip())


def check_deb(deb: Path, bundle: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK_DEB), str(deb), str(bundle)], capture_output=True, text=True,
                          timeout=300)


def test_the_deb_installs_the_bundle_and_desktop_files_into_a_scratch_root(tmp_path):
    bundle = stand_in_bundle(tmp_path / "bundle")
    deb = build_deb(bundle, tmp_path / "out")
    done = check_deb(deb, bundle)
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr
    assert f"{deb.name}: ok" in done.stderr


def test_the_checker_names_what_differs_from_the_bundle(tmp_path):
    bundle = stand_in_bundle(tmp_path / "bundle")
    deb = build_deb(bundle, tmp_path / "out")
    (bundle / "_internal" / "data.bin").write_bytes(b"changed after the build")
    (bundle / "_internal" / "new.txt").write_text("not in the package")
    done = check_deb(deb, bundle)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["in the bundle, not installed: _internal/new.txt",
                                        "installed file differs from the bundle's: _internal/data.bin"]


def test_a_missing_bundle_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([str(BUILD_DEB), str(tmp_path / "nothing"), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "nothing/hivekeeper" in done.stderr
    assert not (tmp_path / "out").exists()
