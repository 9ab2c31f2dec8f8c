"""Offloaded batch throughput with a RAM budget smaller than the model: our engine at the planner's policy (its
batch, micro-batches, placement and prefetch depth; zig-zag block order) against transformers + accelerate disk
offload (device_map from max_memory, offload_folder), in one run with the same budget. Accelerate's max_memory
places weights only, so its peak RSS grows with its batch: each of its runs reports its peak RSS against the budget,
and the issue's ratio (`speedup_vs_accelerate_at_budget`) is against its fastest run that held the budget (peak RSS
over baseline <= budget + 10%), or the run closest to it where none did (`accelerate_held_budget`: false); its
fastest run overall is reported beside it (`speedup_vs_accelerate_best`). Accelerate runs at each batch with its
max_memory at each of --hf-max-memory (fractions of the budget; 0 puts every module on disk).

    python bench/offload_throughput.py                    # a ~350 MB demo model (12 layers, hidden 768), budget 0.5
    python bench/offload_throughput.py --max-batch 32 --hf-batches 1 4 16 --new-tokens 8
    python bench/offload_throughput.py --hf-dtypes float32        # the paired run of docs/performance.md

Ours runs at the planner's batch as it is (no cap unless --max-batch gives one, and never halved: `generate` must
place it within the budget) in the dtype the planner's policy computes in here: on a CPU with native bf16 math (AMX,
AVX512-BF16) a batch plan whose micro-batches multiply more rows than the native decode kernels take is bf16 (the
rows rule, planner/costmodel.bf16_by_rows, which `generate` follows too), else fp32. The planner sees this machine with its saved profile, as `plan` and `generate` do; without one the
quick measurement runs first and saves it (set HIVEKEEPER_CONFIG_DIR to a fresh folder to measure right before the
run). `predicted_vs_measured_tokens_per_s` puts the plan's predicted throughput beside the measured one, and
`machine_profile` says what the prediction was made from. Accelerate runs in that dtype and in fp32 (--hf-dtypes),
at each of --hf-batches; its best run is the one compared. The budget is a fraction of the checkpoint's (fp32) bytes
for every run: in bf16 accelerate's device_map (weights only) may then fit the whole model in RAM, so that run does
not offload at all; `modules_on_disk` says so.

Each run is its own subprocess (peak RSS from RUSAGE_CHILDREN of a wrapper, as in bench/decode_offload.py).
Throughput is generated tokens / wall time of the generation, prefill included (FlexGen's metric). Per generated
token we report the weight bytes each system reads from the offloaded tier and the bound the disk puts on it:

- ours: the block reader's counters (`bytes_streamed`), in a run that evicts what it reads from the page cache
  (`--drop-page-cache`), so those bytes come from the disk; the throughput comparison uses a run with the page cache,
  as accelerate's memory-mapped offload files get it;
- accelerate: the bytes of the modules its device_map puts on "disk" (reloaded from the offload folder at every
  forward) and, measured, `read_bytes` of /proc/self/io over the generation (reads that reached the block device:
  near 0 when the offload files are in the page cache, which this bench does not drop: that would need root and
  slows every other process).

disk bound (tokens/s) = batch x disk read bandwidth / offloaded bytes read per step; `fraction_of_disk_bound` says
how close each system came. `goal_5x` says the issue's goal in words, against which of accelerate's runs it holds.

`terms` writes the plan's prediction out term by term (planner/costmodel.run_terms, milliseconds: the blocks'
reads, FLOPs and fixed costs, the disk, the blocks with the disk overlapped as the prefetch depth allows, the head)
for the prefill and one decode step, beside the page-cached run's own timings (`generate --json`'s stage_seconds:
the blocks' pass, its waits for streamed reads and the KV cache's traffic, the compute; the rest of the phase is the
head, sampling and embedding); `largest_miss` names the part that puts the run's prediction furthest off, in
seconds of the run. Prints one JSON line, with os.getloadavg() before and after.

Why the bf16 batch plan's prediction can miss on a CPU with native bf16 math (AVX512-BF16, session 14): the planner
has one bf16 rate for a plan's prefill (parts of >= 1024 rows) and its decode steps (the whole batch at once, 256
rows here), the FLOP/s table's: the measured bf16 product of the profile's prefill shape (128 rows quick) raised to
the fp32 prefill passes' rate (cpu_dtype_rule.with_choice). That proxy held at load 2 (the 256-row steps multiplied
at ~110 GFLOP/s, the prefill parts at ~110, the table said 117) but a profile whose fp32 reading is low (busy)
prices both too slow, and at load 4 the 256-row steps ran at 67. `terms` shows which term is off.

    python bench/offload_throughput.py --packed-gguf      # a GGUF streamed packed against streamed dequantized

--packed-gguf [FILE] (default: the built-in SmolLM2 Q4_1 GGUF) runs `generate` twice with the same RAM
budget (--budget-fraction of the file's bytes, so that blocks stream from disk): streamed blocks kept packed (the
default) and dequantized into fp32 slots (HIVEKEEPER_GGUF_PACKED=0). Both read the file's packed bytes; the packed
run keeps them so, the other writes 4 bytes a weight into its slots each step: tokens/s, bytes read per token,
bytes written into slots per token, peak RSS over the baseline, the disk bandwidth reached (reads may come from the
page cache). The default budget (0.5 of the file) makes 25 of SmolLM2's 30 packed blocks stream; the dequantized run
does not fit it (its fp32 embedding is 113 MB) and is reported as skipped: give a larger --budget-fraction (>= ~1.6)
to compare the two, where the packed run no longer streams.
"""

from __future__ import annotations

import hivekeeper.core  # noqa: F401 - first, before numpy and torch: sets OpenBLAS's idle-thread timeout

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _common import demo_checkpoint, fixed_prompt  # bench/ is the script's folder, first on sys.path
from decode_offload import run_child

MODEL_350MB = dict(layers=12, hidden=768, intermediate=2048, heads=12, kv_heads=4, vocab=8192, max_position=2048)


def read_bytes() -> int:
    """Bytes this process has read from block devices so far (/proc/self/io), 0 where there is no such file."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def hf_child(model: str, budget_bytes: int, batch: int, prompt_tokens: int, new_tokens: int, dtype_name: str) -> None:
    """In a subprocess: transformers + accelerate, max_memory {"cpu": budget}, the rest offloaded to disk, the
    weights in `dtype_name` ("float32" or "bfloat16")."""
    import psutil
    import torch
    import transformers
    from accelerate import infer_auto_device_map, init_empty_weights

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(psutil.cpu_count(logical=False) or 1)
    baseline = psutil.Process().memory_info().rss
    dtype = getattr(torch, dtype_name)
    config = transformers.AutoConfig.from_pretrained(model)
    with init_empty_weights():
        skeleton = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    device_map = infer_auto_device_map(skeleton, max_memory={"cpu": budget_bytes, "disk": 1 << 40},
                                       no_split_module_classes=["LlamaDecoderLayer"], dtype=dtype)
    sizes = {name: p.numel() * p.element_size() for name, p in skeleton.named_parameters()}
    on_disk = [name for name, where in device_map.items() if where == "disk"]
    disk_bytes = sum(n for name, n in sizes.items()  # module "" is the whole model (max_memory too small for any)
                     if any(m == "" or name == m or name.startswith(m + ".") for m in on_disk))
    with tempfile.TemporaryDirectory(prefix="hivekeeper-accelerate-") as offload:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            model, dtype=dtype, device_map=device_map, offload_folder=offload).eval()
        ids = torch.tensor([fixed_prompt(config.vocab_size, prompt_tokens)] * batch)
        with torch.inference_mode():
            hf_model.generate(ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]), max_new_tokens=1,
                              do_sample=False, pad_token_id=0)  # warm-up
            io_before, start = read_bytes(), time.perf_counter()
            hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            seconds, io = time.perf_counter() - start, read_bytes() - io_before
    print(json.dumps({"batch": batch, "dtype": dtype_name, "max_memory_cpu_bytes": budget_bytes,
                      "throughput_tokens_per_s": round(batch * new_tokens / seconds, 4),
                      "seconds": round(seconds, 3), "disk_module_bytes_per_step": disk_bytes,
                      "device_read_bytes": io, "modules_on_disk": f"{len(on_disk)}/{len(device_map)}",
                      "baseline_rss_bytes": baseline}))


def this_machine_measured() -> tuple[object, object, dict]:
    """(HardwareSpec, efficiency factors, what was measured) of this machine as the planner sees it with its saved
    profile (core/machine/profiles.detect_or_load_profile, as `plan` and `generate` read it): the prediction comes
    from what this machine measured, not from estimates (an AMX bf16 peak predicted 672 tokens/s against 261-353
    measured in session 11). Where `generate` would measure the machine first (no profile, or a busy one), it is
    measured now by the same rule (first_measure.this_machine), in HIVEKEEPER_CONFIG_DIR when set."""
    from hivekeeper.core.machine.first_measure import this_machine
    from hivekeeper.core.machine.profiles import load_machine_profile

    before = load_machine_profile()
    hardware, efficiency = this_machine()
    profile = load_machine_profile()
    measured_now = profile is not None and (before is None or profile.measured_at != before.measured_at)
    values = {m.key: m.value for m in profile.measurements} if profile is not None else {}
    return hardware, efficiency, {
        "path": str(profile.path) if profile is not None else None, "measured_now": measured_now,
        "measured_at": profile.measured_at if profile is not None else None,
        "cpu_gflops": {dtype: round(rate / 1e9, 1) for dtype, rate in hardware.cpu.flops.items()},
        "ram_gbps": round(hardware.cpu.memory_bandwidth / 1e9, 2),
        "disk_read_gbps": round(hardware.disk.read_bandwidth / 1e9, 3),
        "half_decode_step_vs_fp32": {k: round(v, 3) for k, v in values.items() if "bf16_vs_fp32" in k},
    }


def planner_batch(path: Path, budget: int, prompt_tokens: int, new_tokens: int, max_batch: int,
                  hardware, efficiency) -> tuple[int, int, dict | None]:
    """(the planner's batch for goal "batch" with this RAM budget on this measured machine, the batch to run: the
    planner's, or the best one under max_batch when given, the planner's prediction of its policy term by term:
    costmodel.run_terms; None where the batch run is not the planner's)."""
    from hivekeeper.planner.costmodel import Workload, run_terms
    from hivekeeper.planner.model_catalog import load_model_spec
    from hivekeeper.planner.policy import Constraints, batch_curve, search

    from hivekeeper.core.offload.local_plan import with_ram_budget

    hardware = with_ram_budget(hardware, budget, efficiency)  # as local_plan.search_policy does
    spec, workload = load_model_spec(str(path)), Workload(prompt_len=prompt_tokens, output_len=new_tokens)
    plan = search(spec, hardware, "batch", Constraints(quant="none"), workload, efficiency=efficiency)
    if plan.prediction is None:
        raise SystemExit(f"the planner finds no batch plan for {path} within {budget / 1e6:.0f} MB: {plan.reason}")
    chosen = plan.prediction.policy.batch_size
    if chosen <= max_batch:
        return chosen, chosen, run_terms(spec, hardware, plan.prediction.policy, workload, efficiency)
    points = [p for p in batch_curve(spec, hardware, workload, Constraints(quant="none"), efficiency=efficiency)
              if p.batch_size <= max_batch and p.throughput_tokens_per_s]
    return chosen, max(points, key=lambda p: p.throughput_tokens_per_s).batch_size if points else max_batch, None


def ours(path: Path, budget: int, batch: int, prompt_tokens: int, new_tokens: int, *extra: str) -> tuple[dict, int]:
    prompt = " ".join(["bread"] * max(1, prompt_tokens - 1))
    return run_child([sys.executable, "-m", "hivekeeper.core.cli.main", "generate", "--model", str(path), "--prompt",
                      prompt, "--batch", str(batch), "--max-new-tokens", str(new_tokens), "--ignore-eos", "--json",
                      "--ram-budget-gb", f"{budget / 1e9:.9f}", *extra])


def predicted_beside_measured(report: dict) -> dict | None:
    """The plan's predicted throughput (generated tokens / wall time, prefill included) beside the run's, and their
    ratio (measured / predicted), from `generate --json`'s predicted_vs_measured."""
    side = (report.get("predicted_vs_measured") or {}).get("throughput_tokens_per_s")
    if not side or not side.get("predicted"):
        return None
    return {"predicted": side["predicted"], "measured": side["measured"],
            "measured_over_predicted": round(side["measured"] / side["predicted"], 3)}


def terms_beside_measured(predicted: dict, run: dict) -> dict:
    """The plan's prediction term by term (costmodel.run_terms, milliseconds) beside the run's own timings
    (`generate --json`'s stage_seconds): per phase, the prefill and one decode step (the mean of the steps after the
    first token), the blocks' pass split into waiting for streamed reads, the KV cache's traffic and compute, and the
    rest of the phase (the LM head, sampling, embedding) as its time less the blocks' pass."""
    ms = lambda seconds: round(1e3 * seconds, 2)  # noqa: E731
    stages = run.get("stage_seconds") or {}
    measured_s = {"prefill": run["time_to_first_token_s"], "decode_step": None}
    steps = run["steps"] - 1
    if steps > 0 and run.get("decode_s"):
        measured_s["decode_step"] = run["decode_s"] / steps
    out = {}
    for phase, stage in (("prefill", "prefill"), ("decode_step", "decode")):
        terms = predicted[phase]
        measured, passes = stages.get(stage), 1 if phase == "prefill" else max(steps, 1)
        side = {"predicted_ms": {k: ms(v) for k, v in terms.items()}}
        if measured is not None and measured_s[phase] is not None:
            per = {k: measured[k] / passes for k in ("blocks_s", "waiting_for_reads_s", "kv_cache_s", "compute_s")}
            side["measured_ms"] = {**{k: ms(v) for k, v in per.items()},
                                   "head_and_rest_s": ms(measured_s[phase] - per["blocks_s"]),
                                   "pass_s": ms(measured_s[phase])}
            side["measured_over_predicted"] = {
                "pass": round(measured_s[phase] / terms["pass_s"], 3),
                "blocks": round(per["blocks_s"] / terms["blocks_s"], 3) if terms["blocks_s"] else None,
                "head_and_rest": round((measured_s[phase] - per["blocks_s"])
                                       / (terms["pass_s"] - terms["blocks_s"]), 3)
                if terms["pass_s"] > terms["blocks_s"] else None}
        out[phase] = side
    out["largest_miss"] = largest_miss(out, predicted["decode_steps"])
    return out


def largest_miss(sides: dict, decode_steps: int) -> dict | None:
    """Which part of which phase puts the run's prediction furthest off (seconds of the whole run: the prefill once,
    a decode step decode_steps times): the blocks' pass, or the rest of the phase (the head, sampling, embedding)."""
    misses = []
    for phase, count in (("prefill", 1), ("decode_step", decode_steps)):
        side = sides[phase]
        if "measured_ms" not in side:
            continue
        predicted, measured = side["predicted_ms"], side["measured_ms"]
        for part, p, m in (("blocks", predicted["blocks_s"], measured["blocks_s"]),
                           ("head_and_rest", predicted["pass_s"] - predicted["blocks_s"], measured["head_and_rest_s"])):
            misses.append({"phase": phase, "part": part, "run_seconds_off": round(count * (m - p) / 1e3, 3),
                           "measured_over_predicted": round(m / p, 3) if p > 0 else None})
    return max(misses, key=lambda miss: abs(miss["run_seconds_off"])) if misses else None


def our_figures(warm: dict, cold: dict, peak: int, disk_bps: float) -> dict:
    engine = warm["plan"]["engine"]
    per_token = cold["bytes_streamed"] / cold["new_tokens"]
    per_step = per_token * cold["batch"]
    bound = cold["batch"] * disk_bps / per_step if per_step else None
    throughput = warm["new_tokens"] / warm["total_s"]
    cold_throughput = cold["new_tokens"] / cold["total_s"]
    return {
        "batch": warm["batch"], "dtype": engine["dtype"], "micro_batch_size": engine["micro_batch_size"],
        "num_micro_batches": engine["num_micro_batches"], "prefetch_depth": engine["prefetch_depth"],
        "blocks": engine["blocks"], "kv_cache_blocks": engine["kv_cache_blocks"],
        "throughput_tokens_per_s": round(throughput, 4), "cold_throughput_tokens_per_s": round(cold_throughput, 4),
        "predicted_vs_measured": warm["predicted_vs_measured"],
        "disk_bytes_per_token": int(per_token), "disk_bytes_per_step": int(per_step),
        "disk_read_bps_reached": int(cold["bytes_streamed"] / cold["total_s"]),
        "disk_bound_tokens_per_s": None if bound is None else round(bound, 4),
        "fraction_of_disk_bound": None if bound is None else round(cold_throughput / bound, 3),
        "peak_over_baseline_bytes": peak - warm["baseline_rss_bytes"], "ram_bytes_planned": engine["ram_bytes"],
    }


# a run "holds" a RAM budget when its peak RSS over its baseline is at most this much over the budget (issue 22)
BUDGET_TOLERANCE = 1.10


def accelerate_figures(runs: list[dict], disk_bps: float, budget: int) -> dict:
    """Accelerate's runs with their disk bound and whether each held the budget (peak RSS over baseline <= budget +
    10%). `at_budget` is the issue's comparison: the fastest run that held it, or, where none did, the run closest
    to it (smallest peak) with `held_budget` false; `best` is the fastest run whatever its memory."""
    for run in runs:
        per_step = run["disk_module_bytes_per_step"]
        run["disk_bound_tokens_per_s"] = round(run["batch"] * disk_bps / per_step, 4) if per_step else None
        run["fraction_of_disk_bound"] = (round(run["throughput_tokens_per_s"] / run["disk_bound_tokens_per_s"], 3)
                                         if per_step else None)
        run["disk_bytes_per_token"] = int(per_step / run["batch"])
        run["peak_over_budget"] = round(run["peak_over_baseline_bytes"] / budget, 3)
        run["held_budget"] = run["peak_over_baseline_bytes"] <= BUDGET_TOLERANCE * budget
    best = max(runs, key=lambda r: r["throughput_tokens_per_s"])
    offloaded = [r for r in runs if r["disk_module_bytes_per_step"]]
    best_offloaded = max(offloaded, key=lambda r: r["throughput_tokens_per_s"]) if offloaded else None
    held = [r for r in runs if r["held_budget"]]
    at_budget = max(held, key=lambda r: r["throughput_tokens_per_s"]) if held else \
        min(runs, key=lambda r: r["peak_over_baseline_bytes"])
    return {"at_budget": at_budget, "any_run_held_budget": bool(held), "best": best,
            "best_offloading": best_offloaded, "by_batch": runs}


GOAL_SPEEDUP = 5.0  # issue 22: ours at least this many times accelerate's throughput at the same RAM budget


def goal_words(result: dict, hf: dict) -> str:
    """The issue's goal in words, against which of accelerate's runs it holds: its fastest run within the budget +
    10%, or where none held the budget its run closest to it; and, beside it, against its fastest run whatever its
    memory (which may hold the whole model in RAM)."""
    at, best = hf["at_budget"], hf["best"]
    ratio, best_ratio = result["speedup_vs_accelerate_at_budget"], result["speedup_vs_accelerate_best"]
    which = ("its fastest run within the budget + 10%" if hf["any_run_held_budget"] else
             f"its run closest to the budget (no run held it; that one peaked at {at['peak_over_budget']}x)")
    where = "every module in RAM" if not best["disk_module_bytes_per_step"] else \
        f"{best['modules_on_disk']} modules on disk"
    verdict = lambda r: "met" if r >= GOAL_SPEEDUP else "not met"  # noqa: E731
    return (f"{ratio}x accelerate against {which}: {verdict(ratio)}; {best_ratio}x against its fastest run overall "
            f"({best['dtype']}, batch {best['batch']}, {where}, peak {best['peak_over_budget']}x the budget): "
            f"{verdict(best_ratio)}")


def packed_gguf(path: Path, budget_fraction: float, prompt_tokens: int, new_tokens: int, disk_bps: float) -> dict:
    """Streamed packed vs streamed dequantized, one `generate` subprocess each (same budget). Since the RAM budget
    counts a GGUF by its packed bytes (session 8), a budget small enough to make the packed run stream is too small
    for the dequantized one (its fp32 embedding alone is larger): that run is then skipped, with the reason."""
    import torch

    from hivekeeper.core.offload.placement import block_bytes
    from hivekeeper.core.runtime.gguf import PACKED_ENV, GGUFCheckpoint
    from hivekeeper.planner.gguf_metadata import gguf_sizes

    checkpoint = GGUFCheckpoint(path)
    layers = checkpoint.config.num_layers
    budget = int(budget_fraction * path.stat().st_size)
    runs = {}
    for mode, switch in (("packed", "1"), ("dequantized", "0")):
        os.environ[PACKED_ENV] = switch
        try:
            report, peak = ours(path, budget, 1, prompt_tokens, new_tokens)
        except SystemExit as exc:  # run_child's failure: generate refused the budget (its error is on stderr)
            runs[mode] = {"skipped": f"generate failed at this budget ({exc})"}
            continue
        streamed = report["plan"]["engine"]["blocks"].get("disk", 0)
        slot_bytes = (sum(gguf_sizes(path).packed_block_bytes) / layers if mode == "packed"
                      else block_bytes(checkpoint.config, torch.float32))
        runs[mode] = {
            "throughput_tokens_per_s": round(report["new_tokens"] / report["total_s"], 4),
            "decode_tokens_per_s": report["tokens_per_s"], "streamed_blocks": streamed,
            "bytes_read_per_token": int(report["bytes_streamed"] / report["new_tokens"]),
            "slot_bytes_per_block": int(slot_bytes), "slot_bytes_written_per_token": int(streamed * slot_bytes),
            "peak_over_baseline_bytes": peak - report["baseline_rss_bytes"],
            "ram_bytes_planned": report["plan"]["engine"]["ram_bytes"],
            "disk_read_bps_reached": int(report["bytes_streamed"] / report["total_s"]),
            "fraction_of_disk_bandwidth": round(report["bytes_streamed"] / report["total_s"] / disk_bps, 4),
        }
    os.environ.pop(PACKED_ENV, None)
    both = all("skipped" not in run for run in runs.values())
    return {"bench": "offload_throughput_packed_gguf", "model": str(path), "file_bytes": path.stat().st_size,
            "ram_budget_bytes": budget, "new_tokens": new_tokens, "disk_read_bps": int(disk_bps), **runs,
            "packed_vs_dequantized_throughput": round(runs["packed"]["throughput_tokens_per_s"]
                                                      / runs["dequantized"]["throughput_tokens_per_s"], 3)
            if both else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the ~350 MB demo model, written once)")
    parser.add_argument("--budget-fraction", type=float, default=0.5, help="RAM budget as a fraction of the weights")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=None, help="cap on the planner's batch (default: none)")
    parser.add_argument("--hf-batches", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512],
                        help="accelerate's batches: its fastest run within the budget + 10%% is the issue's "
                             "comparison, its fastest overall is reported beside it (accelerate's max_memory places "
                             "weights only, so its peak RSS grows with the batch)")
    parser.add_argument("--hf-dtypes", choices=("same", "float32", "bfloat16"), nargs="+", default=["same", "float32"],
                        help="accelerate's weight dtypes (same: the dtype our engine computes in)")
    parser.add_argument("--hf-max-memory", type=float, nargs="+", default=[1.0, 0.0],
                        help="accelerate's max_memory for the CPU as fractions of the budget (0: every module on "
                             "disk; its loading and activations are not in max_memory, so a smaller one is how it "
                             "may hold the budget: batch 1 peaked at 1.9x the budget with 1.0, 1.13x with 0)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--packed-gguf", nargs="?", const="default", metavar="FILE",
                        help="a GGUF streamed packed vs dequantized (default file: the built-in model)")
    parser.add_argument("--hf-child", nargs=6, metavar=("MODEL", "BUDGET", "BATCH", "PROMPT", "NEW", "DTYPE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_child:
        model, budget, batch, prompt, new, dtype = args.hf_child
        hf_child(model, int(budget), int(batch), int(prompt), int(new), dtype)
        return

    from hivekeeper.core.machine.measure import disk_bandwidth

    load_before = os.getloadavg()
    if args.packed_gguf:
        from hivekeeper.core.runtime.default_model import default_model_file

        gguf = default_model_file() if args.packed_gguf == "default" else Path(args.packed_gguf)
        if gguf is None:
            raise SystemExit("the built-in model is not installed: give --packed-gguf FILE")
        _, gguf_disk_read, _ = disk_bandwidth(Path(gguf).parent)
        result = packed_gguf(Path(gguf), args.budget_fraction, args.prompt_tokens, args.new_tokens, gguf_disk_read)
        result.update({"loadavg_before": [round(x, 2) for x in load_before],
                       "loadavg_after": [round(x, 2) for x in os.getloadavg()]})
        print(json.dumps(result))
        return
    path = Path(args.model) if args.model else demo_checkpoint("offload-350mb", MODEL_350MB)
    model_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    budget = int(args.budget_fraction * model_bytes)
    _, disk_read, cache_bypassed = disk_bandwidth(path)
    hardware, efficiency, measured = this_machine_measured()
    chosen, batch, predicted_terms = planner_batch(path, budget, args.prompt_tokens, args.new_tokens,
                                                   args.max_batch or 1 << 16, hardware, efficiency)
    # the planner's batch as it is: generate refusing it is a failure of this bench, not a reason to halve it
    warm, warm_peak = ours(path, budget, batch, args.prompt_tokens, args.new_tokens)
    cold, cold_peak = ours(path, budget, batch, args.prompt_tokens, args.new_tokens, "--drop-page-cache")
    figures = our_figures(warm, cold, max(warm_peak, cold_peak), disk_read)
    figures["peak_over_budget"] = round(figures["peak_over_baseline_bytes"] / budget, 3)
    figures["held_budget"] = figures["peak_over_baseline_bytes"] <= BUDGET_TOLERANCE * budget
    result = {
        "bench": "offload_throughput", "model": args.model or "demo-350mb", "weight_bytes": model_bytes,
        "ram_budget_bytes": budget, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "disk_read_bps": int(disk_read), "disk_cache_bypassed": cache_bypassed, "machine_profile": measured,
        "planner_batch": chosen, "batch_run": batch, "max_batch": args.max_batch, "ours": figures,
        "predicted_vs_measured_tokens_per_s": predicted_beside_measured(warm),
        "terms": None if predicted_terms is None else terms_beside_measured(predicted_terms, warm),
    }
    if not args.skip_transformers:
        dtypes = dict.fromkeys(warm["plan"]["engine"]["dtype"] if d == "same" else d for d in args.hf_dtypes)
        runs = [run_child([sys.executable, __file__, "--hf-child", str(path), str(max(1, int(fraction * budget))),
                           str(b), str(args.prompt_tokens), str(args.new_tokens), dtype])
                for dtype in dtypes for fraction in args.hf_max_memory for b in args.hf_batches]
        for report, peak in runs:
            report["peak_over_baseline_bytes"] = peak - report.pop("baseline_rss_bytes")
        hf = accelerate_figures([report for report, _ in runs], disk_read, budget)
        result["transformers_accelerate"] = hf
        mine = result["ours"]["throughput_tokens_per_s"]
        # the ratio: against accelerate at the same RAM budget (its fastest run within budget + 10%, or the
        # one closest to the budget where none held it: "accelerate_held_budget" false)
        result["speedup_vs_accelerate_at_budget"] = round(mine / hf["at_budget"]["throughput_tokens_per_s"], 3)
        result["accelerate_held_budget"] = hf["any_run_held_budget"]
        result["speedup_vs_accelerate_best"] = round(mine / hf["best"]["throughput_tokens_per_s"], 3)
        if hf["best_offloading"] is not None:  # accelerate's best run that did read weights from its offload folder
            result["speedup_vs_accelerate_best_offloading"] = round(
                result["ours"]["throughput_tokens_per_s"] / hf["best_offloading"]["throughput_tokens_per_s"], 3)
        result["goal_5x"] = goal_words(result, hf)
    result.update({"loadavg_before": [round(x, 2) for x in load_before],
                   "loadavg_after": [round(x, 2) for x in os.getloadavg()]})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
