"""Issue 14 (session 11): the first chat reply after an install waited 9-18 s for the C compiler, silently. Opening
the Chat page now compiles the CPU decode kernels on a worker and says so on the page, so the first reply starts
without that wait. The real window, an empty kernel cache, the portable build (the quickest to compile)."""

from __future__ import annotations

import pytest

from hivekeeper.core.runtime.kernels import native_kernels

pytestmark = pytest.mark.slow


def test_opening_the_chat_page_compiles_the_kernels_and_says_so(tmp_path, monkeypatch, qapp, qtbot, config_dir):
    from hivekeeper.gui.app import open_window

    monkeypatch.setenv(native_kernels.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setenv(native_kernels.VARIANT_ENV, "portable")
    native_kernels.forget()
    window = open_window(qapp)
    qtbot.addWidget(window)
    try:
        said = []
        window.chat.kernels.connect(said.append)
        window.show_page("Chat")
        status = window.chat_page.status_label
        qtbot.waitUntil(lambda: status.text() == native_kernels.COMPILING, timeout=30_000)
        assert not list((tmp_path / "kernels").glob("decode_kernels-*.so"))  # said before the build was done
        qtbot.waitUntil(lambda: "compiled in" in status.text(), timeout=180_000)
        assert said[0] == native_kernels.COMPILING and said[-1].startswith("CPU decode kernels compiled in ")
        assert list((tmp_path / "kernels").glob("decode_kernels-portable-*.so"))
        assert native_kernels.status().startswith("on (") and not native_kernels.needs_build()
        window.show_page("Plan")
        window.show_page("Chat")  # once per run: shown again, nothing more to do or say
        qtbot.wait(200)
        assert len(said) == 2
    finally:
        window.quit_everything()
        native_kernels.forget()  # the next library() call decides again with the restored environment
