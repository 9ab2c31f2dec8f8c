"""The model picker's menu, shared by the Chat, Swarm and Plan pages: the built-in model first, then other choices a
page offers (the plan's model), the models on this machine (the Models page's list: gui/services/models.py), a GGUF
file, or a Hugging Face checkpoint folder.

A new user has no model on disk but the built-in one (core/runtime/default_model.py, installed by `make run`), so it
comes first; people who already hold GGUF files (llama.cpp, Ollama, LM Studio) pick one with a file dialog, since a
folder dialog cannot select a file.
"""

from __future__ import annotations

from typing import Callable

from PySide6.QtWidgets import QFileDialog, QMenu, QWidget

from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, INSTALL_HINT, default_model_file

GGUF_FILTER = "GGUF models (*.gguf);;All files (*)"


def builtin_label() -> str:
    """The menu entry of the built-in model (saying so when it is not installed)."""
    if default_model_file() is None:
        return f"Built-in model: {DEFAULT_MODEL_ID} (not installed: {INSTALL_HINT})"
    return f"Built-in model: {DEFAULT_MODEL_ID} (SmolLM2-135M-Instruct, runs offline)"


def model_menu(parent: QWidget, title: str, choose: Callable[[str], None], *,
               extra: Callable[[], list[tuple[str, str]]] = list, builtin_as_path: bool = False) -> QMenu:
    """A menu whose entries call `choose(model)`. `extra()` gives (text, model) entries placed after the built-in
    one, read each time the menu opens; `builtin_as_path` hands over the built-in model's file instead of its id
    (for the planner, which does not know the id)."""
    menu = QMenu(parent)

    def fill() -> None:
        menu.clear()
        menu.addAction(builtin_label(), lambda: choose(builtin_model(builtin_as_path)))
        for text, model in extra():
            menu.addAction(text, lambda m=model: choose(m))
        on_machine = library_entries()
        if on_machine:
            menu.addSection("On this machine")
            for text, model in on_machine:
                menu.addAction(text, lambda m=model: choose(m))
        menu.addSeparator()
        menu.addAction("GGUF file…", lambda: _pick(choose, QFileDialog.getOpenFileName(parent, title, "",
                                                                                      GGUF_FILTER)[0]))
        menu.addAction("Checkpoint folder…", lambda: _pick(choose, QFileDialog.getExistingDirectory(parent, title)))

    menu.aboutToShow.connect(fill)
    fill()
    return menu


def library_entries() -> list[tuple[str, str]]:
    """(text, path) of the models on this machine but the built-in one, as the Models page lists them."""
    from hivekeeper.gui.services.models import known_models
    from hivekeeper.gui.viewmodels.models_view import picker_entries

    return picker_entries(known_models())


def builtin_model(as_path: bool = False) -> str:
    """The built-in model's id, or its installed file (the id when it is not installed: using it then says how to
    install it)."""
    path = default_model_file() if as_path else None
    return str(path) if path is not None else DEFAULT_MODEL_ID


def _pick(choose: Callable[[str], None], picked: str) -> None:
    if picked:
        choose(picked)
