"""`hivekeeper app`: open the desktop app; without a display (or before the GUI is installed) say so and show the plan."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL_ID,
                        help="model to plan for when no display is available (default: the built-in model)")


def _has_display() -> bool:
    if sys.platform in ("win32", "darwin"):
        return True
    if os.environ.get("QT_QPA_PLATFORM") in ("offscreen", "minimal"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def run(args: argparse.Namespace) -> int:
    gui_ready = importlib.util.find_spec("PySide6") is not None and importlib.util.find_spec("hivekeeper.gui.app") is not None
    if gui_ready and _has_display():
        from hivekeeper.gui.app import main as gui_main

        return gui_main([])
    if not gui_ready:
        print("The desktop app is not available in this install; here is the plan for this machine instead.")
    else:
        print("No display found (DISPLAY / WAYLAND_DISPLAY unset): the desktop app needs one. "
              "Everything it does is also in the CLI: `hivekeeper plan`, `chat`, `serve`, `swarm status`. "
              "Here is the plan for this machine:")
    from hivekeeper.core.cli import main as cli

    return cli.main(["plan", "--model", args.model, "--hardware", "auto"])
