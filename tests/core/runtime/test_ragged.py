"""decode_rows (continuous batching's step) against Span.forward run on each sequence alone: rows of one pool at
different positions, sliding windows included, K/V written where each row stands, on the native kernels' one call
and on torch's per-block path, from a pool made of memory that held NaN before (ragged.allocate_pool zeroes it); bad
shapes and a full pool refused."""

from __future__ import annotations

import pytest
import torch

from hivekeeper.core.runtime.checkpoint import load_span
from hivekeeper.core.runtime.model import KVCache
from hivekeeper.core.runtime.ragged import allocate_pool, decode_rows, row_view
from hivekeeper.planner.errors import InputError

from .test_model import build_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = (3, 9, 14)  # each sequence's prompt length: the rows stand at different positions
STEPS = 6
MAX_LENGTH = 32


@pytest.fixture(scope="module", params=["llama", "mistral"])  # mistral: a window of 7 that the rows pass
def span(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_reference(request.param, path)
    return load_span(path, 0, 4)


@pytest.fixture(params=["native", "torch"])
def step_path(request, monkeypatch):
    """Which code runs decode_rows: the native kernels' hk_span_decode_rows (where they are built), or torch's;
    checks that it was that one."""
    from hivekeeper.core.runtime import ragged
    from hivekeeper.core.runtime.kernels import native_kernels

    if request.param == "torch":
        monkeypatch.setattr(native_kernels, "ENABLED", False)
    elif native_kernels.library() is None:
        pytest.skip(f"the native kernels are not built here: {native_kernels.status()}")
    taken = []
    native_rows = ragged._native_rows
    monkeypatch.setattr(ragged, "_native_rows", lambda *args: taken.append(native_rows(*args)) or taken[-1])
    with torch.inference_mode():  # as the batcher runs (the native step needs autograd off)
        yield request.param
    assert taken and all((out is not None) == (request.param == "native") for out in taken)


def pool_from_nan_memory(span, rows: int, max_length: int = MAX_LENGTH) -> KVCache:
    """A pool made as decode_rows' callers make it, from memory that held NaN before (as freed memory the allocator
    hands out again may: the flake of session 12, a row all NaN on the torch path, 1 run in many): every fresh tensor
    made during the allocation is NaN-filled, so a pool that is not cleared shows it on every run."""
    empty = torch.empty
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "empty", lambda *args, **kwargs: empty(*args, **kwargs).fill_(float("nan")))
        assert torch.isnan(KVCache.allocate(span.config, 1, 1, 2).k).all()  # the poison reaches a plain allocation
        return allocate_pool(span.config, len(span.blocks), rows, max_length)


def prefilled(span, hidden: torch.Tensor) -> KVCache:
    cache = KVCache.allocate(span.config, len(span.blocks), 1, MAX_LENGTH)
    span(hidden, cache)
    return cache


def test_rows_at_different_positions_equal_each_row_run_alone(span, step_path):
    torch.manual_seed(0)
    size = span.config.hidden_size
    prompts = [torch.randn(1, n, size) for n in PROMPTS]
    pool = pool_from_nan_memory(span, len(PROMPTS) + 1)  # a spare row
    for row, prompt in enumerate(prompts):
        span(prompt, row_view(pool, row, 0))  # prefilled alone, into its row of the pool
    lengths = list(PROMPTS)
    alone = [prefilled(span, p) for p in prompts]
    for _ in range(STEPS):
        step = torch.randn(len(PROMPTS), 1, size)
        got = decode_rows(span, step, pool, lengths)
        lengths = [n + 1 for n in lengths]
        for row, cache in enumerate(alone):
            expected = span(step[row : row + 1], cache)
            torch.testing.assert_close(got[row : row + 1], expected, rtol=1e-5, atol=1e-5)
    for row, reference in enumerate(alone):
        assert reference.length == lengths[row]
        torch.testing.assert_close(pool.k[:, row : row + 1, :, : lengths[row]], reference.k[:, :, :, : lengths[row]])


def test_a_row_whose_cache_is_full_or_a_shape_that_does_not_match_is_refused(span):
    size = span.config.hidden_size
    pool = allocate_pool(span.config, len(span.blocks), 2, 3)
    for row in range(2):
        span(torch.randn(1, 2, size), row_view(pool, row, 0))
    with pytest.raises(InputError, match=r"hidden must be \[2, 1"):
        decode_rows(span, torch.randn(3, 1, size), pool, [2, 2])
    with pytest.raises(InputError, match="3 rows"):
        decode_rows(span, torch.randn(3, 1, size), pool, [2, 2, 2])
    decode_rows(span, torch.randn(2, 1, size), pool, [2, 2])  # the last free position
    with pytest.raises(InputError, match="no room"):
        decode_rows(span, torch.randn(2, 1, size), pool, [3, 3])
