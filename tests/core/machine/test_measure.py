"""Micro-benchmarks: results with repeats and spread, the page cache really bypassed, peers over real TCP."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import io
import mmap
import os
import socket
import subprocess
import sys
import threading

import pytest

from hivekeeper.core.machine import measure
from hivekeeper.core.machine.measure import (TINY, BandwidthServer, MatmulShape, TerminalProgress,
                                     measure_disk, measure_matmul, measure_memory_read, measure_peer, parse_peer,
                                     run_benchmarks)
from hivekeeper.core.machine.measurement import HALF_DECODE_KEY, PREFILL_BF16_KEY
from hivekeeper.core.runtime.model import KVCache
from hivekeeper.planner.errors import InputError

from ...child_output import ChildOutput



def test_memory_read_keeps_the_best_repeat_and_the_spread():
    m = measure_memory_read("cpu", 8 << 20, repeats=3)
    assert m.key == "ram_read" and m.unit == "B/s" and m.repeats == 3 and len(m.samples) == 3
    assert m.value == max(m.samples) > 0
    assert m.spread == pytest.approx((max(m.samples) - min(m.samples)) / max(m.samples))
    assert m.loadavg >= 0
    assert isinstance(measure.memory_read_bandwidth("cpu", 4 << 20, 1), float)  # the plain API the GUI calls


def test_matmul_measurements_name_dtype_and_phase():
    decode = measure_matmul(MatmulShape(1, 128, 256), "fp32", "cpu", repeats=2, phase="decode")
    prefill = measure_matmul(MatmulShape(32, 128, 256), "bf16", "cpu", repeats=2)
    assert decode.key == "cpu_matmul_fp32_decode" and "GB/s" in decode.detail
    assert prefill.key == "cpu_matmul_bf16_prefill" and prefill.unit == "FLOP/s" and prefill.value > 0
    assert measure.matmul_flops(MatmulShape(8, 64, 64), "fp32", "cpu", 1) > 0
    with pytest.raises(InputError, match="dtype"):
        measure_matmul(MatmulShape(1, 8, 8), "int3")


def _resident_pages(path) -> int:
    """Pages of a file in the page cache, by mincore(2) over a read-only mapping."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(size), vec) != 0:
            pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        return sum(v & 1 for v in vec)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
def test_dropping_a_file_from_the_page_cache_really_evicts_it(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(4 << 20))
    with open(path, "rb") as handle:
        while handle.read(1 << 20):
            pass  # now cached
    before = _resident_pages(path)
    if before == 0:
        pytest.skip("this filesystem keeps no page cache (nothing to evict)")
    fd = os.open(path, os.O_RDWR)
    try:
        measure.drop_file_from_page_cache(fd)
    finally:
        os.close(fd)
    after = _resident_pages(path)
    assert before >= (4 << 20) // mmap.PAGESIZE // 2 and after < before // 10


def test_disk_measurement_says_how_the_cache_was_bypassed_and_cleans_up(tmp_path):
    write, read = measure_disk(tmp_path, 8 << 20, repeats=2)
    assert write.key == "disk_write" and read.key == "disk_read"
    assert write.value > 0 and read.value > 0 and read.repeats == 2
    assert "posix_fadvise" in read.detail
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone
    w, r, bypassed = measure.disk_bandwidth(tmp_path, 8 << 20, 1)
    assert w > 0 and r > 0 and bypassed == hasattr(os, "posix_fadvise")


def test_parse_peer_addresses():
    assert parse_peer("127.0.0.1:31337") == ("127.0.0.1", 31337)
    assert parse_peer("[::1]:8080") == ("::1", 8080)
    assert parse_peer("/ip4/10.0.0.2/tcp/4001/p2p/QmPeer") == ("10.0.0.2", 4001)
    for bad in ("no-port", "host:http", "host:70000", "/ip4/1.2.3.4/udp/5"):
        with pytest.raises(InputError, match="peer"):
            parse_peer(bad)


def test_peer_rtt_and_bandwidth_over_real_tcp():
    server = BandwidthServer("127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        results = measure_peer(server.address, repeats=2, transfer_bytes=1 << 20)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    by_kind = {m.key.split(":")[0]: m for m in results}
    assert set(by_kind) == {"peer_rtt", "peer_upload", "peer_download"}
    assert 0 < by_kind["peer_rtt"].value < 1.0 and by_kind["peer_rtt"].unit == "s"
    assert by_kind["peer_upload"].value > 1e6 and by_kind["peer_download"].unit == "bit/s"


def test_peer_without_the_listener_gives_rtt_only_and_a_closed_port_is_an_error():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def accept_and_close():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                conn.close()
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_close, daemon=True)
    thread.start()
    try:
        results = measure_peer(f"127.0.0.1:{port}", repeats=2, transfer_bytes=1 << 16)
    finally:
        stop.set()
        thread.join(5)
        listener.close()
    assert [m.key for m in results] == [f"peer_rtt:127.0.0.1:{port}"]
    with pytest.raises(InputError, match="cannot connect"):
        measure_peer(f"127.0.0.1:{port}", repeats=1)


def test_run_benchmarks_reports_progress_and_stops_when_asked(tmp_path):
    seen = []
    results = run_benchmarks(TINY, disk_folder=tmp_path, gpu=False, progress=lambda f, label: seen.append((f, label)))
    keys = {m.key for m in results}
    assert {"ram_read", "cpu_matmul_fp32_decode", "cpu_matmul_fp32_prefill", "cpu_matmul_bf16_prefill",
            "disk_read", "disk_write"} <= keys
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and seen[-1][1] == "done"
    calls = []
    stopped = run_benchmarks(TINY, gpu=False, should_stop=lambda: calls.append(1) or len(calls) > 1)
    assert [m.key for m in stopped] == ["ram_read"]


def test_a_bf16_decode_step_is_measured_against_fp32_where_bf16_math_is_native(cpu_flags):
    half = measure.measure_half_decode(256, 4 << 20, repeats=3, step_repeats=3)
    assert half.key == HALF_DECODE_KEY and half.unit == "x" and len(half.samples) == 3
    assert min(half.samples) <= half.value <= max(half.samples) and half.value > 0  # the median pair's ratio
    assert "fp32 (" in half.detail and "bf16 (" in half.detail
    cpu_only = dataclasses.replace(TINY, dtypes=("fp32",))
    assert HALF_DECODE_KEY not in {m.key for m in run_benchmarks(cpu_only, gpu=False)}  # the suite's CPU: no bf16 math
    cpu_flags("sse2 avx avx2 fma avx512f avx512_bf16")
    assert {HALF_DECODE_KEY, PREFILL_BF16_KEY} <= {m.key for m in run_benchmarks(cpu_only, gpu=False)}


def test_a_bf16_prefill_is_timed_through_bf16_blocks_on_the_runtimes_path():
    """Issue 22: the planner's bf16 rate for a CPU plan's prefill and batches comes from the engine's own bf16 blocks
    (a bf16 matmul alone read ~3x what they multiply at): FLOPs of the pass over each repeat's seconds, the median."""
    import torch

    threads = torch.get_num_threads()
    prefill = measure.measure_half_prefill(256, repeats=3)
    assert torch.get_num_threads() == threads  # the caller's thread count is restored
    assert prefill.key == PREFILL_BF16_KEY and prefill.unit == "FLOP/s"
    assert len(prefill.samples) == measure.PREFILL_REPEATS
    assert min(prefill.samples) <= prefill.value <= max(prefill.samples) and prefill.value > 0
    config, span = measure.decode_span(256, measure.PREFILL_WEIGHTS * 4)
    _, flops, blocks = measure.prefill_pass(config, measure.half_span(config, span), torch.bfloat16)
    assert f"through {blocks} random bf16 blocks of width 256" in prefill.detail
    assert flops / prefill.value * 1e3 == pytest.approx(float(prefill.detail.split("median ")[1].split(" ms")[0]),
                                                        rel=0.01)


def test_the_bf16_step_is_whole_decode_steps_as_the_runtime_runs_them():
    """Whole steps through Span.forward in the runtime's thread layout (fp32 on the native kernels or numpy, bf16
    through torch block by block), not a chain of matmuls (session 11: a bf16 matmul chain read 0.9x of fp32 where
    generate's bf16 steps took ~1.5x, and plans ran in bf16); the caller's thread count is restored."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as a process that never set the runtime's layout (the app's, the CLI's measure)
    try:
        half = measure.measure_half_decode(256, 4 << 20, repeats=1, step_repeats=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert "fp32 (" in half.detail and measure.decode_path_name() in half.detail
    assert "torch block by block" in half.detail and "decode steps through" in half.detail


def test_with_a_wide_width_too_the_larger_ratio_decides():
    """bf16 must beat fp32 at both widths: on the project's AMX VM whole bf16 steps took 1.3x fp32's through
    768-wide blocks and 0.75x through a 2048-wide one, and the one machine-wide decision must not slow thin models."""
    import re

    half = measure.measure_half_decode(128, 1 << 20, repeats=2, step_repeats=2, wide=256)
    widths = re.findall(r"blocks of width (\d+):.*?, ([0-9.]+)x \(medians of 2\)", half.detail)
    assert [w for w, _ in widths] == ["128", "256"] and "the larger of the widths' ratios counts" in half.detail
    assert f"{half.value:.2f}" == max((ratio for _, ratio in widths), key=float)
    assert len(half.samples) == 2


def test_the_bf16_span_is_the_same_model_as_the_fp32_one():
    """half_span copies every weight of the fp32 span (laid out for the native kernels) into a bf16 span: one
    decode step of both agrees to bf16's precision, so the two timings run the same model."""
    import torch

    config, fp32 = measure.decode_span(128, 1 << 20)
    half = measure.half_span(config, fp32)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert all(p.is_contiguous() for p in half.parameters())
    hidden = torch.randn(1, 1, config.hidden_size)
    outputs = []
    for span, dtype in ((fp32, torch.float32), (half, torch.bfloat16)):
        cache = KVCache.allocate(config, config.num_layers, 1, 16, dtype)
        with torch.inference_mode():
            outputs.append(span(hidden, cache).float())
    scale = outputs[0].abs().max()
    assert (outputs[0] - outputs[1]).abs().max() < 0.05 * scale
    other = measure.decode_span(128, 1 << 20)[1]  # another random span: far from it (the check can fail)
    with torch.inference_mode():
        far = other(hidden, KVCache.allocate(config, config.num_layers, 1, 16))
    assert (outputs[0] - far).abs().max() > 0.2 * scale


def test_terminal_progress_prints_one_line_per_step_when_not_a_terminal():
    stream = io.StringIO()
    bar = TerminalProgress("measure ", stream)
    bar(0.0, "RAM")
    bar(0.1, "RAM")
    bar(0.5, "disk")
    bar(1.0, "done")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "50%" in lines[1] and lines[2].endswith("done")


@pytest.mark.slow
def test_measure_listen_command_serves_a_real_peer():
    child = ChildOutput(subprocess.Popen([sys.executable, "-m", "hivekeeper.core.cli.main", "measure", "--listen",
                                          "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        address = child.wait_for(r"listening on (127\.0\.0\.1:\d+) ", timeout=60).group(1)
        results = measure_peer(address, repeats=1, transfer_bytes=1 << 20)
        assert len(results) == 3
    finally:
        child.close()
