"""Atomic file writes (JSON and bytes): settings, profiles, chat history, caches and installed desktop files are
never left half-written; and the lock file a folder of such files is changed under (the block stores)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable

from hivekeeper.planner.errors import InputError


def in_existing_folder(option: str, path: str | Path) -> Path:
    """`path` (expanded) for an option that names a file to write (--out, --history): its folder must exist, so that
    a typo in it fails at once, naming the option, rather than creating folders."""
    path = Path(path).expanduser()
    if not path.parent.is_dir():
        raise InputError(f"{option} {path}: folder {path.parent} does not exist")
    return path


def write_json_atomic(path: str | Path, doc: Any, *, indent: int = 1) -> None:
    """Write `doc` as JSON to a temp file beside `path`, flush it to disk, then rename it over `path`.

    A crash at any moment leaves either the old file or the new one. Folders are created as needed; a folder
    or file that cannot be written raises InputError naming the path.
    """
    def fill(handle) -> None:
        json.dump(doc, handle, indent=indent, ensure_ascii=False)
        handle.write("\n")

    _replace_atomic(path, fill, "w", None)


def write_bytes_atomic(path: str | Path, data: bytes, *, mode: int | None = None) -> None:
    """Write `data` to `path` the same way (write_json_atomic); with `mode` (e.g. 0o644) the file gets those
    permissions, else mkstemp's 0o600."""
    _replace_atomic(path, lambda handle: handle.write(data), "wb", mode)


def _replace_atomic(path: str | Path, fill: Callable[[IO], Any], open_mode: str, mode: int | None) -> None:
    """Create `path` by `fill`ing a temp file beside it (opened with `open_mode`), fsync, chmod to `mode`, rename."""
    path = Path(path).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise InputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, open_mode, **({} if "b" in open_mode else {"encoding": "utf-8"})) as handle:
            fill(handle)
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


@contextlib.contextmanager
def folder_lock(folder: Path):
    """Hold `folder`/.lock exclusively while the folder's files change (another process may write them too). Where
    there is no flock (Windows) it holds nothing: concurrent writers only waste work, and renames stay atomic."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(Path(folder) / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
