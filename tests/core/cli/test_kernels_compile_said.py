"""Issue 14 (session 11, a new user's first hour): the first `chat` or `generate` after an install waited 9-18 s
for the C compiler before its first token, silently. The command now says on stderr that it compiles the kernels,
then how long it took; a later run with the build in the cache says nothing. In this process (main()), with an
empty kernel cache and the portable build (the quickest to compile)."""

from __future__ import annotations

from hivekeeper.core.cli.main import main
from hivekeeper.core.runtime.kernels import native_kernels


def test_generate_says_it_compiles_the_kernels_once(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(native_kernels.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setenv(native_kernels.VARIANT_ENV, "portable")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["generate", "--model", str(tiny_checkpoint), "--prompt", "The old mill", "--max-new-tokens", "2"]
    native_kernels.forget()
    try:
        assert main(args) == 0
        err = capsys.readouterr().err
        assert native_kernels.COMPILING in err and "kernels on (" in err and "portable" in err
        assert list((tmp_path / "kernels").glob("decode_kernels-portable-*.so"))
        native_kernels.forget()  # a new process: the build is in the cache now, nothing to say
        assert main(args) == 0
        assert native_kernels.COMPILING not in capsys.readouterr().err
    finally:
        native_kernels.forget()  # the next library() call decides again with the restored environment
