"""Offloading policy search: the best policy of the cost model for a model, a machine, a goal and constraints.

The search is exhaustive over a coarse grid — weight format × KV cache placement × activation placement ×
micro-batch size × number of micro-batches × K/V kept or recomputed × attention on the CPU or not × prefetch
depth — evaluated in one numpy pass (tens of thousands of candidates in a few milliseconds). Where the block
weights go is not on the grid: for every candidate the closed form in costmodel.solve_weight_placement puts as
much as fits on the accelerator, then in RAM, the rest on disk, which is optimal for the other knobs fixed.

Goals: chat minimizes the runtime of the request (α + β(o − 1)) at the given batch (1 stream by default);
batch maximizes generated tokens/s over prefill plus decode (FlexGen's metric); serve sizes a swarm server.
With --quant auto a quantized format must win by a margin (QUALITY_WEIGHT): int8 by 11%, nf4 by 25%, q8_0 by 2%,
q4_1 by 18%, q4_0 by 20%; a GGUF's own format has no margin (its weights are those values whatever runs them).
Which formats auto tries depends on the accelerator: bitsandbytes int8/nf4 only on a GPU (on a CPU they are ~17x
slower than fp32), the packed block formats only on a CPU and only those the runtime holds packed for this model
(Constraints.packed_formats: a GGUF's own Q8_0/Q4_0/Q4_1 type).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from .costmodel import (TIERS, Machine, Placement, Policy, Prediction, Workload, cpu_native_half, evaluate_arrays,
                        fixed_memory, format_traits, machine_view, model_numbers, peak_memory, prediction_from_arrays,
                        runs_as_planned, sixteen_bit_format, solve_weight_placement)
from .efficiency import MachineEfficiency, default_efficiency
from .errors import InputError
from .formats import BITSANDBYTES_FORMATS, PACKED_FORMATS
from .hardware import HEADROOM_RULE, HardwareSpec, tier_headroom
from .models import CONTEXT_FIELDS, ModelSpec
from .runtime import RuntimeEstimate, idealized_runtime
from .swarm import PackedSpan, ServerPlan, client_fits, plan_server

GOALS = ("chat", "batch", "serve")
QUANTS = ("auto", "none", "int8", "nf4", *PACKED_FORMATS)
QUALITY_WEIGHT = {"fp32": 1.0, "bf16": 1.0, "fp16": 1.0, "int8": 0.9, "nf4": 0.8, "q8_0": 0.98, "q4_1": 0.85,
                  "q4_0": 0.83}

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MICRO_BATCH_COUNTS = (1, 2, 4, 8, 16)
CACHE_ON_ACCELERATOR = (1.0, 0.75, 0.5, 0.25, 0.0)
CACHE_HOST_SHARE = (1.0, 0.5, 0.0)  # of the cache not on the accelerator, the part in RAM (the rest on disk)
PREFETCH_DEPTHS = (0, 1, 2)


@dataclass(frozen=True)
class Constraints:
    """What the user fixes: the quantization choice, the batch (sequences together), memory to leave free; and what
    the runtime can hold packed for this model (`packed_formats`, the packed formats auto may choose on a CPU) and
    the format its file already stores (`file_format`: no quality margin, the weights are those values anyway)."""

    quant: str = "auto"
    batch_size: int | None = None
    reserve_bytes: dict[str, float] = field(default_factory=dict)  # tier ("gpu", "cpu", "disk") -> bytes
    packed_formats: tuple[str, ...] = ()
    file_format: str | None = None
    packed_span: PackedSpan | None = None  # goal serve: a GGUF's span as the server holds it (format_choice)

    def __post_init__(self) -> None:
        if self.quant not in QUANTS:
            raise InputError(f"unknown quantization {self.quant!r}; choose one of {', '.join(QUANTS)}")
        if self.batch_size is not None and not 1 <= self.batch_size <= 65536:
            raise InputError(f"batch must be an integer from 1 to 65536, got {self.batch_size}")
        for tier, value in self.reserve_bytes.items():
            if tier not in TIERS or not 0 <= value <= 1e15:
                raise InputError(f"reserve for {tier!r} must be a tier (gpu, cpu, disk) and 0..1e15 bytes")
        for name in self.packed_formats:
            if name not in PACKED_FORMATS:
                raise InputError(f"packed format {name!r} is not one of {', '.join(PACKED_FORMATS)}")


def candidate_formats(model: ModelSpec, machine: Machine, quant: str, packed: tuple[str, ...] = ()) -> list[str]:
    """Weight formats the search tries: the 16-bit format (and fp32 on a CPU); with auto, int8/nf4 on a GPU and the
    `packed` formats (what the runtime holds packed for this model) on a CPU. A named format alone."""
    if quant in PACKED_FORMATS and machine.acc.kind != "cpu":
        raise InputError(f"--quant {quant} is a CPU format (hivekeeper's native kernels); on a GPU use none, int8 "
                         f"or nf4")
    if quant in BITSANDBYTES_FORMATS or quant in PACKED_FORMATS:
        return [quant]
    formats = [sixteen_bit_format(model, machine)]
    if machine.acc.kind == "cpu":
        # a CPU without 16-bit math computes a 16-bit plan in fp32 (core/offload/local_plan.compute_dtype), holding
        # 4 bytes a weight where the 16-bit format would count 2: only fp32 is what runs there. With it, a 16-bit
        # candidate stays where the engine computes it in bf16 at its rows (costmodel.runs_as_planned: every bf16
        # one, each its own plan), weighed against fp32 by its price (a few-row step at the measured bf16 step)
        formats = ["fp32"] if not cpu_native_half(machine.acc) else [*formats, "fp32"]
        if quant == "auto":
            formats += [name for name in packed if name not in formats]
    elif quant == "auto":
        formats += list(BITSANDBYTES_FORMATS)
    return formats


def quality_weight(name: str, constraints: "Constraints") -> float:
    """How much a format's predicted speed counts (QUALITY_WEIGHT); 1 for the format the model's file stores."""
    return 1.0 if name == constraints.file_format else QUALITY_WEIGHT[name]


def _batch_pairs(goal: str, batch_size: int | None) -> list[tuple[int, int]]:
    if goal == "chat":
        return [(batch_size or 1, 1)]
    if batch_size is not None:
        return [(b, batch_size // b) for b in range(1, batch_size + 1)
                if batch_size % b == 0 and batch_size // b <= max(MICRO_BATCH_COUNTS)] or [(batch_size, 1)]
    return [(b, n) for b in MICRO_BATCH_SIZES for n in MICRO_BATCH_COUNTS]


def build_grid(model: ModelSpec, machine: Machine, goal: str, constraints: Constraints,
               n_formats: int) -> dict[str, np.ndarray]:
    """Every candidate (without weight fractions), as columns of one table."""
    # recomputing K and V from stored hidden states only saves memory where they are wider than the hidden state
    recompute = 2 * model.num_kv_heads * model.head_dim > model.hidden_size
    cols = _grid_skeleton(goal, constraints.batch_size, machine.has_host_tier, recompute, n_formats)
    return {k: v.copy() for k, v in cols.items()}


@functools.lru_cache(maxsize=64)
def _grid_skeleton(goal: str, batch_size: int | None, host: bool, recompute_allowed: bool,
                   n_formats: int) -> dict[str, np.ndarray]:
    cache_options = []
    for ca in CACHE_ON_ACCELERATOR:
        shares = (1.0,) if ca == 1.0 else (CACHE_HOST_SHARE if host else (0.0,))
        for share in shares:
            cache_options.append((ca, (1.0 - ca) * share, (1.0 - ca) * (1.0 - share)))
    cache = np.array(cache_options)
    pairs = np.array(_batch_pairs(goal, batch_size), dtype=float)
    recompute = (0.0, 1.0) if recompute_allowed else (0.0,)
    axes = {
        "fmt": np.arange(n_formats), "cache": np.arange(len(cache)), "ah": np.array((0.0, 1.0) if host else (0.0,)),
        "pair": np.arange(len(pairs)), "rec": np.array(recompute),
        "cattn": np.array((0.0, 1.0) if host else (0.0,)), "d": np.array(PREFETCH_DEPTHS, dtype=float),
    }
    mesh = np.meshgrid(*axes.values(), indexing="ij")
    flat = {name: grid.ravel() for name, grid in zip(axes, mesh)}
    ci, pi = flat.pop("cache"), flat.pop("pair")
    cols = {"fmt": flat["fmt"].astype(int), "ca": cache[ci, 0], "ch": cache[ci, 1], "cd": cache[ci, 2],
            "ah": flat["ah"], "b": pairs[pi, 0], "n": pairs[pi, 1], "rec": flat["rec"], "cattn": flat["cattn"],
            "d": flat["d"]}
    keep = ~((cols["cattn"] > 0) & ((cols["ca"] >= 1.0) | (cols["rec"] > 0)))
    return {k: v[keep] for k, v in cols.items()}


@dataclass
class GridResult:
    """A whole evaluated grid: the columns, memory peaks, cost-model outputs, feasibility and scores."""

    machine: Machine
    efficiency: MachineEfficiency
    formats: list[str]
    cols: dict[str, np.ndarray]
    peaks: dict[str, np.ndarray]
    out: dict[str, np.ndarray]
    feasible: np.ndarray
    speed: np.ndarray  # chat: 1 / runtime; batch: generated tokens/s
    score: np.ndarray  # speed × quality weight of the format (−inf where infeasible)
    mem: dict[str, np.ndarray]
    batch_sizes: np.ndarray  # every batch size on the grid, fitting or not

    def best(self) -> int:
        """Index of the best candidate; exact ties (to 1e-9) go to the plan that keeps the least off the
        accelerator, then to the shallowest prefetch and the fewest micro-batches."""
        top = float(np.max(self.score))
        if not np.isfinite(top):
            return int(np.argmax(self.score))
        near = np.flatnonzero(self.score >= top * (1.0 - 1e-9))
        off_accelerator = self.peaks["host"][near] + self.peaks["disk"][near]
        order = np.lexsort((self.cols["n"][near], self.cols["d"][near], off_accelerator))
        return int(near[order[0]])

    def policy(self, i: int) -> Policy:
        c = self.cols
        acc = self.machine.acc_tier

        def placement(on_acc: float, on_host: float, on_disk: float) -> Placement:
            if acc == "gpu":
                return Placement(on_acc, on_host, on_disk)
            return Placement(0.0, on_acc, on_disk)

        return Policy(
            weight_format=self.formats[int(c["fmt"][i])],
            weights=placement(float(c["wa"][i]), float(c["wh"][i]), float(c["wd"][i])),
            kv_cache=placement(float(c["ca"][i]), float(c["ch"][i]), float(c["cd"][i])),
            activations=placement(1.0 - float(c["ah"][i]), float(c["ah"][i]), 0.0),
            micro_batch_size=int(c["b"][i]), num_micro_batches=int(c["n"][i]), kv_recompute=bool(c["rec"][i]),
            prefetch_depth=int(c["d"][i]), attention_on_cpu=bool(c["cattn"][i]),
        )


def evaluate_grid(model: ModelSpec, hardware: HardwareSpec, goal: str, constraints: Constraints,
                  workload: Workload, efficiency: MachineEfficiency | None = None) -> GridResult:
    """Evaluate every candidate of the grid for a local goal ("chat" or "batch")."""
    eff = efficiency or default_efficiency(hardware)
    machine = machine_view(hardware, constraints.reserve_bytes)
    numbers = model_numbers(model)
    formats = candidate_formats(model, machine, constraints.quant, constraints.packed_formats)
    traits = [format_traits(machine, f) for f in formats]
    cols = build_grid(model, machine, goal, constraints, len(formats))
    mem = fixed_memory(numbers, machine, eff, workload, traits, cols)
    wa, wh, wd, feasible = solve_weight_placement(mem, machine)
    feasible &= runs_as_planned(machine, traits, cols)  # no 16-bit plan the engine would compute in fp32
    cols.update(wa=wa, wh=wh, wd=wd)
    batch_sizes = np.unique((cols["b"] * cols["n"]).astype(int))
    if feasible.any():
        # time only what fits (memory is cheap to check, time is not), and skip candidates whose time is provably
        # that of a simpler one: prefetch depth changes nothing when nothing streams, and depth 2 equals depth 1
        # (with more buffers) when nothing is on disk
        d = cols["d"]
        nothing_streams = (wa >= 1.0) & (cols["ca"] >= 1.0) & (cols["ah"] == 0)
        nothing_on_disk = (wd == 0) & (cols["cd"] == 0)
        keep = feasible & ~((d > 0) & nothing_streams) & ~((d == 2) & nothing_on_disk)
        cols = {k: v[keep] for k, v in cols.items()}
        mem = {k: (v[keep] if isinstance(v, np.ndarray) and v.shape == keep.shape else v) for k, v in mem.items()}
        feasible = feasible[keep]
    peaks = peak_memory(mem, cols["wa"], cols["wh"], cols["wd"])
    out = evaluate_arrays(numbers, machine, eff, workload, traits, cols)
    speed = 1.0 / out["runtime_s"] if goal == "chat" else out["throughput_tps"]
    quality = np.array([quality_weight(f, constraints) for f in formats])[cols["fmt"]]
    score = np.where(feasible, speed * quality, -np.inf)
    return GridResult(machine, eff, formats, cols, peaks, out, feasible, speed, score, mem, batch_sizes)


def _missing_bytes(grid: GridResult) -> dict[str, int]:
    """For a model that fits nowhere: the least memory to add, per tier, over all candidates, such that adding it
    makes that candidate fit. Per candidate: the accelerator gets its fixed bytes and one streamed block's buffers
    (or all the weights, if fewer); the host its fixed bytes and the RAM staging of what the accelerator leaves
    (or all of it, if less); the disk then what the weight placement (solve_weight_placement, the same closed form
    and floors the search uses) puts there beyond its capacity."""
    mem, machine = grid.mem, grid.machine
    w_all, w_blk = mem["w_all"], mem["w_blk"]
    acc = np.maximum(machine.acc_capacity, mem["acc"] + np.minimum(w_all, mem["acc_buffers"] * w_blk))
    unlimited = replace(machine, acc_capacity=acc, host_capacity=np.inf, disk_capacity=np.inf)
    rest = 1.0 - solve_weight_placement(mem, unlimited)[0]
    staged = np.where(rest > 0, np.minimum(rest * w_all, mem["host_staging"] * rest * w_blk), 0.0)
    host = np.maximum(machine.host_capacity, mem["host"] + staged)
    wa, wh, wd, ok = solve_weight_placement(mem, replace(unlimited, host_capacity=host))
    disk = np.maximum(machine.disk_capacity, peak_memory(mem, wa, wh, wd)["disk"])
    short = {"acc": acc - machine.acc_capacity, "host": host - machine.host_capacity,
             "disk": disk - machine.disk_capacity}
    # bytes are counted up: adding the amounts (as whole bytes) must be enough
    total = np.where(ok, np.ceil(short["acc"]) + np.ceil(short["host"]) + np.ceil(short["disk"]), np.inf)
    i = int(np.argmin(total))
    result = {"gpu": 0, "cpu": 0, "disk": int(np.ceil(short["disk"][i]))}
    result[machine.acc_tier] += int(np.ceil(short["acc"][i]))
    if machine.has_host_tier:
        result["cpu"] += int(np.ceil(short["host"][i]))
    result["total"] = result["gpu"] + result["cpu"] + result["disk"]
    return result


def _device_growth(hardware: HardwareSpec, reserve: dict[str, float], usable: dict[str, int]) -> dict[str, int]:
    """The usable bytes a tier lacks as bytes of device to add. Where the tier's reserve is the default headroom
    rule's for this machine (`hivekeeper plan` without --reserve-gb), memory added raises the headroom too (5% of a
    bigger disk), so the device must grow by more: to the smallest size whose usable part holds the shortfall."""
    devices = {"cpu": (hardware.cpu.memory_bytes, hardware.cpu.in_use_bytes),
               "disk": (hardware.disk.capacity_bytes, 0.0)}
    if len(hardware.gpus) == 1 and not hardware.gpus[0].unified_memory:
        devices["gpu"] = (hardware.gpus[0].memory_bytes, hardware.gpus[0].in_use_bytes)
    grown = dict(usable)
    for tier, (size, in_use) in devices.items():
        kept = float(reserve.get(tier, 0.0))
        if usable[tier] <= 0 or not math.isclose(kept, tier_headroom(tier, size, in_use), rel_tol=1e-9):
            continue
        minimum, fraction = HEADROOM_RULE[tier]
        target = size - kept + usable[tier] + in_use  # usable bytes wanted, plus what other programs hold
        grown[tier] = max(usable[tier], math.ceil(max(target + minimum, target / (1.0 - fraction)) - size))
    grown["total"] = grown["gpu"] + grown["cpu"] + grown["disk"]
    return grown


def _gb_up(nbytes: float) -> str:
    """Bytes as GB to three significant digits, rounded up: adding the amount a reason quotes is enough."""
    gb = nbytes / 1e9
    if gb <= 0:
        return "0"
    scale = 10.0 ** (2 - math.floor(math.log10(gb)))
    return f"{math.ceil(gb * scale - 1e-9) / scale:.3g}"


# ---- plans --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """The recommendation: how to run (or serve) a model on a machine, how fast, and why."""

    goal: str
    model: str
    hardware: str
    workload: Workload
    fit: str  # "local" | "swarm" | "none"
    reason: str
    prediction: Prediction | None  # the best local policy; None when nothing fits locally
    runtime: RuntimeEstimate | None
    missing_bytes: dict[str, int] | None  # what a model that cannot run lacks
    server: ServerPlan | None  # goal "serve"
    efficiency: str
    candidates_evaluated: int
    warnings: tuple[str, ...] = ()  # what a user should know before running it (plan_warnings)
    other_formats: tuple["FormatOption", ...] = ()  # the search's best of each weight format it did not choose


@dataclass(frozen=True)
class FormatOption:
    """The best candidate of a weight format the search weighed and did not choose: its predicted decode tokens/s
    and the share of its weights on disk (None tokens/s: no candidate of it fits). A newcomer (session 22) saw a bf16
    plan on a CPU, whose rule says fp32 for few rows, with no word that fp32 would stream from disk."""

    weight_format: str
    decode_tokens_per_s: float | None
    on_disk: float = 0.0


def weighed_words(others: list[dict] | None) -> str:
    """"; weighed: fp32 0.0549 tokens/s (47% of its weights on disk), ...": plan_to_dict's "other_formats" in words
    (`plan`'s format row, the Plan page's format line), so a choice against a rule of thumb shows why; "" for none."""
    words = []
    for other in others or []:
        tps, disk = other["decode_tokens_per_s"], other["weights_on_disk"]
        on_disk = f" ({100 * disk:.0f}% of its weights on disk)" if disk > 0 else ""
        words.append(f"{other['weight_format']} does not fit" if tps is None else
                     f"{other['weight_format']} {tps:.3g} tokens/s{on_disk}")
    return f"; weighed: {', '.join(words)}" if words else ""


def other_formats(grid: GridResult, best: int) -> tuple[FormatOption, ...]:
    """Each format of the grid but the best candidate's, at its own best feasible candidate (by score)."""
    options = []
    for k, name in enumerate(grid.formats):
        if k == int(grid.cols["fmt"][best]):
            continue
        mine = np.flatnonzero((grid.cols["fmt"] == k) & grid.feasible)
        if mine.size == 0:
            options.append(FormatOption(name, None))
            continue
        i = int(mine[np.argmax(grid.score[mine])])
        options.append(FormatOption(name, float(grid.out["decode_tps"][i]), float(grid.cols["wd"][i])))
    return tuple(options)


def _placement_words(prediction: Prediction, machine: Machine) -> str:
    policy = prediction.policy

    def where(placement: Placement) -> str:
        parts = [f"{100 * v:.0f}% {name}"  # the tier names of `plan`'s rows: GPU, RAM, disk
                 for name, v in (("GPU", placement.gpu), ("RAM", placement.cpu), ("disk", placement.disk)) if v > 0]
        return " / ".join(parts)

    batch = policy.batch_size
    split = f" ({policy.micro_batch_size} × {policy.num_micro_batches})" if policy.num_micro_batches > 1 else ""
    return (f"{policy.weight_format} weights {where(policy.weights)}; KV cache {where(policy.kv_cache)}; "
            f"batch {batch}{split}")


def search(model: ModelSpec, hardware: HardwareSpec, goal: str = "chat", constraints: Constraints | None = None,
           workload: Workload | None = None, efficiency: MachineEfficiency | None = None,
           price_per_hour: float | None = None) -> Plan:
    """The best plan of the cost model for this model, machine and goal."""
    if goal not in GOALS:
        raise InputError(f"unknown goal {goal!r}; choose one of {', '.join(GOALS)}")
    constraints = constraints or Constraints()
    workload = workload or Workload()
    eff = efficiency or default_efficiency(hardware)
    price = hardware.price_per_hour if price_per_hour is None else price_per_hour
    grid = evaluate_grid(model, hardware, "batch" if goal == "batch" else "chat", constraints, workload, eff)
    machine = grid.machine
    best = grid.best()
    local_ok = bool(grid.feasible[best])
    prediction = prediction_from_arrays(machine, eff, grid.policy(best), grid.peaks, grid.out, best, model) \
        if local_ok else None
    client_ok = client_fits(model, machine, workload, eff)
    missing = None
    if prediction is not None:
        on_disk = prediction.policy.weights.disk > 0
        fit = "swarm" if (on_disk and goal != "batch" and client_ok) else "local"
        reason = f"{prediction.bottleneck_detail}. {_placement_words(prediction, machine)}."
        if fit == "swarm":
            reason += (f" Locally {100 * prediction.policy.weights.disk:.0f}% of the weights would sit on disk "
                       f"({prediction.decode_tokens_per_s:.3g} tokens/s): run it with the swarm instead.")
    else:
        missing = _device_growth(hardware, constraints.reserve_bytes, _missing_bytes(grid))
        fit = "swarm" if client_ok else "none"
        lacking = ", ".join(f"{tier} {_gb_up(missing[tier])} GB" for tier in TIERS if missing[tier] > 0)
        reason = f"does not fit locally: needs {_gb_up(missing['total'])} GB more memory ({lacking})."
        reason += " The swarm can run it: this machine holds the client side." if client_ok else \
            " This machine cannot even hold the client side (embeddings and LM head)."
    runtime = None
    if prediction is not None:
        runtime = idealized_runtime(prediction.prefill_s, prediction.decode_step_s, workload.prompt_len,
                                    workload.output_len, prediction.policy.batch_size, machine.power_watts, price)
    server = None
    if goal == "serve":  # the reason so far is a local run's: say so, beside the server's span
        reason = f"Running the whole model here instead: {reason}"
        server = plan_server(model, hardware, constraints.quant, None, constraints.reserve_bytes, eff,
                             packed=constraints.packed_span)
        n = server.num_blocks
        if n:
            alpha = n * workload.prompt_len / server.forward_rps
            beta = n / server.inference_rps
            runtime = idealized_runtime(alpha, beta, workload.prompt_len, workload.output_len, 1,
                                        machine.power_watts, price)
            reason = (f"serves {n} of {model.num_layers} blocks in {server.weight_format}"
                      f"{' packed' if server.packed else ''} with a "
                      f"{server.cache_tokens}-token cache per block; a 1-token step is bound by "
                      f"{server.inference_bound}. " + reason)
        else:
            runtime = None
            reason = f"cannot hold a single block for serving ({server.block_bytes / 1e9:.3g} GB each). " + reason
    return Plan(goal=goal, model=model.name, hardware=hardware.id, workload=workload, fit=fit, reason=reason,
                prediction=prediction, runtime=runtime, missing_bytes=missing, server=server, efficiency=eff.name,
                candidates_evaluated=int(grid.score.size),
                warnings=plan_warnings(prediction if goal != "serve" else None, runtime),
                other_formats=other_formats(grid, best) if local_ok else ())


def check_context(model: ModelSpec, workload: Workload) -> None:
    """An InputError where the workload's context (prompt + output, or the context asked for) is beyond the model's
    own (max_position_embeddings): the model cannot attend that far, and a plan for it is no plan (a newcomer,
    session 23: `plan --context 1000000` for an 8192-token model predicted 37 tokens/s, 75% of the cache on disk).
    For what a person asks to plan (`plan`, the Plan page); the engine's own plans take a run's lengths as given."""
    limit = model.max_position_embeddings
    if limit and workload.cache_len > limit:
        raise InputError(f"a context of {workload.cache_len:,} tokens (prompt + output, or the context asked for) is "
                         f"beyond {model.name}'s {limit:,} ({CONTEXT_FIELDS})")


SLOW_QUERY_S = 600.0  # a plan whose query takes longer than this (10 minutes) gets a warning
MOSTLY_ON_DISK = 0.5  # a plan with more of its block weights than this on disk says it streams the model from disk
FIT_WORDS = {"local": "fits here", "swarm": "needs the swarm", "none": "too large"}  # a fit, as the app says it


def fit_words(plan: Plan) -> str:
    """A plan's fit as the app and `models` say it: FIT_WORDS, except that a local plan streaming most of its weights
    from disk says so, and a plan the swarm is suggested for that still runs here with a part of its weights on disk
    says both rather than "needs the swarm" (a newcomer, session 24, read that beside a local speed); one with most
    of them on disk needs the swarm, and says what here would take."""
    prediction = plan.prediction
    if prediction is None or plan.goal == "serve":
        return FIT_WORDS[plan.fit]
    disk = prediction.policy.weights.disk
    streamed = f", {100 * disk:.0f}% streamed from disk" if disk > 0 else ""
    if plan.fit == "swarm" and disk > MOSTLY_ON_DISK:
        return f"{FIT_WORDS['swarm']} (here {100 * disk:.0f}% of the weights would stream from disk)"
    if plan.fit == "swarm":
        return f"runs here{streamed}; the swarm is suggested"
    return f"runs here{streamed}" if disk > MOSTLY_ON_DISK else FIT_WORDS[plan.fit]


def plan_warnings(prediction: Prediction | None, runtime) -> tuple[str, ...]:
    """Warnings for a recommended local plan: a query slower than SLOW_QUERY_S (a batch's queries all wait for the
    whole batch), and weights mostly streamed from disk on every decode step."""
    if prediction is None or runtime is None:
        return ()
    warnings = []
    batch = prediction.policy.batch_size
    if runtime.runtime_s > SLOW_QUERY_S:
        each = "" if batch == 1 else f" (the whole batch of {batch}; {_duration(runtime.runtime_s / batch)} per " \
                                     f"query on average)"
        warnings.append(f"very slow: the planner rates this plan at {_duration(runtime.runtime_s)} per run{each}, "
                        f"{prediction.decode_tokens_per_s:.3g} tokens/s; a smaller model, the swarm or more memory "
                        f"would be faster")
    disk = prediction.policy.weights.disk
    if disk > MOSTLY_ON_DISK:
        warnings.append(f"streams {100 * disk:.0f}% of the weights from disk on every decode step: it runs here, "
                        f"but at the disk's speed")
    return tuple(warnings)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} minutes"
    return f"{seconds / 3600:.3g} hours"


@dataclass(frozen=True)
class BatchPoint:
    batch_size: int
    throughput_tokens_per_s: float | None  # None where no policy with this batch fits
    decode_tokens_per_s: float | None


def batch_curve(model: ModelSpec, hardware: HardwareSpec, workload: Workload | None = None,
                constraints: Constraints | None = None,
                efficiency: MachineEfficiency | None = None) -> list[BatchPoint]:
    """Best predicted tokens/s at each batch size the grid reaches (for a chart), from one grid pass."""
    constraints = constraints or Constraints()
    grid = evaluate_grid(model, hardware, "batch", replace(constraints, batch_size=None), workload or Workload(),
                         efficiency)
    batch = (grid.cols["b"] * grid.cols["n"]).astype(int)
    points = []
    for size in grid.batch_sizes:
        rows = np.flatnonzero((batch == size) & grid.feasible)
        if rows.size == 0:
            points.append(BatchPoint(int(size), None, None))
            continue
        i = rows[np.argmax(grid.score[rows])]
        points.append(BatchPoint(int(size), float(grid.out["throughput_tps"][i]), float(grid.out["decode_tps"][i])))
    return points


# ---- JSON ---------------------------------------------------------------------------------------------------------
def _round(x: float | None, digits: int = 6) -> float | None:
    if x is None:
        return None
    return float(f"{x:.{digits}g}")


def plan_to_dict(plan: Plan) -> dict:
    """The plan as one JSON-ready object (docs/plan-json.md documents every field)."""
    p, r, s, w = plan.prediction, plan.runtime, plan.server, plan.workload
    data: dict = {
        "goal": plan.goal, "model": plan.model, "hardware": plan.hardware, "fit": plan.fit, "reason": plan.reason,
        "efficiency": plan.efficiency,
        "prompt_len": w.prompt_len, "output_len": w.output_len, "context_len": w.cache_len,
    }
    if s is not None and s.num_blocks:
        n = s.num_blocks
        peaks = {"gpu": 0, "cpu": 0, "disk": 0}
        peaks[s.tier] = s.peak_memory_bytes
        data.update({
            "policy": {"weight_format": s.weight_format, "num_blocks": n, "cache_tokens": s.cache_tokens,
                       "blocks_on": s.tier},
            # one client session's pass through this server's span
            "decode_tokens_per_s": _round(s.inference_rps / n), "prefill_tokens_per_s": _round(s.forward_rps / n),
            "throughput_tokens_per_s": _round(s.inference_rps / n),
            "roofline_decode_tokens_per_s": _round(s.roofline_inference_rps / n),
            "roofline_prefill_tokens_per_s": _round(s.roofline_forward_rps / n),
            "bottleneck": s.inference_bound,
            "bottleneck_detail": f"a 1-token step through {n} blocks is bound by {s.inference_bound}",
            "min_compute_bound_batch": s.min_compute_bound_batch,
            "min_compute_bound_basis": "GPU memory bandwidth" if s.tier == "gpu" else "RAM bandwidth",
            "peak_memory_bytes": peaks,
            "capacity_bytes": {tier: (s.capacity_bytes if tier == s.tier else 0) for tier in TIERS},
        })
    elif p is not None:
        data.update({
            "policy": p.policy.as_dict(),
            "decode_tokens_per_s": _round(p.decode_tokens_per_s),
            "prefill_tokens_per_s": _round(p.prefill_tokens_per_s),
            "throughput_tokens_per_s": _round(p.throughput_tokens_per_s),
            "roofline_decode_tokens_per_s": _round(p.roofline_decode_tokens_per_s),
            "roofline_prefill_tokens_per_s": _round(p.roofline_prefill_tokens_per_s),
            "bottleneck": p.bottleneck, "bottleneck_detail": p.bottleneck_detail,
            "min_compute_bound_batch": p.min_compute_bound_batch, "min_compute_bound_basis": p.min_compute_bound_basis,
            "peak_memory_bytes": dict(p.peak_memory_bytes), "capacity_bytes": dict(p.capacity_bytes),
        })
    else:
        for key in ("policy", "decode_tokens_per_s", "prefill_tokens_per_s", "throughput_tokens_per_s",
                    "roofline_decode_tokens_per_s", "roofline_prefill_tokens_per_s", "bottleneck",
                    "bottleneck_detail", "min_compute_bound_batch", "min_compute_bound_basis", "peak_memory_bytes",
                    "capacity_bytes"):
            data[key] = None
    data.update({
        "runtime_s": _round(r.runtime_s) if r else None, "alpha_s": _round(r.alpha_s) if r else None,
        "beta_s": _round(r.beta_s) if r else None, "power_watts": r.power_watts if r else None,
        "energy_j": _round(r.energy_j) if r else None,
        "energy_j_per_1k_tokens": _round(r.energy_j_per_1k_tokens) if r else None,
        "price_per_hour": r.price_per_hour if r else None,
        "cost_usd": _round(r.cost_usd) if r and r.cost_usd is not None else None,
        "cost_usd_per_1k_tokens": _round(r.cost_usd_per_1k_tokens) if r and r.cost_usd_per_1k_tokens is not None
        else None,
        "missing_bytes": plan.missing_bytes,
        "candidates_evaluated": plan.candidates_evaluated,
        "other_formats": [{"weight_format": o.weight_format, "decode_tokens_per_s": _round(o.decode_tokens_per_s),
                           "weights_on_disk": round(o.on_disk, 4)} for o in plan.other_formats],
        "warnings": list(plan.warnings),
    })
    if plan.goal == "serve" and s is not None:
        data.update({
            "num_blocks": s.num_blocks, "total_blocks": s.total_blocks, "block_inference_rps": _round(s.inference_rps),
            "block_forward_rps": _round(s.forward_rps), "cache_tokens": s.cache_tokens,
            "block_bytes": s.block_bytes, "cache_bytes_per_block": s.cache_bytes_per_block,
            "network_rps": _round(s.network_rps), "advertised_throughput": _round(s.throughput),
        })
    return data

