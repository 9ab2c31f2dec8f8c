"""Offloaded decode with a RAM budget of half the model: our engine vs transformers + accelerate with the same budget
(device_map with disk offload), peak RSS of each, and our streamed bytes/s vs the disk's measured read bandwidth.

    python bench/decode_offload.py                 # the ~1 GB demo model (12 layers, hidden 1024, fp32)
    python bench/decode_offload.py --model DIR --budget-fraction 0.5

Each system runs as its own subprocess, its peak RSS read with getrusage(RUSAGE_CHILDREN) by the parent. Our run is
done twice: with the OS page cache (as accelerate's memory-mapped offload files get it) for the speed comparison,
and with every streamed read evicted from the page cache afterwards (--drop-page-cache) so that it reads the disk,
for the comparison with disk bandwidth. The budget counts what the engine holds in RAM (weights, buffers, KV cache);
`baseline_rss_bytes` is the Python + torch runtime before loading. Prints one JSON line.
"""

from __future__ import annotations

import hivekeeper.core  # noqa: F401 - first, before numpy and torch: sets OpenBLAS's idle-thread timeout

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import demo_checkpoint  # bench/ is the script's folder, first on sys.path

ONE_GB_MODEL = dict(layers=12, hidden=1024, intermediate=4096, heads=16, kv_heads=4, vocab=32000, max_position=4096)


def run_child(command: list[str]) -> tuple[dict, int]:
    """Run a command as the only child of a fresh wrapper process; (its JSON output, its peak RSS in bytes)."""
    wrapper = ("import resource, subprocess, sys\n"
               "proc = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, text=True)\n"
               "print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else '{}')\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
               "sys.exit(proc.returncode)\n")
    proc = subprocess.run([sys.executable, "-c", wrapper, *command], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}")
    report, peak = proc.stdout.strip().splitlines()[-2:]
    return json.loads(report), int(peak)


def hf_child(model: str, budget_bytes: int, prompt_tokens: int, new_tokens: int) -> None:
    """In a subprocess: transformers + accelerate with max_memory {"cpu": budget}, the rest offloaded to disk."""
    import psutil
    import torch
    import transformers
    from accelerate import infer_auto_device_map, init_empty_weights

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(psutil.cpu_count(logical=False) or 1)
    baseline = psutil.Process().memory_info().rss
    config = transformers.AutoConfig.from_pretrained(model)
    with init_empty_weights():
        skeleton = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    device_map = infer_auto_device_map(skeleton, max_memory={"cpu": budget_bytes, "disk": 1 << 40},
                                       no_split_module_classes=["LlamaDecoderLayer"], dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="hivekeeper-accelerate-") as offload:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32, device_map=device_map, offload_folder=offload).eval()
        ids = torch.tensor([[1] + [(7 * i) % 30000 + 10 for i in range(prompt_tokens - 1)]])

        def run(n: int) -> float:
            start = time.perf_counter()
            with torch.inference_mode():
                hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)
            return time.perf_counter() - start

        one = run(1)
        total = run(new_tokens)
    on_disk = sum(1 for where in device_map.values() if where == "disk")
    print(json.dumps({"tokens_per_s": (new_tokens - 1) / (total - one), "baseline_rss_bytes": baseline,
                      "modules_on_disk": on_disk, "modules": len(device_map)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the ~1 GB demo model, written once)")
    parser.add_argument("--budget-fraction", type=float, default=0.5, help="RAM budget as a fraction of the weights")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--hf-child", nargs=4, metavar=("MODEL", "BUDGET", "PROMPT", "NEW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_child:
        model, budget, prompt, new = args.hf_child
        hf_child(model, int(budget), int(prompt), int(new))
        return

    from hivekeeper.core.machine.measure import disk_bandwidth

    load_before = os.getloadavg()
    path = Path(args.model) if args.model else demo_checkpoint("1gb", ONE_GB_MODEL)
    model_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    budget = int(args.budget_fraction * model_bytes)
    prompt = " ".join(["bread"] * max(1, args.prompt_tokens - 1))
    _, disk_read, cache_bypassed = disk_bandwidth(path)

    def ours(*extra: str) -> tuple[dict, int]:
        return run_child([sys.executable, "-m", "hivekeeper.core.cli.main", "generate", "--model", str(path), "--prompt",
                          prompt, "--max-new-tokens", str(args.new_tokens), "--ignore-eos", "--json",
                          "--ram-budget-gb", f"{budget / 1e9:.9f}", *extra])

    warm, warm_peak = ours()
    cold, cold_peak = ours("--drop-page-cache")
    engine = cold["plan"]["engine"]
    import torch

    from hivekeeper.core.offload.placement import block_bytes
    from hivekeeper.core.runtime.model import ModelConfig

    disk_blocks = engine["blocks"].get("disk", 0)
    streamed_per_token = disk_blocks * block_bytes(ModelConfig.from_folder(path), torch.float32)
    streamed_bps = streamed_per_token * cold["tokens_per_s"]
    result = {
        "bench": "decode_offload", "model": args.model or "demo-1gb", "weight_bytes": model_bytes,
        "ram_budget_bytes": budget, "new_tokens": args.new_tokens, "prompt_tokens": cold["prompt_tokens"],
        "blocks": engine["blocks"], "prefetch_depth": engine["prefetch_depth"],
        "ours_tokens_per_s": warm["tokens_per_s"], "ours_cold_tokens_per_s": cold["tokens_per_s"],
        "ours_peak_rss_bytes": warm_peak, "ours_cold_peak_rss_bytes": cold_peak,
        "ours_baseline_rss_bytes": warm["baseline_rss_bytes"],
        "ours_peak_over_baseline_bytes": max(warm_peak, cold_peak) - warm["baseline_rss_bytes"],
        "within_budget_plus_10pct": max(warm_peak, cold_peak) - warm["baseline_rss_bytes"] <= 1.1 * budget,
        "streamed_bytes_per_token": streamed_per_token, "streamed_bytes_per_s": int(streamed_bps),
        "disk_read_bps": int(disk_read), "disk_cache_bypassed": cache_bypassed,
        "fraction_of_disk_bandwidth": round(streamed_bps / disk_read, 3),
    }
    if not args.skip_transformers:
        hf, hf_peak = run_child([sys.executable, __file__, "--hf-child", str(path), str(budget),
                                 str(args.prompt_tokens), str(args.new_tokens)])
        result.update({
            "transformers_accelerate_tokens_per_s": round(hf["tokens_per_s"], 4), "transformers_peak_rss_bytes": hf_peak,
            "transformers_baseline_rss_bytes": hf["baseline_rss_bytes"],
            "transformers_modules_on_disk": f"{hf['modules_on_disk']}/{hf['modules']}",
            "speedup_vs_transformers": round(warm["tokens_per_s"] / hf["tokens_per_s"], 3),
        })
    result.update({"loadavg_before": [round(x, 2) for x in load_before],
                   "loadavg_after": [round(x, 2) for x in os.getloadavg()]})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
