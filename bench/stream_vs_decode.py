"""Is a miss in the demo's predicted decode the cost model's or the host's? (issue 14 item 12)

On this VM the memory bandwidth swings ±35% from minute to minute, and a prediction made from one quick measurement
is judged against a decode run seconds or minutes later. This bench separates the two: in one process it alternates,
`--pairs` times, a short streaming-rate reading (exactly the quick measurement's: one-row decode steps through a wide
and a narrow span of random fp32 blocks beyond the last-level cache, timed in turn, bandwidth and a block's fixed cost
fitted to their medians: measure.stream_reading) with a short generation of the demo model as `generate` runs it
(the plan for this machine, OffloadedModel, the same thread layout), and reports per pair:

- the reading (GB/s, a block's ms) and the demo's measured decode tokens/s;
- `achieved_over_reading`: the weight bytes a demo step reads per second of the step over the reading's rate (the
  fraction of the reading the real model achieves; the cost model assumes 1 minus the blocks' fixed cost);
- `predicted_over_measured`: the planner's decode tokens/s for the demo, with that reading in place of the profile's
  (the rest of the profile from one quick measurement at the start), over the measured tokens/s beside it;
- `pooled_predicted_over_measured`: the same with the last POOLED readings pooled as the quick measurement pools
  its five (measure.pooled_reading), over ~20 s rather than its ~10.

If both ratios stay steady while the reading and the decode swing together, the cost model is right and a miss is the
timing of the reading; if they wander, or sit away from 1, the model's term is off. One JSON line, with the load
average before and after:

    python bench/stream_vs_decode.py --pairs 12
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile

from _common import demo_preset, fixed_prompt, timed_parts  # bench/ is the script's folder, first on sys.path

POOLED = 5  # readings pooled as the quick measurement pools them (measure.pooled_reading): this one and the 4 before


def spread(values: list[float]) -> dict:
    """min, median, max and (max - min) / median of a list."""
    middle = statistics.median(values)
    return {"min": round(min(values), 3), "median": round(middle, 3), "max": round(max(values), 3),
            "spread": round((max(values) - min(values)) / middle, 3) if middle else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    os.environ["HIVEKEEPER_CONFIG_DIR"] = tempfile.mkdtemp(prefix="hivekeeper-svd-")  # never the user's profile

    from hivekeeper.planner.calibration import measured_efficiency

    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.measure import QUICK, StreamSpans, pooled_reading, run_benchmarks, stream_reading
    from hivekeeper.core.machine.measurement import BLOCK_OVERHEAD_KEY, WEIGHT_STREAM_KEY
    from hivekeeper.core.machine.profiles import apply_measurements
    from hivekeeper.core.offload.local_plan import plan_local_run, search_policy, use_runtime_threads
    from hivekeeper.core.offload.offloaded_model import OffloadedModel
    from hivekeeper.core.runtime.checkpoint import load_config
    from hivekeeper.core.runtime.generation import generate

    detected = detect_hardware()
    measurements = run_benchmarks(QUICK)  # the rest of the profile: a first plan's quick measurement
    path = demo_preset("100m")
    config = load_config(path)
    use_runtime_threads()
    workload = dict(batch=1, prompt_len=args.prompt_len, max_new_tokens=args.new_tokens)
    _, plan = plan_local_run("auto", path, config, **workload, max_length=args.prompt_len + args.new_tokens,
                             hardware=apply_measurements(detected, measurements),
                             efficiency=measured_efficiency(apply_measurements(detected, measurements)))
    runner = OffloadedModel(path, plan)
    times = timed_parts(runner)
    step_bytes = 4 * (config.num_layers * config.block_param_count() + config.vocab_size * config.hidden_size)  # fp32
    prompt = fixed_prompt(config.vocab_size, args.prompt_len)
    spans = StreamSpans.make(QUICK.stream_hidden, QUICK.stream_bytes)
    generate(runner, prompt, max_new_tokens=4, ignore_eos=True)  # warm-up: pages touched, kernels chosen
    readings, pairs = [], []
    shapes = spans.shapes()

    def predicted(reading) -> tuple[float, str]:
        """The planner's decode tokens/s for the demo with this reading in place of the profile's, and its format."""
        values = {WEIGHT_STREAM_KEY: reading.bandwidth, BLOCK_OVERHEAD_KEY: reading.per_block}
        hardware = apply_measurements(detected, [dataclasses.replace(m, value=values.get(m.key, m.value))
                                                 for m in measurements])
        choice = search_policy(path, **workload, hardware=hardware, efficiency=measured_efficiency(hardware))
        return choice.predicted["decode_tokens_per_s"], choice.policy.weight_format

    block_bytes = 4 * config.num_layers * config.block_param_count()
    for _ in range(args.pairs):
        readings.append(stream_reading(spans, max(QUICK.repeats, QUICK.step_repeats)))
        reading, pooled = readings[-1], pooled_reading(readings[-POOLED:], shapes)
        result = generate(runner, prompt, max_new_tokens=args.new_tokens, ignore_eos=True)
        step_s = 1 / result.decode_tokens_per_s
        blocks_s, head_s = (statistics.median(times[name][1:]) for name in ("blocks", "head"))  # [0]: the prefill
        for part in times.values():
            part.clear()
        (now, weight_format), (from_pooled, _) = predicted(reading), predicted(pooled)
        pairs.append({"reading_gbps": round(reading.bandwidth / 1e9, 2),
                      "block_ms": round(reading.per_block * 1e3, 3),
                      "pooled_gbps": round(pooled.bandwidth / 1e9, 2),
                      "pooled_block_ms": round(pooled.per_block * 1e3, 3),
                      "measured_tokens_per_s": round(1 / step_s, 2), "predicted_tokens_per_s": round(now, 2),
                      "achieved_over_reading": round(step_bytes / step_s / reading.bandwidth, 3),
                      "predicted_over_measured": round(now * step_s, 3),
                      "pooled_predicted_over_measured": round(from_pooled * step_s, 3),
                      "weight_format": weight_format,
                      "measured_ms": {"blocks": round(blocks_s * 1e3, 2), "head": round(head_s * 1e3, 2),
                                      "rest": round((step_s - blocks_s - head_s) * 1e3, 2)},
                      "reading_ms": {"blocks": round((block_bytes / reading.bandwidth
                                                      + config.num_layers * reading.per_block) * 1e3, 2),
                                     "head": round((step_bytes - block_bytes) / reading.bandwidth * 1e3, 2)}})
    keys = ("reading_gbps", "measured_tokens_per_s", "achieved_over_reading", "predicted_over_measured",
            "pooled_predicted_over_measured")
    print(json.dumps({"bench": "stream_vs_decode", "model": "demo-100m", "step_weight_mb": round(step_bytes / 1e6),
                      "pairs": pairs, **{k: spread([p[k] for p in pairs]) for k in keys},
                      "loadavg_before": round(load_before, 2), "loadavg_after": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
