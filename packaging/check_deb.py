"""Check a .deb made by packaging/deb/build_deb.sh, without a chroot and without touching the system: install it with
`dpkg --root` into a scratch root (its maintainer scripts run too, chroot-less, on that root), compare what it
installed with the bundle it was built from, then remove it.

Checked: the control fields (package, pyproject's version, this machine's architecture); the maintainer scripts parse
(`sh -n`) and run on install and removal; /opt/hivekeeper holds exactly the bundle's files, byte for byte;
/usr/bin/hivekeeper points into it; the menu entry, icons, metainfo and node service are in /usr/share and
/usr/lib/systemd/user, and no autostart entry (starting a node at login is each user's choice); the installed desktop
entry and metainfo pass desktop-file-validate and appstreamcli when they are installed; removal leaves none of the
package's files. With --run, packaging/check_bundle.py then runs the installed copy (plan, generate, first paint...).

    python3 packaging/check_deb.py dist/hivekeeper_0.1.0_amd64.deb dist/hivekeeper [--run]
Prints one line per problem and exits 1 if there is any; 2 when dpkg is missing or an argument is not there.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from hivekeeper.core.version import APP_ID

ROOT = Path(__file__).resolve().parents[1]
DESKTOP = f"usr/share/applications/{APP_ID}.desktop"
METAINFO = f"usr/share/metainfo/{APP_ID}.metainfo.xml"
INSTALLED = [DESKTOP, METAINFO, "usr/share/icons/hicolor/scalable/apps/hivekeeper.svg",
             "usr/share/icons/hicolor/48x48/apps/hivekeeper.png", "usr/lib/systemd/user/hivekeeper-node.service"]
STEP_TIMEOUT_S = 600  # dpkg unpacking a GB-sized package on a busy machine
BUNDLE_CHECK_TIMEOUT_S = 1800  # check_bundle.py's six steps, each limited to 300 s by check_bundle itself


def run(words: list[str], timeout_s: float = STEP_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a command; past its time limit it is killed and this script stops, showing its output so far."""
    try:
        return subprocess.run(words, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"check_deb: {' '.join(words)} ran over {timeout_s} s; output so far:\n"
                         f"{exc.stdout or ''}{exc.stderr or ''}") from None


def dpkg(root: Path, *words: str) -> subprocess.CompletedProcess:
    """dpkg on a scratch root: maintainer scripts run without a chroot (DPKG_ROOT set), as a normal user too."""
    return run(["dpkg", f"--root={root}", "--force-script-chrootless", "--force-depends", "--force-not-root",
                "--log=/dev/null", *words])


def scratch_root(root: Path) -> Path:
    """The few files dpkg needs to treat a folder as a system's root."""
    (root / "var/lib/dpkg/updates").mkdir(parents=True)
    (root / "var/lib/dpkg/info").mkdir()
    (root / "var/lib/dpkg/status").touch()
    return root


def field_problems(deb: Path) -> list[str]:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    arch = run(["dpkg", "--print-architecture"]).stdout.strip()
    wanted = {"Package": "hivekeeper", "Version": version, "Architecture": arch}
    problems = []
    for name, value in wanted.items():
        found = run(["dpkg-deb", "-f", str(deb), name]).stdout.strip()
        if found != value:
            problems.append(f"control field {name} is {found!r}, not {value!r}")
    with tempfile.TemporaryDirectory(prefix="hivekeeper-deb-control-") as control:
        run(["dpkg-deb", "--control", str(deb), control])
        for script in ("postinst", "postrm"):
            path = Path(control) / script
            if not os.access(path, os.X_OK):
                problems.append(f"maintainer script {script} is missing or not executable")
            elif (done := run(["sh", "-n", str(path)])).returncode != 0:
                problems.append(f"maintainer script {script} does not parse: {done.stderr.strip()}")
    return problems


def bundle_differences(bundle: Path, installed: Path) -> list[str]:
    """Every path that is in one tree and not the other, or whose bytes or link target differ."""
    def listing(top: Path) -> set[str]:
        return {str(path.relative_to(top)) for path in top.rglob("*") if not path.is_dir() or path.is_symlink()}

    ours, theirs = listing(bundle), listing(installed)
    problems = [f"in the bundle, not installed: {name}" for name in sorted(ours - theirs)]
    problems += [f"installed, not in the bundle: {name}" for name in sorted(theirs - ours)]
    for name in sorted(ours & theirs):
        a, b = bundle / name, installed / name
        if a.is_symlink() or b.is_symlink():
            same = a.is_symlink() and b.is_symlink() and os.readlink(a) == os.readlink(b)
        else:
            same = filecmp.cmp(a, b, shallow=False)
        if not same:
            problems.append(f"installed file differs from the bundle's: {name}")
    return problems


def layout_problems(root: Path) -> list[str]:
    problems = [f"not installed: /{name}" for name in INSTALLED if not (root / name).is_file()]
    link = root / "usr/bin/hivekeeper"
    if not link.is_symlink() or os.readlink(link) != "/opt/hivekeeper/hivekeeper":
        problems.append("/usr/bin/hivekeeper is not a link to /opt/hivekeeper/hivekeeper")
    if shutil.which("update-desktop-database") and not (root / "usr/share/applications/mimeinfo.cache").is_file():
        problems.append("postinst did not refresh the menu's cache in the scratch root (DPKG_ROOT)")
    if (root / "etc/xdg/autostart").exists():
        problems.append("an autostart entry is installed system-wide")
    validators = {DESKTOP: ["desktop-file-validate"], METAINFO: ["appstreamcli", "validate", "--no-net"]}
    for name, words in validators.items():
        if (root / name).is_file() and shutil.which(words[0]):
            done = run([*words, str(root / name)])
            if done.returncode != 0:
                problems.append(f"{words[0]} rejects /{name}: {(done.stdout + done.stderr).strip()}")
        elif not shutil.which(words[0]):
            print(f"check_deb: {words[0]} not installed: /{name} not validated", file=sys.stderr)
    return problems


def deb_problems(deb: Path, bundle: Path, run_bundle: bool) -> list[str]:
    problems = field_problems(deb)
    with tempfile.TemporaryDirectory(prefix="hivekeeper-deb-root-") as scratch:
        root = scratch_root(Path(scratch))
        done = dpkg(root, "-i", str(deb))
        if done.returncode != 0:
            return problems + [f"dpkg -i failed: {(done.stdout + done.stderr).strip()[-2000:]}"]
        problems += bundle_differences(bundle, root / "opt/hivekeeper") + layout_problems(root)
        if run_bundle and not problems:
            checked = run([sys.executable, str(ROOT / "packaging/check_bundle.py"), str(root / "opt/hivekeeper")],
                          BUNDLE_CHECK_TIMEOUT_S)
            sys.stderr.write(checked.stderr)
            problems += [f"installed bundle: {line}" for line in checked.stdout.splitlines()]
        done = dpkg(root, "-r", "hivekeeper")
        if done.returncode != 0:
            return problems + [f"dpkg -r failed: {(done.stdout + done.stderr).strip()[-2000:]}"]
        left = [name for name in ["opt/hivekeeper/hivekeeper", "usr/bin/hivekeeper", *INSTALLED]
                if (root / name).exists() or (root / name).is_symlink()]
        problems += [f"left after dpkg -r: /{name}" for name in left]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("deb", type=Path)
    parser.add_argument("bundle", type=Path, help="the bundle folder the .deb was built from")
    parser.add_argument("--run", action="store_true", help="also run packaging/check_bundle.py on the installed copy")
    args = parser.parse_args()
    missing = [tool for tool in ("dpkg", "dpkg-deb") if not shutil.which(tool)]
    if missing:
        print(f"check_deb: {' and '.join(missing)} not installed (a Debian-family tool)", file=sys.stderr)
        return 2
    for path in (args.deb, args.bundle):
        if not path.exists():
            print(f"check_deb: {path}: not there", file=sys.stderr)
            return 2
    problems = deb_problems(args.deb, args.bundle, args.run)
    for problem in problems:
        print(problem)
    print(f"{args.deb.name}: {'ok' if not problems else f'{len(problems)} problem(s)'}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
