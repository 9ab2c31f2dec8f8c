"""Predicted against measured decode speed on this machine, for thin, many-layer models (issue 14 item 12): the
demo "100m" model (12 blocks of 768, ~125M parameters) and the real default model, smollm2-135m-instruct (30 blocks
of 576). The prediction is `hivekeeper plan --hardware auto --json` on a machine never measured (a fresh config
folder per run), so the plan first runs the automatic quick measurement as a new user's first plan does (pass
--no-measure to plan with the estimates instead); the measurement is `hivekeeper generate --json` with the same
prompt and output lengths right after it. Both through the real commands.

The host's speed swings (this 2-core VM's memory bandwidth moves ±35% from minute to minute at load ~1), so one
quick measurement checked against one later run agrees only when both land in the same phase. The runs therefore
interleave: measure, decode model A, measure, decode model B, measure, decode A, ... (M, D, M, D, ...), each model's
runs spread over the whole bench; and the verdict per model is the **median prediction against the median
measurement** (`ratio`), beside the host's own spread during the bench: the decode steps' streaming rate each quick
measurement found (GB/s min / median / max over the runs, `host_stream_gbps`, and each measurement's own repeats'
range). A miss with a wide host spread says the machine moved; with a narrow one, the model.

Each run also predicts from a reading taken right before its decode (a child that reads the decode steps' streaming
rate five times in a row on the quick measurement's spans, pools them as the quick measurement pools its own, and
plans with that in place of the profile's: `now`, with its own median ratio): the profile's prediction is what a user gets; the one from the reading is the cost model's own error, apart
from the host's move between the measurement and the decode.

The default model is planned and run as `generate` runs it: its Q4_1 blocks kept packed (the plan's format q4_1).
--dequantized adds a line for it dequantized to fp32 (HIVEKEEPER_GGUF_PACKED=0 for both the plan and the run).

    python bench/predicted_vs_measured.py                 # both models, 64 prompt + 64 new tokens, 3 runs each
    python bench/predicted_vs_measured.py --runs 5 --no-measure
    python bench/predicted_vs_measured.py --dequantized   # and SmolLM2 in fp32
    python bench/predicted_vs_measured.py --runs 2 --prompt-len 3000 --new-tokens 256  # a long chat's context

Goal: median predicted decode tokens/s within 15% of the median measured, for both models, uncalibrated. Prints one
JSON line per model: predicted and measured tokens/s for every run and each run's ratio, the medians and their
ratio, whether the goal is met, the host's spread, the plan's efficiency set and the load average before and after.
Each run also says what its quick measurement found (`measured`: the decode steps' RAM rate and its repeats' range,
the fixed cost of a block, the packed kernels' rates) and, in a third child after `generate`, where a decode step's
time went (`parts_ms`: the blocks, the LM head and the rest, i.e. embedding, sampling and the loop; medians over the
steps of one more generation with the same plan), so a miss points at its part (issue 23).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from _common import child_json, demo_preset, timed_parts  # bench/ is the script's folder, first on sys.path

GOAL = 0.15
NOW_READINGS = 5  # streaming readings in a row right before each decode (reading_now), pooled


def hivekeeper(*args: str, env: dict | None = None) -> dict:
    """One command's JSON; on failure or past the deadline, the output so far in the error."""
    return child_json([sys.executable, "-m", "hivekeeper.core.cli.main", *args], env)


def one_run(model: str, prompt_len: int, new_tokens: int, no_measure: bool, packed: bool) -> tuple[dict, float]:
    """(the plan with its quick measurement's figures and the step's parts added, measured decode tokens/s): a
    first plan on a machine never measured, then the decode; a GGUF's blocks packed as the runtime keeps them by
    default, or (packed=False) dequantized in both."""
    with tempfile.TemporaryDirectory(prefix="hivekeeper-pvm-") as config:
        env = {**os.environ, "HIVEKEEPER_CONFIG_DIR": config, "HIVEKEEPER_GGUF_PACKED": "1" if packed else "0"}
        plan = hivekeeper("plan", "--model", model, "--hardware", "auto", "--prompt-len", str(prompt_len),
                          "--output-len", str(new_tokens), "--json", *(["--no-measure"] if no_measure else []),
                          env=env)
        if not no_measure:  # the prediction from a streaming-rate reading taken right before the decode
            plan["now"] = child_json([sys.executable, __file__, "--reading-of", model, "--prompt-len", str(prompt_len),
                                      "--new-tokens", str(new_tokens)], env)
        prompt = " ".join(["the"] * prompt_len)  # about one token per word for both tokenizers
        measured = hivekeeper("generate", "--model", model, "--prompt", prompt, "--max-new-tokens", str(new_tokens),
                              "--ignore-eos", "--json", *(["--no-measure"] if no_measure else []),
                              env=env)["tokens_per_s"]
        plan["measured"] = quick_measurement(config)
        plan["parts_ms"] = child_json([sys.executable, __file__, "--parts-of", model, "--prompt-len", str(prompt_len),
                                       "--new-tokens", str(new_tokens)], env)
    return plan, measured


def quick_measurement(config: str) -> dict:
    """What the run's automatic quick measurement saved in its config folder: the decode steps' RAM rate (GB/s, the
    pooled fit of the readings spread over the measurement) with every reading's, the fixed cost of a block (ms), the
    fp32 prefill rate (GFLOP/s), the packed kernels' rates (G weights/s; in cache, streamed, prefill), a packed
    block's fixed cost (ms), a decode step's beyond its blocks and head (ms; NaN before session 16) and the decode
    attention's KV cache read rate (GB/s; NaN before session 26: long contexts, `--prompt-len 3000`)."""
    from pathlib import Path

    from hivekeeper.core.machine.measurement import ATTENTION_KEY, HALF_DECODE_KEY, PACKED_BLOCK_KEY, STEP_OVERHEAD_KEY

    profiles = list((Path(config) / "profiles").glob("*.json"))
    if not profiles:
        return {}
    doc = json.loads(profiles[0].read_text())
    by_key = {m["key"]: m for m in doc.get("measurements", [])}
    values = {key: m["value"] for key, m in by_key.items()}
    packed = {key[len("cpu_packed_"):]: round(value / 1e9, 2) for key, value in values.items()
              if key.startswith("cpu_packed_")}
    stream_samples = by_key.get("cpu_weight_stream", {}).get("samples", [])
    return {"decode_stream_gbps": round(values.get("cpu_weight_stream", 0) / 1e9, 2),
            "decode_stream_readings_gbps": [round(s / 1e9, 2) for s in stream_samples],
            "block_overhead_ms": round(values.get("cpu_decode_block_overhead", 0) * 1e3, 3),
            "prefill_gflops": round(values.get("cpu_prefill_fp32", 0) / 1e9, 1),
            "bf16_vs_fp32_step": round(values.get(HALF_DECODE_KEY, 0), 3),
            "packed_gweights_per_s": packed,
            "packed_block_overhead_ms": round(values.get(PACKED_BLOCK_KEY, float("nan")) * 1e3, 4),
            "step_overhead_ms": round(values.get(STEP_OVERHEAD_KEY, float("nan")) * 1e3, 3),
            "attention_gbps": round(values.get(ATTENTION_KEY, float("nan")) / 1e9, 2)}


def reading_now(model: str, prompt_len: int, new_tokens: int) -> dict:
    """The decode prediction for `model` from the saved profile with the decode steps' streaming rate and a block's
    fixed cost read now (NOW_READINGS readings in a row on the quick measurement's spans, pooled as it pools its own:
    one reading's fit reads high, its noise in the denominator) in place of the profile's: what the plan would have
    said had it been measured right before the decode."""
    import dataclasses

    from hivekeeper.core.machine.measure import QUICK, StreamSpans, pooled_reading, stream_reading
    from hivekeeper.core.machine.measurement import BLOCK_OVERHEAD_KEY, WEIGHT_STREAM_KEY
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.profiles import load_machine_profile
    from hivekeeper.core.offload.local_plan import search_policy
    from hivekeeper.core.runtime.checkpoint import resolve_checkpoint
    from hivekeeper.core.runtime.kernels.cpu_matmul import use_blas_threads

    detected = detect_hardware()
    profile = load_machine_profile(detected)
    use_blas_threads()
    spans = StreamSpans.make(QUICK.stream_hidden, QUICK.stream_bytes)
    repeats = max(QUICK.repeats, QUICK.step_repeats)
    reading = pooled_reading([stream_reading(spans, repeats) for _ in range(NOW_READINGS)], spans.shapes())
    now = {WEIGHT_STREAM_KEY: reading.bandwidth, BLOCK_OVERHEAD_KEY: reading.per_block}
    profile.measurements = [dataclasses.replace(m, value=now.get(m.key, m.value)) for m in profile.measurements]
    hardware = profile.hardware(detected)
    choice = search_policy(resolve_checkpoint(model), batch=1, prompt_len=prompt_len, max_new_tokens=new_tokens,
                           hardware=hardware, efficiency=profile.efficiency(hardware))
    return {"decode_tokens_per_s": choice.predicted["decode_tokens_per_s"],
            "stream_gbps": round(reading.bandwidth / 1e9, 2), "block_overhead_ms": round(reading.per_block * 1e3, 3)}


def step_parts(model: str, prompt_len: int, new_tokens: int) -> dict:
    """Median milliseconds per decode step of one generation as `generate` runs it (its thread layout, the plan
    for this machine): the blocks (the span's call), the LM head, and the rest of the step (embedding, sampling,
    the loop: each step less its own span and head calls, step_overhead.step_rests; until session 16 the mean step
    less the median blocks and head, which put a few slow steps' excess in it), with the step itself (the mean: the
    tokens/s `generate` reports)."""
    import time

    from hivekeeper.core.cli.generate import set_threads
    from hivekeeper.core.machine.step_overhead import StepClock, step_rests
    from hivekeeper.core.offload.local_plan import plan_local_run
    from hivekeeper.core.offload.offloaded_model import OffloadedModel
    from hivekeeper.core.runtime.checkpoint import load_config, resolve_checkpoint
    from hivekeeper.core.runtime.generation import generate

    set_threads()
    path = resolve_checkpoint(model)
    config = load_config(path)
    _, plan = plan_local_run("auto", path, config, batch=1, prompt_len=prompt_len, max_new_tokens=new_tokens,
                             max_length=prompt_len + new_tokens)
    runner = OffloadedModel(path, plan)
    times = timed_parts(runner)
    prompt = [1] + [(7 * i) % (config.vocab_size - 10) + 10 for i in range(prompt_len - 1)]
    clock = StepClock()
    called = time.perf_counter()
    result = generate(runner, prompt, max_new_tokens=new_tokens, ignore_eos=True, stop=clock)
    rests = step_rests(clock.step_durations(called + result.time_to_first_token_s + result.decode_s),
                       times["blocks"], times["head"])
    blocks, head = (statistics.median(times[name][1:]) * 1e3 for name in ("blocks", "head"))  # [0]: the prefill
    step = result.decode_s / max(1, result.new_tokens - 1) * 1e3
    return {"step": round(step, 2), "blocks": round(blocks, 2), "head": round(head, 2),
            "rest": round(statistics.median(rests) * 1e3, 2)}


def summary(predicted: list[float], measured: list[float], stream_gbps: list[float]) -> dict:
    """The verdict of one model's runs: each run's ratio, the median prediction over the median measurement (the
    ratio judged against GOAL), and the host's spread during them (the quick measurements' streaming rates: min,
    median, max, and (max - min) / median)."""
    ratios = [p / m for p, m in zip(predicted, measured) if m]
    median_measured = statistics.median(measured) if measured else 0.0
    ratio = statistics.median(predicted) / median_measured if median_measured else None
    host = {}
    if stream_gbps:
        middle = statistics.median(stream_gbps)
        host = {"min": round(min(stream_gbps), 2), "median": round(middle, 2), "max": round(max(stream_gbps), 2),
                "spread": round((max(stream_gbps) - min(stream_gbps)) / middle, 3) if middle else None}
    return {"predicted_median": round(statistics.median(predicted), 2) if predicted else None,
            "measured_median": round(median_measured, 2), "ratios": [round(r, 3) for r in ratios],
            "ratio": round(ratio, 3) if ratio else None,
            "within_goal": ratio is not None and abs(ratio - 1) <= GOAL, "goal": GOAL, "host_stream_gbps": host}


def model_line(name: str, results: list[tuple[dict, float]], prompt_len: int, new_tokens: int,
               load_before: float) -> dict:
    """One model's JSON line from its runs [(plan with its quick measurement's figures, measured tokens/s)]."""
    plan = results[-1][0]
    predicted = [p["decode_tokens_per_s"] for p, _ in results]
    measured = [m for _, m in results]
    stream = [p["measured"]["decode_stream_gbps"] for p, _ in results if p.get("measured")]
    now = [p["now"]["decode_tokens_per_s"] for p, _ in results if p.get("now")]
    from_reading = {}
    if len(now) == len(measured):  # the prediction from a reading right before each decode: the model's own error
        verdict = summary(now, measured, [p["now"]["stream_gbps"] for p, _ in results])
        from_reading = {"now": {key: verdict[key] for key in ("predicted_median", "ratios", "ratio", "within_goal",
                                                              "host_stream_gbps")},
                        "now_predicted_tokens_per_s": [round(x, 2) for x in now]}
    return {"bench": "predicted_vs_measured", "model": name, "predicted_tokens_per_s": predicted,
            "measured_tokens_per_s": measured, **summary(predicted, measured, stream), **from_reading,
            "efficiency": plan["efficiency"], "weight_format": plan["policy"]["weight_format"],
            "weight_formats": [p["policy"]["weight_format"] for p, _ in results],  # per run (bf16 is measured)
            "measured_by_quick": [p.get("measured") for p, _ in results],
            "parts_ms": [p.get("parts_ms") for p, _ in results],
            "prompt_len": prompt_len, "new_tokens": new_tokens,
            "loadavg_before": round(load_before, 2), "loadavg_after": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-measure", action="store_true", help="plan with estimates where there is no profile")
    parser.add_argument("--dequantized", action="store_true", help="also the default model dequantized to fp32")
    parser.add_argument("--parts-of", metavar="MODEL", help=argparse.SUPPRESS)  # the child that times the parts
    parser.add_argument("--reading-of", metavar="MODEL", help=argparse.SUPPRESS)  # ... that predicts from a reading
    args = parser.parse_args()
    if args.parts_of:
        print(json.dumps(step_parts(args.parts_of, args.prompt_len, args.new_tokens)))
        return
    if args.reading_of:
        print(json.dumps(reading_now(args.reading_of, args.prompt_len, args.new_tokens)))
        return
    models = [(str(demo_preset("100m")), "demo-100m", True), ("smollm2-135m-instruct", "smollm2-135m-instruct", True)]
    if args.dequantized:
        models.append(("smollm2-135m-instruct", "smollm2-135m-instruct (fp32)", False))
    load_before = os.getloadavg()[0]
    results: dict[str, list] = {name: [] for _, name, _ in models}
    for _ in range(args.runs):  # M, D for each model in turn, then again: each model's runs span the whole bench
        for model, name, packed in models:
            results[name].append(one_run(model, args.prompt_len, args.new_tokens, args.no_measure, packed))
    for _, name, _ in models:
        print(json.dumps(model_line(name, results[name], args.prompt_len, args.new_tokens, load_before)), flush=True)


if __name__ == "__main__":
    main()
