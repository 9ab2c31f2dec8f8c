"""The Models page in the window `hivekeeper app` opens: it lists what `models list` lists (the chat's model picker
too), removes a model after a confirmation, and pulls from the loopback hub (tests/core/hub_server.py) with
progress, or stops a pull on Stop leaving the partial file for the next pull to resume."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import pytest
from PySide6.QtCore import QCoreApplication
from PySide6.QtWidgets import QDialogButtonBox, QMenu

from hivekeeper.core.runtime.library import scan_library

from ...core.cli.test_models import write_gguf
from ...core.hub_server import LoopbackHub

Q8, F16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16
CHUNK = 10 * 1024 * 1024  # huggingface_hub's download chunk


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gui-hub")
    write_gguf(root / "small" / "small-Q8_0.gguf", Q8)
    write_gguf(root / "big" / "big-F16.gguf", F16, vocab=96_000)  # 12 MB: more than one chunk
    return {"org/small-GGUF": root / "small", "org/big-GGUF": root / "big"}


@pytest.fixture
def library(tmp_path, monkeypatch, repos):
    """Our models folder holding one GGUF, empty HF cache, Ollama and LM Studio folders, and the loopback hub as
    the endpoint of the pull's child process (this process stays offline)."""
    models = tmp_path / "models"
    write_gguf(models / "mine-f16.gguf", F16)
    for env, folder in (("HIVEKEEPER_MODELS_DIR", models), ("HF_HUB_CACHE", tmp_path / "hf"),
                        ("OLLAMA_MODELS", tmp_path / "ollama"), ("HIVEKEEPER_LMSTUDIO_DIRS", tmp_path / "lms")):
        monkeypatch.setenv(env, str(folder))
    with LoopbackHub(repos) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        yield models, hub


def open_models_page(window, qtbot):
    window.show_page("Models")
    page = window.models_page
    qtbot.waitUntil(lambda: bool(page.models), timeout=120_000)
    return page


def table_ids(page) -> list[str]:
    return [page.table.item(r, 0).text() for r in range(page.table.rowCount())]


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_the_page_and_the_pickers_list_the_library_and_remove_asks_first(library, app_window, qtbot):
    models, _ = library
    page = open_models_page(app_window, qtbot)
    assert table_ids(page) == [m.id for m in scan_library()]  # what `models list` shows, in its order
    row = table_ids(page).index("mine-f16.gguf")
    assert page.table.item(row, 3).text() == "F16" and page.table.item(row, 5).text() == "fits here"

    # the chat's model picker offers it, and choosing it fills the model field
    chat = app_window.chat_page
    menu = next(m for m in chat.findChildren(QMenu) if any("Checkpoint folder" in a.text() for a in m.actions()))
    menu.aboutToShow.emit()
    entry = next(a for a in menu.actions() if a.text().startswith("mine-f16.gguf"))
    entry.trigger()
    assert chat.model_edit.text() == str(models / "mine-f16.gguf")

    # Remove asks; Cancel keeps the file, Remove deletes it and the list follows
    page.table.selectRow(row)
    assert page.remove_button.isEnabled()
    page.remove_button.click()
    qtbot.waitUntil(lambda: page.confirm_box is not None and page.confirm_box.isVisible(), timeout=5000)
    buttons = page.confirm_box.findChild(QDialogButtonBox)
    buttons.button(QDialogButtonBox.StandardButton.Cancel).click()
    assert (models / "mine-f16.gguf").is_file()
    page.table.selectRow(row)
    page.remove_button.click()
    qtbot.waitUntil(lambda: page.confirm_box.isVisible(), timeout=5000)
    remove = next(b for b in page.confirm_box.findChild(QDialogButtonBox).buttons() if b.text() == "Remove")
    remove.click()
    qtbot.waitUntil(lambda: "mine-f16.gguf" not in table_ids(page), timeout=60_000)
    assert not (models / "mine-f16.gguf").exists() and "Removed mine-f16.gguf" in page.status.text()
    # the listing that follows a removal was started on the GUI thread (the removal's callback runs there,
    # workers.run_in_thread), not on the removal's worker thread, which made its QObjects there
    assert page.service.listing.thread.thread() is QCoreApplication.instance().thread()


def test_pull_shows_progress_and_stop_keeps_the_partial_file(library, app_window, qtbot, repos):
    models, hub = library
    page = open_models_page(app_window, qtbot)

    page.pull_id.setText("org/small-GGUF")
    page.pull_button.click()
    assert not page.pull_button.isEnabled() and page.stop_button.isEnabled()
    qtbot.waitUntil(lambda: page.progress_label.text().startswith("Pulled into"), timeout=120_000)
    pulled = models / "org--small-GGUF" / "small-Q8_0.gguf"
    assert sha256(pulled) == sha256(repos["org/small-GGUF"] / "small-Q8_0.gguf")
    assert page.progress.value() == 100 and page.pull_button.isEnabled()
    qtbot.waitUntil(lambda: "org--small-GGUF" in table_ids(page), timeout=60_000)

    hub.stall_after["big-F16.gguf"] = CHUNK + (1 << 20)
    page.pull_id.setText("org/big-GGUF")
    page.pull_button.click()
    qtbot.waitUntil(lambda: 0 < page.progress.value() < 100, timeout=120_000)  # a chunk written, then the stall
    assert "MB of 12." in page.progress_label.text()
    page.stop_button.click()
    qtbot.waitUntil(lambda: page.pull_button.isEnabled(), timeout=30_000)
    assert page.progress_label.text().startswith("Pull stopped")
    partial = models / "org--big-GGUF" / ".big-F16.gguf.partial"
    # what arrived before the stall, kept as it is: a prefix of the file (huggingface_hub writes its 10 MiB chunks as
    # they come; under load one arrived in pieces, and the partial file held 8 MiB when Stop was clicked)
    kept, source = partial.read_bytes(), (repos["org/big-GGUF"] / "big-F16.gguf").read_bytes()
    assert 0 < len(kept) <= CHUNK + (1 << 20) and kept == source[:len(kept)]
    assert not (models / "org--big-GGUF" / "big-F16.gguf").exists()
