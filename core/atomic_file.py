"""Atomic file writes (JSON and bytes): settings, profiles, chat history, caches and installed desktop files are
never left half-written."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hivekeeper.planner.errors import InputError


def write_json_atomic(path: str | Path, doc: Any, *, indent: int = 1) -> None:
    """Write `doc` as JSON to `path` atomically (write_bytes_atomic): the old file or the new one, never half."""
    text = json.dumps(doc, indent=indent, ensure_ascii=False) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | Path, data: bytes, *, mode: int | None = None) -> None:
    """Write `data` to a temp file beside `path`, flush it to disk, then rename it over `path` (with `mode`, e.g.
    0o644, when given; mkstemp's 0o600 otherwise).

    A crash at any moment leaves either the old file or the new one. Folders are created as needed; a folder
    or file that cannot be written raises InputError naming the path.
    """
    path = Path(path).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise InputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise InputError(f"{path}: cannot write ({exc.strerror or exc})") from None
        raise
