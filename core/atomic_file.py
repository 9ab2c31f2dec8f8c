"""Atomic JSON writes: settings, profiles, chat history and caches are never left half-written."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hivekeeper.planner.errors import InputError


def write_json_atomic(path: str | Path, doc: Any, *, indent: int = 1) -> None:
    """Write `doc` as JSON to a temp file beside `path`, flush it to disk, then rename it over `path`.

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
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(doc, handle, indent=indent, ensure_ascii=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise InputError(f"{path}: cannot write ({exc.strerror or exc})") from None
        raise
