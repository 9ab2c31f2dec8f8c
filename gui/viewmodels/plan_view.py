"""What the Plan page shows, computed from the planner alone (no Qt): one function per panel, each fast.

    plan_format(...)   the search's constraints for the knobs and the weight format choice behind them, as
                       `hivekeeper plan --quant` makes them (a GGUF's own Q8_0/Q4_0/Q4_1 kept packed on a CPU)
    quant_choices(...) the Weight format menu for a model on a machine: (--quant value, words) pairs
    plan_for(...)      the recommendation for the knobs, or the user's placement override evaluated (~1–70 ms)
    memory_bars(...)   per tier: weights / KV cache / activations and buffers / free, in bytes
    batch_chart(...)   best tokens/s at each batch size, and the point of the current choice
    budget_chart(...)  tokens/s against the accelerator memory budget, and the current budget
    model_fit(...)     the three-state fit of a model on a machine: fits here / needs the swarm / too large
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hivekeeper.planner import policy as planner_policy
from hivekeeper.planner.policy import fit_words
from hivekeeper.planner.costmodel import (Placement, Workload, block_weight_bytes, evaluate_as_run, kv_cache_bytes,
                                          machine_view, weight_bytes)
from hivekeeper.planner.efficiency import MachineEfficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.format_choice import FormatChoice, gguf_packed_type, plan_constraints, quant_options
from hivekeeper.planner.formats import get_format
from hivekeeper.planner.gguf_metadata import is_gguf
from hivekeeper.planner.hardware import HardwareSpec, default_headroom
from hivekeeper.planner.models import ModelSpec
from hivekeeper.planner.runtime import idealized_runtime

from hivekeeper.core.runtime.default_model import model_path_or_id

from hivekeeper.gui.settings import PlanSettings, TIERS

GB = 1e9


@dataclass(frozen=True)
class PlanResult:
    """One evaluation of the knobs: the planner's Plan, its JSON-style numbers, and whether it is an override."""

    plan: planner_policy.Plan
    numbers: dict  # policy.plan_to_dict of the plan (or of the override's evaluation), with "format_choice"
    overridden: bool
    format_choice: FormatChoice | None = None  # what the Weight format knob became for this model here, and why


def workload_of(settings: PlanSettings) -> Workload:
    return Workload(settings.prompt_len, settings.output_len, settings.context_len or None)


def constraints_of(settings: PlanSettings, hardware: HardwareSpec) -> planner_policy.Constraints:
    """The search's constraints for the knobs (plan_format)."""
    return plan_format(settings, hardware)[0]


def plan_format(settings: PlanSettings, hardware: HardwareSpec) -> tuple[planner_policy.Constraints, FormatChoice]:
    """The search's constraints for the knobs and the format choice behind them, made by the planner call
    `hivekeeper plan --quant` makes (format_choice.plan_constraints: a GGUF's own Q8_0/Q4_0/Q4_1 packed on a CPU):
    the user's "Leave free" on top of the default headroom of `hardware` (planner.hardware.default_headroom).
    InputError when the weight format does not apply to this model here."""
    headroom = default_headroom(hardware)
    reserve = {tier: settings.reserve_gb.get(tier, 0.0) * GB + headroom.get(tier, 0.0) for tier in TIERS}
    return plan_constraints(model_path_or_id(settings.model), settings.quant, hardware, settings.goal,
                            batch_size=settings.batch_size or None, reserve_bytes=reserve)


def quant_choices(model: str, hardware: HardwareSpec) -> list[tuple[str, str]]:
    """The Weight format menu for `model` on `hardware`: (--quant value, words), only the values that apply there
    (format_choice.quant_options: a GGUF's own packed type on a CPU, bitsandbytes on a CUDA GPU)."""
    path = model_path_or_id(model)
    options = quant_options(path, hardware)
    gguf = is_gguf(path)
    own = gguf_packed_type(path) if gguf else None
    packed_auto = own is not None and own in options
    on_cpu = not hardware.has_gpu
    words = {
        "auto": (f"auto ({own} packed)" if packed_auto else
                 "auto (fp32 or 16-bit, the faster)" if on_cpu else
                 "auto (16-bit, dequantized)" if gguf else "auto (quantize if it pays)"),
        "none": (("fp32 / bf16 (dequantized)" if on_cpu else "16-bit (dequantized)") if gguf else
                 ("fp32 / bf16 (no quantization)" if on_cpu else "16-bit (no quantization)")),
        "int8": "int8 (bitsandbytes)", "nf4": "nf4 4-bit (bitsandbytes)",
    }
    return [(quant, words.get(quant, f"{quant} packed (the file's own)")) for quant in options]


def _placement(percent: dict[str, float], has_gpu: bool, what: str) -> Placement:
    values = {tier: max(0.0, float(percent.get(tier, 0.0))) for tier in TIERS}
    if not has_gpu and values["gpu"] > 0:
        raise InputError(f"{what}: this machine has no GPU; put the GPU share on RAM or disk")
    total = sum(values.values())
    if total <= 0:
        raise InputError(f"{what}: the shares on GPU, RAM and disk add up to 0%")
    return Placement(values["gpu"] / total, values["cpu"] / total, values["disk"] / total)


def plan_for(model: ModelSpec, hardware: HardwareSpec, settings: PlanSettings,
             efficiency: MachineEfficiency | None = None) -> PlanResult:
    """The plan for the knobs. With the placement override on, the recommended policy with the user's weight and
    KV cache placement, evaluated by the cost model as the engine would run it (costmodel.evaluate_as_run; the
    search's other choices kept). `efficiency`: the cost-model factors for this machine (measured or calibrated),
    None for the defaults."""
    workload = workload_of(settings)
    planner_policy.check_context(model, workload)
    constraints, choice = plan_format(settings, hardware)
    price = settings.price_per_hour or None
    plan = planner_policy.search(model, hardware, settings.goal, constraints, workload, efficiency=efficiency,
                                 price_per_hour=price)
    if not settings.override_placement or settings.goal == "serve" or plan.prediction is None:
        return PlanResult(plan, numbers_of(plan, settings, choice), False, choice)
    has_gpu = hardware.has_gpu
    best = plan.prediction.policy
    weights = _placement(settings.weights_percent, has_gpu, "weights placement")
    cache = _placement(settings.cache_percent, has_gpu, "KV cache placement")
    policy = replace(best, weights=weights, kv_cache=cache,
                     attention_on_cpu=best.attention_on_cpu and cache.gpu < 1.0)
    prediction = evaluate_as_run(model, hardware, policy, workload, efficiency=efficiency,
                                 reserve_bytes=constraints.reserve_bytes)
    machine = machine_view(hardware, constraints.reserve_bytes)
    runtime = idealized_runtime(prediction.prefill_s, prediction.decode_step_s, workload.prompt_len,
                                workload.output_len, policy.batch_size, machine.power_watts,
                                price if price is not None else hardware.price_per_hour)
    fit = "local" if prediction.fits else "none"
    reason = prediction.bottleneck_detail + ("." if prediction.fits else
                                             ". This placement does not fit in memory (see the bars).")
    overridden = replace(plan, prediction=prediction, runtime=runtime, fit=fit, reason=reason, missing_bytes=None,
                         warnings=planner_policy.plan_warnings(prediction if prediction.fits else None, runtime))
    return PlanResult(overridden, numbers_of(overridden, settings, choice), True, choice)


def numbers_of(plan: planner_policy.Plan, settings: PlanSettings, choice: FormatChoice) -> dict:
    """policy.plan_to_dict of the plan, with the "format_choice" object `hivekeeper plan --json` adds."""
    numbers = planner_policy.plan_to_dict(plan)
    if numbers.get("policy") is not None:
        numbers["format_choice"] = {"format": numbers["policy"]["weight_format"], "quant": settings.quant,
                                    "why": choice.why}
    return numbers


def predict_run(model: ModelSpec, hardware: HardwareSpec, settings: PlanSettings, policy,
                efficiency: MachineEfficiency | None, batch: int, prompt_len: int, new_tokens: int):
    """The cost model's Prediction for `policy` run the way "Run this plan" runs it: `batch` sequences of
    `prompt_len` tokens, `new_tokens` each, in micro-batches of the policy's size (the engine's split: one
    micro-batch when the batch is smaller), with the page's memory to leave free; in the dtype the engine computes
    that shape in (costmodel.evaluate_as_run: a bf16 plan made for more rows run on a few prompts may be fp32, and
    says so)."""
    micro = max(1, min(policy.micro_batch_size, batch))
    shaped = replace(policy, micro_batch_size=micro, num_micro_batches=-(-batch // micro))
    return evaluate_as_run(model, hardware, shaped, Workload(max(1, prompt_len), max(1, new_tokens)),
                           efficiency=efficiency, reserve_bytes=constraints_of(settings, hardware).reserve_bytes,
                           planned_rows=policy.micro_batch_size)


# ---- memory per tier -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TierBar:
    tier: str  # "gpu", "cpu" (RAM) or "disk"
    weights: float
    kv_cache: float
    activations: float  # activations, streaming buffers and the framework's own memory
    free: float
    capacity: float

    @property
    def used(self) -> float:
        return self.weights + self.kv_cache + self.activations

    @property
    def over(self) -> bool:
        return self.used > self.capacity + 1.0


def memory_bars(model: ModelSpec, hardware: HardwareSpec, result: PlanResult) -> list[TierBar]:
    """Bytes per tier split into weights, KV cache, the rest of the peak, and what stays free."""
    plan, numbers = result.plan, result.numbers
    server = plan.server
    if plan.goal == "serve" and server is not None and server.num_blocks:
        bars = []
        for tier in TIERS:
            capacity = float(numbers["capacity_bytes"].get(tier, 0.0) if numbers.get("capacity_bytes") else 0.0)
            if tier != server.tier:
                bars.append(TierBar(tier, 0.0, 0.0, 0.0, capacity, capacity))
                continue
            weights = float(server.num_blocks * server.block_bytes)
            cache = float(server.num_blocks * server.cache_bytes_per_block)
            other = float(server.workspace_bytes)
            bars.append(TierBar(tier, weights, cache, other, max(0.0, capacity - weights - cache - other), capacity))
        return bars
    prediction = plan.prediction
    if prediction is None:
        return []
    policy = prediction.policy
    # the KV cache and the weights outside the blocks are fp32 beside fp32 or packed block weights (costmodel)
    value_bytes = 4.0 if policy.weight_format == "fp32" or get_format(policy.weight_format).packed else 2.0
    blocks = model.num_layers * block_weight_bytes(model, policy.weight_format)
    outside = weight_bytes(model, policy.weight_format) - blocks
    acc_tier = "gpu" if hardware.has_gpu else "cpu"
    tokens = plan.workload.cache_len
    if policy.kv_recompute:
        cache_all = policy.batch_size * tokens * model.num_layers * model.hidden_size * value_bytes
    else:
        cache_all = kv_cache_bytes(model, tokens, policy.batch_size, value_bytes)
    bars = []
    for tier in TIERS:
        peak = float(prediction.peak_memory_bytes.get(tier, 0))
        capacity = float(prediction.capacity_bytes.get(tier, 0))
        weights = blocks * getattr(policy.weights, tier) + (outside if tier == acc_tier else 0.0)
        cache = cache_all * getattr(policy.kv_cache, tier)
        weights, cache = min(weights, peak), min(cache, max(0.0, peak - min(weights, peak)))
        other = max(0.0, peak - weights - cache)
        bars.append(TierBar(tier, weights, cache, other, max(0.0, capacity - peak), capacity))
    return bars


# ---- charts --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Curve:
    x: np.ndarray
    throughput: np.ndarray  # generated tokens/s over prefill + decode (NaN where nothing fits)
    decode: np.ndarray  # decode tokens/s
    current_x: float | None
    current_y: float | None


def batch_chart(model: ModelSpec, hardware: HardwareSpec, settings: PlanSettings, result: PlanResult,
                efficiency: MachineEfficiency | None = None) -> Curve:
    """Best predicted tokens/s at each batch size the search reaches; the current plan marked."""
    points = planner_policy.batch_curve(model, hardware, workload_of(settings), constraints_of(settings, hardware),
                                        efficiency=efficiency)
    x = np.array([p.batch_size for p in points], dtype=float)
    y = np.array([np.nan if p.throughput_tokens_per_s is None else p.throughput_tokens_per_s for p in points])
    d = np.array([np.nan if p.decode_tokens_per_s is None else p.decode_tokens_per_s for p in points])
    prediction = result.plan.prediction
    if prediction is None or result.plan.goal == "serve":
        return Curve(x, y, d, None, None)
    return Curve(x, y, d, float(prediction.policy.batch_size), float(prediction.throughput_tokens_per_s))


def accelerator_memory(hardware: HardwareSpec) -> tuple[str, float]:
    """The accelerator tier ("gpu" or "cpu") and its memory in bytes a plan may use: less the default headroom,
    before the user's own reserve."""
    machine = machine_view(hardware)
    return machine.acc_tier, max(0.0, float(machine.acc_capacity) - default_headroom(hardware)[machine.acc_tier])


def budget_chart(model: ModelSpec, hardware: HardwareSpec, settings: PlanSettings, result: PlanResult,
                 efficiency: MachineEfficiency | None = None, steps: int = 8,
                 should_stop=lambda: False) -> Curve | None:
    """Predicted tokens/s (the goal's metric) as the accelerator memory budget grows; the current budget marked.
    None when should_stop() says the caller no longer wants it (checked between searches)."""
    tier, total = accelerator_memory(hardware)
    budgets = np.linspace(total / steps, total, steps)
    speeds, decodes = [], []
    for budget in budgets:
        if should_stop():
            return None
        reserve = {**settings.reserve_gb, tier: (total - budget) / GB}
        knobs = replace(settings, override_placement=False, reserve_gb=reserve)
        try:
            plan = planner_policy.search(model, hardware, settings.goal, constraints_of(knobs, hardware),
                                         workload_of(knobs),
                                         efficiency=efficiency)
        except InputError:
            plan = None
        data = planner_policy.plan_to_dict(plan) if plan is not None else {}
        speeds.append(data.get("throughput_tokens_per_s") or np.nan)
        decodes.append(data.get("decode_tokens_per_s") or np.nan)
    current = total - settings.reserve_gb.get(tier, 0.0) * GB
    y_now = result.numbers.get("throughput_tokens_per_s")
    return Curve(budgets / GB, np.array(speeds, dtype=float), np.array(decodes, dtype=float), current / GB,
                 None if y_now is None else float(y_now))


# ---- the model list ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFit:
    model_id: str
    fit: str  # "local", "swarm" or "none"
    words: str  # planner.policy.fit_words
    reason: str


def model_fit(model: ModelSpec, hardware: HardwareSpec, model_id: str | None = None,
              efficiency: MachineEfficiency | None = None) -> ModelFit:
    """Whether a model runs here (chat, default knobs), only with the swarm, or not at all, and why: planned in
    the format the runtime runs it in (a GGUF's own Q8_0/Q4_0/Q4_1 packed on a CPU: format_choice)."""
    constraints, _ = plan_constraints(model_path_or_id(model_id or model.name), "auto", hardware, "chat",
                                      reserve_bytes=default_headroom(hardware))
    plan = planner_policy.search(model, hardware, "chat", constraints, efficiency=efficiency)
    return ModelFit(model_id or model.name, plan.fit, fit_words(plan), plan.reason)


def fit_reason(plan: planner_policy.Plan) -> str:
    """The plan's reason for the fit line, without the bottleneck's explanation it opens with (the Bottleneck card
    shows that): what remains is where the weights and KV cache go, or why it does not fit."""
    detail = plan.prediction.bottleneck_detail if plan.prediction is not None else ""
    lead = f"{detail}. "
    return plan.reason[len(lead):] if detail and plan.reason.startswith(lead) else plan.reason
