"""Fixtures for core tests: a tiny demo checkpoint written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random-weight Llama checkpoint (2 layers, hidden 64, 4 heads / 2 KV heads, vocab 512, fp32, seed 0)
    in Hugging Face format, with tokenizer and chat template. Treat it as read-only: it is shared by all tests."""
    from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

    return make_demo_checkpoint(tmp_path_factory.mktemp("demo") / "tiny-llama")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: intra-op threads only add synchronisation (and on a busy shared machine, long stalls).
    Modules of tiny-model tests use it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
