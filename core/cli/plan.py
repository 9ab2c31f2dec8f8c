"""`hivekeeper plan`: recommend how to run (or serve) a model on a machine, with predicted speed, memory, energy, cost.

Human output is a short table and the reason (the bottleneck); `--json` prints one object (docs/plan-json.md).
Numbers are read as text and checked here, so bad input is one line on stderr (exit 2) rather than argparse's usage.
For a GGUF model the plan also says what the file holds (bytes per weight of each tensor type, the total, a block)
and what the runtime holds (docs/gguf.md). On a CPU the runtime keeps a GGUF's Q8_0/Q4_0/Q4_1 linears packed, so the
plan of such a file is in that format (its kernels' speed and bytes), as `generate` runs it; the "format" row (JSON
"format_choice") names the format and why. Where nothing fits locally the reason (JSON and text alike) goes on to say
where the memory goes (what is kept free and why, what the client side and the runtime need) and which --reserve-gb,
if any, lets the model run here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from hivekeeper.planner.costmodel import PACKED_HEAD_FORMAT, Workload, block_weight_bytes, evaluate, weight_bytes
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.format_choice import FormatChoice, plan_constraints
from hivekeeper.planner.formats import PACKED_FORMATS, packed_words
from hivekeeper.planner.gguf_metadata import gguf_sizes, is_gguf
from hivekeeper.planner.hardware import GIB, HEADROOM_RULE, HEADROOM_TEXT, default_headroom
from hivekeeper.planner.hardware_catalog import field_limits
from hivekeeper.planner.policy import (GOALS, MOSTLY_ON_DISK, QUANTS, Plan, check_context, plan_to_dict, search,
                                       weighed_words)

from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, model_path_or_id

HOST_OVERRIDES = {  # option -> (keyword of resolve_hardware, the hardware field limits it is checked against)
    "ram_gb": ("ram_gb", "ram_gb"),
    "disk_gb": ("disk_gb", "capacity_gb"),
    "disk_read_gbps": ("disk_read_gbps", "disk_gbps"),
    "network_mbps": ("network_mbps", "network_mbps"),
    "rtt_ms": ("rtt_ms", "rtt_ms"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL_ID,
                        help="catalog id (e.g. meta-llama/Llama-2-7b-hf), config.json, a GGUF file, or a folder with "
                             f"one of them; default {DEFAULT_MODEL_ID}, the built-in model (as chat and generate)")
    parser.add_argument("--hardware", default="auto",
                        help="catalog id, hardware JSON file, or auto (detect this machine)")
    parser.add_argument("--goal", default="chat", help="chat (one stream's latency), batch (throughput) or serve "
                                                        "(a swarm server's span)")
    parser.add_argument("--quant", default="auto",
                        help="weight format: auto (the fastest the model runs in here: a GGUF's own Q8_0/Q4_0/Q4_1 "
                             "on a CPU, int8/nf4 only on a GPU), none (16-bit or fp32), int8 or nf4 (bitsandbytes, "
                             "for GPUs), q8_0, q4_0 or q4_1 (a GGUF of that type, on a CPU)")
    parser.add_argument("--prompt-len", default="512", metavar="N", help="prompt tokens (default 512)")
    parser.add_argument("--output-len", default="128", metavar="N", help="generated tokens (default 128)")
    parser.add_argument("--batch", metavar="N", help="sequences run together (default: 1 for chat, searched for batch)")
    parser.add_argument("--context", metavar="N", help="KV cache tokens per sequence (default prompt + output)")
    parser.add_argument("--reserve-gb", metavar="X",
                        help="memory to leave free on the GPU and in RAM, GB (default: the headroom rule of "
                             "docs/cost-model.md: the larger of 2 GiB and 10%% of RAM, 0.5 GiB and 5%% of a GPU, plus "
                             "what other programs hold now)")
    parser.add_argument("--price-per-hour", metavar="USD", help="machine price for cost per query (default: catalog)")
    parser.add_argument("--ram-gb", metavar="X", help="host RAM (overrides the catalog host)")
    parser.add_argument("--disk-gb", metavar="X", help="free disk space for offloading")
    parser.add_argument("--disk-read-gbps", metavar="X", help="disk read speed, GB/s")
    parser.add_argument("--network-mbps", metavar="X", help="network speed, Mbit/s")
    parser.add_argument("--rtt-ms", metavar="X", help="round-trip time to a typical peer, ms")
    parser.add_argument("--no-measure", action="store_true",
                        help="with --hardware auto on a machine never measured: plan with estimates instead of "
                             "measuring it quickly first")
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


def _hardware(arg: str, overrides: dict[str, float], measure: bool = True):
    """(spec, efficiency or None). auto: this machine, with its saved profile's measured numbers and (calibrated)
    efficiency factors when `hivekeeper measure` / `hivekeeper profile` ran here; without a profile (the first plan
    for this machine) it is measured quickly first (first_measure.this_machine), unless `measure` is False."""
    if arg == "auto":
        from hivekeeper.planner.hardware_catalog import apply_host_overrides

        from hivekeeper.core.machine.first_measure import this_machine

        hardware, efficiency = this_machine(measure)
        return apply_host_overrides(hardware, where="command line", **overrides), efficiency
    from hivekeeper.planner.hardware_catalog import resolve_hardware

    return resolve_hardware(arg, **overrides), None


def kept_free(hardware, reserve_gb: float | None) -> dict[str, float]:
    """Bytes per tier the plan leaves free: --reserve-gb on the GPU and in RAM, else the default headroom
    (planner.hardware.default_headroom). A reserve that leaves no memory is an InputError naming the limit."""
    if reserve_gb is None:
        return default_headroom(hardware)
    sizes = [hardware.cpu.memory_bytes, *(gpu.memory_bytes for gpu in hardware.gpus)]
    limit = min(sizes) / 1e9
    if reserve_gb >= limit:
        where = "RAM" if limit * 1e9 == hardware.cpu.memory_bytes else "GPU memory"
        machine = "this machine" if hardware.id == "detected" else hardware.id
        raise InputError(f"--reserve-gb {reserve_gb:g} leaves nothing to plan with: it must be below the "
                         f"{limit:.3g} GB of {where} that {machine} has")
    return {"gpu": reserve_gb * 1e9 if hardware.gpus else 0.0, "cpu": reserve_gb * 1e9, "disk": 0.0}


def build_plan(args: argparse.Namespace) -> tuple[Plan, dict[str, float], object, FormatChoice]:
    """Read and check the options, then search: (the plan, the bytes per tier it leaves free, the HardwareSpec, the
    format choice). Every problem is an InputError naming the option."""
    if not args.model:
        raise InputError("--model is required (a catalog id, a config.json, a GGUF file, or a folder holding one)")
    if args.goal not in GOALS:
        raise InputError(f"--goal must be one of {', '.join(GOALS)}, got {args.goal!r}")
    if args.quant not in QUANTS:
        raise InputError(f"--quant must be one of {', '.join(QUANTS)}, got {args.quant!r}")
    model_arg = model_path_or_id(args.model)
    prompt_len = _integer(args.prompt_len, "prompt-len", 1, 10_000_000)
    output_len = _integer(args.output_len, "output-len", 1, 10_000_000)
    batch = _integer(args.batch, "batch", 1, 65536)
    context = _integer(args.context, "context", 1, 10_000_000)
    reserve_gb = _number(args.reserve_gb, "reserve-gb", 0.0, 1_000_000.0)
    price = _number(args.price_per_hour, "price-per-hour", 0.0, 10_000.0)
    overrides = {}
    for option, (keyword, limit) in HOST_OVERRIDES.items():
        value = _number(getattr(args, option), option.replace("_", "-"), *field_limits(limit))
        if value is not None:
            overrides[keyword] = value
    workload = Workload(prompt_len, output_len, context)

    from hivekeeper.planner.model_catalog import load_model_spec

    model = load_model_spec(model_arg)
    check_context(model, workload)  # before measuring a never-measured machine
    hardware, efficiency = _hardware(args.hardware, overrides, measure=not args.no_measure)
    reserve = kept_free(hardware, reserve_gb)
    constraints, choice = plan_constraints(model_arg, args.quant, hardware, args.goal, batch_size=batch,
                                           reserve_bytes=reserve)  # as the app's Plan page plans it
    plan = search(model, hardware, args.goal, constraints, workload, efficiency=efficiency, price_per_hour=price)
    if plan.prediction is None:  # the reason says where the memory went and what a smaller reserve would do
        from hivekeeper.planner.efficiency import default_efficiency
        from hivekeeper.planner.swarm import client_bytes

        eff = efficiency or default_efficiency(hardware)
        words = room_words(hardware, reserve, reserve_gb is not None, client_bytes(model, workload, eff),
                           eff.accelerator.runtime_bytes) if plan.fit == "none" else ""
        hint = reserve_hint(lambda trial: search(model, hardware, args.goal, dataclasses.replace(
            constraints, reserve_bytes=trial), workload, efficiency=efficiency), hardware, reserve)
        plan = dataclasses.replace(plan, reason=" ".join(part for part in (plan.reason, words, hint) if part))
    elif context and context > prompt_len + output_len:
        words = filled_context_words(model, hardware, plan, efficiency, reserve)
        plan = dataclasses.replace(plan, warnings=(*plan.warnings, words))
    return plan, reserve, hardware, choice


def filled_context_words(model, hardware, plan: Plan, efficiency, reserve: dict[str, float]) -> str:
    """For a --context beyond prompt + output: the plan's policy predicted for a conversation that fills it (the
    prompt the context less the output). A newcomer (session 26) read 163 tokens/s for `--context 8192`, planned at the
    default 512 + 128 tokens; a chat near 8k tokens decoded at 35-41."""
    asked = plan.workload
    filled = Workload(max(1, asked.context_len - asked.output_len), asked.output_len, asked.context_len)
    full = evaluate(model, hardware, plan.prediction.policy, filled, efficiency, reserve)
    return (f"--context {asked.context_len:,}: the speeds above are for {asked.prompt_len:,} + {asked.output_len:,} "
            f"tokens; a conversation that fills the context ({filled.prompt_len:,} prompt tokens) decodes at "
            f"{full.decode_tokens_per_s:.3g} tokens/s and reads its prompt at {full.prefill_tokens_per_s:.3g} "
            f"(--prompt-len {filled.prompt_len} plans for it)")


def _memories(hardware) -> list[tuple[str, str, float, float]]:
    """(tier, name, size, bytes other programs hold) of the memories a plan keeps room in: RAM, and a GPU's own."""
    memories = [("cpu", "RAM", hardware.cpu.memory_bytes, hardware.cpu.in_use_bytes)]
    if hardware.gpus and not hardware.gpus[0].unified_memory:
        gpu = hardware.gpus[0]
        memories.append(("gpu", "GPU memory", gpu.memory_bytes, gpu.in_use_bytes))
    return memories


def room_words(hardware, reserve: dict[str, float], explicit: bool, client: float, runtime: float) -> str:
    """For a model whose client side fits nowhere: what each memory keeps free, and why (--reserve-gb, or the default
    headroom and what other programs hold), what is left, and what the client side needs, the runtime's share named.
    A newcomer read "cannot even hold the client side" for a 96 MB model on 1 GB of RAM that the headroom kept free."""
    clauses = []
    for tier, name, size, in_use in _memories(hardware):
        kept = min(size, reserve.get(tier, 0.0))
        if explicit:
            why = f"--reserve-gb {kept / 1e9:g}"
        else:
            minimum, fraction = HEADROOM_RULE[tier]
            why = f"the default headroom: the larger of {minimum / GIB:g} GiB and {100 * fraction:g}% of it"
            why += f", plus {_gb(in_use)} that other programs hold" if in_use > 0 else ""
            why += ", at most all of it" if kept >= size else ""
        left = "leaving nothing" if kept >= size else f"leaving {_gb(size - kept)}"
        clauses.append(f"of its {_gb(size)} of {name} the plan keeps {_gb(kept)} free ({why}), {left}")
    text = "; ".join(clauses)
    return (f"{text[0].upper()}{text[1:]}; the client side alone needs {_gb(client)}, {_gb(runtime)} of it the "
            f"runtime itself.")


def _round_down(gb: float) -> float:
    """A reserve to suggest: `gb` rounded down to one significant digit (room to spare over the tightest value)."""
    if gb <= 0:
        return 0.0
    scale = 10.0 ** math.floor(math.log10(gb))
    return math.floor(gb / scale + 1e-9) * scale


MIN_SUGGESTED_RESERVE = 10e6  # bytes: a plan that runs only with less kept free gets no hint


def reserve_hint(plan_with, hardware, reserve: dict[str, float]) -> str:
    """Where the model runs here once less is kept free (only what other programs hold): "With --reserve-gb X it runs
    here.", X the largest one-digit reserve with which it still runs; "" where it would not run either.
    `plan_with(reserve_bytes)` plans with that reserve, for the goal asked (a batch of 64 split into micro-batches
    runs where one chat step of 64 rows does not: a hint planned as chat was missing or too small for it). "Runs": as
    with the least kept free, no more of its weights and cache on disk. The reserve is searched for
    (reserve_boundary), not read off one plan's peak: a batch plan fills the memory it is given, and its peak with
    nothing kept free suggested "--reserve-gb 1e-06"."""
    memories = _memories(hardware)
    floor = {tier: float(in_use) for tier, _name, _size, in_use in memories}
    if all(reserve.get(tier, 0.0) <= floor[tier] for tier in floor):
        return ""  # nothing kept free beyond what other programs hold: a smaller reserve is no way out
    kept = min(reserve.get(tier, 0.0) for tier in floor)

    def planned(gb: float):
        trial = {tier: max(least, gb * 1e9) for tier, least in floor.items()}
        return plan_with({**trial, "disk": reserve.get("disk", 0.0)})

    lowest = max(floor.values()) / 1e9
    best = planned(lowest)
    if best.prediction is None:
        return ""

    def runs(gb: float) -> bool:  # as it runs with the least kept free: no more of it on disk
        trial = planned(gb)
        if trial.prediction is None:
            return False
        return on_disk(trial.prediction.policy) <= on_disk(best.prediction.policy) + 1e-9

    suggested = _round_down(reserve_boundary(runs, lowest, kept / 1e9))
    if suggested * 1e9 < max(MIN_SUGGESTED_RESERVE, max(floor.values())) or not runs(suggested):
        return ""  # it runs only with (almost) nothing kept free for the system: no advice to give
    names = " and of ".join(name for _tier, name, _size, _in_use in memories)
    return f"With --reserve-gb {suggested:g} (keeping {suggested:g} GB of {names} free) it runs here."


def on_disk(policy) -> float:
    """The shares of a policy's weights and KV cache on disk, summed: what a smaller reserve must not raise."""
    return policy.weights.disk + policy.kv_cache.disk


def reserve_boundary(runs, low: float, high: float, steps: int = 16) -> float:
    """The largest reserve (GB) between `low` (with which the plan runs) and `high` (with which it does not) that
    `runs`, to 1/2^steps of the interval: fewer bytes kept free never stops a plan that ran."""
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if runs(middle) else (low, middle)
    return low


def gguf_report(model: str, data: dict, this_machine: bool) -> dict | None:
    """For a GGUF model: the file's sizes (gguf_metadata.GGUFSizes.as_dict) and, when the plan runs, what the
    runtime holds in memory: the weights dequantized to the float format that runs (on this machine, the one the
    engine computes the plan's format in), the whole model and its largest block; for a plan of the GGUF's packed
    format, the packed bytes (a plan of a float format, --quant none, runs dequantized: local_plan.engine_plan)."""
    model = model_path_or_id(model)
    if not is_gguf(model):
        return None
    from hivekeeper.planner.model_catalog import load_model_spec

    report = gguf_sizes(model).as_dict()
    policy = data.get("policy")
    if policy is not None:
        spec, planned = load_model_spec(model), policy["weight_format"]
        rows = int(policy.get("micro_batch_size") or 1)  # the rows its decode steps multiply decide a 16-bit plan's
        held = format_that_runs(planned, rows) if this_machine or planned in PACKED_FORMATS else planned
        report.update(memory_format=held, memory_bytes=round(weight_bytes(spec, held)),
                      memory_block_bytes=round(block_weight_bytes(spec, held)))
        if held != planned and planned not in PACKED_FORMATS:
            report["memory_note"] = f"the plan's {planned} weights run as {held} on this machine"
        if planned in PACKED_FORMATS:
            report.update(packed_memory(model, spec, held))
    return report


def packed_memory(model: str, spec, held: str) -> dict:
    """For a plan of a GGUF's packed format (one for a CPU), where the engine keeps its Q8_0/Q4_0/Q4_1 linears packed
    (fp32, gguf.packed_by_default): the bytes it holds then (the blocks as load_packed_block builds them) and the
    packed types; else nothing."""
    from hivekeeper.core.offload.packed_stream import outside_held_bytes
    from hivekeeper.core.runtime.gguf import GGUFCheckpoint, packed_by_default

    if held != "fp32" or not packed_by_default():
        return {}
    checkpoint = GGUFCheckpoint(model, packed=True)
    blocks = gguf_sizes(model).packed_block_bytes  # the one count of a packed block's bytes, per layer
    if sum(blocks) >= spec.num_layers * block_weight_bytes(spec, held):
        return {}
    outside = outside_held_bytes(checkpoint)  # the engine's packed head and embedding (packed_stream.load_outside)
    if outside is None:  # the head does not pack: embedding and head in fp32
        outside = weight_bytes(spec, held) - spec.num_layers * block_weight_bytes(spec, held)
    types = sorted({checkpoint.tensor_type(name) for name in checkpoint.tensors
                    if name.startswith("model.layers.") and checkpoint.packable(name)})
    return {"memory_bytes": round(outside + sum(blocks)), "memory_block_bytes": max(blocks),
            "memory_packed": types}


def format_that_runs(weight_format: str, rows: int = 1) -> str:
    """The float format the engine holds a plan's weight format in on this machine, for decode micro-batches of
    `rows` rows, the plan's own (a 16-bit plan runs in fp32 on a CPU where it has no fast 16-bit path:
    local_plan.compute_dtype)."""
    from hivekeeper.core.offload.placement import FLOAT_FORMATS
    from hivekeeper.core.offload.local_plan import compute_dtype, default_device

    dtype, _quant = compute_dtype(weight_format, default_device(), rows, planned_rows=rows)
    return {value: name for name, value in FLOAT_FORMATS.items()}[dtype]


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


def _size(x: float) -> str:
    return f"{_num(x / 1e6)} MB" if x < 1e9 else _gb(x)


def _gguf_rows(gguf: dict) -> list[tuple[str, str]]:
    """What the GGUF file holds and what the runtime holds once it has loaded it."""
    types = ", ".join(f"{name} {t['bits_per_weight']:.3g} bits/weight" for name, t in gguf["types"].items())
    rows = [("GGUF file", f"{_size(gguf['tensor_bytes'])} of weights ({types}); {_size(gguf['block_bytes'])} "
                          f"per block")]
    if "memory_format" in gguf:
        note = f"; {gguf['memory_note']}" if "memory_note" in gguf else ""
        rows.append(("in memory", f"{_size(gguf['memory_bytes'])} as {held_as(gguf)}, "
                                  f"{_size(gguf['memory_block_bytes'])} per block: {held_how(gguf)}{note}"))
    return rows


def held_as(gguf: dict) -> str:
    """The format the runtime holds the blocks' weights in, as `generate` names it ("q4_1 (packed)" where they stay
    packed: OffloadPlan.describe; else the float format it dequantizes them to)."""
    packed = gguf.get("memory_packed")
    return packed_words("/".join(packed)) if packed else gguf["memory_format"]


def held_how(gguf: dict) -> str:
    """Which of the weights stay packed and what the rest is held in."""
    if not gguf.get("memory_packed"):
        return "the runtime dequantizes GGUF weights"
    return (f"the blocks' {'/'.join(gguf['memory_packed'])} linears stay packed as the file stores them and the LM "
            f"head packed as {PACKED_HEAD_FORMAT}; the rest is held as {gguf['memory_format']}")


def runtime_row(data: dict) -> tuple[str, str]:
    """The runtime, labelled with what it covers: one query, or the whole batch (whose queries all finish then)."""
    batch = (data.get("policy") or {}).get("batch_size") or 1
    tokens = f"{data['prompt_len']} + {data['output_len']} tokens"
    steps = f"first token after {_seconds(data['alpha_s'])}, then {_seconds(data['beta_s'])} per token"
    if batch == 1 or data.get("goal") == "serve":
        return "runtime per query", f"{_seconds(data['runtime_s'])} for {tokens} ({steps})"
    return ("runtime of the batch", f"{_seconds(data['runtime_s'])} for {batch} queries of {tokens} together, all "
                                    f"finishing then ({_seconds(data['runtime_s'] / batch)} per query on average; "
                                    f"{steps} of every query)")


def _share(x: float) -> str:
    """A share as a whole percentage that never reads 0% or 100% for a part (0.004 -> "under 1%")."""
    if 0 < x < 0.005:
        return "under 1%"
    return f"{min(100 * x, 99) if x < 1 else 100 * x:.0f}%"


def fit_words(plan: Plan) -> str:
    """The "fit" row, as JSON "fit" says it: a "swarm" plan that has a local policy runs here with part of its
    weights on disk (the reason says why the swarm is suggested), so it says both rather than "only with the swarm"."""
    if plan.fit == "none":
        return "does not fit"
    if plan.prediction is None:
        return "only with the swarm (this machine can run the client side)"
    disk = plan.prediction.policy.weights.disk
    if plan.fit == "swarm":
        return (f"runs locally, streaming {_share(disk)} of the weights from disk at "
                f"{_num(plan.prediction.decode_tokens_per_s)} tokens/s; the swarm is suggested instead")
    if disk > MOSTLY_ON_DISK and plan.goal != "serve":
        return f"runs locally, streaming {_share(disk)} of the weights from disk"
    return "runs locally"


def kept_free_words(kept_free: dict) -> str:
    """The "kept free" row: GB per tier and the rule ("nothing (--reserve-gb 0)" where nothing is kept)."""
    kept = kept_free["bytes"]
    parts = [f"{name} {_gb(kept[tier])}" for tier, name in (("gpu", "GPU"), ("cpu", "RAM"), ("disk", "disk"))
             if kept.get(tier)]
    rule = kept_free["rule"]
    if rule == "--reserve-gb":
        rule += f" {max(kept.get('gpu', 0), kept.get('cpu', 0)) / 1e9:g}"
    return f"{' · '.join(parts) or 'nothing'} ({rule})"


def render(plan: Plan, data: dict) -> str:
    rows: list[tuple[str, str]] = [("fit", fit_words(plan))]
    policy = data.get("policy")
    if plan.server is not None and plan.server.num_blocks:
        s = plan.server
        rows += [("serve", f"{s.num_blocks} of {s.total_blocks} blocks, {s.weight_format}"
                           f"{' packed' if s.packed else ''}, "
                           f"{s.cache_tokens}-token cache per block"),
                 ("per block", f"{_num(s.inference_rps)} inference rps, {_num(s.forward_rps)} forward rps"),
                 ("advertised", f"{_num(s.throughput)} rps")]
        if data.get("serve_measured"):  # serve's own timing of such a block here, beside the planner's estimate
            m = data["serve_measured"]
            rows[-2:] = [(name, f"{value} (planner's estimate)") for name, value in rows[-2:]]
            rows += [("measured", f"{_num(m['inference_rps'])} inference rps, {_num(m['forward_rps'])} forward rps "
                                  f"per block, {m['source']}: serve advertises {_num(m['throughput'])} rps")]
    elif policy is not None:
        split = f" ({policy['micro_batch_size']} × {policy['num_micro_batches']})" \
            if policy["num_micro_batches"] > 1 else ""
        why = (data.get("format_choice") or {}).get("why")
        rows += [*([("format", f"{policy['weight_format']}: {why}{weighed_words(data.get('other_formats'))}")] if why else []),
                 ("weights", f"{policy['weight_format']}: {_where(policy['weights'])}"),
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
        rows.append(("compute-bound", f"from batch {data['min_compute_bound_batch']} (a decode step's compute "
                                      f"outlasts its weight reads, bounded by the {data['min_compute_bound_basis']})"))
    if data.get("gguf") is not None:
        rows += _gguf_rows(data["gguf"])
    if data.get("runtime_s") is not None:
        rows.append(runtime_row(data))
        cost = "" if data["cost_usd"] is None else f" · ${data['cost_usd']:.3g} per query, " \
                                                   f"${data['cost_usd_per_1k_tokens']:.3g} per 1k tokens"
        rows.append(("energy, cost", f"{_num(data['energy_j'])} J per query{cost} (one query's share of the batch's)"
                     if ((data.get("policy") or {}).get("batch_size") or 1) > 1 and data.get("goal") != "serve"
                     else f"{_num(data['energy_j'])} J per query{cost}"))
    if data.get("kept_free") is not None:
        rows.append(("kept free", kept_free_words(data["kept_free"])))
    width = max(len(name) for name, _ in rows)
    where = "this machine" if plan.hardware == "detected" else plan.hardware  # --hardware auto: the app's words
    header = f"{plan.model} on {where} (goal: {plan.goal})"
    body = "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)
    warnings = "".join(f"\nwarning: {text}" for text in data.get("warnings") or ())
    return f"{header}\n{body}\nwhy: {plan.reason}{warnings}\nefficiency: {plan.efficiency}"


def kept_free_report(reserve: dict[str, float], explicit: bool) -> dict:
    """The JSON "kept_free" object: bytes per tier the plan leaves free, and the rule that chose them."""
    rule = "--reserve-gb" if explicit else HEADROOM_TEXT
    return {"bytes": {tier: round(value) for tier, value in reserve.items()}, "rule": rule}


def run(args: argparse.Namespace) -> int:
    plan, reserve, hardware, choice = build_plan(args)
    data = plan_to_dict(plan)
    if data.get("policy") is not None:
        data["format_choice"] = {"format": data["policy"]["weight_format"], "quant": args.quant, "why": choice.why}
    if args.hardware == "auto":  # a plan file made here says so: `generate --plan FILE` warns on another machine
        from hivekeeper.core.offload.local_plan import this_machine_fingerprint

        # the machine as detected, not as --ram-gb and the like reshape it (session 24: a plan made here with
        # --ram-gb 0.62 was "made on another machine" to generate)
        data["machine_fingerprint"] = this_machine_fingerprint()
    data["kept_free"] = kept_free_report(reserve, args.reserve_gb is not None)
    if plan.server is not None and plan.server.num_blocks and args.hardware == "auto":
        from hivekeeper.core.swarm.server.throughput import measured_block_speed, measured_report

        speed = measured_block_speed(model_path_or_id(args.model), plan.server)  # as the app's Swarm page reads it
        data["serve_measured"] = measured_report(speed, plan.server.num_blocks) if speed else None
    gguf = gguf_report(args.model, data, this_machine=args.hardware == "auto")
    if gguf is not None:
        data["gguf"] = gguf
    if args.json:
        print(json.dumps(data))
    else:
        print(render(plan, data))
    return 0
