"""The native decode kernels (core/runtime/kernels/native/decode_kernels.c) against the torch code they stand in for, their build and
their fallbacks. tests/core/runtime/test_model.py also runs them against transformers on every model family."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F

from hivekeeper.core.runtime.kernels import cpu_decode

from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.kernels.cpu_matmul import linear, store_linears_by_column
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear, QuantizedMatrix
from hivekeeper.core.runtime.quant.blocks import FORMATS
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import place_model
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.model import Head, KVCache, ModelConfig, Span
from hivekeeper.planner.costmodel import Placement, Policy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-5  # relative to each value's size and absolute near zero (fp32 sums in another order)
# Odd sizes on purpose: a hidden size that is not a multiple of the 32-float loop (72 = 2 x 32 + 8), an intermediate
# size with a scalar tail (100 = 3 x 32 + 4), GQA, and in the second config Qwen2's biases and a sliding window
# shorter than the sequence.
CONFIGS = {
    "llama-gqa": ModelConfig.from_hf_config(dict(
        model_type="llama", vocab_size=50, hidden_size=72, intermediate_size=100, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)),
    "qwen2-window": ModelConfig.from_hf_config(dict(
        model_type="qwen2", vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, use_sliding_window=True,
        sliding_window=5, max_window_layers=1)),
}
PROMPT, DECODE = 6, 12


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL)


def random_span(config: ModelConfig) -> Span:
    torch.manual_seed(0)
    span = Span(config, 0, config.num_layers).eval()
    with torch.no_grad():
        for name, param in span.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            else:  # ~1/sqrt(fan-in): activations stay near 1, as in a trained model
                param.normal_(0.0, 0.1)
    return span


def decode(span: Span, x: torch.Tensor, path: str, monkeypatch, prompt: int = PROMPT) -> tuple[torch.Tensor, KVCache]:
    """A prefill of `prompt` tokens, then one-token steps to the end of x, through `path` (native, numpy or torch)."""
    monkeypatch.setattr(native_kernels, "ENABLED", path == "native")
    monkeypatch.setattr(cpu_decode, "ENABLED", path != "torch")
    cache = KVCache.allocate(span.config, span.end - span.start, batch=x.shape[0], max_length=x.shape[1])
    with torch.inference_mode():
        outputs = [span(x[:, :prompt], cache)]
        outputs += [span(x[:, i : i + 1], cache) for i in range(prompt, x.shape[1])]
    return torch.cat(outputs, dim=1), cache


def test_built_and_loaded_where_a_compiler_and_avx2_exist():
    """On a machine that can build them (this project's CI machine can), a failed build is a failure, not a skip."""
    if native_kernels._cpu_supported() is not None or native_kernels._compiler() is None:
        pytest.skip(f"this machine cannot build them: {native_kernels.status()}")
    assert native_kernels.library() is not None, native_kernels.status()
    assert native_kernels.status().startswith("on (")


@pytest.mark.parametrize("layout", ["row-major", "tall-by-column"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_span_decode_equals_the_torch_code(native, name, layout, monkeypatch):
    """As loaded by the runtime (tall weights, here the fused gate/up, stored column-major) and as built."""
    span = random_span(CONFIGS[name])
    if layout == "tall-by-column":
        store_linears_by_column(span)
        assert not span.blocks[0].mlp.gate_up_proj.weight.is_contiguous()
    x = torch.randn(1, PROMPT + DECODE, span.config.hidden_size)
    calls = []
    real = cpu_decode.decode_blocks
    monkeypatch.setattr(cpu_decode, "decode_blocks", lambda *args: (lambda out: calls.append(out is not None) or out)(
        real(*args)))
    out, cache = decode(span, x, "native", monkeypatch)
    assert calls == [True] * DECODE  # every decode step ran natively, all blocks in one call
    ref_out, ref_cache = decode(span, x, "torch", monkeypatch)
    assert_close(out, ref_out)
    assert_close(cache.k, ref_cache.k)  # the kernels wrote K/V where the torch code does
    assert_close(cache.v, ref_cache.v)


def test_block_by_block_steps_equal_the_torch_code(native, monkeypatch):
    """Block.forward alone (one call per block, as the engine's streamed blocks run) takes the native step too."""
    span = random_span(CONFIGS["qwen2-window"])
    x = torch.randn(1, PROMPT + DECODE, span.config.hidden_size)
    monkeypatch.setattr(cpu_decode, "decode_blocks", lambda *args: None)  # force the per-block path
    steps = []
    real = cpu_decode._native_step
    monkeypatch.setattr(cpu_decode, "_native_step", lambda *args: steps.append(1) or real(*args))
    out, _ = decode(span, x, "native", monkeypatch)
    assert len(steps) == DECODE * span.config.num_layers
    ref_out, _ = decode(span, x, "torch", monkeypatch)
    assert_close(out, ref_out)


@pytest.mark.parametrize("batch", [3, native_kernels.MAX_ROWS])
def test_a_few_rows_decode_together_and_equal_the_torch_code(native, batch, monkeypatch):
    """Each weight row is read once for all the batch's rows; rows keep their own caches."""
    span = random_span(CONFIGS["qwen2-window"])
    x = torch.randn(batch, PROMPT + DECODE, span.config.hidden_size)
    calls = []
    real = cpu_decode.decode_blocks
    monkeypatch.setattr(cpu_decode, "decode_blocks", lambda *args: (lambda out: calls.append(out is not None) or out)(
        real(*args)))
    out, cache = decode(span, x, "native", monkeypatch)
    assert calls == [True] * DECODE
    ref_out, ref_cache = decode(span, x, "torch", monkeypatch)
    assert_close(out, ref_out)
    assert_close(cache.k, ref_cache.k)
    assert_close(cache.v, ref_cache.v)


def test_more_rows_than_the_kernels_take_stay_on_the_numpy_path(native, monkeypatch):
    span = random_span(CONFIGS["llama-gqa"])
    x = torch.randn(native_kernels.MAX_ROWS + 1, PROMPT + DECODE, span.config.hidden_size)
    native_calls = []
    monkeypatch.setattr(native, "hk_span_decode", lambda *args: native_calls.append(1) or -1)  # every layer step
    out, _ = decode(span, x, "native", monkeypatch)
    ref_out, _ = decode(span, x, "torch", monkeypatch)
    assert native_calls == []
    assert_close(out, ref_out)


def test_head_step_equals_norm_then_lm_head(native):
    config = CONFIGS["llama-gqa"]
    torch.manual_seed(0)
    head = Head(config)
    with torch.no_grad():
        head.weight.normal_()
        head.norm.weight.normal_(1.0, 0.2)
    hidden = torch.randn(1, 1, config.hidden_size)
    with torch.inference_mode():
        logits = cpu_decode.head_step(head, hidden)
        by_column = Head(config, torch.nn.Parameter(head.weight.detach().t().contiguous().t()))
        by_column.norm.weight.data.copy_(head.norm.weight)
        assert_close(cpu_decode.head_step(by_column, hidden), logits)
        expected = F.linear(F.rms_norm(hidden, (config.hidden_size,), head.norm.weight, head.norm.eps), head.weight)
        rows = torch.randn(3, 1, config.hidden_size)
        assert_close(cpu_decode.head_step(head, rows), F.linear(F.rms_norm(
            rows, (config.hidden_size,), head.norm.weight, head.norm.eps), head.weight))
        too_many = torch.randn(native_kernels.MAX_ROWS + 1, 1, config.hidden_size)
        assert cpu_decode.head_step(head, too_many) is None  # torch and BLAS take those
    assert logits.shape == (1, 1, config.vocab_size)
    assert_close(logits, expected)


@pytest.mark.parametrize("rows,cols,bias,batch,by_column", [
    (701, 403, True, 1, False), (1024, 512, False, 1, False), (701, 403, True, 5, False),
    (1031, 403, True, 1, True), (1031, 403, False, 5, True), (1024, 512, True, 8, True)])
def test_few_row_linear_equals_f_linear(native, rows, cols, bias, batch, by_column):
    """cpu_matmul.linear's product of a few rows (an LM head, any large linear at a small batch) runs on the
    kernels' pool, for row- and column-major weights; odd sizes exercise the uneven split between threads and the
    scalar tails (403 columns = 4 x 100 + 3, 1031 outputs = 8 x 128 + 7)."""
    torch.manual_seed(0)
    weight, x = torch.randn(rows, cols), torch.randn(batch, 1, cols)
    if by_column:
        weight = weight.t().contiguous().t()
    b = torch.randn(rows) if bias else None
    with torch.inference_mode():
        assert (linear(x, weight, b) - F.linear(x, weight, b)).abs().max().item() <= 1e-4


# Few-row products (decode_kernels.c's matvec: a case per row count, batch rows in groups, weight rows in pairs from
# 2048 columns): odd sizes give scalar tails and an odd weight row out; 1008 floats is a width whose padded row
# stride is bumped again (padded: 1024 floats apart would share the cache sets).
FEW_ROW_SHAPES = [(701, 403, False), (264, 1008, False), (131, 2051, False), (1031, 403, True), (1008, 300, True)]


@pytest.mark.parametrize("build", ["avx512vnni", "avx2", "portable"])
@pytest.mark.parametrize("outs,cols,by_column", FEW_ROW_SHAPES)
def test_every_few_row_count_equals_f_linear_and_its_rows_alone(kernel_build, build, outs, cols, by_column):
    """Each row count 1..MAX_ROWS, through cpu_matmul.linear on the kernels' pool, in every build: the product agrees
    with F.linear, and each row's result has the same bits as that row multiplied alone (a row's sum is the same
    whatever batch it is in), so a row count whose case drops or misplaces a row's result fails."""
    native = kernel_build(build)
    torch.manual_seed(1)
    weight, x, bias = torch.randn(outs, cols), torch.randn(native_kernels.MAX_ROWS, 1, cols), torch.randn(outs)
    if by_column:
        weight = weight.t().contiguous().t()
    with torch.inference_mode():
        alone = [linear(x[r : r + 1], weight, bias) for r in range(native_kernels.MAX_ROWS)]
        for rows in range(1, native_kernels.MAX_ROWS + 1):
            product = linear(x[:rows], weight, bias)
            assert (product - F.linear(x[:rows], weight, bias)).abs().max().item() <= 1e-4, rows
            for r in range(rows):
                assert torch.equal(product[r : r + 1], alone[r]), (rows, r)
    assert native.hk_variant().decode() == build


@pytest.mark.parametrize("build", ["avx512vnni", "avx2", "portable"])
@pytest.mark.parametrize("by_column", [False, True])
def test_few_row_products_have_the_same_bits_on_any_thread_count(kernel_build, build, by_column):
    """Every row count, row- and column-major (many chunks and pieces: 1.5 MiB of weights), on 1, 3 and 2 threads."""
    native = kernel_build(build)
    torch.manual_seed(2)
    weight, x = torch.randn(1536, 264), torch.randn(native_kernels.MAX_ROWS, 1, 264)
    if by_column:
        weight = weight.t().contiguous().t()
    results = {}
    try:
        for threads in (1, 3, 2):
            native.hk_set_threads(threads)
            with torch.inference_mode():
                results[threads] = [linear(x[:rows], weight) for rows in range(1, native_kernels.MAX_ROWS + 1)]
    finally:
        native.hk_set_threads(native_kernels.default_threads())
    for threads in (3, 2):
        assert all(torch.equal(a, b) for a, b in zip(results[1], results[threads]))


def test_any_thread_count_gives_the_same_result(native, monkeypatch):
    span = random_span(CONFIGS["llama-gqa"])
    x = torch.randn(1, PROMPT + DECODE, span.config.hidden_size)
    results = []
    try:
        for threads in (1, 3, 2):
            native.hk_set_threads(threads)
            results.append(decode(span, x, "native", monkeypatch)[0])
    finally:
        native.hk_set_threads(native_kernels.default_threads())
    assert all(torch.equal(results[0], other) for other in results[1:])  # each row is summed the same way


# Large enough that every product is cut into many chunks (64 KiB of weights each) and, past 128 keys, attention
# runs on the pool too.
POOL_CONFIG = ModelConfig.from_hf_config(dict(
    model_type="llama", vocab_size=50, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256))
HOLD_S = 120.0  # far longer than the test: a pool that waited for the held worker would outlast it


def hold_worker(native, index: int) -> None:
    """Hold pool worker `index` before it claims work, and return once it waits there (products on the pool
    wake it)."""
    native.hk_test_hold_worker(index, HOLD_S, 0)
    weight, x, y = torch.randn(4096, 512), torch.randn(1, 512), torch.empty(1, 4096)
    for _ in range(10_000):
        native.hk_gemv(weight.data_ptr(), 0, x.data_ptr(), None, y.data_ptr(), 4096, 512, 1)
        if native.hk_test_worker_held():
            return
    raise AssertionError("the held worker never took up a task")


@pytest.mark.parametrize("layout", ["row-major", "tall-by-column"])
def test_a_worker_held_back_does_not_stall_the_step_or_change_its_result(native, layout, monkeypatch):
    """A busy machine's case, made on purpose: pool worker 1 stops before claiming any work (as one whose core went
    to another process would). The caller and worker 2 take every chunk without it, so the decode finishes while it
    is still held (a pool that waited for it would sit out the hold), with the result one thread gives (each output
    is summed by one chunk in a fixed order, whoever computes it)."""
    torch.manual_seed(0)
    span = random_span(POOL_CONFIG)
    if layout == "tall-by-column":
        store_linears_by_column(span)
    x = torch.randn(1, 140, POOL_CONFIG.hidden_size)
    try:
        native.hk_set_threads(1)
        expected = decode(span, x, "native", monkeypatch, prompt=130)[0]
        native.hk_set_threads(3)
        hold_worker(native, 1)
        held = decode(span, x, "native", monkeypatch, prompt=130)[0]
        assert native.hk_test_worker_held() == 1  # held the whole decode: every step finished without it
    finally:
        native.hk_test_release_worker()
    released = decode(span, x, "native", monkeypatch, prompt=130)[0]  # and once back, it works again
    native.hk_set_threads(native_kernels.default_threads())
    assert torch.equal(held, expected)
    assert torch.equal(released, expected)


RESTART_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from hivekeeper.core.runtime.kernels import native_kernels

    native = native_kernels.library()
    assert native.hk_variant().decode() == sys.argv[1], native_kernels.status()
    weight, x, y = torch.randn(2048, 256), torch.randn(1, 256), torch.empty(1, 2048)
    expected = weight @ x[0]
    for i in range(int(sys.argv[2])):
        native.hk_set_threads(2 + i % 3)  # the next product stops the pool and starts another
        native.hk_gemv(weight.data_ptr(), 0, x.data_ptr(), None, y.data_ptr(), 2048, 256, 1)
        assert torch.allclose(y[0], expected, rtol=1e-4, atol=1e-4)
    print("done")
""")


def run_script(native, script: str, *args: str) -> None:
    """Run `script` in a child process on the same build of the kernels; a hang (a lost wake-up in the pool) is a
    failure: the child is killed at a deadline and its output so far reported."""
    env = {**os.environ, native_kernels.VARIANT_ENV: native.hk_variant().decode()}
    child = subprocess.Popen([sys.executable, "-c", script, native.hk_variant().decode(), *args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        output, _ = child.communicate(timeout=10)
        pytest.fail(f"the pool hung; output so far: {output[-2000:]}")
    assert child.returncode == 0 and output.strip().endswith("done"), output[-2000:]


def test_the_pool_restarts_cleanly_however_its_threads_are_scheduled(native):
    """Thread counts changed between products: each product may stop workers that have not run yet (just
    started, on a busy machine); they must still see the stop."""
    run_script(native, RESTART_SCRIPT, "400")


MID_CHUNK_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from hivekeeper.core.runtime.kernels import native_kernels

    native = native_kernels.library()
    assert native.hk_variant().decode() == sys.argv[1], native_kernels.status()
    weight, x, y = torch.randn(8192, 256), torch.randn(1, 256), torch.empty(1, 8192)
    native.hk_set_threads(1)
    native.hk_gemv(weight.data_ptr(), 0, x.data_ptr(), None, y.data_ptr(), 8192, 256, 1)
    expected = y.clone()
    native.hk_set_threads(2)
    native.hk_test_hold_worker(1, 0.2, 1)  # after it claims a chunk, 0.2 s
    for _ in range(2000):
        y.zero_()
        native.hk_gemv(weight.data_ptr(), 0, x.data_ptr(), None, y.data_ptr(), 8192, 256, 1)
        assert torch.equal(y, expected)
        if native.hk_pool_stalls() == 1:  # one stall on its own (a quiet machine's) starts no solo run
            assert native.hk_pool_solo_left() == 0, native.hk_pool_solo_left()
        if native.hk_test_worker_holds() >= 3:
            break
    assert native.hk_test_worker_holds() >= 3, native.hk_test_worker_holds()
    assert native.hk_pool_stalls() >= 1, native.hk_pool_stalls()
    native.hk_test_release_worker()

    def one_held_stall():
        stalls = native.hk_pool_stalls()
        native.hk_test_hold_worker(1, 0.05, 1)
        for _ in range(2000):
            native.hk_gemv(weight.data_ptr(), 0, x.data_ptr(), None, y.data_ptr(), 8192, 256, 1)
            if native.hk_pool_stalls() > stalls:
                break
        native.hk_test_release_worker()
        assert native.hk_pool_stalls() > stalls and torch.equal(y, expected)

    # Stalls product after product (a busy machine's): the caller goes on alone for a while. A held stall counts as
    # "in a row" only when the held worker claims a chunk within the pool's window of the previous stall; on a loaded
    # machine the caller may take every chunk for longer than that first, so held stalls are tried until one lands
    # (quietly, the second does). hk_set_solo(64) (the pool's own first length) clears any solo run left from above,
    # and the loop stops at the first solo run, so no held stall is waited for while the caller runs alone.
    native.hk_set_solo(64)
    deadline = time.monotonic() + 45.0
    while time.monotonic() < deadline:
        one_held_stall()
        if native.hk_pool_solo_left() > 0:
            break
    assert native.hk_pool_solo_left() > 0, native.hk_pool_solo_left()
    native.hk_set_solo(0)  # no solo runs (bench/decode_profile.py's A/B): the next stall leaves the pool in use
    stalls = native.hk_pool_stalls()
    native.hk_test_hold_worker(1, 0.2, 1)
    for _ in range(2000):
        native.hk_gemv(weight.data_ptr(), 0, x.data_ptr(), None, y.data_ptr(), 8192, 256, 1)
        if native.hk_pool_stalls() > stalls:
            break
    assert native.hk_pool_stalls() > stalls and native.hk_pool_solo_left() == 0, native.hk_pool_solo_left()
    assert torch.equal(y, expected)
    native.hk_test_release_worker()
    print("done")
""")


LATE_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from hivekeeper.core.runtime.kernels import native_kernels

    native = native_kernels.library()
    assert native.hk_variant().decode() == sys.argv[1], native_kernels.status()
    native.hk_set_threads(2)
    native.hk_set_solo(0)  # every product on the pool
    native.hk_test_hold_worker(1, 10.0, 2)  # once, after it read a spent ticket
    spent = np.zeros(2, dtype=np.int64)
    for _ in range(2_000):  # until worker 1 took part in a task and waits after its end (the task just run's)
        native.hk_test_count_chunks(2, spent.ctypes.data)
        for _ in range(100):
            if native.hk_test_worker_held():
                break
            time.sleep(0.001)
        if native.hk_test_worker_held():
            break
    assert native.hk_test_worker_held() == 1
    assert native.hk_test_worker_holds() == 1
    runs = np.zeros(8, dtype=np.int64)
    native.hk_test_count_chunks(8, runs.ctypes.data)  # more chunks than the spent ticket's number: it goes on
    assert runs.tolist() == [1] * 8, runs.tolist()
    assert native.hk_test_worker_held() == 0
    native.hk_test_count_chunks(8, runs.ctypes.data)  # the pool goes on as before
    assert runs.tolist() == [2] * 8, runs.tolist()
    native.hk_test_release_worker()
    print("done")
""")


def test_a_worker_late_after_a_tasks_end_runs_no_chunk_twice(native):
    """A worker that read a task's spent ticket (every chunk claimed) and lost its core right there, back while the
    next task, with more chunks, is being published (the caller paused between the new chunk count and the new
    ticket by the test hook), must claim nothing with the old ticket: each of the new task's chunks runs once. Before
    publish closed the old ticket, such a worker ran chunks of the new task that the pool ran again, and counted
    them done (a chunk added twice into an accumulating product, a caller returning before its product was whole:
    a column-major product once differed from one thread's under xdist at load 20)."""
    run_script(native, LATE_SCRIPT)


def test_a_worker_that_stops_mid_chunk_delays_the_product_but_completes_it(native):
    """The one case the pool must wait for: a worker that claimed a chunk and lost its core. The caller sleeps after
    a moment (its core free for that worker), and the worker, back, finishes the chunk and wakes it: the product
    completes, correct (several times over, so the wake-up cannot be missed by luck), and the pool counts the stall.
    One stall on its own starts no solo run; a stall right after another does (the products after it run on the
    caller alone for a while, then the pool is tried again; with solo runs set to 0, none)."""
    run_script(native, MID_CHUNK_SCRIPT)


def quantized_copies(span: Span, fmt: str) -> tuple[Span, Span]:
    """(the span with every block's linear layers block-quantized in `fmt`, the span with fp32 weights equal to what
    those blocks stand for)."""
    quantized, reference = copy.deepcopy(span), copy.deepcopy(span)
    for q_block, r_block in zip(quantized.blocks, reference.blocks):
        for owner, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                            ("mlp", "down_proj")):
            layer = QuantizedLinear.from_linear(getattr(getattr(q_block, owner), name), fmt)
            setattr(getattr(q_block, owner), name, layer)
            with torch.no_grad():
                getattr(getattr(r_block, owner), name).weight.copy_(torch.from_numpy(layer.matrix.dequantize()))
    return quantized, reference


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_block_quantized_span_decodes_in_one_native_call(native, fmt, monkeypatch):
    """Every step of a span whose layers are Q8_0/Q4_0/Q4_1 runs natively in one call, and stays within the
    activations' int8 rounding (about 1% per product) of the fp32 span holding the same weights. Without the kernels
    the layers multiply the dequantized weights in torch: that span's result."""
    span = random_span(CONFIGS["qwen2-window"])  # sizes in whole blocks of 32; biases; a sliding window
    quantized, reference = quantized_copies(span, fmt)
    x = torch.randn(1, PROMPT + DECODE, span.config.hidden_size)
    calls = []
    real = cpu_decode.decode_blocks
    monkeypatch.setattr(cpu_decode, "decode_blocks", lambda *args: (lambda out: calls.append(out is not None) or out)(
        real(*args)))
    out, cache = decode(quantized, x, "native", monkeypatch)
    assert calls == [True] * DECODE
    expected, expected_cache = decode(reference, x, "torch", monkeypatch)
    torch_path, _ = decode(quantized, x, "torch", monkeypatch)  # QuantizedLinear.forward: dequantized, in torch
    assert_close(torch_path, expected)
    scale = expected.abs().max()
    assert (out - expected).abs().max() <= 0.03 * scale
    assert (cache.k - expected_cache.k).abs().max() <= 0.03 * expected_cache.k.abs().max()
    assert not torch.equal(out, expected)  # the kernels' arithmetic, not the reference's, ran


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_quantized_spans_long_prompt_equals_its_tokens_decoded_one_by_one(native, fmt, monkeypatch):
    """A prompt longer than a decode step's MAX_ROWS through a Q8_0/Q4_0/Q4_1 span multiplies on the int8 kernels too
    (every product one call with all the prompt's rows): its outputs equal the same tokens decoded one at a time up to
    fp32 rounding (a row's product is the same bits in any batch; only attention's and the norms' sums run in
    another order), and are within the format's bound of the fp32 span holding the same weights."""
    span = random_span(CONFIGS["qwen2-window"])
    quantized, reference = quantized_copies(span, fmt)
    x = torch.randn(1, PROMPT + DECODE, span.config.hidden_size)
    rows = []
    real = QuantizedMatrix.matvec
    monkeypatch.setattr(QuantizedMatrix, "matvec", lambda self, x, *a: rows.append(len(x)) or real(self, x, *a))
    at_once, _ = decode(quantized, x, "native", monkeypatch, prompt=PROMPT + DECODE)
    assert PROMPT + DECODE > native_kernels.MAX_ROWS
    assert len(rows) == 4 * span.config.num_layers and set(rows) == {PROMPT + DECODE}
    one_by_one, _ = decode(quantized, x, "native", monkeypatch, prompt=1)
    expected, _ = decode(reference, x, "torch", monkeypatch, prompt=PROMPT + DECODE)
    scale = expected.abs().max()
    assert (at_once - one_by_one).abs().max() <= TOL * scale  # ~2e-7 of it measured: no int8 rounding flipped
    assert (at_once - expected).abs().max() <= 0.03 * scale
    assert not torch.equal(at_once, expected)  # the kernels' arithmetic, not the reference's, ran


def test_concurrent_callers_get_their_own_results(native, monkeypatch):
    """Two threads decoding at once (a server's sessions) are serialized inside the kernels, not mixed. (Equal up to
    rounding: their prefills share OpenBLAS, which splits a product differently when two threads call it.)"""
    span = random_span(CONFIGS["qwen2-window"])
    inputs = [torch.randn(1, PROMPT + DECODE, span.config.hidden_size) * scale for scale in (1.0, 3.0)]
    expected = [decode(span, x, "native", monkeypatch)[0] for x in inputs]
    results: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    errors = []

    def run(i: int) -> None:
        try:
            for _ in range(5):
                results[i].append(decode(span, inputs[i], "native", monkeypatch)[0])
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    for i in range(2):
        assert len(results[i]) == 5
        for result in results[i]:
            assert_close(result, expected[i])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_starts_its_own_workers(native, monkeypatch):
    """The parent's pool threads do not exist in a forked child; its first call must start new ones, not wait for
    them."""
    span = random_span(CONFIGS["llama-gqa"])
    x = torch.randn(1, PROMPT + DECODE, span.config.hidden_size)
    expected = decode(span, x, "native", monkeypatch)[0]  # the parent's workers are running now
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only for an equal result
        try:
            os._exit(0 if torch.equal(decode(span, x, "native", monkeypatch)[0], expected) else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_resident_engine_decodes_natively_and_generates_the_same_tokens(native, tiny_checkpoint, monkeypatch):
    config = ModelConfig.from_folder(tiny_checkpoint)
    plan = place_model(config, Policy("fp32", Placement(0, 1, 0), Placement(0, 1, 0), prefetch_depth=0),
                       device="cpu", dtype=torch.float32, batch=1, max_length=40)
    calls = []
    real = cpu_decode.PreparedSpan.__call__
    monkeypatch.setattr(cpu_decode.PreparedSpan, "__call__", lambda self, *args: (
        lambda out: calls.append(out is not None) or out)(real(self, *args)))
    prompt = [1, 20, 31, 42, 53]
    with OffloadedModel(tiny_checkpoint, plan) as model:
        tokens = {}
        for path in ("native", "torch"):
            monkeypatch.setattr(native_kernels, "ENABLED", path == "native")
            monkeypatch.setattr(cpu_decode, "ENABLED", path != "torch")
            tokens[path] = generate(model, prompt, max_new_tokens=24, ignore_eos=True).token_ids
    assert calls == [True] * 23  # the native run took every decode step in one call; the other prepared none
    assert tokens["native"] == tokens["torch"]


def test_the_build_is_reused(native, tmp_path):
    compiler = native_kernels._compiler()
    first = native_kernels.build(compiler, tmp_path)
    built_at = first.stat().st_mtime_ns
    assert native_kernels.build(compiler, tmp_path) == first
    assert first.stat().st_mtime_ns == built_at
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left behind


FALLBACK_SCRIPT = textwrap.dedent("""
    import torch
    from hivekeeper.core.runtime.kernels import cpu_decode
    from hivekeeper.core.runtime.kernels import native_kernels
    from hivekeeper.core.runtime.model import KVCache, ModelConfig, Span

    torch.set_num_threads(1)
    config = ModelConfig.from_hf_config(dict(model_type="llama", vocab_size=50, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    torch.manual_seed(0)
    span = Span(config, 0, 2).eval()
    x = torch.randn(1, 8, 64)
    outputs = []
    for enabled in (True, False):
        cpu_decode.ENABLED = enabled
        cache = KVCache.allocate(config, 2, batch=1, max_length=8)
        with torch.inference_mode():
            outputs.append(torch.cat([span(x[:, i : i + 1], cache) for i in range(8)], dim=1))
    print(native_kernels.status())
    print("equal" if (outputs[0] - outputs[1]).abs().max().item() <= 1e-5 else "different")
""")


@pytest.mark.parametrize("env,expected", [
    ({"CC": "/nonexistent/cc"}, "off: the C compiler '/nonexistent/cc' was not found"),
    ({"CC": "false"}, "off: false could not build decode_kernels.c"),
    ({"HIVEKEEPER_NATIVE": "0"}, "off (HIVEKEEPER_NATIVE=0)"),
])
def test_without_the_kernels_decoding_runs_the_numpy_path(tmp_path, env, expected):
    """No compiler, a failing one, or switched off: one line says why, and decoding still works (in numpy)."""
    if native_kernels._cpu_supported() is not None:
        pytest.skip(native_kernels._cpu_supported())
    result = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HIVEKEEPER_KERNEL_CACHE": str(tmp_path), **env})
    assert result.returncode == 0, result.stderr
    status, verdict = result.stdout.strip().splitlines()
    assert status.startswith(expected)
    assert verdict == "equal"
    assert not any(tmp_path.rglob("*.so"))  # nothing half-built left behind


def test_a_prepared_span_declines_other_caches(native):
    """PreparedSpan's tables point into the caches it was prepared with; given others it must not run."""
    span = random_span(CONFIGS["llama-gqa"])
    prepared_with, other = (KVCache.allocate(span.config, 3, batch=1, max_length=8) for _ in range(2))
    x = torch.randn(1, 1, span.config.hidden_size)
    rope = span.rotary.get(0, 1, x.device, x.dtype)
    other.k.zero_(), other.v.zero_()  # allocated uninitialized: NaNs there would never compare equal
    untouched = (other.k.clone(), other.v.clone())
    with torch.inference_mode():
        prepared = cpu_decode.PreparedSpan.prepare(list(span.blocks), [prepared_with.block(i) for i in range(3)], x)
        assert prepared is not None
        assert prepared([other.block(i) for i in range(3)], x, 0, rope) is None
        out = prepared([prepared_with.block(i) for i in range(3)], x, 0, rope)
        reference = span(x, KVCache.allocate(span.config, 3, batch=1, max_length=8))
    assert_close(out, reference)
    assert torch.equal(other.k, untouched[0]) and torch.equal(other.v, untouched[1])  # nothing written there


def test_a_plan_of_several_micro_batches_decodes_its_whole_batch_in_one_native_call(native, tiny_checkpoint,
                                                                                   monkeypatch):
    """A CPU decode step runs its whole batch at once whatever the plan's micro-batches (OffloadedModel._step_rows),
    so a plan of 2 micro-batches of 2 rows takes the kernels' one call for its 4 rows, as a plan of one 4-row micro-batch
    does (session 22: it took the block-by-block loop, 23.5 ms a step of the built-in model against 21), and
    generates the same tokens."""
    config = ModelConfig.from_folder(tiny_checkpoint)
    calls = []
    real = cpu_decode.PreparedSpan.__call__
    monkeypatch.setattr(cpu_decode.PreparedSpan, "__call__", lambda self, *args: (
        lambda out: calls.append(out is not None) or out)(real(self, *args)))
    prompts = [[1, 20, 31, 42], [1, 21, 32, 43], [1, 22, 33, 44], [1, 23, 34, 45]]
    tokens = {}
    for rows, parts in ((2, 2), (4, 1)):
        policy = Policy("fp32", Placement(0, 1, 0), Placement(0, 1, 0), prefetch_depth=0, micro_batch_size=rows,
                        num_micro_batches=parts)
        plan = place_model(config, policy, device="cpu", dtype=torch.float32, batch=4, max_length=40)
        calls.clear()
        with OffloadedModel(tiny_checkpoint, plan) as model:
            tokens[parts] = generate(model, prompts, max_new_tokens=8, ignore_eos=True).token_ids
        assert calls == [True] * 7, (rows, parts)
    assert tokens[2] == tokens[1]
