"""HIVEKEEPER_KERNEL_CACHE (core/runtime/kernels/native_kernels.py `_cache_dir`): processes with different user cache
folders share one folder of native kernel builds. The suite points all its processes at one such folder
(tests/conftest.py) so the kernels compile once per run; this checks a second process really reuses the build."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hivekeeper.core.runtime.kernels import native_kernels

from ....child_output import run

STATUS_SCRIPT = "from hivekeeper.core.runtime.kernels import native_kernels; print(native_kernels.status())"


def refusing_compiler(folder) -> str:
    """A C compiler that reports the real one's version (so the build's key is the same) but refuses to compile:
    a process given it can load the kernels only from a build it finds."""
    wrapper = folder / "cc"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {native_kernels._compiler()} --version\n'
                       'echo "compiling refused" >&2\nexit 1\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def kernel_status(env: dict) -> str:
    result = run([sys.executable, "-c", STATUS_SCRIPT], timeout=300, env=env)  # a hang fails with the output so far
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_process_with_another_user_cache_reuses_the_shared_build(kernel_build, tmp_path):
    kernel_build("avx2")  # built in (or found in) the folder this run shares
    shared = native_kernels._cache_dir()
    assert shared == Path(os.environ[native_kernels.CACHE_ENV])
    builds = {path.name: path.stat().st_mtime_ns for path in shared.glob("*.so")}
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CC": refusing_compiler(tmp_path)}

    reused = kernel_status(env)
    assert reused.startswith("on (") and reused.rstrip(")").rsplit(", ", 1)[-1] in builds, reused
    assert {path.name: path.stat().st_mtime_ns for path in shared.glob("*.so")} == builds  # nothing rebuilt
    assert not any((tmp_path / "cache").rglob("*.so"))

    del env[native_kernels.CACHE_ENV]  # the same process without the shared folder: its own user cache, empty
    alone = kernel_status(env)
    assert alone.startswith("off: ") and "compiling refused" in alone, alone
