"""While a window is open, cyclic garbage holding a Qt object dies on the GUI thread, never on a worker that happens
to allocate (CI, session 20: eight "QBasicTimer::start: Timers cannot be started from another thread" while the
first quick measurement's worker allocated inside torch); when the window is shut down, Python collects as before."""

from __future__ import annotations

import gc
import threading

from PySide6.QtCore import QObject, Qt

from hivekeeper.gui.services.workers import run_in_thread


def garbage_qobject(died: dict) -> None:
    """A Python-owned QObject in a reference cycle, unreachable when this returns; `died["thread"]` is set by its
    destructor, on the thread that runs it."""
    obj = QObject()
    obj.destroyed.connect(lambda: died.setdefault("thread", threading.get_ident()),
                          Qt.ConnectionType.DirectConnection)
    obj.itself = obj


def allocate(report, should_stop) -> list:
    """Far more container objects than the youngest generation's threshold, kept (the counts stay past it until the
    GUI thread looks): an automatic collection would run here, on the worker."""
    return [[] for _ in range(200_000)]


def test_a_cycle_with_a_qt_object_dies_on_the_gui_thread_while_a_worker_allocates(make_window, qtbot):
    window = make_window()
    assert not gc.isenabled()  # off while the window is open
    gui, died, done = threading.get_ident(), {}, {}
    garbage_qobject(died)
    run_in_thread(allocate, on_return=lambda n: done.setdefault("n", n),
                  on_finish=lambda: done.setdefault("finished", True))
    # until the worker has finished (its relay holds the collector till then; its return comes before: CI, session
    # 21, shut the window down between the two and found collection still off)
    qtbot.waitUntil(lambda: "finished" in done and "thread" in died, timeout=30_000)
    assert died["thread"] == gui and window.collector.collections >= 1 and done["n"]

    window.shutdown()
    assert gc.isenabled()  # given back as it was
    window.collector.stop()  # idempotent: a second stop leaves it on
    assert gc.isenabled()


def test_two_windows_hold_it_off_until_both_are_shut_down(make_window):
    first, second = make_window(), make_window()
    first.shutdown()
    assert not gc.isenabled()
    second.shutdown()
    assert gc.isenabled()


def test_a_full_collection_waits_until_the_oldest_generation_grew_a_quarter(make_window):
    """CPython's brake, kept: a full collection (0.1-0.5 s with torch loaded) only once the younger collections
    moved a quarter more objects into the oldest generation than the last full one kept; a younger one till then."""
    collector = make_window().collector
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        def due_now():  # the oldest generation's count past its threshold, the youngest's too
            gc.collect(1)
            gc.collect(1)
            garbage = [[] for _ in range(10)]  # noqa: F841 - allocated: the youngest count passes 1

        def collections():
            return [stats["collections"] for stats in gc.get_stats()]

        kept = [[] for _ in range(len(gc.get_objects(2)) // 4 + 1000)]  # a quarter more, long-lived
        due_now()  # moves them into the oldest generation
        before = collections()
        collector.collect_if_due()
        assert collections()[2] == before[2] + 1 and kept

        due_now()  # right after that full one: a few objects more
        before = collections()
        collector.collect_if_due()
        after = collections()
        assert after[2] == before[2] and after[1] == before[1] + 1  # braked: the younger generation only
    finally:
        gc.set_threshold(*thresholds)


def test_without_a_window_a_running_worker_holds_it_off_too(qapp, qtbot):
    assert gc.isenabled()
    gui, died, done = threading.get_ident(), {}, {}
    garbage_qobject(died)
    handle = run_in_thread(allocate, on_return=lambda n: done.setdefault("n", n))
    assert not gc.isenabled()
    qtbot.waitUntil(lambda: "n" in done and "thread" in died, timeout=30_000)
    assert died["thread"] == gui
    qtbot.waitUntil(gc.isenabled, timeout=10_000)  # given back once the worker has finished
    assert handle.wait(10_000)
