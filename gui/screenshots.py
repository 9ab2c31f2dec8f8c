"""`python -m hivekeeper.gui.screenshots [--out docs/screenshots]`: a PNG of every page at 1280×800, with real data.

It starts a loopback swarm of two `hivekeeper serve` processes serving the built-in model (smollm2-135m-instruct,
blocks 0:12 and 8:22), opens the app (offscreen, on temporary config and data folders: your settings are not touched),
detects and measures this machine (the Measure button, with HIVEKEEPER_MEASURE_SIZES=quick unless set otherwise),
joins the swarm as the Join button does (the node fills blocks 22:30, and measures its speed in this run rather
than take the one an earlier `serve` cached in the user's cache folder; the new one replaces it there), chats through
the swarm so the node serves real requests, lets the monitor run, opens the Models page (which lists the library when
first shown), then saves a PNG of every page (PAGE_FILES). Everything it started is stopped before it exits. Takes a
few minutes on a small machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

PAGE_FILES = {"Hardware": "hardware.png", "Plan": "plan.png", "Swarm": "swarm.png", "Chat": "chat.png",
              "Monitor": "monitor.png", "Models": "models.png", "Settings": "settings.png"}
QUESTIONS = ("What is the capital of France? Answer in one sentence.", "Name one famous museum there.")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hivekeeper.gui.screenshots",
                                     description="Save a 1280x800 PNG of each page of the app, with a loopback swarm of the built-in model.")
    parser.add_argument("--out", default="docs/screenshots", help="folder for the PNGs (default docs/screenshots)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from hivekeeper.gui.services.measure import SIZES_ENV

    os.environ.setdefault(SIZES_ENV, "quick")  # the Measure button's `hivekeeper measure --quick` sizes
    with tempfile.TemporaryDirectory(prefix="hivekeeper-shots-") as tmp:
        os.environ["HIVEKEEPER_CONFIG_DIR"] = str(Path(tmp) / "config")
        # and fresh data folders: the loopback servers' first, then the app's (_run), so that the Monitor's
        # contribution counts this run's node only, not the loopback servers nor earlier runs on this machine
        os.environ["HIVEKEEPER_DATA_DIR"] = str(Path(tmp) / "swarm-data")
        return _run(Path(tmp), out, args.timeout)


def _run(tmp: Path, out: Path, timeout: float) -> int:
    from PySide6.QtWidgets import QApplication

    from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID
    from hivekeeper.core.swarm.local import LocalSwarm

    from hivekeeper.gui.main_window import PAGES, MainWindow
    from hivekeeper.gui.settings import Settings, SettingsStore
    from hivekeeper.gui.style import STYLESHEET, configure_pyqtgraph

    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setStyleSheet(STYLESHEET)
    configure_pyqtgraph()

    def wait(what: str, condition, seconds: float = timeout) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"screenshots: timed out waiting for {what}")
            app.processEvents()
            time.sleep(0.02)

    def settle(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            app.processEvents()
            time.sleep(0.02)

    demo = DEFAULT_MODEL_ID
    (tmp / "logs").mkdir()
    with LocalSwarm(demo, log_dir=tmp / "logs") as swarm:
        print("starting a loopback swarm of two servers…", flush=True)
        swarm.start("--block-indices", "0:12", "--throughput", "30", "--public-name", "server-a", timeout=timeout)
        swarm.start("--block-indices", "8:22", "--throughput", "18", "--public-name", "server-b", timeout=timeout)
        os.environ["HIVEKEEPER_DATA_DIR"] = str(tmp / "data")  # the app's, and its node's

        settings = Settings()
        settings.plan.model = "meta-llama/Meta-Llama-3.1-8B-Instruct"
        settings.plan.hardware = "rtx-4090"
        settings.plan.price_per_hour = 0.7
        settings.swarm.model = str(demo)
        settings.swarm.new_swarm = False
        settings.swarm.initial_peers = swarm.initial_peers
        settings.swarm.host = "127.0.0.1"
        settings.swarm.num_blocks = 8
        settings.swarm.public_name = "this-machine"
        settings.chat.mode = "swarm"
        settings.chat.model = str(demo)
        settings.chat.max_new_tokens = 40
        settings.chat.temperature = 0.3
        window = MainWindow(SettingsStore(), settings, detect_on_start=False)
        window.ask_on_close = lambda: "stop"
        window.resize(1280, 800)
        window.show()
        try:
            window.build_all_pages()
            print("detecting and measuring this machine…", flush=True)
            window.hardware_page.start_detection()
            wait("hardware detection", lambda: not window.detect.running and window.hardware_page.spec is not None)
            window.hardware_page.measure_button.click()  # as a user does, with the app's quick sizes
            hardware = window.hardware_page
            wait("the measurements", lambda: not window.measure.running and (
                hardware.machine.measured_at or "failed" in hardware.profile_label.text()))
            if not hardware.machine.measured_at:
                raise RuntimeError(f"screenshots: {hardware.profile_label.text()}")

            print("joining the swarm…", flush=True)
            window.show_page("Swarm")
            page = window.swarm_page
            launch = page.launch()  # what Join starts, and the node measures its speed now (`--throughput eval`):
            # it advertised a speed cached in the user's cache folder by an earlier, busier serve on this machine
            window.node.start(replace(launch, extra_args=(*launch.extra_args, "--throughput", "eval")))
            wait("the node to come online", lambda: window.node.state == "online")
            wait("the coverage chart", lambda: page.coverage_data is not None and page.coverage_data[2].any())
            page.find_button.click()  # the swarm's models list, read while the chat runs (not waited for)

            print("chatting through the swarm…", flush=True)
            chat = window.chat_page
            for question in QUESTIONS:
                chat.input.setPlainText(question)
                chat.send()
                wait("a chat reply", lambda: not chat.replying)
                if chat.last_error:
                    raise RuntimeError(f"screenshots: chat failed: {chat.last_error}")
            window.show_page("Monitor")
            settle(8.0)  # a few node stats lines and system samples for the plots
            window.show_page("Plan")
            plan = window.plan_page
            wait("the plan's charts", lambda: plan.result is not None and plan.charts is not None)

            window.show_page("Models")  # as a user opens it: the page lists the library the first time it is shown
            models = window.models_page
            wait("the model list", lambda: "model(s)" in models.status.text())

            for name in PAGES:
                window.show_page(name)
                settle(1.0)
                path = out / PAGE_FILES[name]
                if not window.grab().save(str(path)):
                    raise OSError(f"cannot write {path}")
                print(f"wrote {path}", flush=True)
        finally:
            window.shutdown()
            window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
