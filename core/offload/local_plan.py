"""Choosing how to run a model locally: a planner Policy (searched for this machine, or read from a plan file) turned
into an EnginePlan for the offloading engine, under an optional RAM budget. `plan_local_run` is the one choice that
`generate`, `chat` and the app's chat make (benches use its pieces).

A plan file is what `hivekeeper plan --json` writes (its "policy" object is read), or a bare policy object:

    {"weight_format": "fp32", "weights": {"gpu": 0, "cpu": 0.5, "disk": 0.5}, "kv_cache": {"gpu": 0, "cpu": 1,
     "disk": 0}, "micro_batch_size": 1, "num_micro_batches": 1, "prefetch_depth": 1}

A plan file says what it was made for (plan_file_checks): one made for another model is refused (its weight format
and placement were sized for that model's bytes); one made for another machine (a catalog id, or `--hardware auto`
on a machine whose fingerprint differs) runs with a warning.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from hivekeeper.planner.costmodel import TIERS, Placement, Policy, Workload
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.fields import Fields

from hivekeeper.core.machine.cpu_dtype import runs_natively_on_cpu


@dataclass(frozen=True)
class PolicyChoice:
    policy: Policy
    source: str  # "auto" (the planner), "fallback" (the planner found nothing that fits) or the plan file's path
    reason: str  # the planner's explanation, or where the policy came from
    warnings: tuple[str, ...] = ()  # what the user should know about this choice (a plan file for another machine)
    predicted: dict | None = None  # the cost model's figures for this policy (PREDICTED_KEYS), when there are any
    # the planner's figures of another policy for this run on the machine it planned for (run_predictor): the plan
    # made here re-predicted for the blocks the engine placed (as_placed)
    predict: Callable[[Policy], dict | None] | None = field(default=None, compare=False, repr=False)


# what a run prints as predicted beside its measured figures: the planner's Prediction fields / plan JSON keys
PREDICTED_KEYS = ("throughput_tokens_per_s", "decode_tokens_per_s", "prefill_tokens_per_s", "bottleneck")
# ... and, where the prediction is of another dtype than the policy names (costmodel.evaluate_as_run), why
ENGINE_NOTE_KEY = "engine_note"
# the prompt and output tokens a prediction is for ({"prompt_len": p, "output_len": o}), and, where a plan file's
# prediction was made again for this run's tokens (plan_file_prediction), the plan's tokens and figures
TOKENS_KEY, PLAN_FIGURES_KEY = "tokens", "plan_figures"


def predicted_figures(source) -> dict | None:
    """PREDICTED_KEYS of a planner Prediction or of a plan JSON document (`hivekeeper plan --json`), with its
    engine note where it has one, or None."""
    if isinstance(source, dict):
        found = {key: source.get(key) for key in PREDICTED_KEYS}
    else:
        found = {key: getattr(source, key, None) for key in PREDICTED_KEYS}
    if not isinstance(found["throughput_tokens_per_s"], (int, float)):
        return None
    note = source.get(ENGINE_NOTE_KEY) if isinstance(source, dict) else getattr(source, ENGINE_NOTE_KEY, "")
    if note:
        found[ENGINE_NOTE_KEY] = note
    return {key: (round(value, 4) if isinstance(value, float) else value) for key, value in found.items()}


def placement(policy: Fields, name: str, default: Placement) -> Placement:
    """The placement object `name` ({"gpu": x, "cpu": y, "disk": z}, fractions summing to 1), or `default`."""
    if not policy.has(name):
        return default
    tiers = policy.section(name)
    fractions = [tiers.number(tier, 0.0, 1.0, default=0.0) for tier in TIERS]
    try:
        return Placement(*fractions)
    except InputError as exc:
        raise policy.error(name, f"is not a placement: {exc}") from None


def policy_from_dict(doc, source: str = "plan") -> Policy:
    """A Policy from a plan JSON object (`hivekeeper plan --json`) or a bare policy object."""
    if not isinstance(doc, dict):
        raise InputError(f"{source}: expected a JSON object")
    if "policy" in doc:
        doc = doc["policy"]
        if doc is None:
            raise InputError(f"{source}: the plan has no local policy (field 'policy' is null: it does not fit here)")
        if not isinstance(doc, dict):
            raise InputError(f"{source}: field 'policy' must be an object")
        if "num_blocks" in doc:
            raise InputError(f"{source}: this is a serving plan (goal 'serve'); make a chat or batch plan")
    check_policy_fields(doc, source)
    policy = Fields(doc, source)
    ram = Placement(0.0, 1.0, 0.0)
    values = dict(
        weight_format=policy.text("weight_format", default="fp32", max_len=100),
        weights=placement(policy, "weights", ram),
        kv_cache=placement(policy, "kv_cache", ram),
        activations=placement(policy, "activations", ram),
        micro_batch_size=policy.integer("micro_batch_size", default=1, high=65536),
        num_micro_batches=policy.integer("num_micro_batches", default=1, high=4096),
        kv_recompute=policy.text("kv_cache_mode", default="keep", choices=("keep", "recompute")) == "recompute",
        prefetch_depth=policy.integer("prefetch_depth", default=1, low=0, high=2),
        attention_on_cpu=policy.flag("attention_on_cpu", default=False),
    )
    try:
        made = Policy(**values)  # checks that span fields (recompute with CPU attention, disk activations)
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None
    if policy.has("batch_size") and policy.integer("batch_size", low=1, high=65536 * 4096) != made.batch_size:
        raise policy.error("batch_size", f"is {doc['batch_size']}, but micro_batch_size x num_micro_batches is "
                                         f"{made.batch_size}")
    return made


# what Policy.as_dict writes (`plan --json`'s "policy"); batch_size is the product of the micro-batches, checked
POLICY_FIELDS = ("weight_format", "weights", "kv_cache", "activations", "batch_size", "micro_batch_size",
                 "num_micro_batches", "kv_cache_mode", "prefetch_depth", "attention_on_cpu")


def check_policy_fields(doc: dict, source: str) -> None:
    """A policy object names only policy fields, at least one: a file that is not a plan (a hardware JSON, a typo'd
    field) is refused rather than run with every default."""
    unknown = [key for key in doc if key not in POLICY_FIELDS]
    if unknown or not doc:
        what = f"unknown field {', '.join(repr(k) for k in unknown[:5])}" if unknown else "no policy fields"
        raise InputError(f"{source}: not a plan ({what}): give a file from `hivekeeper plan --json` or its 'policy' "
                         f"object ({', '.join(POLICY_FIELDS)})")


def read_plan_file(path: str | Path):
    """The JSON document of a plan file; errors name the file."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such plan file (give --plan auto or a file from `hivekeeper plan --json`)") \
            from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a valid plan JSON file ({exc})") from None


def load_policy_file(path: str | Path) -> Policy:
    return policy_from_dict(read_plan_file(path), source=str(path))


def plan_file_checks(doc, path: str | Path, model_path: str | Path) -> tuple[str, ...]:
    """Whether a plan file (`hivekeeper plan --json`) applies to this run: an InputError when it was made for
    another model; warnings when it was made for another machine. A bare policy object says neither: no checks."""
    if not isinstance(doc, dict) or "policy" not in doc:
        return ()
    check_plan_model(doc, path, model_path)
    hardware = doc.get("hardware")
    if isinstance(hardware, str) and hardware != "detected":
        return (f"{path} was made for hardware {hardware!r}, not this machine: its weight format and placement were "
                f"chosen for that machine (`hivekeeper plan --hardware auto --json` makes one for this one)",)
    fingerprint = doc.get("machine_fingerprint")
    if isinstance(fingerprint, str) and fingerprint != this_machine_fingerprint():
        return (f"{path} was made on another machine (fingerprint {fingerprint}): its placement may not fit here",)
    return ()


def check_plan_model(doc, path: str | Path, model_path: str | Path) -> None:
    """An InputError when a plan file (`hivekeeper plan --json`) was made for another model than this run's."""
    if not isinstance(doc, dict) or "policy" not in doc:
        return
    from hivekeeper.planner.model_catalog import load_model_spec

    planned_model, here = doc.get("model"), load_model_spec(str(model_path)).name
    if isinstance(planned_model, str) and planned_model != here:
        raise InputError(f"{path}: this plan was made for model {planned_model!r}, not {here!r} (this run's "
                         f"--model); make one with `hivekeeper plan --model {model_path} --json`")


def check_plan_file(plan_arg: str | Path, model_path: str | Path) -> None:
    """A plan file that can be run with this model: a policy (policy_from_dict) made for it (check_plan_model). The
    machine's warnings wait for the run's plan (plan_file_checks): they detect the hardware."""
    doc = read_plan_file(plan_arg)
    check_plan_model(doc, plan_arg, model_path)
    policy_from_dict(doc, source=str(plan_arg))


def this_machine_fingerprint() -> str:
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.profile_files import machine_fingerprint

    return machine_fingerprint(detect_hardware())


def fallback_policy(weight_format: str, batch: int) -> Policy:
    """Everything in RAM as far as the budget allows, the rest streamed from disk with double buffering."""
    return Policy(weight_format=weight_format, weights=Placement(0.0, 1.0, 0.0), kv_cache=Placement(0.0, 1.0, 0.0),
                  activations=Placement(0.0, 1.0, 0.0), micro_batch_size=batch, prefetch_depth=1)


class DoesNotFit(InputError):
    """The planner found no local plan for this model on this machine (search_policy with fallback=False)."""


def with_ram_budget(hardware, ram_budget_bytes: float, efficiency=None):
    """The planner's HardwareSpec with RAM for the model of `ram_budget_bytes` on top of the runtime the planner
    reserves itself (efficiency's runtime_bytes). apply_host_overrides takes decimal GB: dividing by GiB (as until
    session 11) gave the planner 7% less RAM than budget + runtime, 123 MB of the 176 MB left for the model at the
    offload bench's budget, so it planned nearly every block on disk and no batch above 128."""
    from hivekeeper.planner.efficiency import default_efficiency
    from hivekeeper.planner.hardware_catalog import apply_host_overrides

    eff = efficiency or default_efficiency(hardware)
    runtime = (eff.host if hardware.has_gpu else eff.accelerator).runtime_bytes
    return apply_host_overrides(hardware, ram_gb=(ram_budget_bytes + runtime) / 1e9)


def search_policy(model_path: str | Path, *, batch: int, prompt_len: int, max_new_tokens: int,
                  ram_budget_bytes: float | None = None, quant: str = "none", hardware=None, efficiency=None,
                  fallback: bool = True, measure: bool = False) -> PolicyChoice:
    """The planner's best policy for this machine, this model and this run: 16-bit or fp32 weights, or int8/nf4
    when `quant` says so.

    hardware: the planner's HardwareSpec of this machine (None: this machine as `plan --hardware auto` sees it,
    detected with its saved profile's measurements, measured quickly first when it has none and `measure`, as the
    first plan for a machine is: core/machine/first_measure.py); efficiency: its cost-model factors (None: the
    profile's, else the defaults). With a RAM budget the planner is told the machine has that much RAM on top of
    the runtime it reserves itself. When nothing fits, `fallback` streams what RAM cannot hold (fallback_policy); without it,
    DoesNotFit says why.
    """
    from hivekeeper.planner.model_catalog import load_model_spec
    from hivekeeper.planner.policy import Constraints, search

    if hardware is None:  # one prediction per machine and model: generate, chat and the app plan as `plan` does
        from hivekeeper.core.machine.first_measure import this_machine

        # detected with the saved profile's measured numbers and factors (before, generate planned with the detected
        # estimates alone while plan read the profile: the app showed 13.2 tokens/s beside generate's 41.8)
        hardware, profiled = this_machine(measure)
        efficiency = efficiency if efficiency is not None else profiled
    spec = load_model_spec(str(model_path))
    if ram_budget_bytes is not None:
        hardware = with_ram_budget(hardware, ram_budget_bytes, efficiency)
    goal = "batch" if batch > 1 else "chat"
    packed = packed_choice(model_path, quant, hardware)  # a GGUF the runtime keeps packed: plan what runs
    workload = Workload(prompt_len=max(1, prompt_len), output_len=max(1, max_new_tokens))
    plan = search(spec, hardware, goal, Constraints(quant=packed.quant, batch_size=batch,
                                                    packed_formats=packed.packed_formats,
                                                    file_format=packed.file_format), workload, efficiency=efficiency)
    if plan.prediction is not None:
        return PolicyChoice(plan.prediction.policy, "auto", plan.reason,
                            predicted=for_tokens(predicted_figures(plan.prediction), workload),
                            predict=run_predictor(spec, workload, hardware, efficiency))
    if not fallback:
        raise DoesNotFit(f"{spec.name} does not fit on this machine: {plan.reason}")
    fmt = packed.quant if packed.quant != "none" else \
        spec.torch_dtype if spec.torch_dtype in ("fp32", "bf16", "fp16") else "fp32"  # a GGUF the runtime packs: packed
    return PolicyChoice(fallback_policy(fmt, batch), "fallback",
                        f"the planner found no local plan ({plan.reason}); streaming what RAM cannot hold")


def packed_choice(model_path: str | Path, quant: str, hardware):
    """planner.format_choice for this run: a GGUF's own Q8_0/Q4_0/Q4_1 on a CPU where the runtime packs it (what
    the engine then runs, so the prediction is of it); else `quant` unchanged."""
    return runtime_format(model_path, quant, on_gpu=bool(hardware.gpus))


def tokens_of(workload: Workload) -> dict:
    return {"prompt_len": workload.prompt_len, "output_len": workload.output_len}


def for_tokens(figures: dict | None, workload: Workload) -> dict | None:
    """Predicted figures with the tokens they are for (TOKENS_KEY)."""
    return None if figures is None else {**figures, TOKENS_KEY: tokens_of(workload)}


def run_predictor(spec, workload: Workload, hardware, efficiency,
                  reserve_bytes: dict[str, float] | None = None) -> Callable[[Policy], dict | None]:
    """The figures (predicted_figures, TOKENS_KEY) of a policy run for `workload` on `hardware`, in the dtype the engine
    computes it in (costmodel.evaluate_as_run: the planner's prediction of one policy, as the app's "Run this plan"
    predicts a run)."""
    from hivekeeper.planner.costmodel import evaluate_as_run

    def predict(policy: Policy) -> dict | None:
        return for_tokens(predicted_figures(evaluate_as_run(spec, hardware, policy, workload, efficiency,
                                                            reserve_bytes, planned_rows=policy.micro_batch_size)),
                          workload)

    return predict


def runtime_format(model_path: str | Path, quant: str = "none", *, on_gpu: bool):
    """packed_choice on a device: a GGUF's own packed format where the runtime keeps it packed (a CPU, no --quant),
    else `quant` unchanged."""
    from hivekeeper.planner.format_choice import FormatChoice, format_choice
    from hivekeeper.planner.formats import PACKED_FORMATS

    from hivekeeper.core.runtime.gguf import packed_by_default

    if quant != "none" or on_gpu:
        return FormatChoice(quant)
    choice = format_choice(str(model_path), "auto", on_cpu=True, runtime_packs=packed_by_default())
    return choice if choice.quant in PACKED_FORMATS else FormatChoice(quant)


def check_plan_options(plan_arg: str, quant: str) -> None:
    """--plan and --quant as given, checked before anything is loaded or compiled (one line, exit 2): a known
    --quant, only with --plan auto, and a plan file that can be read."""
    if quant not in ("none", "int8", "nf4"):
        raise InputError(f"--quant {quant!r}: choose none, int8 or nf4")
    if plan_arg == "auto":
        return
    if quant != "none":
        raise InputError(f"--quant {quant} goes with --plan auto; with --plan {plan_arg} the plan file's "
                         "weight_format decides")
    read_plan_file(plan_arg)


def choose_policy(plan_arg: str, model_path: str | Path, *, batch: int, prompt_len: int, max_new_tokens: int,
                  ram_budget_bytes: float | None = None, quant: str = "none", **search_options) -> PolicyChoice:
    """--plan auto (the planner, with --quant's weight format) or --plan FILE (whose weight_format decides).
    search_options: search_policy's hardware, efficiency, fallback and measure."""
    check_plan_options(plan_arg, quant)
    if plan_arg == "auto":
        return search_policy(model_path, batch=batch, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                             ram_budget_bytes=ram_budget_bytes, quant=quant, **search_options)
    doc = read_plan_file(plan_arg)
    warnings = plan_file_checks(doc, plan_arg, model_path)
    policy = policy_from_dict(doc, source=str(plan_arg))
    run = Workload(prompt_len=max(1, prompt_len), output_len=max(1, max_new_tokens))
    predicted = plan_file_prediction(doc, policy, model_path, run, batch, this_machine=not warnings,
                                     hardware=search_options.get("hardware"),
                                     efficiency=search_options.get("efficiency"))
    return PolicyChoice(policy, str(plan_arg), f"policy read from {plan_arg}", warnings, predicted=predicted)


def plan_tokens(doc) -> dict | None:
    """The prompt and output tokens a plan file (`hivekeeper plan --json`) was made for, or None (a bare policy)."""
    if not isinstance(doc, dict):
        return None
    tokens = {key: doc.get(key) for key in ("prompt_len", "output_len")}
    return tokens if all(isinstance(v, int) and v >= 1 for v in tokens.values()) else None


def plan_file_prediction(doc, policy: Policy, model_path: str | Path, run: Workload, batch: int, *,
                         this_machine: bool, hardware=None, efficiency=None) -> dict | None:
    """A plan file's predicted figures for this run: the plan's own when it was made for this run's prompt and
    output tokens; made again for them (run_predictor, with the plan's kept-free memory) when the plan was made on
    this machine (`--hardware auto`, no warning of another one) for this batch, its own figures and tokens kept
    under PLAN_FIGURES_KEY; else the plan's, with the tokens they are for (TOKENS_KEY: generate says they are not
    this run's)."""
    figures, tokens = predicted_figures(doc), plan_tokens(doc)
    if figures is None or tokens is None:
        return figures
    figures[TOKENS_KEY] = tokens
    if tokens == tokens_of(run) or not this_machine or doc.get("hardware") != "detected" or \
            policy.batch_size != batch:
        return figures
    from hivekeeper.planner.model_catalog import load_model_spec

    if hardware is None:  # this machine as the plan saw it: the saved profile's measurements (none taken now)
        from hivekeeper.core.machine.first_measure import this_machine as measured_machine

        hardware, profiled = measured_machine(False)
        efficiency = efficiency if efficiency is not None else profiled
    kept = ((doc.get("kept_free") or {}).get("bytes")) if isinstance(doc.get("kept_free"), dict) else None
    reserve = {tier: float(v) for tier, v in kept.items() if tier in TIERS and isinstance(v, (int, float))} \
        if isinstance(kept, dict) else None
    again = run_predictor(load_model_spec(str(model_path)), run, hardware, efficiency, reserve)(policy)
    if again is None:
        return figures
    return {**again, PLAN_FIGURES_KEY: {key: figures.get(key) for key in
                                        (TOKENS_KEY, "throughput_tokens_per_s", "decode_tokens_per_s")}}


def compute_dtype(weight_format: str, device: str, rows: int = 1, planned_rows: int | None = None):
    """(torch dtype, quant) to run a weight format with on a device, for a plan whose decode micro-batches multiply
    `rows` rows (placement.micro_batch_rows) and which was made for micro-batches of `planned_rows` (its
    micro_batch_size; None: no plan, a checkpoint's own dtype). On a CPU a 16-bit plan runs in bf16 where the CPU
    multiplies bf16 natively and the rule of core/machine/cpu_dtype_rule says so for its rows (beyond the native
    decode kernels' rows; at or below them where a measured bf16 step beat fp32's or the plan was made for so few
    rows: the planner names bf16 there only where it predicts fp32 slower, as streamed from disk), else in fp32
    (without 16-bit math prefill would be ~100x slower); the planner offers no 16-bit plan the engine would run in
    fp32 (costmodel.runs_as_planned).
    int8/nf4 compute in fp16 on CUDA, fp32 on the CPU; a packed format (q8_0/q4_0/q4_1) is a GGUF run in fp32 on a
    CPU, packed by the GGUF loader (fp16 on CUDA)."""
    import torch

    from hivekeeper.planner.formats import PACKED_FORMATS

    from hivekeeper.core.offload.placement import FLOAT_FORMATS

    on_gpu = torch.device(device).type == "cuda"
    if weight_format in ("int8", "nf4"):
        return (torch.float16 if on_gpu else torch.float32), weight_format
    if weight_format in PACKED_FORMATS:  # a GGUF's own Q8_0/Q4_0/Q4_1: its loader keeps fp32 blocks' linears packed
        return (torch.float16 if on_gpu else torch.float32), "none"
    if weight_format not in FLOAT_FORMATS:
        raise InputError(f"weight format {weight_format!r} is not supported by the engine")
    if not on_gpu and weight_format != "fp32" and not runs_natively_on_cpu(weight_format, rows, planned_rows):
        return torch.float32, "none"
    return FLOAT_FORMATS[weight_format], "none"


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_plan(config, choice: PolicyChoice, *, batch: int, max_length: int, ram_budget_bytes: float | None = None,
                prefill_tokens: int = 256, device: str | None = None, model_path: str | Path | None = None):
    """The EnginePlan for this run (device, dtype and every block's tier). model_path: the model, so that a GGUF the
    engine keeps packed is placed by its packed bytes (packed_stream.packed_sizes), not by the dtype's. A GGUF stays
    packed only where the policy names its packed format (q8_0/q4_0/q4_1): a plan of a float format (a plan file
    made with --quant none) runs dequantized, as it was predicted (EnginePlan.gguf_dequantized)."""
    from hivekeeper.planner.format_choice import gguf_packed_type
    from hivekeeper.planner.formats import PACKED_FORMATS

    from hivekeeper.core.offload.packed_stream import packed_sizes
    from hivekeeper.core.offload.placement import micro_batch_rows, place_model

    device = device or default_device()
    policy = choice.policy
    rows = micro_batch_rows(batch, policy.micro_batch_size, policy.num_micro_batches)
    dtype, quant = compute_dtype(policy.weight_format, device, rows, planned_rows=policy.micro_batch_size)
    packs = policy.weight_format in PACKED_FORMATS
    held = packed_sizes(model_path, device, dtype, quant) if model_path is not None and packs else {}
    plan = place_model(config, choice.policy, device=device, dtype=dtype, batch=batch, max_length=max_length,
                       ram_budget_bytes=ram_budget_bytes, prefill_tokens=prefill_tokens, quant=quant, **held)
    plan = replace(plan, gguf_dequantized=not packs)
    return replace(plan, packed_format=gguf_packed_type(str(model_path)) or "") if held else plan  # says what runs


def plan_local_run(plan_arg: str, model_path: str | Path, config, *, batch: int, prompt_len: int,
                   max_new_tokens: int, max_length: int, ram_budget_bytes: float | None = None, quant: str = "none",
                   device: str | None = None, **search_options):
    """The one choice of how to run a model here, made the same way by `hivekeeper generate`, `chat` and the app's
    chat: the policy (choose_policy), then the EnginePlan with the dtype this machine computes it in
    (compute_dtype); under a RAM budget the planner's policy names the blocks the engine placed (as_placed).
    Returns (PolicyChoice, EnginePlan)."""
    choice = choose_policy(plan_arg, model_path, batch=batch, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                           ram_budget_bytes=ram_budget_bytes, quant=quant, **search_options)
    plan = engine_plan(config, choice, batch=batch, max_length=max_length, ram_budget_bytes=ram_budget_bytes,
                       prefill_tokens=min(256, max(1, prompt_len)), device=device, model_path=model_path)
    return (as_placed(choice, plan) if ram_budget_bytes is not None else choice), plan


def as_placed(choice: PolicyChoice, plan) -> PolicyChoice:
    """A plan made here (choice.predict) under a RAM budget, with the blocks the engine placed and predicted for
    them. The engine fills the budget with whole blocks and streams through whole slots (placement.place_model);
    the planner counts a fraction of the weights and slots in proportion to the streamed share (costmodel
    solve_weight_placement), which came one block more: SmolLM2 at 0.05 GB planned 7 blocks in RAM, and 7 with
    their two slots took 50.8 MB. Unchanged where the engine placed the blocks and prefetch depth the policy names."""
    from hivekeeper.core.offload.placement import tier_counts

    policy, layers = choice.policy, len(plan.weight_tiers)
    w = policy.weights
    placed = {tier: plan.weight_tiers.count(tier) for tier in TIERS}
    named = tier_counts({"gpu": w.gpu, "cpu": w.cpu, "disk": w.disk}, layers, TIERS)
    if choice.predict is None or (named == placed and policy.prefetch_depth == plan.prefetch_depth):
        return choice
    whole = Placement(*(placed[tier] / layers for tier in TIERS))
    ran = replace(policy, weights=whole, prefetch_depth=plan.prefetch_depth)
    return replace(choice, policy=ran, predicted=choice.predict(ran))

def use_runtime_threads() -> None:
    """The thread layout local runs use (offloaded_model.use_physical_cores: torch on one thread, the matmuls on
    the cores), unless OMP_NUM_THREADS already sets torch's threads. For processes that run no other torch work."""
    if "OMP_NUM_THREADS" not in os.environ:
        from hivekeeper.core.offload.offloaded_model import use_physical_cores

        use_physical_cores()
