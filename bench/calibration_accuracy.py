"""How well the planner predicts this machine, before and after calibration, on a demo model.

1. Writes a random-weight Llama demo checkpoint (default 38M parameters, 0.15 GB fp32: far beyond the CPU caches,
   so decode reads its weights from RAM as a real model's would).
2. Calibration (timed): micro-benchmarks (RAM bandwidth, fp32 matmuls), then a runtime profile over a small grid
   with the real engine and generate(), then the fit.
3. Evaluation: a second, independent run over a larger grid (other prompt lengths and batch sizes too).
   Predicted vs measured decode and prefill tokens/s for the uncalibrated cost model (measured numbers, default
   overheads) and the calibrated one; the idealized α(p) + β(o − 1) fit's runtime error too.

Prints ONE JSON line. Goals (issue 6): calibration under 60 s; calibrated decode within 10% and prefill within 15%
(MAPE) over the grid; uncalibrated within 30%. On a shared machine the load average is reported with the numbers:
other processes slow some runs, and every point keeps its fastest repeat.

    python bench/calibration_accuracy.py [--threads N] [--quick]
"""

from __future__ import annotations

import hivekeeper.core  # noqa: F401 - first, before numpy and torch: sets OpenBLAS's idle-thread timeout

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

DEMO = dict(layers=4, hidden=768, intermediate=2048, heads=12, kv_heads=4, vocab=8192, max_position=4096)
QUICK_DEMO = dict(layers=2, hidden=512, intermediate=1408, heads=8, kv_heads=4, vocab=4096, max_position=2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: physical cores, as the runtime uses)")
    parser.add_argument("--quick", action="store_true", help="a smaller model and grids (a smoke run)")
    parser.add_argument("--repeats", type=int, default=2, help="repeats per grid point (the fastest is kept)")
    parser.add_argument("--dump", metavar="FILE", help="also write the calibration and the evaluation points (JSON)")
    args = parser.parse_args()

    import torch

    from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.offload.offloaded_model import use_physical_cores
    from hivekeeper.core.machine.profiles import apply_measurements, machine_fingerprint
    from hivekeeper.core.machine.measure import BenchmarkSizes, TerminalProgress, run_benchmarks
    from hivekeeper.core.machine.profiling import ProfileGrid, denoise, measure_grid
    from hivekeeper.planner.calibration import (build_calibration, cost_model_predictions, form_accuracy,
                                                idealized_predictions, measured_efficiency)
    from hivekeeper.planner.hardware_catalog import hardware_to_json
    from hivekeeper.planner.model_catalog import load_model_spec

    threads = use_physical_cores()
    if args.threads:
        torch.set_num_threads(args.threads)
        threads = args.threads
    if args.quick:
        demo, sizes = QUICK_DEMO, BenchmarkSizes(ram_bytes=256 << 20, matmul_k=1024, matmul_n=2048, prefill_rows=256,
                                                 repeats=3, dtypes=("fp32",))
        calibration_grid = ProfileGrid((16, 64, 256), (1, 8), (1,), repeats=2)
        evaluation_grid = ProfileGrid((8, 32, 128, 384), (1, 8), (1, 2), repeats=2)
    else:
        demo, sizes = DEMO, BenchmarkSizes(ram_bytes=1 << 30, repeats=5, dtypes=("fp32",))
        calibration_grid = ProfileGrid((16, 64, 256), (1, 16), (1, 2, 4), repeats=args.repeats)
        evaluation_grid = ProfileGrid((8, 32, 128, 384), (1, 8, 24), (1, 2, 4), repeats=args.repeats)

    with tempfile.TemporaryDirectory(prefix="hivekeeper-bench-") as folder:
        path = make_demo_checkpoint(Path(folder) / "demo", **demo)
        spec = load_model_spec(str(path))
        load_before = os.getloadavg()[0]

        # ---- calibration: measure, profile, fit -----------------------------------------------------------------
        started = time.perf_counter()
        detected = detect_hardware(folder)
        measurements = run_benchmarks(sizes, disk_folder=None, gpu=False)
        measure_s = time.perf_counter() - started
        hardware = apply_measurements(detected, measurements, time.time())
        base = measured_efficiency(hardware)
        runs, policies = measure_grid(path, calibration_grid, device="cpu", progress=TerminalProgress("calibrate "))
        calibration = build_calibration(spec, str(path), hardware, hardware_to_json(hardware),
                                        machine_fingerprint(detected), denoise(runs), policies, created=time.time(),
                                        profile_seconds=time.perf_counter() - started, base=base,
                                        threads=threads, clock=time.perf_counter)
        calibration_s = calibration.profile_seconds

        # ---- evaluation: an independent, larger grid ----------------------------------------------------------
        eval_runs, _ = measure_grid(path, evaluation_grid, device="cpu", seed=1, progress=TerminalProgress("evaluate "))
        points = denoise(eval_runs)
        uncalibrated = form_accuracy(points, cost_model_predictions(spec, hardware, points, policies, base))
        calibrated = form_accuracy(points, cost_model_predictions(spec, hardware, points, policies,
                                                                  calibration.efficiency))
        by_batch, by_batch_uncalibrated = {}, {}
        for batch in evaluation_grid.batch_sizes:
            chosen = [pt for pt in points if pt.batch_size == batch]
            for table, eff in ((by_batch, calibration.efficiency), (by_batch_uncalibrated, base)):
                acc = form_accuracy(chosen, cost_model_predictions(spec, hardware, chosen, policies, eff))
                table[str(batch)] = {q: round(100 * acc[q].mape, 1) for q in ("decode", "prefill")}
        # the idealized fit is per batch size: evaluated on the batch sizes it was fitted at
        fitted_batches = {f.batch_size for f in calibration.idealized}
        ideal_points = [pt for pt in points if pt.batch_size in fitted_batches]
        idealized = form_accuracy(ideal_points, idealized_predictions(ideal_points, calibration.idealized))

    if args.dump:
        Path(args.dump).write_text(json.dumps({"calibration": calibration.as_dict(),
                                               "evaluation": [pt.as_dict() for pt in points]}))

    def pct(x: float) -> float:
        return round(100 * x, 1)

    ram = next(m for m in measurements if m.key == "ram_read")
    mm = next(m for m in measurements if m.key == "cpu_matmul_fp32_prefill")
    result = {
        "bench": "calibration_accuracy",
        "model": {k: demo[k] for k in ("layers", "hidden", "intermediate", "vocab")},
        "weights_gb": round(spec.total_params() * 4 / 1e9, 3),
        "threads": threads,
        "calibration_s": round(calibration_s, 1), "measure_s": round(measure_s, 1),
        "uncalibrated": {k: float(f"{getattr(base.accelerator, k):.4g}")
                         for k in ("bandwidth_fraction", "matmul_fraction", "layer_overhead_s", "step_overhead_s",
                                   "weight_reread_rows")},
        "calibration_points": len(calibration.points), "evaluation_points": len(points),
        "decode_mape_calibrated_pct": pct(calibrated["decode"].mape),
        "prefill_mape_calibrated_pct": pct(calibrated["prefill"].mape),
        "decode_mape_uncalibrated_pct": pct(uncalibrated["decode"].mape),
        "prefill_mape_uncalibrated_pct": pct(uncalibrated["prefill"].mape),
        "decode_worst_calibrated_pct": pct(calibrated["decode"].worst),
        "prefill_worst_calibrated_pct": pct(calibrated["prefill"].worst),
        "calibrated_mape_pct_by_batch": by_batch, "uncalibrated_mape_pct_by_batch": by_batch_uncalibrated,
        "idealized_runtime_mape_pct": pct(idealized["runtime"].mape) if idealized else None,
        "ram_read_gbps": round(ram.value / 1e9, 2), "fp32_matmul_gflops": round(mm.value / 1e9, 1),
        "fitted": {k: float(f"{getattr(calibration.accelerator, k):.4g}")
                   for k in ("bandwidth_fraction", "matmul_fraction", "layer_overhead_s", "step_overhead_s",
                             "weight_reread_rows")},
        "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "median_spread_pct": pct(float(np.median([pt.spread for pt in points]))),
        "goals": {"calibration_s": 60, "decode_mape_pct": 10, "prefill_mape_pct": 15, "uncalibrated_mape_pct": 30},
    }
    result["goals_met"] = {
        "calibration_s": calibration_s < 60,
        "decode": calibrated["decode"].mape <= 0.10, "prefill": calibrated["prefill"].mape <= 0.15,
        "uncalibrated": max(uncalibrated["decode"].mape, uncalibrated["prefill"].mape) <= 0.30,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
