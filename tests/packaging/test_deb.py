"""packaging/deb/build_deb.sh: the .deb it makes from a bundle folder installs with `dpkg --root` into a scratch root
(maintainer scripts run there too, without a chroot), holds the bundle's files unchanged, the desktop files and the
node service, and is removed cleanly.

The bundle here is a stand-in folder (a script named hivekeeper and a data file): a real frozen bundle is several GB
of torch and takes long to build (packaging/README.md), and the layout of the package does not depend on it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_DEB = ROOT / "packaging" / "deb" / "build_deb.sh"
APP_DESKTOP = "usr/share/applications/io.github.hivekeeper.Hivekeeper.desktop"

pytestmark = pytest.mark.skipif(not (shutil.which("dpkg-deb") and shutil.which("dpkg")),
                                reason="dpkg and dpkg-deb are not installed (a Debian-family tool)")


def stand_in_bundle(folder: Path) -> Path:
    (folder / "_internal").mkdir(parents=True)
    (folder / "hivekeeper").write_text('#!/bin/sh\necho "bundle ran: $*"\n')
    (folder / "hivekeeper").chmod(0o755)
    (folder / "_internal" / "data.bin").write_bytes(os.urandom(1000))
    return folder


def dpkg(root: Path, *words: str) -> subprocess.CompletedProcess:
    done = subprocess.run(["dpkg", f"--root={root}", "--force-script-chrootless", "--force-depends",
                           "--force-not-root", *words], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def scratch_root(root: Path) -> Path:
    (root / "var/lib/dpkg/updates").mkdir(parents=True)
    (root / "var/lib/dpkg/info").mkdir()
    (root / "var/lib/dpkg/status").touch()
    return root


def test_the_deb_installs_the_bundle_and_desktop_files_into_a_scratch_root(tmp_path):
    bundle = stand_in_bundle(tmp_path / "bundle")
    built = subprocess.run([str(BUILD_DEB), str(bundle), str(tmp_path / "out")], capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    deb = Path(built.stdout.strip())
    fields = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version"], capture_output=True, text=True,
                            timeout=60, check=True).stdout
    version_line = next(line for line in (ROOT / "pyproject.toml").read_text().splitlines()
                        if line.startswith("version = "))
    version = version_line.split("=", 1)[1].strip().strip('"')
    assert "Package: hivekeeper" in fields and f"Version: {version}" in fields

    root = scratch_root(tmp_path / "root")
    dpkg(root, "-i", str(deb))
    for path in bundle.rglob("*"):
        if path.is_file():
            assert (root / "opt/hivekeeper" / path.relative_to(bundle)).read_bytes() == path.read_bytes()
    assert os.readlink(root / "usr/bin/hivekeeper") == "/opt/hivekeeper/hivekeeper"
    assert "Exec=hivekeeper app" in (root / APP_DESKTOP).read_text()
    assert (root / "usr/share/icons/hicolor/48x48/apps/hivekeeper.png").is_file()
    assert "ExecStart=/usr/bin/hivekeeper serve --config" in (
        root / "usr/lib/systemd/user/hivekeeper-node.service").read_text()
    assert not (root / "etc/xdg/autostart").exists()  # starting a node at login is each user's choice
    if shutil.which("desktop-file-validate"):
        done = subprocess.run(["desktop-file-validate", str(root / APP_DESKTOP)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stdout

    dpkg(root, "-r", "hivekeeper")
    assert not (root / "opt/hivekeeper/hivekeeper").exists() and not (root / APP_DESKTOP).exists()


def test_a_missing_bundle_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([str(BUILD_DEB), str(tmp_path / "nothing"), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "nothing/hivekeeper" in done.stderr
    assert not (tmp_path / "out").exists()
