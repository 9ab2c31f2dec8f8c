"""What the Models page shows, without Qt: the table's rows from the library's models, and the pull's progress in
words, so both are tested as plain functions."""

from __future__ import annotations

from dataclasses import dataclass

from hivekeeper.core.runtime.library import human_bytes

COLUMNS = ("Model", "Where", "Format", "Quantization", "Size", "Fits here", "Path")


@dataclass(frozen=True)
class ModelRow:
    """One table row: its cells, and what Remove and the pickers need."""

    cells: tuple[str, ...]
    id: str
    path: str
    removable: bool


def model_rows(models) -> list[ModelRow]:
    """Rows for library.LibraryModel objects, in the order given (the library's source order)."""
    from hivekeeper.core.runtime.library import SOURCES

    rows = []
    for m in models:
        where = SOURCES.get(m.source, m.source).removeprefix("the ")
        cells = (m.id, where, m.format, m.quantization, human_bytes(m.size_bytes), m.fit or "…", m.path)
        rows.append(ModelRow(cells, m.id, m.path, m.removable))
    return rows


def picker_entries(models) -> list[tuple[str, str]]:
    """(menu text, model path) for the model pickers: every model but the bundled one (the menu has its own entry)."""
    return [(f"{m.id}  ({m.format} {m.quantization}, {human_bytes(m.size_bytes)})", m.path)
            for m in models if m.source != "bundled"]


def progress_text(done: int, total: int) -> str:
    """'3.2 MB of 12.4 MB (26%)'; the total alone when nothing is known yet."""
    if total <= 0:
        return human_bytes(done)
    return f"{human_bytes(done)} of {human_bytes(total)} ({100 * done // total}%)"


def progress_percent(done: int, total: int) -> int:
    return 0 if total <= 0 else max(0, min(100, 100 * done // total))


def pull_argv_args(repo_id: str, gguf_file: str) -> list[str]:
    """`models pull` arguments for what the user typed (the file is optional); empty id -> ValueError."""
    repo_id, gguf_file = repo_id.strip(), gguf_file.strip()
    if not repo_id:
        raise ValueError("type a hub id such as ORG/NAME")
    return ["models", "pull", repo_id, "--json", *(["--file", gguf_file] if gguf_file else [])]
