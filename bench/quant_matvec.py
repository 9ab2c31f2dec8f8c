"""Block-quantized matrix-vector products (Q8_0, Q4_0, Q4_1: core/runtime/kernels/quant_kernels.py) against the fp32
one, on the native kernels, batch 1 (or --batch rows: the multi-row kernel a continuous batch runs).

    python bench/quant_matvec.py                       # 576x1536 (SmolLM2-135M's MLP) and 2048x5632 (TinyLlama's)
    python bench/quant_matvec.py --shapes 4096x11008   # others, [outs]x[cols]
    python bench/quant_matvec.py --batch 1 8           # 1 row and 8 rows a product: "rows_per_s" compares them

Prints one JSON line per weight shape. Two rates per format: "streamed", cycling through copies of the weight that
together exceed the caches (~256 MiB), as a decode step reads each weight once from RAM; "hot", one copy again and
again (in cache when it fits). Goal: streamed speed-up over fp32 near the byte ratio (Q8_0 ~3.8x, Q4_x ~6-7x), since
fp32 decode is RAM-bound. The kernels' build (avx2 or portable) and the load average are recorded: on a shared
machine the numbers are only as quiet as it was.
"""

from __future__ import annotations

import hivekeeper.core  # noqa: F401 - first, before numpy: sets OpenBLAS's idle-thread timeout

import argparse
import json
import os
import statistics
import time

import numpy as np

from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.quant.blocks import FORMATS, quantize

STREAM_BYTES = 256 << 20


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}  # thread: this thread's CPU time (--threads 1)
clock = time.perf_counter


def time_calls(call, pointers: list[int], seconds: float) -> float:
    """Median seconds per call over rounds of one call per pointer, for about `seconds`."""
    rounds, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds or len(rounds) < 3:
        begin = clock()
        for pointer in pointers:
            call(pointer)
        rounds.append((clock() - begin) / len(pointers))
    return statistics.median(rounds)


def copies(array: np.ndarray) -> list[np.ndarray]:
    return [array.copy() for _ in range(max(1, -(-STREAM_BYTES // array.nbytes)))]


def measure(native, outs: int, cols: int, seconds: float, batch: int = 1) -> dict:
    rng = np.random.default_rng(0)
    weight = rng.normal(0, cols ** -0.5, (outs, cols)).astype(np.float32)
    x, y = rng.normal(0, 1, (batch, cols)).astype(np.float32), np.empty((batch, outs), dtype=np.float32)
    xp, yp = x.ctypes.data, y.ctypes.data
    packed = {"fp32": (weight, lambda p: native.hk_gemv(p, 0, xp, None, yp, outs, cols, batch))}
    for name, fmt in FORMATS.items():
        packed[name] = (quantize(weight, fmt), lambda p, t=fmt.ggml_type: native.hk_qgemv(t, p, xp, None, yp, outs,
                                                                                          cols, batch))
    results = {}
    for name, (data, call) in packed.items():
        streamed = copies(data)
        per_call = {"streamed": time_calls(call, [a.ctypes.data for a in streamed], seconds),
                    "hot": time_calls(call, [data.ctypes.data] * 64, seconds)}
        del streamed
        results[name] = {"bytes": int(data.nbytes),
                         **{f"{k}_us": round(v * 1e6, 2) for k, v in per_call.items()},
                         **{f"{k}_rows_per_s": round(batch / v, 1) for k, v in per_call.items()},
                         **{f"{k}_gbps": round(data.nbytes / v / 1e9, 2) for k, v in per_call.items()}}
    for name in FORMATS:
        for kind in ("streamed", "hot"):
            fp32, quantized = results["fp32"][f"{kind}_us"], results[name][f"{kind}_us"]
            results[name][f"{kind}_speedup_vs_fp32"] = round(fp32 / quantized, 2)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["576x1536", "2048x5632"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1], help="rows a product (1..8)")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per format and kind")
    parser.add_argument("--threads", type=int, help="kernel threads (default: physical cores)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="thread: CPU time of this thread, steadier on a shared machine (with --threads 1)")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    native = native_kernels.library()
    if native is None:
        print(json.dumps({"bench": "quant_matvec", "skipped": f"native kernels {native_kernels.status()}"}))
        return
    if args.threads:
        native.hk_set_threads(args.threads)
    for shape, batch in ((shape, batch) for shape in args.shapes for batch in args.batch):
        outs, cols = (int(v) for v in shape.lower().split("x"))
        load_before = os.getloadavg()
        results = measure(native, outs, cols, args.seconds, batch)
        print(json.dumps({
            "bench": "quant_matvec", "shape": [outs, cols], "batch": batch, "clock": args.clock, "results": results,
            "native_kernels": native_kernels.status(), "variant": native.hk_variant().decode(),
            "loadavg_before": [round(v, 2) for v in load_before],
            "loadavg_after": [round(v, 2) for v in os.getloadavg()]}), flush=True)


if __name__ == "__main__":
    main()
