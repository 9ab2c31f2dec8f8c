"""Decode on a busy machine: batch-1 decode tokens/s of a demo model alone and beside one CPU-bound process (a
`python -c 'while 1: pass'` child), for the native kernels at a few idle-spin budgets and for the numpy path.

    python bench/decode_busy.py                      # the 100m demo model, default spin budget, numpy path
    python bench/decode_busy.py --spins-us 0 50 1000 # the native kernels' idle workers spin that long, then sleep

Why: the kernels' pool workers wait spinning between products; a worker that lost its core to another process used
to stall every step (issue 16: 454, 9.5, 311, 9.6 ... tokens/s over runs under load). Goal: decode degrades in
proportion to the cores it loses (one busy process on 2 cores: about 1/2-2/3 of the quiet rate), never ~10x; the
numpy path is the reference for what a run keeps. Prints one JSON line per model: every run's tokens/s alone and
busy per setting, medians, the worst busy run against the quiet median, and the load average before and after
(the machine may be shared: the quiet numbers are only as quiet as it was).
"""

from __future__ import annotations

import hivekeeper.core  # noqa: F401 - first, before numpy and torch: sets OpenBLAS's idle-thread timeout

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import torch

from hivekeeper.core.offload.offloaded_model import OffloadedModel, use_physical_cores
from hivekeeper.core.offload.placement import place_model
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.model import ModelConfig
from hivekeeper.planner.costmodel import Placement, Policy

from _common import demo_preset, fixed_prompt  # bench/ is the script's folder, first on sys.path

HOG = "while 1: pass"
HOG_DEADLINE_S = 600  # the hog kills itself after this, should this process die without killing it


@contextmanager
def busy_core():
    """One CPU-bound child process for the duration of the block (killed and reaped after it)."""
    child = subprocess.Popen([sys.executable, "-c", f"import signal; signal.alarm({HOG_DEADLINE_S})\n{HOG}"])
    try:
        time.sleep(0.2)  # let it start spinning
        yield child.pid
    finally:
        child.kill()
        child.wait(timeout=30)


def decode_rate(model: OffloadedModel, prompt: list[int], new_tokens: int) -> float:
    return generate(model, prompt, max_new_tokens=new_tokens, ignore_eos=True).decode_tokens_per_s


def settings(spins_us: list[float]) -> list[tuple[str, float | None]]:
    """(name, spin seconds) for every native spin budget, then the numpy path (None)."""
    out = [(f"native_spin_{us:g}us", us * 1e-6) for us in spins_us] if native_kernels.library() is not None else []
    return out + [("numpy", None)]


def use_setting(spin_s: float | None) -> None:
    native_kernels.ENABLED = spin_s is not None
    if spin_s is not None:
        native_kernels.set_spin_seconds(spin_s)


def run_model(preset: str, spins_us: list[float], repeats: int, new_tokens: int, prompt_tokens: int) -> dict:
    path = demo_preset(preset)
    config = ModelConfig.from_folder(path)
    prompt = fixed_prompt(config.vocab_size, prompt_tokens)
    plan = place_model(config, Policy("fp32", Placement(0, 1, 0), Placement(0, 1, 0), prefetch_depth=0),
                       device="cpu", dtype=torch.float32, batch=1, max_length=prompt_tokens + new_tokens)
    load_before = os.getloadavg()
    runs: dict[str, dict[str, list[float]]] = {}
    chosen = settings(spins_us)
    with OffloadedModel(path, plan) as model:
        generate(model, prompt, max_new_tokens=2, ignore_eos=True)  # warm-up: page first-touch, the kernels' build
        for phase in ("alone", "busy"):
            with (busy_core() if phase == "busy" else _nothing()):
                for _ in range(repeats):  # settings interleaved, so a busy spell of the shared machine hits all
                    for name, spin_s in chosen:
                        use_setting(spin_s)
                        runs.setdefault(name, {}).setdefault(phase, []).append(
                            round(decode_rate(model, prompt, new_tokens), 2))
    use_setting(native_kernels.DEFAULT_SPIN_SECONDS)
    summary = {}
    for name, phases in runs.items():
        quiet = statistics.median(phases["alone"])
        summary[name] = {"alone": phases["alone"], "busy": phases["busy"], "alone_median": round(quiet, 2),
                         "busy_median": round(statistics.median(phases["busy"]), 2),
                         "busy_median_over_alone": round(statistics.median(phases["busy"]) / quiet, 3),
                         "worst_busy_over_alone": round(min(phases["busy"]) / quiet, 3)}
    return {"bench": "decode_busy", "model": f"demo-{preset}", "layers": config.num_layers,
            "hidden": config.hidden_size, "new_tokens": new_tokens, "repeats": repeats, "results": summary,
            "native_kernels": native_kernels.status(), "cpus": os.cpu_count(), "busy_processes": 1,
            "goal": "busy/alone near (cores-1)/cores, never ~0.1",
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


@contextmanager
def _nothing():
    yield None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["100m"], choices=("tiny", "100m", "1b"))
    parser.add_argument("--spins-us", nargs="+", type=float, default=None,
                        help="idle-spin budgets of the kernels' workers, microseconds (default: the built-in one)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    args = parser.parse_args()
    use_physical_cores()
    spins = args.spins_us if args.spins_us is not None else [native_kernels.DEFAULT_SPIN_SECONDS * 1e6]
    for preset in args.presets:
        print(json.dumps(run_model(preset, spins, args.repeats, args.new_tokens, args.prompt_tokens)), flush=True)


if __name__ == "__main__":
    main()
