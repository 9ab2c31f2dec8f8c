"""The Models page's Qt-free parts: rows and picker entries from library models, a pull's progress in words and
percent (clamped, with an unknown total), and the pull's arguments from what the user typed."""

from __future__ import annotations

import pytest

from hivekeeper.core.runtime.library import LibraryModel
from hivekeeper.gui.viewmodels.models_view import (model_rows, picker_entries, progress_percent, progress_text,
                                                   pull_argv_args)


def models() -> list[LibraryModel]:
    return [LibraryModel("smollm2", "bundled", "/site/smollm2.gguf", 93_000_000, "gguf", "Q4_1"),
            LibraryModel("org--tiny-GGUF", "hivekeeper", "/m/org--tiny-GGUF/tiny.gguf", 47_400, "gguf", "Q8_0",
                         root="/m/org--tiny-GGUF", fit="fits here"),
            LibraryModel("ollama:tiny:latest", "ollama", "/o/blobs/sha256-x", 2_500_000_000, "gguf", "Q4_K")]


def test_rows_say_where_each_model_is_and_only_ours_are_removable():
    rows = model_rows(models())
    assert [r.id for r in rows] == ["smollm2", "org--tiny-GGUF", "ollama:tiny:latest"]
    assert [r.removable for r in rows] == [False, True, False]
    assert rows[1].cells == ("org--tiny-GGUF", "Hivekeeper's models folder", "gguf", "Q8_0", "47.4 kB", "fits here",
                             "/m/org--tiny-GGUF/tiny.gguf")
    assert rows[2].cells[1] == "Ollama's models folder" and rows[2].cells[4] == "2.5 GB"
    assert rows[0].cells[5] == "…"  # fit not known yet


def test_pickers_get_every_model_but_the_bundled_one_by_path():
    entries = picker_entries(models())
    assert [path for _, path in entries] == ["/m/org--tiny-GGUF/tiny.gguf", "/o/blobs/sha256-x"]
    assert entries[0][0] == "org--tiny-GGUF  (gguf Q8_0, 47.4 kB)"


def test_progress_in_words_and_percent():
    assert progress_text(3_200_000, 12_400_000) == "3.2 MB of 12.4 MB (25%)"
    assert progress_text(5, 0) == "5 B"
    assert [progress_percent(d, 100) for d in (-1, 0, 50, 100, 150)] == [0, 0, 50, 100, 100]
    assert progress_percent(10, 0) == 0


def test_pull_arguments_from_what_was_typed():
    assert pull_argv_args(" org/x ", "") == ["models", "pull", "org/x", "--json"]
    assert pull_argv_args("org/x", " a.gguf ") == ["models", "pull", "org/x", "--json", "--file", "a.gguf"]
    with pytest.raises(ValueError, match="hub id"):
        pull_argv_args("  ", "a.gguf")
