"""Runtime profiles: time the real runtime over a grid, calibrate the planner, and report predicted vs measured.

`profile_model` loads a checkpoint into the offloading engine once per placement, runs `generation.generate`
(greedy, ignore_eos) for every prompt length × output length × batch size of a `ProfileGrid`, and repeats the whole
grid `repeats` times, so a burst of load from other processes hits different repeats of a point at different
moments; each point keeps the median of its repeats (the machine's typical time, as `hivekeeper measure` keeps the
median of its timings) and the spread. On a measured machine `PaceCheck` compares each pass of the grid with what
the measurement predicts and, when the host ran well off that pace, times the grid again at a later moment (issue 23,
session 21); where every pass ran faster than the measurement predicts, its decode steps and prefill passes are
read again (core/machine/read_again.py, session 24) and the fit is against that reading. It then fits the cost
model's efficiency factors and the idealized-runtime forms (planner/calibration.py) and returns the Calibration to
save.

`render_report` and `write_report_png` compare the three forms (uncalibrated cost model, calibrated cost model,
idealized α(p) + β(o − 1)) with the measurements: per point, MAPE and worst error, and plots of runtime vs p and o.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from hivekeeper.core.machine.step_overhead import StepClock
from hivekeeper.planner.calibration import (Calibration, FormPrediction, ProfilePoint, build_calibration,
                                            compare_forms, cost_model_predictions, form_accuracy, linear_alpha_fits,
                                            measured_efficiency)
from hivekeeper.planner.costmodel import Placement, Policy
from hivekeeper.planner.efficiency import MEASURED_PREFIX, MachineEfficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import HardwareSpec
from hivekeeper.planner.models import ModelSpec

Progress = Callable[[float, str], None]

PLACEMENTS = ("resident", "ram", "disk")


@dataclass(frozen=True)
class ProfileGrid:
    """The points to time: every prompt length × output length × batch size, for each placement."""

    prompt_lens: tuple[int, ...] = (16, 64, 256, 1024)
    output_lens: tuple[int, ...] = (1, 32)
    # three batch sizes: on a CPU the weight re-reads (b = 2, 4) cannot be told from the bandwidth with two
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    placements: tuple[str, ...] = ("resident",)
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("prompt_lens", "output_lens", "batch_sizes"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise InputError(f"grid {name.replace('_', '-')} must be positive integers, got {values!r}")
        if len(set(self.prompt_lens)) < 2:
            raise InputError("the grid needs at least two prompt lengths (the idealized fit has a slope in p)")
        unknown = [p for p in self.placements if p not in PLACEMENTS]
        if unknown or not self.placements:
            name = unknown[0] if unknown else ""
            raise InputError(f"unknown placement {name!r}; choose from {', '.join(PLACEMENTS)}")
        if not 1 <= self.repeats <= 50:
            raise InputError(f"repeats must be from 1 to 50, got {self.repeats}")

    def points(self) -> list[tuple[int, int, int]]:
        """(prompt_len, output_len, batch) of every point, the cheapest first."""
        grid = [(p, o, b) for b in self.batch_sizes for p in self.prompt_lens for o in self.output_lens]
        return sorted(grid, key=lambda g: (g[2] * (g[0] + 4 * g[1]), g))

    @property
    def runs(self) -> int:
        return len(self.placements) * self.repeats * len(self.points())


QUICK_GRID = ProfileGrid(prompt_lens=(8, 32, 128), output_lens=(1, 8), batch_sizes=(1,), repeats=2)

_FORMAT_OF_DTYPE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def placement_policy(name: str, on_gpu: bool, weight_format: str) -> Policy:
    """The policy of a named placement. resident: weights and KV cache on the compute device; ram (GPU only):
    weights in RAM, streamed to the GPU; disk: half the blocks on disk (the rest in RAM), streamed."""
    compute = Placement(1.0, 0.0, 0.0) if on_gpu else Placement(0.0, 1.0, 0.0)
    if name == "resident":
        return Policy(weight_format, weights=compute, kv_cache=compute, activations=compute, prefetch_depth=0)
    if name == "ram":
        if not on_gpu:
            raise InputError("placement 'ram' streams weights from RAM to a GPU; on a CPU 'resident' is RAM")
        return Policy(weight_format, weights=Placement(0.0, 1.0, 0.0), kv_cache=compute, activations=compute,
                      prefetch_depth=1)
    if name == "disk":
        return Policy(weight_format, weights=Placement(0.0, 0.5, 0.5), kv_cache=compute, activations=compute,
                      prefetch_depth=1)
    raise InputError(f"unknown placement {name!r}; choose from {', '.join(PLACEMENTS)}")


@dataclass(frozen=True)
class Run:
    """One timed generate() call. step_s is the median of its decode steps (robust to bursts of load; the steps'
    context grows linearly, so the median step is also the mean one)."""

    prompt_len: int
    output_len: int
    batch_size: int
    placement: str
    prefill_s: float
    step_s: float | None
    runtime_s: float
    loadavg: float
    grid_pass: int = 0  # which pass of the whole grid (PaceCheck may ask for more than one)


def denoise(runs: list[Run]) -> list[ProfilePoint]:
    """One point per (placement, p, o, batch): the median repeat of each time (of two, their mean), and the
    runtime's spread. Issue 23 (session 17): the fastest repeat, kept until then, was compared with predictions from
    the measurement's medians; on a host whose rate swings within seconds two repeats of a SmolLM2 decode point lay
    8-25% apart, and the fastest put every decode step 4-12% faster than typical."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault((run.placement, run.prompt_len, run.output_len, run.batch_size), []).append(run)
    points = []
    for (placement, p, o, b), group in groups.items():
        runtimes = [r.runtime_s for r in group]
        steps = [r.step_s for r in group if r.step_s is not None]
        points.append(ProfilePoint(
            prompt_len=p, output_len=o, batch_size=b, placement=placement,
            prefill_s=statistics.median(r.prefill_s for r in group), step_s=statistics.median(steps) if steps else None,
            runtime_s=statistics.median(runtimes), spread=(max(runtimes) - min(runtimes)) / min(runtimes),
            repeats=len(group), loadavg=max(r.loadavg for r in group),
        ))
    return points


def _silent(fraction: float, label: str) -> None:
    pass


PassCheck = Callable[[list[Run], Policy, int], bool]


def measure_grid(model_path: str | Path, grid: ProfileGrid, *, device: str = "cpu", progress: Progress = _silent,
                 should_stop: Callable[[], bool] = lambda: False, seed: int = 0,
                 check: PassCheck | None = None) -> tuple[list[Run], dict[str, Policy]]:
    """Time generate() at every grid point and repeat; returns the raw runs and the policy of each placement.

    After each pass of the whole grid (its `repeats`) `check(runs of the pass, policy, pass index)` may ask for one
    more pass of that placement (PaceCheck: the host ran off its measured pace)."""
    import torch

    from hivekeeper.core.runtime.checkpoint import load_config
    from hivekeeper.core.offload.offloaded_model import OffloadedModel
    from hivekeeper.core.offload.placement import place_model
    from hivekeeper.core.offload.local_plan import compute_dtype, runtime_format

    from hivekeeper.planner.formats import PACKED_FORMATS
    from hivekeeper.planner.model_catalog import load_model_spec

    config = load_config(model_path)
    spec = load_model_spec(str(model_path))
    on_gpu = torch.device(device).type == "cuda"
    packed = runtime_format(model_path, on_gpu=on_gpu).quant  # a GGUF the runtime keeps packed on a CPU: its format
    dtype, quant = compute_dtype(packed if packed in PACKED_FORMATS else spec.torch_dtype, device)
    weight_format = packed if packed in PACKED_FORMATS else _FORMAT_OF_DTYPE[str(dtype)]
    longest = max(grid.prompt_lens) + max(grid.output_lens)
    if longest > config.max_position_embeddings:
        raise InputError(f"the grid's longest run ({max(grid.prompt_lens)} + {max(grid.output_lens)} tokens) exceeds "
                         f"the model's context ({config.max_position_embeddings} tokens)")
    timer = _GridTimer(grid, config.vocab_size, torch.Generator().manual_seed(seed), progress, should_stop)
    policies = {name: placement_policy(name, on_gpu, weight_format) for name in grid.placements}
    for name, policy in policies.items():
        plan = place_model(config, policy, device=device, dtype=dtype, batch=max(grid.batch_sizes),
                           max_length=longest, quant=quant)
        progress(timer.fraction, f"loading ({name})")
        model = OffloadedModel(model_path, plan, drop_page_cache=name == "disk")
        try:
            timer.warm_up(model)
            grid_pass = 0
            while timer.time_pass(model, name, grid_pass) and check is not None \
                    and check(timer.runs_of(name, grid_pass), policy, grid_pass):
                grid_pass += 1
                timer.add_pass()
        finally:
            model.close()
        if should_stop():
            break
    if not should_stop():
        progress(1.0, "measured")
    return timer.runs, policies


class _GridTimer:
    """The runs of one measure_grid call and its progress (the total grows when a check asks for another pass)."""

    def __init__(self, grid: ProfileGrid, vocab_size: int, generator, progress: Progress,
                 should_stop: Callable[[], bool]):
        self.grid, self.vocab_size, self.generator = grid, vocab_size, generator
        self.progress, self.should_stop = progress, should_stop
        self.runs: list[Run] = []
        self.total = grid.runs

    @property
    def fraction(self) -> float:
        return len(self.runs) / self.total

    def add_pass(self) -> None:
        self.total += self.grid.repeats * len(self.grid.points())

    def runs_of(self, placement: str, grid_pass: int) -> list[Run]:
        return [r for r in self.runs if r.placement == placement and r.grid_pass == grid_pass]

    def warm_up(self, model) -> None:
        """First-call costs (allocator, kernel choice) before anything is timed."""
        import torch

        from hivekeeper.core.runtime.generation import generate

        warm = torch.randint(0, self.vocab_size, (min(self.grid.prompt_lens),), generator=self.generator).tolist()
        generate(model, warm, max_new_tokens=2, ignore_eos=True)

    def time_pass(self, model, placement: str, grid_pass: int) -> bool:
        """Every point `repeats` times, in turn; False when stopped."""
        repeats = self.grid.repeats
        for repeat in range(repeats):
            for p, o, b in self.grid.points():
                if self.should_stop():
                    return False
                label = f"repeat {repeat + 1}/{repeats}" if not grid_pass else \
                    f"pass {grid_pass + 1}, repeat {repeat + 1}/{repeats}"
                self.progress(self.fraction, f"{placement} p={p} o={o} b={b} ({label})")
                self.runs.append(self.time_point(model, placement, p, o, b, grid_pass))
        return True

    def time_point(self, model, placement: str, p: int, o: int, b: int, grid_pass: int) -> Run:
        import torch

        from hivekeeper.core.machine.measure import load_average
        from hivekeeper.core.runtime.generation import generate

        ids = torch.randint(0, self.vocab_size, (b, p), generator=self.generator).tolist()
        load = load_average()
        clock = StepClock()
        called = time.perf_counter()
        result = generate(model, ids, max_new_tokens=o, batch=b, ignore_eos=True, stop=clock)
        last_token_at = called + result.time_to_first_token_s + result.decode_s
        steps = clock.step_durations(last_token_at) if result.steps > 1 else []
        step = float(np.median(steps)) if steps else None
        return Run(p, o, b, placement, result.time_to_first_token_s, step, result.total_s, max(load, load_average()),
                   grid_pass)


# ---- the host's pace during the grid (issue 23, session 21) -------------------------------------------------------
# The accuracy bench's calibration grid lasts ~17 s, and its host has slow spells of 10-20 s. In one run every point
# of the grid ran at 0.72-0.85 of what the quick measurement predicted (the evaluation a minute later at 0.95-1.08):
# the fit followed that moment, and the calibrated decode missed by 17.5% where the uncalibrated one missed by 7.7%.
# The measurement reads its figures at several moments (core/machine/measure.py); the grid is one moment unless it
# is read again. A pass of the grid whose pace (predicted / measured time, geometric mean over its points, prefill
# and decode apart) lies outside [1 / PACE_TOLERANCE, PACE_TOLERANCE] is followed by another pass, at most
# EXTRA_PASSES more; the fit keeps the passes within the tolerance when there are any (the host at the pace the
# plans are made for), else all of them (then it is the model's own error on this machine, or a host busy the
# whole time, and the calibration's notes say which passes were off).
PACE_TOLERANCE = 1.12
EXTRA_PASSES = 2


# where every pass of the grid ran faster than the measurement predicted: the measurement caught a slower moment, and
# the fit (which keeps a CPU's measured per-byte rates) cannot make it up. Issue 23, session 23: a run whose passes
# all ran 1.23-1.34x faster than measured fitted 14.9% off against 15.0% uncalibrated
MEASURED_SLOW_WORDS = ("every pass ran faster than this machine's measurement predicts, which likely caught a busy "
                       "moment: run `hivekeeper measure` again at a quiet one, then profile again")


# where every pass ran faster than measured and profile_model could read the measurement again (read_again)
READ_AGAIN_WORDS = ("every pass ran faster than the measurement predicts, so its decode steps and prefill passes were "
                    "read again after the grid and the measurement updated; against the new reading")
# ... where the new reading agreed with the grid no better than the measurement (the host moved in between)
KEPT_WORDS = "its decode steps and prefill passes read again after the grid agreed with it no better, so the " \
             "measurement was kept (against the new reading"


@dataclass(frozen=True)
class PassPace:
    """How fast one pass of the grid ran against the measured machine's prediction: predicted / measured time,
    geometric mean over the pass's points (1: as measured; 0.8: the runs took 1.25x the predicted time)."""

    placement: str
    grid_pass: int
    prefill: float
    decode: float | None

    def off(self, tolerance: float = PACE_TOLERANCE) -> bool:
        return any(not 1 / tolerance <= pace <= tolerance for pace in (self.prefill, self.decode) if pace is not None)

    def faster(self, tolerance: float = PACE_TOLERANCE) -> bool:
        """Whether the pass ran faster than the measurement predicted beyond the tolerance, in no phase slower."""
        paces = [pace for pace in (self.prefill, self.decode) if pace is not None]
        return max(paces) > tolerance and min(paces) >= 1 / tolerance

    def describe(self) -> str:
        decode = "" if self.decode is None else f", decode {self.decode:.2f}"
        return f"pass {self.grid_pass + 1} ({self.placement}): prefill {self.prefill:.2f}{decode}"


def pass_pace(model: ModelSpec, hardware: HardwareSpec, efficiency: MachineEfficiency, runs: list[Run],
              policy: Policy, grid_pass: int) -> PassPace:
    """The pace of one pass: its points (medians of its repeats) against the cost model's predictions."""
    points = denoise(runs)
    placement = points[0].placement
    predicted = cost_model_predictions(model, hardware, points, {placement: policy}, efficiency)
    prefill = [predicted.prefill_s[i] / pt.prefill_s for i, pt in enumerate(points)]
    decode = [predicted.step_s[i] / pt.step_s for i, pt in enumerate(points) if pt.step_s]
    return PassPace(placement, grid_pass, _geometric_mean(prefill), _geometric_mean(decode) if decode else None)


def _geometric_mean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


class PaceCheck:
    """measure_grid's check on a measured machine: another pass while the last one ran off the measured pace
    (at most `extra_passes` more); `kept` the runs to fit, `notes` what happened, for the calibration."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, efficiency: MachineEfficiency,
                 tolerance: float = PACE_TOLERANCE, extra_passes: int = EXTRA_PASSES):
        self.model, self.hardware, self.efficiency = model, hardware, efficiency
        self.tolerance, self.extra_passes = tolerance, extra_passes
        self.paces: list[PassPace] = []
        self.earlier: list[PassPace] = []  # the paces against the measurement before it was read again (against)
        self.declined: list[PassPace] = []  # the paces against a new reading not adopted (profile_model)

    @staticmethod
    def applies(efficiency: MachineEfficiency) -> bool:
        """Only a measured machine has a pace to compare with (a catalog's figures are estimates)."""
        return efficiency.accelerator.name.startswith(MEASURED_PREFIX)

    def __call__(self, runs: list[Run], policy: Policy, grid_pass: int) -> bool:
        pace = pass_pace(self.model, self.hardware, self.efficiency, runs, policy, grid_pass)
        self.paces.append(pace)
        return pace.off(self.tolerance) and grid_pass < self.extra_passes

    def read_slow(self) -> bool:
        """Whether some placement's every pass ran faster than the measurement predicts (PassPace.faster): the
        measurement likely caught a slow moment, and its readings are worth taking again before the fit."""
        return any(self.all_faster([p for p in self.paces if p.placement == placement])
                   for placement in dict.fromkeys(p.placement for p in self.paces))

    def all_faster(self, paces: list[PassPace]) -> bool:
        return bool(paces) and all(p.faster(self.tolerance) for p in paces)

    def against(self, hardware: HardwareSpec, efficiency: MachineEfficiency, runs: list[Run],
                policies: dict[str, Policy]) -> "PaceCheck":
        """The same passes' paces against a measurement read again (read_again), the earlier ones kept for the
        notes."""
        check = PaceCheck(self.model, hardware, efficiency, self.tolerance, self.extra_passes)
        check.earlier = list(self.paces)
        check.paces = [pass_pace(self.model, hardware, efficiency,
                                 [r for r in runs if r.placement == p.placement and r.grid_pass == p.grid_pass],
                                 policies[p.placement], p.grid_pass) for p in self.paces]
        return check

    def distance(self) -> float:
        """How far the passes ran from the measured pace: the mean |log pace| over the passes and phases."""
        logs = [abs(math.log(pace)) for p in self.paces for pace in (p.prefill, p.decode) if pace is not None]
        return float(np.mean(logs)) if logs else 0.0

    def kept(self, runs: list[Run]) -> list[Run]:
        """Per placement, the runs of its passes within the tolerance; all its runs when none was."""
        kept = []
        for placement in dict.fromkeys(r.placement for r in runs):
            paces = [p for p in self.paces if p.placement == placement]
            steady = {p.grid_pass for p in paces if not p.off(self.tolerance)}
            kept += [r for r in runs if r.placement == placement and (not steady or r.grid_pass in steady)]
        return kept

    def notes(self) -> tuple[str, ...]:
        """One line per placement whose grid ran off the measured pace (nothing when every first pass was on it)."""
        notes = []
        for placement in dict.fromkeys(p.placement for p in self.paces):
            paces = [p for p in self.paces if p.placement == placement]
            earlier = [p for p in self.earlier if p.placement == placement]
            if len(paces) == 1 and not paces[0].off(self.tolerance) and not earlier:
                continue
            steady = [p.grid_pass + 1 for p in paces if not p.off(self.tolerance)]
            kept = f"fitted on pass {', '.join(map(str, steady))}" if steady else \
                "no pass ran at the measured pace: fitted on all (the model's own error here, or a host busy throughout)"
            if not steady and self.all_faster(paces):
                kept += f"; {MEASURED_SLOW_WORDS}"
            read = f"{'; '.join(p.describe() for p in earlier)}; {READ_AGAIN_WORDS}: " if earlier else ""
            declined = [p for p in self.declined if p.placement == placement]
            if declined:
                kept += f"; {KEPT_WORDS}: {'; '.join(p.describe() for p in declined)})"
            notes.append(f"the host's pace during the grid (predicted / measured time; {1 / self.tolerance:.2f}-"
                         f"{self.tolerance:.2f} is the measured pace): {read}"
                         f"{'; '.join(p.describe() for p in paces)}; {kept}")
        return tuple(notes)


ReadAgain = Callable[[], HardwareSpec]


def second_look(check: PaceCheck, again: HardwareSpec, hardware: HardwareSpec, base: MachineEfficiency,
                runs: list[Run], policies: dict[str, Policy]) -> tuple[PaceCheck, HardwareSpec, MachineEfficiency]:
    """(check, hardware, base) to fit with: the new reading's where the grid's passes lie nearer its pace than the
    measurement's (PaceCheck.distance), else the measurement's, the new reading's paces noted (the host may have
    moved between the grid and the reading: session 24, a newcomer's profile beside a running test suite read the
    measurement again at a quiet moment and put the grid 0.80-0.97 of it)."""
    if again == hardware:
        return check, hardware, base
    looked = check.against(again, measured_efficiency(again), runs, policies)
    if looked.distance() < check.distance():
        return looked, again, looked.efficiency
    check.declined = looked.paces
    return check, hardware, base


def moved_factors(calibration: Calibration) -> tuple[str, ...]:
    """The efficiency factors the fit moved from the measured machine's (none: the calibration prices everything as
    the measurement does, e.g. a packed format's decode and prefill from its measured kernels, which it keeps)."""
    before, after = (dataclasses.asdict(e) for e in (calibration.uncalibrated_accelerator, calibration.accelerator))
    return tuple(name for name, value in after.items() if isinstance(value, float)
                 and not math.isclose(value, before[name], rel_tol=1e-6, abs_tol=1e-12))


def profile_model(model_path: str | Path, grid: ProfileGrid, hardware: HardwareSpec, machine_id: str, *,
                  base: MachineEfficiency | None = None, device: str | None = None, progress: Progress = _silent,
                  should_stop: Callable[[], bool] = lambda: False, threads: int | None = None,
                  read_again: ReadAgain | None = None) -> Calibration:
    """Measure the grid on this machine and fit every form: the Calibration to save in the machine profile.

    `hardware` is the spec the planner uses here (with measured numbers when `hivekeeper measure` ran) and `base`
    the efficiency it uses before calibration; the fitted factors are relative to that spec. `threads`: the matmul
    threads the runtime's layout set (offloaded_model.use_physical_cores), for the report; else torch's.
    `read_again()`: on a CPU, where every pass ran faster than the measurement predicts, reads its decode steps
    and prefill passes again, keeps the measurements for the caller to save, and returns the spec they give
    (read_again.read_measurement_again); the fit is then against it (`base` becomes its measured efficiency).
    """
    import torch

    from hivekeeper.planner.hardware_catalog import hardware_to_json
    from hivekeeper.planner.model_catalog import load_model_spec

    from hivekeeper.core.offload.local_plan import default_device

    device = device or default_device()
    started = time.perf_counter()
    spec = load_model_spec(str(model_path))
    base = base or measured_efficiency(hardware)
    check = PaceCheck(spec, hardware, base) if PaceCheck.applies(base) else None
    runs, policies = measure_grid(model_path, grid, device=device, progress=progress, should_stop=should_stop,
                                  check=check)
    if should_stop():
        raise InputError("profiling stopped before the grid was measured")
    if check is not None and read_again is not None and device == "cpu" and check.read_slow():
        progress(1.0, "reading the measurement's decode steps and prefill passes again")
        check, hardware, base = second_look(check, read_again(), hardware, base, runs, policies)
    points = denoise(check.kept(runs) if check else runs)
    progress(1.0, "fitting")
    return build_calibration(
        spec, str(Path(model_path).absolute()), hardware, hardware_to_json(hardware), machine_id, points, policies,
        created=time.time(), profile_seconds=time.perf_counter() - started, base=base, device=device,
        threads=threads or torch.get_num_threads(), clock=time.perf_counter, notes=check.notes() if check else (),
    )


# ---- the report ---------------------------------------------------------------------------------------------------
def calibration_hardware(calibration: Calibration) -> HardwareSpec:
    """The hardware spec the calibration was fitted against (saved with it)."""
    from hivekeeper.planner.hardware_catalog import hardware_from_dict

    return hardware_from_dict(calibration.hardware, where="calibration hardware", default_source="measured")


def _factor(x: float) -> str:
    """A factor as the report shows it: 4 digits, a rounding residue below 1e-12 as 0 (a fit ended at 1e-19 s)."""
    return "0" if abs(x) < 1e-12 else f"{x:.4g}"


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:+.0f}%"


def _err(predicted: float, measured: float | None) -> float:
    if measured is None or not math.isfinite(predicted) or predicted <= 0:
        return math.nan
    return (predicted - measured) / measured


_FORM_NAMES = {"uncalibrated": "cost model, uncalibrated", "calibrated": "cost model, calibrated",
               "idealized": "idealized, piecewise α", "linear-alpha": "idealized, linear α"}


def report_dict(calibration: Calibration, predictions: dict[str, FormPrediction] | None = None) -> dict:
    """Everything the report shows, as JSON-ready data."""
    hardware = calibration_hardware(calibration)
    predictions = predictions or compare_forms(calibration, hardware)
    points = list(calibration.points)
    rows = []
    for i, pt in enumerate(points):
        row = pt.as_dict()
        row["prefill_tokens_per_s"] = round(pt.prefill_tokens_per_s, 4)
        row["decode_tokens_per_s"] = None if pt.step_s is None else round(pt.decode_tokens_per_s, 4)
        row["predicted"] = {}
        for form, pred in predictions.items():
            row["predicted"][form] = {
                "prefill_s": _finite(pred.prefill_s[i]), "step_s": _finite(pred.step_s[i]),
                "runtime_s": _finite(pred.runtime_s[i]),
            }
        rows.append(row)
    accuracy = {form: {q: a.as_dict() for q, a in form_accuracy(points, pred).items()}
                for form, pred in predictions.items()}
    return {
        "model": calibration.model.name, "model_path": calibration.model_path, "machine_id": calibration.machine_id,
        "device": calibration.device, "threads": calibration.threads, "created": calibration.created,
        "profile_seconds": round(calibration.profile_seconds, 3),
        "efficiency": {"uncalibrated": dataclasses.asdict(calibration.uncalibrated_accelerator),
                       "calibrated": dataclasses.asdict(calibration.accelerator)},
        "idealized": [f.as_dict() for f in calibration.idealized],
        "linear_alpha": [f.as_dict() for f in linear_alpha_fits(points)],
        "accuracy": accuracy, "points": rows, "notes": list(calibration.notes),
    }


def _finite(x: float) -> float | None:
    return float(f"{x:.6g}") if math.isfinite(x) else None


def render_report(calibration: Calibration) -> str:
    """Predicted vs measured at every point for every form, then MAPE / worst error / R², then the fits."""
    hardware = calibration_hardware(calibration)
    predictions = compare_forms(calibration, hardware)
    points = list(calibration.points)
    lines = [f"{calibration.model.name} on {calibration.device} ({calibration.threads} threads), "
             f"{len(points)} points, calibrated in {calibration.profile_seconds:.1f} s",
             "errors: (predicted − measured) / measured for uncalibrated / calibrated / idealized"]
    lines += [f"note: {note}" for note in calibration.notes]
    lines += _columns(_point_table(points, predictions))
    lines.append("")
    summary = [("form", "prefill MAPE", "worst", "decode MAPE", "worst", "runtime MAPE", "worst", "runtime R²")]
    for form, pred in predictions.items():
        acc = form_accuracy(points, pred)
        if not acc:
            continue
        cells = [_FORM_NAMES[form]]
        for quantity in ("prefill", "decode", "runtime"):
            a = acc.get(quantity)
            cells += [f"{100 * a.mape:.1f}%", f"{100 * a.worst:.0f}%"] if a else ["-", "-"]
        r2 = acc["runtime"].r2
        cells.append(f"{r2:.4f}" if math.isfinite(r2) else "-")
        summary.append(tuple(cells))
    lines += _columns(summary)
    lines.append("")
    unc, cal = calibration.uncalibrated_accelerator, calibration.accelerator
    lines.append(f"efficiency factors ({unc.name} -> {cal.name}):")
    for name in ("bandwidth_fraction", "matmul_fraction", "layer_overhead_s", "step_overhead_s",
                 "weight_reread_rows"):
        lines.append(f"  {name:<19} {_factor(getattr(unc, name))} -> {_factor(getattr(cal, name))}")
    lines.append("idealized runtime(p, o) = α(p) + β·(o − 1):")
    linear = {(f.placement, f.batch_size): f for f in linear_alpha_fits(points)}
    for fit in calibration.idealized:
        knots = ", ".join(f"α({p:g}) = {a:.4g} s" for p, a in zip(fit.knots_p, fit.alpha_s))
        breaks = ", ".join(f"{b:.0f}" for b in fit.breaks) or "none"
        lines.append(f"  {fit.placement} b={fit.batch_size}: {knots}; β = {1e3 * fit.beta_s:.4g} ms; "
                     f"breaks at p = {breaks}; R² {fit.r2:.4f}, MAPE {100 * fit.mape:.1f}%")
        flat = linear.get((fit.placement, fit.batch_size))
        if flat is not None:
            group = [i for i, pt in enumerate(points)
                     if pt.placement == fit.placement and pt.batch_size == fit.batch_size]
            longest = max(group, key=lambda i: (points[i].prompt_len, points[i].output_len))
            err = _err(float(flat.runtime(points[longest].prompt_len, points[longest].output_len)),
                       points[longest].runtime_s)
            lines.append(f"    α linear in p instead: R² {flat.r2:.4f}, MAPE {100 * flat.mape:.1f}%, "
                         f"{_pct(err)} at the longest prompt (p = {points[longest].prompt_len})")
    return "\n".join(lines)


def _point_table(points: list[ProfilePoint], predictions: dict[str, FormPrediction]) -> list[tuple[str, ...]]:
    """One row per point: measured rates and runtime, each form's error on them."""
    forms = ("uncalibrated", "calibrated", "idealized")
    with np.errstate(divide="ignore", invalid="ignore"):  # a form predicting zero time shows as "-"
        table = [("place", "p", "o", "b", "prefill tok/s", "errors", "decode tok/s", "errors", "runtime s", "errors",
                  "spread", "load")]
        for i, pt in enumerate(points):
            pre = [_err(pt.batch_size * pt.prompt_len / predictions[f].prefill_s[i], pt.prefill_tokens_per_s)
                   for f in forms]
            dec = [_err(pt.batch_size / predictions[f].step_s[i], pt.decode_tokens_per_s) for f in forms]
            run = [_err(predictions[f].runtime_s[i], pt.runtime_s) for f in forms]
            table.append((pt.placement, str(pt.prompt_len), str(pt.output_len), str(pt.batch_size),
                          f"{pt.prefill_tokens_per_s:.4g}", " ".join(_pct(e) for e in pre),
                          "-" if pt.step_s is None else f"{pt.decode_tokens_per_s:.4g}",
                          " ".join(_pct(e) for e in dec) if pt.step_s is not None else "",
                          f"{pt.runtime_s:.4g}", " ".join(_pct(e) for e in run),
                          f"{100 * pt.spread:.0f}%" if pt.repeats > 1 or pt.spread else "-",  # 1 repeat: none
                          f"{pt.loadavg:.1f}"))
        return table


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]


def write_report_png(calibration: Calibration, path: str | Path) -> Path:
    """Three panels: predicted vs measured runtime for every form; runtime vs p (batch 1, longest output) with
    each form's curve; runtime vs o for each prompt length with the idealized lines. Written atomically."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--png needs matplotlib: pip install matplotlib") from None
    path = Path(path).expanduser()
    if not path.parent.is_dir():
        raise InputError(f"--png {path}: folder {path.parent} does not exist")
    hardware = calibration_hardware(calibration)
    predictions = compare_forms(calibration, hardware)
    points = list(calibration.points)
    measured = np.array([pt.runtime_s for pt in points])
    colors = {"uncalibrated": "tab:gray", "calibrated": "tab:blue", "idealized": "tab:green",
              "linear-alpha": "tab:orange"}

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    ax = axes[0]
    for form, pred in predictions.items():
        ax.scatter(measured, pred.runtime_s, s=18, color=colors[form], label=_FORM_NAMES[form], alpha=0.8)
    low, high = measured.min() / 1.5, measured.max() * 1.5
    ax.plot([low, high], [low, high], color="black", linewidth=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured runtime (s)", ylabel="predicted runtime (s)",
           title="predicted vs measured")
    ax.legend(fontsize=8)

    placement = points[0].placement
    batch = min(pt.batch_size for pt in points if pt.placement == placement)
    group = [pt for pt in points if pt.placement == placement and pt.batch_size == batch]
    o_max = max(pt.output_len for pt in group)
    along_p = sorted((pt for pt in group if pt.output_len == o_max), key=lambda pt: pt.prompt_len)
    ax = axes[1]
    ax.scatter([pt.prompt_len for pt in along_p], [pt.runtime_s for pt in along_p], color="black", zorder=3,
               label="measured")
    dense_p = np.unique(np.geomspace(min(pt.prompt_len for pt in along_p), max(pt.prompt_len for pt in along_p), 40)
                        .round().astype(int))
    dense = [dataclasses.replace(along_p[0], prompt_len=int(p), output_len=o_max) for p in dense_p]
    for form, eff in (("uncalibrated", calibration.uncalibrated), ("calibrated", calibration.efficiency)):
        curve = cost_model_predictions(calibration.model, hardware, dense, calibration.policies, eff)
        ax.plot(dense_p, curve.runtime_s, color=colors[form], label=_FORM_NAMES[form])
    fit = calibration.idealized_for(batch, placement)
    flat = next((f for f in linear_alpha_fits(points) if f.batch_size == batch and f.placement == placement), None)
    for form, f in (("idealized", fit), ("linear-alpha", flat)):
        if f is not None:
            ax.plot(dense_p, f.runtime(dense_p, o_max), color=colors[form], linestyle="--", label=_FORM_NAMES[form])
    if fit is not None:
        for b in fit.breaks:
            ax.axvline(b, color=colors["idealized"], linewidth=0.6, linestyle=":")
    ax.set(xscale="log", yscale="log", xlabel="prompt length p", ylabel="runtime (s)",
           title=f"runtime vs p (b={batch}, o={o_max}, {placement})")
    ax.legend(fontsize=8)

    ax = axes[2]
    for index, p in enumerate(sorted({pt.prompt_len for pt in group})):
        row = sorted((pt for pt in group if pt.prompt_len == p), key=lambda pt: pt.output_len)
        color = plt.cm.viridis(index / max(1, len({pt.prompt_len for pt in group}) - 1))
        ax.scatter([pt.output_len for pt in row], [pt.runtime_s for pt in row], color=color, label=f"p={p}")
        if fit is not None:
            os_ = np.array([row[0].output_len, row[-1].output_len], dtype=float)
            ax.plot(os_, fit.runtime(p, os_), color=color, linestyle="--")
    ax.set(xlabel="output length o", ylabel="runtime (s)", title="runtime vs o (dashed: α(p) + β(o − 1))")
    ax.legend(fontsize=8)
    fig.suptitle(f"{calibration.model.name} on {calibration.device}: calibrated in {calibration.profile_seconds:.0f} s")
    fig.tight_layout()

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path

