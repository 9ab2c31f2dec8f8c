"""Batch throughput: generated tokens/s at the batch the planner chooses (goal "batch") vs batch 1, same engine.

    python bench/batch_throughput.py                   # the ~100M demo model, fp32, all blocks in RAM
    python bench/batch_throughput.py --max-batch 32

The planner's batch for a small model on a CPU can be in the thousands (its objective is throughput over prefill
plus decode); --max-batch caps it to keep the run to minutes, taking the planner's best batch under the cap.
Throughput counts prefill and decode: batch x new tokens / wall time of the generation (FlexGen's metric); the
decode-only rate is reported beside it. Prints one JSON line, with os.getloadavg().
"""

from __future__ import annotations

import hivekeeper.core  # noqa: F401 - first, before numpy and torch: sets OpenBLAS's idle-thread timeout

import argparse
import json
import os
from pathlib import Path

import torch

from hivekeeper.core.machine.detect import detect_hardware
from hivekeeper.core.offload.offloaded_model import OffloadedModel, use_physical_cores
from hivekeeper.core.offload.placement import place_model
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.model import ModelConfig
from hivekeeper.planner.costmodel import Workload
from hivekeeper.planner.model_catalog import load_model_spec
from hivekeeper.planner.policy import Constraints, batch_curve, search

from _common import demo_preset, fixed_prompt  # bench/ is the script's folder, first on sys.path


def planner_batch(path: Path, workload: Workload, max_batch: int) -> tuple[int, int, float | None]:
    """(the planner's batch, the batch used (capped), the planner's predicted throughput at the batch used)."""
    spec, hardware = load_model_spec(str(path)), detect_hardware()
    plan = search(spec, hardware, "batch", Constraints(quant="none"), workload)
    chosen = plan.prediction.policy.batch_size
    if chosen <= max_batch:
        return chosen, chosen, plan.prediction.throughput_tokens_per_s
    points = [p for p in batch_curve(spec, hardware, workload, Constraints(quant="none"))
              if p.batch_size <= max_batch and p.throughput_tokens_per_s]
    best = max(points, key=lambda p: p.throughput_tokens_per_s)
    return chosen, best.batch_size, best.throughput_tokens_per_s


def measure(path: Path, config: ModelConfig, batch: int, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    plan = place_model(config, _resident_policy(batch), device="cpu", dtype=torch.float32, batch=batch,
                       max_length=len(prompt) + new_tokens)
    best = None
    with OffloadedModel(path, plan) as model:
        generate(model, prompt, max_new_tokens=2, batch=batch, ignore_eos=True)  # warm-up
        for _ in range(repeats):
            result = generate(model, prompt, max_new_tokens=new_tokens, batch=batch, ignore_eos=True)
            throughput = batch * new_tokens / result.total_s
            if best is None or throughput > best["throughput_tokens_per_s"]:
                best = {"throughput_tokens_per_s": round(throughput, 3),
                        "decode_tokens_per_s": round(result.decode_tokens_per_s, 3),
                        "time_to_first_token_s": round(result.time_to_first_token_s, 4)}
    return best


def _resident_policy(batch: int):
    from hivekeeper.planner.costmodel import Placement, Policy

    return Policy("fp32", Placement(0, 1, 0), Placement(0, 1, 0), micro_batch_size=batch, prefetch_depth=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("100m", "1b"), default="100m")
    parser.add_argument("--model", help="a checkpoint folder instead of a demo preset")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, help="torch threads (default: physical cores)")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads() if args.threads else use_physical_cores()
    load_before = os.getloadavg()
    path = Path(args.model) if args.model else demo_preset(args.preset)
    config = ModelConfig.from_folder(path)
    workload = Workload(prompt_len=args.prompt_tokens, output_len=args.new_tokens)
    chosen, used, predicted = planner_batch(path, workload, args.max_batch)
    prompt = fixed_prompt(config.vocab_size, args.prompt_tokens)
    single = measure(path, config, 1, prompt, args.new_tokens, args.repeats)
    batched = measure(path, config, used, prompt, args.new_tokens, args.repeats)
    print(json.dumps({
        "bench": "batch_throughput", "model": args.model or f"demo-{args.preset}", "dtype": "fp32",
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "planner_batch": chosen, "batch": used, "batch_capped": used != chosen,
        "planner_predicted_tokens_per_s": None if predicted is None else round(predicted, 3),
        "batch1": single, "batched": batched,
        "throughput_ratio": round(batched["throughput_tokens_per_s"] / single["throughput_tokens_per_s"], 3),
        "threads": threads, "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
