"""Issue 14 (session 11, a new user's first hour): the first `chat` or `generate` after an install waited 9-18 s
for the C compiler before its first token, silently. The command now says on stderr that it compiles the kernels,
then how long it took; a later run with the build in the cache says nothing. The real command with an empty kernel
cache and the portable build (the quickest to compile), then main() in this process with the cache it filled."""

from __future__ import annotations

import os
import sys

from hivekeeper.core.cli.main import main
from hivekeeper.core.runtime.kernels import native_kernels

from ...child_output import run


def test_generate_says_it_compiles_the_kernels_once(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "kernels"
    monkeypatch.setenv(native_kernels.CACHE_ENV, str(cache))
    monkeypatch.setenv(native_kernels.VARIANT_ENV, "portable")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["generate", "--model", str(tiny_checkpoint), "--prompt", "The old mill", "--max-new-tokens", "2"]
    first = run([sys.executable, "-m", "hivekeeper.core.cli.main", *args], timeout=300, env=dict(os.environ))
    assert first.returncode == 0, first.stderr
    assert native_kernels.COMPILING in first.stderr and "kernels on (" in first.stderr, first.stderr
    assert list(cache.glob("decode_kernels-portable-*.so"))
    native_kernels.forget()  # as a new process: the build is in the cache now, nothing to say
    try:
        assert main(args) == 0
        assert native_kernels.COMPILING not in capsys.readouterr().err
    finally:
        native_kernels.forget()  # the next library() call decides again with the restored environment
