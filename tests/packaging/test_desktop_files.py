"""packaging/linux and `hivekeeper install-desktop`: the desktop files pass the freedesktop validators, and the real
command installs and uninstalls them in XDG folders idempotently; the node service's config file is read by serve.

The validators are Debian's desktop-file-utils and appstream (.ci/run installs them where it can); without them the
validation tests skip and say so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hivekeeper.core.cli.serve import add_arguments
from hivekeeper.core.cli.serve_config import apply_config, read_config
from hivekeeper.planner.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "packaging" / "linux"
APP_DESKTOP = "io.github.hivekeeper.Hivekeeper.desktop"
HIVEKEEPER = Path(sys.executable).parent / "hivekeeper"


def validator(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian: apt-get install desktop-file-utils appstream)")
    return path


def check_desktop_file(path: Path) -> None:
    done = subprocess.run([validator("desktop-file-validate"), str(path)], capture_output=True, text=True, timeout=60)
    # hints are advice; errors and warnings fail
    problems = [line for line in done.stdout.splitlines() if ": error:" in line or ": warning:" in line]
    assert done.returncode == 0 and not problems, done.stdout + done.stderr


def check_metainfo(path: Path) -> None:
    done = subprocess.run([validator("appstreamcli"), "validate", "--no-net", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", [APP_DESKTOP, "hivekeeper-node-autostart.desktop"])
def test_desktop_entries_validate(name):
    check_desktop_file(LINUX / name)


def test_metainfo_validates_and_names_the_desktop_entry():
    check_metainfo(LINUX / "io.github.hivekeeper.Hivekeeper.metainfo.xml")
    assert f">{APP_DESKTOP}</launchable>" in (LINUX / "io.github.hivekeeper.Hivekeeper.metainfo.xml").read_text()


def test_icon_pngs_are_the_sizes_their_names_say():
    pngs = sorted((LINUX / "icons").glob("hivekeeper-*.png"))
    assert {png.stem.rsplit("-", 1)[1] for png in pngs} >= {"16", "32", "48", "64", "128", "256"}
    for png in pngs:
        head = png.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n", png
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        assert width == height == int(png.stem.rsplit("-", 1)[1]), png


def install_desktop(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    done = subprocess.run([str(HIVEKEEPER), "install-desktop", *flags], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def installed_files(tmp_path: Path) -> set[str]:
    return {str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file()}


def test_install_twice_then_uninstall_twice(tmp_path):
    first = install_desktop(tmp_path, "--autostart")
    files = installed_files(tmp_path)
    assert {f"data/applications/{APP_DESKTOP}", "data/icons/hicolor/48x48/apps/hivekeeper.png",
            "data/icons/hicolor/scalable/apps/hivekeeper.svg", "config/systemd/user/hivekeeper-node.service",
            "config/autostart/hivekeeper-node-autostart.desktop"} <= files
    assert "wrote" in first.stdout and not any(name.endswith(".tmp") for name in files)
    entry = (tmp_path / "data/applications" / APP_DESKTOP).read_text()
    assert f"Exec={HIVEKEEPER} app\n" in entry  # this installation's command, by absolute path
    unit = (tmp_path / "config/systemd/user/hivekeeper-node.service").read_text()
    assert f"ExecStart={HIVEKEEPER} serve --config %E/hivekeeper/node.json\n" in unit
    check_desktop_file(tmp_path / "data/applications" / APP_DESKTOP)
    check_desktop_file(tmp_path / "config/autostart/hivekeeper-node-autostart.desktop")

    second = install_desktop(tmp_path, "--autostart")
    assert "wrote" not in second.stdout and second.stdout.count("up to date") == len(files)
    assert installed_files(tmp_path) == files

    install_desktop(tmp_path, "--uninstall")
    assert installed_files(tmp_path) == set()
    again = install_desktop(tmp_path, "--uninstall")
    assert "removed" not in again.stdout and "not there" in again.stdout


def test_autostart_is_only_written_when_asked(tmp_path):
    install_desktop(tmp_path)
    assert not (tmp_path / "config/autostart").exists()
    assert (tmp_path / "config/systemd/user/hivekeeper-node.service").is_file()


def test_the_example_node_config_reads_as_serve_flags():
    args = read_config(LINUX / "node.example.json", add_arguments)
    example = json.loads((LINUX / "node.example.json").read_text())
    assert args.model == example["model"] and args.new_swarm is True and args.num_blocks == example["num-blocks"]


@pytest.mark.parametrize("doc, named", [
    ({"model": "m", "new-swarm": True, "bogus": 1}, "unknown key 'bogus'"),
    ({"model": "m", "new-swarm": "yes"}, "'new-swarm' is a switch"),
    ({"model": "m", "port": "abc"}, "--port: invalid int value"),
    ({"model": "m", "initial-peers": "/ip4/1.2.3.4/tcp/1"}, "'initial-peers' takes a non-empty list"),
    ({"model": "m", "new-swarm": True, "initial-peers": ["/ip4/1.2.3.4/tcp/1"]}, "not allowed with"),
    ([1, 2], "must be a JSON object"),
])
def test_a_bad_node_config_is_one_error_naming_file_and_key(tmp_path, doc, named):
    path = tmp_path / "node.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=str(path)) as error:
        read_config(path, add_arguments)
    assert named in str(error.value)


def test_serve_with_a_bad_config_exits_2_with_one_line(tmp_path):
    path = tmp_path / "node.json"
    path.write_text("{not json")
    done = subprocess.run([str(HIVEKEEPER), "serve", "--config", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and f"{path}: not valid JSON" in done.stderr


def test_command_line_flags_win_over_the_config_file(tmp_path):
    from hivekeeper.core.cli.main import build_parser

    path = tmp_path / "node.json"
    path.write_text(json.dumps({"model": "from-file", "new-swarm": True, "port": 4000, "max-sessions": 3}))
    args = apply_config(build_parser().parse_args(["serve", "--config", str(path), "--port", "5000"]),
                        add_arguments)
    assert (args.model, args.new_swarm, args.port, args.max_sessions) == ("from-file", True, 5000, 3)
    with pytest.raises(InputError, match="--model is required"):
        apply_config(build_parser().parse_args(["serve", "--new-swarm"]), add_arguments)


def test_exec_lines_quote_what_the_specs_ask(tmp_path):
    from hivekeeper.core.cli.install_desktop import desktop_exec, systemd_exec

    assert desktop_exec(["/opt/my apps/hivekeeper", "app"]) == '"/opt/my apps/hivekeeper" app'
    assert desktop_exec(["/home/$x/100%/hivekeeper"]) == '"/home/\\$x/100%%/hivekeeper"'
    assert systemd_exec(["/opt/my apps/hivekeeper", "serve"]) == '"/opt/my apps/hivekeeper" serve'
    assert systemd_exec(["/x/100%/hivekeeper"]) == "/x/100%%/hivekeeper"
    entry = (LINUX / APP_DESKTOP).read_text().replace("Exec=hivekeeper app",
                                                      "Exec=" + desktop_exec(["/opt/my $apps/hivekeeper", "app"]))
    (tmp_path / APP_DESKTOP).write_text(entry)
    check_desktop_file(tmp_path / APP_DESKTOP)
