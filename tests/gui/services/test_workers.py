"""A worker's callbacks run on the GUI thread whatever they are (a lambda too: PySide calls a lambda connected to a
worker's signal on the worker thread, where touching a widget starts its timers from the wrong thread), and a
worker is started from the GUI thread only."""

from __future__ import annotations

import gc
import threading


from hivekeeper.gui.services.workers import run_in_thread


def test_lambda_callbacks_run_on_the_gui_thread_and_workers_start_there_only(qapp, qtbot):
    gui = threading.get_ident()
    seen = {}
    handle = run_in_thread(lambda report, should_stop: report(1) or threading.get_ident(),
                           on_yield=lambda value: seen.setdefault("yield", threading.get_ident()),
                           on_return=lambda worker: seen.update(worker=worker, ret=threading.get_ident()),
                           on_finish=lambda: seen.setdefault("finish", threading.get_ident()))
    qtbot.waitUntil(lambda: "finish" in seen, timeout=30_000)
    assert handle.wait(10_000)
    assert seen["worker"] != gui and seen["yield"] == seen["ret"] == seen["finish"] == gui

    # a worker started from a worker thread is refused (its QObjects and callbacks would live there)
    nested = run_in_thread(lambda report, should_stop: run_in_thread(lambda r, s: None),
                           on_error=lambda message: seen.setdefault("error", message))
    qtbot.waitUntil(lambda: "error" in seen, timeout=30_000)
    assert nested.wait(10_000) and "from the GUI thread only" in seen["error"]
    qtbot.waitUntil(gc.isenabled, timeout=10_000)  # the refused worker holds no collector (collector.py)
