"""`hivekeeper plan`: recommend how to run (or serve) a model on a machine, with predicted speed, memory, energy, cost.

Human output is a short table and the reason (the bottleneck); `--json` prints one object (docs/plan-json.md).
Numbers are read as text and checked here, so bad input is one line on stderr (exit 2) rather than argparse's usage.
"""

from __future__ import annotations

import argparse
import json
import math

from hivekeeper.planner.costmodel import Workload
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.policy import GOALS, QUANTS, Constraints, Plan, plan_to_dict, search

HOST_OVERRIDES = {  # option -> (keyword of resolve_hardware, limit)
    "ram_gb": ("ram_gb", 65_536.0),
    "disk_gb": ("disk_gb", 1_000_000.0),
    "disk_read_gbps": ("disk_read_gbps", 1000.0),
    "network_mbps": ("network_mbps", 10_000_000.0),
    "rtt_ms": ("rtt_ms", 60_000.0),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="catalog id (e.g. meta-llama/Llama-2-7b-hf), config.json, or a folder with one")
    parser.add_argument("--hardware", default="auto",
                        help="catalog id, hardware JSON file, or auto (detect this machine)")
    parser.add_argument("--goal", default="chat", help="chat (one stream's latency), batch (throughput) or serve "
                                                        "(a swarm server's span)")
    parser.add_argument("--quant", default="auto", help="weight format: auto, none (16-bit), int8 or nf4")
    parser.add_argument("--prompt-len", default="512", metavar="N", help="prompt tokens (default 512)")
    parser.add_argument("--output-len", default="128", metavar="N", help="generated tokens (default 128)")
    parser.add_argument("--batch", metavar="N", help="sequences run together (default: 1 for chat, searched for batch)")
    parser.add_argument("--context", metavar="N", help="KV cache tokens per sequence (default prompt + output)")
    parser.add_argument("--reserve-gb", default="0", metavar="X", help="memory to leave free on the GPU and in RAM, GB")
    parser.add_argument("--price-per-hour", metavar="USD", help="machine price for cost per query (default: catalog)")
    parser.add_argument("--ram-gb", metavar="X", help="host RAM (overrides the catalog host)")
    parser.add_argument("--disk-gb", metavar="X", help="free disk space for offloading")
    parser.add_argument("--disk-read-gbps", metavar="X", help="disk read speed, GB/s")
    parser.add_argument("--network-mbps", metavar="X", help="network speed, Mbit/s")
    parser.add_argument("--rtt-ms", metavar="X", help="round-trip time to a typical peer, ms")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _integer(text: str | None, option: str, low: int, high: int) -> int | None:
    if text is None:
        return None
    try:
        value = int(str(text).strip())
    except ValueError:
        raise InputError(f"--{option} must be an integer, got {text!r}") from None
    if not low <= value <= high:
        raise InputError(f"--{option} must be from {low} to {high}, got {value}")
    return value


def _number(text: str | None, option: str, low: float, high: float) -> float | None:
    if text is None:
        return None
    try:
        value = float(str(text).strip())
    except ValueError:
        raise InputError(f"--{option} must be a number, got {text!r}") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise InputError(f"--{option} must be from {low:g} to {high:g}, got {text}")
    return value


def _hardware(arg: str, overrides: dict[str, float]):
    """(spec, efficiency or None). auto: this machine, with its saved profile's measured numbers and (calibrated)
    efficiency factors when `hivekeeper measure` / `hivekeeper profile` ran here."""
    if arg == "auto":
        from hivekeeper.core.machine.profiles import detect_or_load_profile
        from hivekeeper.planner.hardware_catalog import apply_host_overrides

        hardware, efficiency = detect_or_load_profile()
        return apply_host_overrides(hardware, where="command line", **overrides), efficiency
    from hivekeeper.planner.hardware_catalog import resolve_hardware

    return resolve_hardware(arg, **overrides), None


def build_plan(args: argparse.Namespace) -> Plan:
    """Read and check the options, then search. Every problem is an InputError naming the option."""
    if not args.model:
        raise InputError("--model is required (a catalog id, a config.json, or a folder holding one)")
    if args.goal not in GOALS:
        raise InputError(f"--goal must be one of {', '.join(GOALS)}, got {args.goal!r}")
    if args.quant not in QUANTS:
        raise InputError(f"--quant must be one of {', '.join(QUANTS)}, got {args.quant!r}")
    prompt_len = _integer(args.prompt_len, "prompt-len", 1, 10_000_000)
    output_len = _integer(args.output_len, "output-len", 1, 10_000_000)
    batch = _integer(args.batch, "batch", 1, 65536)
    context = _integer(args.context, "context", 1, 10_000_000)
    reserve_gb = _number(args.reserve_gb, "reserve-gb", 0.0, 1_000_000.0)
    price = _number(args.price_per_hour, "price-per-hour", 0.0, 10_000.0)
    overrides = {}
    for option, (keyword, limit) in HOST_OVERRIDES.items():
        value = _number(getattr(args, option), option.replace("_", "-"), 0.0, limit)
        if value is not None:
            overrides[keyword] = value
    workload = Workload(prompt_len, output_len, context)

    from hivekeeper.planner.model_catalog import load_model_spec

    model = load_model_spec(args.model)
    hardware, efficiency = _hardware(args.hardware, overrides)
    reserve = {"gpu": reserve_gb * 1e9, "cpu": reserve_gb * 1e9}
    constraints = Constraints(quant=args.quant, batch_size=batch, reserve_bytes=reserve)
    return search(model, hardware, args.goal, constraints, workload, efficiency=efficiency, price_per_hour=price)


# ---- human output ---------------------------------------------------------------------------------------------------
def _num(x: float) -> str:
    """Three significant digits without exponents for the sizes people read (12,345 rather than 1.23e+04)."""
    if x >= 1000:
        return f"{x:,.0f}"
    if x >= 0.01 or x == 0:
        return f"{x:.3g}"
    return f"{x:.2e}"


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{_num(x / 1e9)} GB"


def _tps(x: float | None) -> str:
    return "-" if x is None else f"{_num(x)} tokens/s"


def _seconds(x: float) -> str:
    return f"{_num(x * 1e3)} ms" if x < 1 else f"{_num(x)} s"


def _where(placement: dict[str, float]) -> str:
    names = {"gpu": "GPU", "cpu": "RAM", "disk": "disk"}
    return " / ".join(f"{100 * v:.0f}% {names[t]}" for t, v in placement.items() if v > 0) or "-"


def render(plan: Plan, data: dict) -> str:
    rows: list[tuple[str, str]] = [("fit", {"local": "runs locally", "swarm": "only with the swarm",
                                            "none": "does not fit"}[plan.fit])]
    policy = data.get("policy")
    if plan.server is not None and plan.server.num_blocks:
        s = plan.server
        rows += [("serve", f"{s.num_blocks} of {s.total_blocks} blocks, {s.weight_format}, "
                           f"{s.cache_tokens}-token cache per block"),
                 ("per block", f"{_num(s.inference_rps)} inference rps, {_num(s.forward_rps)} forward rps"),
                 ("advertised", f"{_num(s.throughput)} rps")]
    elif policy is not None:
        split = f" ({policy['micro_batch_size']} × {policy['num_micro_batches']})" \
            if policy["num_micro_batches"] > 1 else ""
        rows += [("weights", f"{policy['weight_format']}: {_where(policy['weights'])}"),
                 ("KV cache", f"{_where(policy['kv_cache'])} ({policy['kv_cache_mode']}"
                              f"{', attention on CPU' if policy['attention_on_cpu'] else ''})"),
                 ("batch", f"{policy['batch_size']}{split}, prefetch depth {policy['prefetch_depth']}")]
    if data.get("decode_tokens_per_s") is not None:
        for phase in ("decode", "prefill"):
            rows.append((phase, f"{_tps(data[f'{phase}_tokens_per_s'])}  "
                                f"(roofline {_tps(data[f'roofline_{phase}_tokens_per_s'])})"))
        peaks, capacity = data["peak_memory_bytes"], data.get("capacity_bytes") or {}
        rows.append(("peak memory", " · ".join(
            f"{name} {_gb(peaks.get(tier))}" + (f" of {_gb(capacity[tier])}" if capacity.get(tier) else "")
            for tier, name in (("gpu", "GPU"), ("cpu", "RAM"), ("disk", "disk")) if peaks.get(tier))))
        rows.append(("compute-bound", f"from batch {data['min_compute_bound_batch']} "
                                      f"({data['min_compute_bound_basis']})"))
    if data.get("runtime_s") is not None:
        rows.append(("runtime", f"{_seconds(data['runtime_s'])} for {data['prompt_len']} + {data['output_len']} "
                                f"tokens (α {_seconds(data['alpha_s'])} + β {_seconds(data['beta_s'])} per token)"))
        cost = "" if data["cost_usd"] is None else f" · ${data['cost_usd']:.3g} per query, " \
                                                   f"${data['cost_usd_per_1k_tokens']:.3g} per 1k tokens"
        rows.append(("energy, cost", f"{_num(data['energy_j'])} J per query{cost}"))
    width = max(len(name) for name, _ in rows)
    header = f"{plan.model} on {plan.hardware} (goal: {plan.goal})"
    body = "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)
    return f"{header}\n{body}\nwhy: {plan.reason}\nefficiency: {plan.efficiency}"


def run(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    data = plan_to_dict(plan)
    if args.json:
        print(json.dumps(data))
    else:
        print(render(plan, data))
    return 0
