"""`hivekeeper install-desktop`: put the app in this user's desktop menu, and the node service beside it.

A wheel or a checkout has no place in the desktop's menu; this command writes, for the current user only, into the
XDG folders ($XDG_DATA_HOME, default ~/.local/share; $XDG_CONFIG_HOME, default ~/.config):
  applications/io.github.hivekeeper.Hivekeeper.desktop   the menu entry (runs `hivekeeper app`)
  icons/hicolor/NxN/apps/hivekeeper.png, scalable/...svg  its icon
  metainfo/io.github.hivekeeper.Hivekeeper.metainfo.xml   the software centre's description
  systemd/user/hivekeeper-node.service                    the headless node: `hivekeeper serve --config
                                                          $XDG_CONFIG_HOME/hivekeeper/node.json`
  autostart/hivekeeper-node-autostart.desktop             with --autostart: start that service at login
The files come from packaging/linux (shipped in the wheel as hivekeeper/desktop); the command lines in them are
rewritten to this installation's `hivekeeper`. Each file is written atomically and only when it changed, so running
the command again is harmless; --uninstall removes them all and is harmless to repeat.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hivekeeper.core.atomic_file import write_bytes_atomic
from hivekeeper.core.version import APP_ID

ICON_NAME = "hivekeeper"
SERVICE = "hivekeeper-node.service"
AUTOSTART = "hivekeeper-node-autostart.desktop"
DESKTOP_SPECIAL = set(' \t\n"\'\\><~|&;$*?#()`')  # characters that make a desktop-entry Exec argument need quotes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--autostart", action="store_true",
                        help="also start the node service (hivekeeper-node) when you log in")
    parser.add_argument("--uninstall", action="store_true", help="remove everything install-desktop writes")


def data_dir() -> Path:
    """packaging/linux: hivekeeper/desktop beside hivekeeper/core in an installed wheel or a frozen bundle, else the
    checkout's folder."""
    package = Path(__file__).resolve().parents[2]
    installed = package / "desktop"
    return installed if installed.is_dir() else package / "packaging" / "linux"


def xdg_home(variable: str, default: str) -> Path:
    """An XDG base folder; the spec says to ignore a value that is not an absolute path."""
    value = os.environ.get(variable, "")
    return Path(value) if os.path.isabs(value) else Path.home() / default


def hivekeeper_command() -> list[str]:
    """The words that run this installation's `hivekeeper`, as absolute paths: the program running now when it is
    `hivekeeper` (a console script or a frozen bundle), else the console script beside this Python, else
    `python -m`."""
    script = Path(sys.argv[0])
    if script.name == "hivekeeper" and script.is_file():
        return [str(script.absolute())]
    beside = Path(sys.executable).parent / "hivekeeper"
    if beside.is_file():
        return [str(beside)]
    return [sys.executable, "-m", "hivekeeper.core.cli.main"]


def desktop_exec(words: list[str]) -> str:
    """An Exec= value (Desktop Entry spec): special words in double quotes, with " ` $ \\ escaped; % doubled."""
    def quote(word: str) -> str:
        word = word.replace("%", "%%")
        if not DESKTOP_SPECIAL.intersection(word):
            return word
        return '"' + "".join("\\" + c if c in '"`$\\' else c for c in word) + '"'
    return " ".join(quote(word) for word in words)


def systemd_exec(words: list[str]) -> str:
    """An ExecStart= value: words quoted when they hold spaces, % doubled (systemd's specifiers start with %)."""
    def quote(word: str) -> str:
        word = word.replace("%", "%%")
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"' if set(' \t"\\\'').intersection(word) \
            else word
    return " ".join(quote(word) for word in words)


def rewrite(text: str, key: str, value: str) -> str:
    """`text` with the value of each line `key=...` replaced by `value`."""
    lines = [f"{key}={value}" if line.startswith(key + "=") else line for line in text.splitlines()]
    return "\n".join(lines) + "\n"


def planned_files() -> dict[Path, bytes]:
    """Every file the menu entry, icons, metainfo and service need: installed path -> content."""
    source, data, config = data_dir(), xdg_home("XDG_DATA_HOME", ".local/share"), xdg_home("XDG_CONFIG_HOME", ".config")
    command = hivekeeper_command()
    entry = (source / f"{APP_ID}.desktop").read_text(encoding="utf-8")
    entry = rewrite(rewrite(entry, "Exec", desktop_exec([*command, "app"])), "TryExec", desktop_exec(command[:1]))
    unit = rewrite((source / SERVICE).read_text(encoding="utf-8"), "ExecStart",
                   systemd_exec([*command, "serve", "--config"]) + " %E/hivekeeper/node.json")
    files = {data / "applications" / f"{APP_ID}.desktop": entry.encode("utf-8"),
             data / "metainfo" / f"{APP_ID}.metainfo.xml": (source / f"{APP_ID}.metainfo.xml").read_bytes(),
             data / "icons/hicolor/scalable/apps" / f"{ICON_NAME}.svg": (source / "icons/hivekeeper.svg").read_bytes(),
             config / "systemd/user" / SERVICE: unit.encode("utf-8")}
    for png in sorted((source / "icons").glob("hivekeeper-*.png")):
        size = png.stem.rsplit("-", 1)[1]
        files[data / f"icons/hicolor/{size}x{size}/apps/{ICON_NAME}.png"] = png.read_bytes()
    return files


def autostart_file() -> tuple[Path, bytes]:
    config = xdg_home("XDG_CONFIG_HOME", ".config")
    return config / "autostart" / AUTOSTART, (data_dir() / AUTOSTART).read_bytes()


def install(files: dict[Path, bytes]) -> None:
    for path, content in files.items():
        if path.is_file() and path.read_bytes() == content:
            print(f"up to date  {path}")
            continue
        write_bytes_atomic(path, content, mode=0o644)
        print(f"wrote       {path}")


def uninstall(paths: list[Path]) -> None:
    for path in paths:
        if path.is_file() or path.is_symlink():
            path.unlink()
            print(f"removed     {path}")
        else:
            print(f"not there   {path}")


def run(args: argparse.Namespace) -> int:
    files = planned_files()
    autostart_path, autostart = autostart_file()
    if args.uninstall:
        uninstall([*files, autostart_path])
        return 0
    install({**files, **({autostart_path: autostart} if args.autostart else {})})
    node_config = xdg_home("XDG_CONFIG_HOME", ".config") / "hivekeeper" / "node.json"
    print(f"The node service reads its flags from {node_config} (example: {data_dir() / 'node.example.json'});\n"
          f"start it with: systemctl --user enable --now {SERVICE}")
    return 0
