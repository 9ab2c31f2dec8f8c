"""Calibration: fit the planner to what this machine measures, and say how well each form predicts.

Three forms predict the time of a run of p prompt tokens and o output tokens at batch B:

- the analytic cost model (costmodel.evaluate) with the efficiency factors it has before any profile
  ("uncalibrated": defaults, or 1.0 for fractions of numbers that `hivekeeper measure` measured);
- the same cost model with efficiency factors fitted to a runtime profile ("calibrated");
- the idealized-runtime form of Narayanan et al., runtime(p, o) = α(p) + β·(o − 1), fitted per batch size and
  placement, with α piecewise linear in p so that it can bend where attention (quadratic in p) takes over.

Everything here is pure numpy; the measurements come from hivekeeper.core.machine.profiling. Errors are relative:
MAPE is the mean of |predicted − measured| / measured, the worst error the largest of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .costmodel import Placement, Policy, Workload, evaluate
from .efficiency import MEASURED_PREFIX, Efficiency, MachineEfficiency, default_efficiency  # noqa: F401 (re-export)
from .errors import InputError
from .fields import REQUIRED, Fields
from .hardware import HardwareSpec
from .models import ModelSpec

CALIBRATED_PREFIX = "calibrated:"


# ---- error measures ---------------------------------------------------------------------------------------------
def relative_errors(predicted, measured) -> np.ndarray:
    """(predicted − measured) / measured, element by element."""
    predicted, measured = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    if predicted.shape != measured.shape:
        raise InputError(f"predicted {predicted.shape} and measured {measured.shape} differ in shape")
    if np.any(measured <= 0):
        raise InputError("measured values must be positive to compute relative errors")
    return (predicted - measured) / measured


def mape(predicted, measured) -> float:
    """Mean absolute percentage error, as a fraction (0.05 is 5%)."""
    return float(np.mean(np.abs(relative_errors(predicted, measured))))


def worst_error(predicted, measured) -> tuple[float, int]:
    """The largest absolute relative error and the index of its point."""
    errors = np.abs(relative_errors(predicted, measured))
    index = int(np.argmax(errors))
    return float(errors[index]), index


def r_squared(predicted, measured) -> float:
    """Coefficient of determination 1 − SS_res / SS_tot of predictions against measurements (1 is perfect).

    With every measurement equal, SS_tot is zero: 1.0 when the predictions are exact too, else −inf.
    """
    predicted, measured = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    ss_res = float(np.sum((measured - predicted) ** 2))
    ss_tot = float(np.sum((measured - measured.mean()) ** 2))
    if ss_tot == 0.0:
        return 1.0 if ss_res == 0.0 else -math.inf
    return 1.0 - ss_res / ss_tot


@dataclass(frozen=True)
class Accuracy:
    """How well one form predicts one quantity over a grid of points."""

    mape: float  # mean absolute relative error, fraction
    worst: float  # largest absolute relative error, fraction
    worst_point: int  # index of that point in the list compared
    r2: float
    points: int

    def as_dict(self) -> dict:
        return {"mape": _round(self.mape), "worst": _round(self.worst), "worst_point": self.worst_point,
                "r2": _round(self.r2) if math.isfinite(self.r2) else None, "points": self.points}

    @classmethod
    def from_dict(cls, doc: dict) -> "Accuracy":
        r2 = doc.get("r2")
        return cls(float(doc["mape"]), float(doc["worst"]), int(doc["worst_point"]),
                   -math.inf if r2 is None else float(r2), int(doc["points"]))


def accuracy(predicted, measured) -> Accuracy:
    """MAPE, worst error (and where) and R² of predictions against measurements."""
    predicted, measured = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    if predicted.size == 0:
        raise InputError("no points to compare")
    worst, index = worst_error(predicted, measured)
    return Accuracy(mape(predicted, measured), worst, index, r_squared(predicted, measured), int(predicted.size))


def _round(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


# ---- the idealized runtime form -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class IdealizedFit:
    """runtime(p, o) = α(p) + β·(o − 1) for one batch size and placement.

    α is continuous and piecewise linear: its values `alpha_s` at the knots `knots_p` (the first and last are the
    smallest and largest prompt measured, the others are where the slope changes); beyond the ends it continues
    the end segments' slopes.
    """

    knots_p: tuple[float, ...]
    alpha_s: tuple[float, ...]
    beta_s: float
    batch_size: int = 1
    placement: str = "resident"
    r2: float = float("nan")  # of runtime over the points fitted
    mape: float = float("nan")  # of runtime
    points: int = 0

    @property
    def breaks(self) -> tuple[float, ...]:
        """Prompt lengths where α's slope changes."""
        return self.knots_p[1:-1]

    def alpha(self, p):
        """α(p): prefill time in seconds (first token included) for a prompt of p tokens."""
        p = np.asarray(p, dtype=float)
        knots, values = np.asarray(self.knots_p), np.asarray(self.alpha_s)
        if knots.size == 1:
            return values[0] + 0.0 * p
        inside = np.interp(p, knots, values)
        left_slope = (values[1] - values[0]) / (knots[1] - knots[0])
        right_slope = (values[-1] - values[-2]) / (knots[-1] - knots[-2])
        result = np.where(p < knots[0], values[0] + left_slope * (p - knots[0]), inside)
        result = np.where(p > knots[-1], values[-1] + right_slope * (p - knots[-1]), result)
        return float(result) if result.ndim == 0 else result

    def runtime(self, p, o):
        """α(p) + β·(o − 1), seconds."""
        return self.alpha(p) + self.beta_s * (np.asarray(o, dtype=float) - 1.0)

    def as_dict(self) -> dict:
        return {"knots_p": list(self.knots_p), "alpha_s": [_round(a, 9) for a in self.alpha_s],
                "beta_s": _round(self.beta_s, 9), "batch_size": self.batch_size, "placement": self.placement,
                "r2": None if not math.isfinite(self.r2) else _round(self.r2),
                "mape": None if not math.isfinite(self.mape) else _round(self.mape), "points": self.points}

    @classmethod
    def from_dict(cls, doc: dict) -> "IdealizedFit":
        return cls(tuple(float(k) for k in doc["knots_p"]), tuple(float(a) for a in doc["alpha_s"]),
                   float(doc["beta_s"]), int(doc.get("batch_size", 1)), str(doc.get("placement", "resident")),
                   float("nan") if doc.get("r2") is None else float(doc["r2"]),
                   float("nan") if doc.get("mape") is None else float(doc["mape"]), int(doc.get("points", 0)))


def _idealized_design(p: np.ndarray, o: np.ndarray, knots: tuple[float, ...], with_beta: bool) -> np.ndarray:
    """Columns: one hat function per knot (α is the sum of α(knot) × hat, so the coefficients are α's values at the
    knots and α is continuous and piecewise linear), then o − 1 for β."""
    columns = [np.interp(p, knots, np.eye(len(knots))[j]) for j in range(len(knots))]
    if with_beta:
        columns.append(o - 1.0)
    return np.stack(columns, axis=1)


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray, max_iterations: int | None = None) -> np.ndarray:
    """min ‖a x − b‖² with x ≥ 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)  # variables free to be positive
    x = np.zeros(n)
    tolerance = 1e-12 * max(1.0, float(np.abs(a).max()) * float(np.abs(b).max()))
    for _ in range(max_iterations or 3 * n + 10):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max() <= tolerance:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[passive], *_ = np.linalg.lstsq(a[:, passive], b, rcond=None)
            if np.all(z[passive] > 0):
                x = z
                break
            blocking = passive & (z <= 0)
            step = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + step * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
    return x


def _relative_fit(design: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares of relative residuals (each row divided by its measurement); (coefs, SSE)."""
    a = design / y[:, None]
    coef = nonnegative_lstsq(a, np.ones_like(y))
    residual = a @ coef - 1.0
    return coef, float(residual @ residual)


def _break_candidates(p_values: np.ndarray, per_gap: int = 8) -> np.ndarray:
    """Candidate break positions: the measured interior prompt lengths and points between neighbours
    (geometrically spaced, since grids of prompt lengths usually are)."""
    distinct = np.unique(p_values)
    candidates = list(distinct[1:-1])
    for low, high in zip(distinct[:-1], distinct[1:]):
        if low > 0:
            candidates += list(np.geomspace(low, high, per_gap + 2)[1:-1])
        else:
            candidates += list(np.linspace(low, high, per_gap + 2)[1:-1])
    return np.unique(np.asarray(candidates, dtype=float))


def _segments_supported(breaks: tuple[float, ...], distinct_p: np.ndarray) -> bool:
    """Each segment of α, ends included, must hold at least two measured prompt lengths (else it is unidentified)."""
    edges = (-math.inf, *breaks, math.inf)
    for low, high in zip(edges[:-1], edges[1:]):
        if np.count_nonzero((distinct_p >= low) & (distinct_p <= high)) < 2:
            return False
    return True


BREAK_GAIN = 2.0  # a break must at least halve the squared relative error left


def fit_idealized(prompt_len, output_len, runtime_s, *, max_breaks: int = 2, batch_size: int = 1,
                  placement: str = "resident") -> IdealizedFit:
    """Fit runtime(p, o) = α(p) + β·(o − 1), α continuous piecewise linear in p, by least squares of relative
    errors with α ≥ 0 at every knot and β ≥ 0 (a time is never negative, however noisy the points). Break
    positions are searched over candidates; a break is added only while it halves the error left and lowers the
    BIC (so noise on a straight α adds none). max_breaks=0 gives the plain linear α."""
    p = np.asarray(prompt_len, dtype=float)
    o = np.asarray(output_len, dtype=float)
    y = np.asarray(runtime_s, dtype=float)
    if not (p.shape == o.shape == y.shape) or p.ndim != 1:
        raise InputError("prompt lengths, output lengths and runtimes must be equal-length lists")
    if np.any(y <= 0) or np.any(p < 1) or np.any(o < 1):
        raise InputError("runtimes must be positive and lengths at least 1")
    distinct_p = np.unique(p)
    if distinct_p.size < 2:
        raise InputError("the idealized fit needs at least two different prompt lengths")
    n = y.size
    has_beta = np.unique(o).size > 1
    candidates = _break_candidates(p)

    ends = (float(distinct_p[0]), float(distinct_p[-1]))

    # the best breaks for each count; one more break must halve the error left, and win on BIC
    best: tuple[float, float, tuple[float, ...], np.ndarray] | None = None  # (BIC, SSE, knots, coefficients)
    for count in range(0, max(0, max_breaks) + 1):
        best_of_count = None
        for breaks in itertools.combinations(candidates, count):
            if not _segments_supported(breaks, distinct_p):
                continue
            knots = (ends[0], *(float(k) for k in breaks), ends[1])
            design = _idealized_design(p, o, knots, has_beta)
            params = design.shape[1] + count  # a break's position is a parameter too
            if params >= n and count:
                continue
            coef, sse = _relative_fit(design, y)
            if best_of_count is None or sse < best_of_count[1]:
                bic = n * math.log(max(sse, 1e-300) / n) + params * math.log(n)
                best_of_count = (bic, sse, knots, coef)
        if best_of_count is None:
            break
        if best is None or (best_of_count[1] <= best[1] / BREAK_GAIN and best_of_count[0] < best[0]):
            best = best_of_count
        else:
            break
    _, _, knots, coef = best
    beta = float(coef[-1]) if has_beta else 0.0
    alphas = tuple(float(v) for v in (coef[:-1] if has_beta else coef))
    fit = IdealizedFit(knots, alphas, beta, batch_size, placement)
    predicted = fit.runtime(p, o)
    return dataclasses.replace(fit, r2=r_squared(predicted, y), mape=mape(predicted, y), points=int(n))


# ---- measured points ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfilePoint:
    """One grid point of a runtime profile: the median of its repeats (core/machine/profiling.denoise) and their
    spread."""

    prompt_len: int
    output_len: int
    batch_size: int
    prefill_s: float  # time to the first token: prefill of the prompt plus the first sampled token
    step_s: float | None  # mean decode step (one token for every sequence); None when output_len == 1
    runtime_s: float  # the whole generate() call
    placement: str = "resident"
    spread: float = 0.0  # (slowest − fastest) / fastest runtime over the repeats
    repeats: int = 1
    loadavg: float = 0.0  # 1-minute load average while measuring (the largest seen)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch_size * self.prompt_len / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        return None if self.step_s is None else self.batch_size / self.step_s

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> "ProfilePoint":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})


def policy_to_dict(policy: Policy) -> dict:
    return policy.as_dict()


def policy_from_dict(doc: dict) -> Policy:
    """The inverse of Policy.as_dict (batch_size is implied by the micro-batches)."""
    def placement(key: str, default: Placement) -> Placement:
        part = doc.get(key)
        return Placement(**{t: float(part.get(t, 0.0)) for t in ("gpu", "cpu", "disk")}) if part else default

    return Policy(
        weight_format=str(doc.get("weight_format", "fp16")),
        weights=placement("weights", Placement()), kv_cache=placement("kv_cache", Placement()),
        activations=placement("activations", Placement()),
        micro_batch_size=int(doc.get("micro_batch_size", 1)), num_micro_batches=int(doc.get("num_micro_batches", 1)),
        kv_recompute=doc.get("kv_cache_mode") == "recompute", prefetch_depth=int(doc.get("prefetch_depth", 1)),
        attention_on_cpu=bool(doc.get("attention_on_cpu", False)),
    )


def point_policy(policy: Policy, point: ProfilePoint) -> Policy:
    """The placement's policy at the point's batch (one micro-batch of that many sequences)."""
    return dataclasses.replace(policy, micro_batch_size=point.batch_size, num_micro_batches=1)


# ---- efficiency factors -------------------------------------------------------------------------------------------
def measured_efficiency(hardware: HardwareSpec) -> MachineEfficiency:
    """Efficiency before any runtime profile: the defaults, with a fraction of 1 for every number that
    `hivekeeper measure` measured and the CPU's decode weight streaming as measured (efficiency.default_efficiency
    decides this, for every plan)."""
    return default_efficiency(hardware)


def is_calibrated(efficiency_name: str) -> bool:
    """Whether a plan's efficiency (Plan.efficiency, Prediction.efficiency) came from a runtime calibration."""
    return efficiency_name.startswith(CALIBRATED_PREFIX)


# Factors the fit may move -> (lower bound, upper bound, typical size) of the fitted parameter. Fractions are fitted
# as their inverse (a multiplier on time, bounded below by 1), which keeps a resident run's time linear in every
# parameter. A factor the cost model gains later is fitted by adding it here (and to the fit lists below).
_FACTORS = {
    "bandwidth_fraction": (1.0, 1e4, 1.0),
    "matmul_fraction": (1.0, 1e4, 1.0),
    "layer_overhead_s": (0.0, 0.5, 1e-4),
    "step_overhead_s": (0.0, 5.0, 1e-3),
    "prefill_layer_overhead_s": (0.0, 0.5, 1e-4),
    "link_fraction": (1.0, 1e4, 1.0),
    "disk_fraction": (1.0, 1e4, 1.0),
    "weight_reread_rows": (1.0, 16.0, 1.0),
    "row_overhead_s": (0.0, 0.5, 1e-4),
}
_INVERSE = ("bandwidth_fraction", "matmul_fraction", "link_fraction", "disk_fraction")
DEFAULT_FIT_FACTORS = ("bandwidth_fraction", "matmul_fraction", "layer_overhead_s", "step_overhead_s",
                       "prefill_layer_overhead_s")
# On a CPU the weight re-reads of small-row matmuls are fitted too; a GPU keeps one read (no evidence of more).
CPU_FIT_FACTORS = DEFAULT_FIT_FACTORS + ("weight_reread_rows",)
# A CPU whose decode steps `hivekeeper measure` timed (DecodeStreaming.block_overhead_s) has a decode step measured
# term by term on spans of two widths: the rate weights stream at (bandwidth_fraction) and the re-reads of a few-row
# step (weight_reread_rows), per byte; a block's fixed cost (layer_overhead_s) and what it adds per row beyond the
# first (row_overhead_s), per block. One profiled model's blocks are all alike, so its steps say how long its steps
# take, not which of those terms is off: "faster reads" and "cheaper blocks" fit it equally well. They carry over
# differently: a model of a few wide blocks is all reads, so a rate moved to fit a thin model of many small blocks
# moves the wide model's whole step (issue 23, session 15: SmolLM2, 30 blocks of 576, ran 1.41x faster than its
# measured terms; the fit raised the rate to the cap and the 2-block wide model, predicted 0.95x uncalibrated, came
# out 0.73x). So the fit keeps the per-byte terms as measured, on spans as wide as a wide model's blocks, and fits
# the per-block terms, which the thin model weighs 15 times as much as the wide one (30 blocks against 2): what the
# thin model says then changes the wide model's step by its two blocks' share only. The per-step overhead stays as
# it is (one model cannot tell it from the blocks'). A thin model that runs faster than its reads at the measured
# rate alone keeps that miss (the block cost stops at 0): it is in the rate of its shape, which one model cannot
# tell from the rate of every other.
MEASURED_STEPS_FIT_FACTORS = ("layer_overhead_s", "row_overhead_s", "matmul_fraction", "prefill_layer_overhead_s")


# Huber threshold of the efficiency fit, in log(predicted / measured): ~10%
ROBUST_THRESHOLD = 0.1


def default_fit_factors(hardware: HardwareSpec) -> tuple[str, ...]:
    """The factors a calibration fits on this machine."""
    if hardware.gpus:
        return DEFAULT_FIT_FACTORS
    streaming = hardware.cpu.decode_streaming
    return MEASURED_STEPS_FIT_FACTORS if streaming and streaming.block_overhead_s is not None else CPU_FIT_FACTORS


def _to_theta(eff: Efficiency, names: tuple[str, ...]) -> np.ndarray:
    """The fitted parameters of `eff`: fractions as their inverse, the rest as they are."""
    return np.array([1.0 / getattr(eff, n) if n in _INVERSE else getattr(eff, n) for n in names])


def from_fitted(eff: Efficiency, names: tuple[str, ...], theta: np.ndarray, name: str) -> Efficiency:
    """`eff` with the fitted parameters `theta` of the factors `names` (fractions as their inverse), named `name`."""
    # within the bounds exactly: a step that ends on a bound can miss it by a rounding (1 - 1e-16 re-reads, which
    # Efficiency refuses: issue 23's quick accuracy bench failed so at load 13)
    theta = [min(max(float(t), _FACTORS[n][0]), _FACTORS[n][1]) for n, t in zip(names, theta)]
    values = {n: (1.0 / t if n in _INVERSE else t) for n, t in zip(names, theta)}
    if "weight_reread_rows" in values:  # the fitted reads hold for every width (no per-width figures fitted)
        values["reread_rows_by_width"] = ()
    return dataclasses.replace(eff, name=name, **values)


def _bounded_lstsq(a: np.ndarray, b: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """min ‖a x − b‖² with lower ≤ x ≤ upper, exactly, by trying every set of variables held at a bound (the
    problems here have a handful of variables)."""
    n = a.shape[1]
    best_x, best_cost = None, math.inf
    for states in itertools.product((0, 1, 2), repeat=n):  # 0 free, 1 at lower, 2 at upper
        x = np.where(np.array(states) == 1, lower, np.where(np.array(states) == 2, upper, 0.0))
        free = np.array(states) == 0
        if free.any():
            rhs = b - a[:, ~free] @ x[~free]
            try:
                x_free, *_ = np.linalg.lstsq(a[:, free], rhs, rcond=None)
            except np.linalg.LinAlgError:  # LAPACK's SVD can fail to converge on a near-singular subset: skip it
                continue
            if np.any(x_free < lower[free] - 1e-12) or np.any(x_free > upper[free] + 1e-12):
                continue
            x[free] = x_free
        cost = float(np.sum((a @ x - b) ** 2))
        if cost < best_cost - 1e-15:
            best_x, best_cost = x, cost
    return best_x


@dataclass(frozen=True)
class EfficiencyFit:
    """Fitted efficiency factors and what they do to the error."""

    efficiency: MachineEfficiency
    before: dict[str, Accuracy]  # "decode", "prefill" (tokens/s) with the starting factors
    after: dict[str, Accuracy]
    factors: tuple[str, ...]  # the factors that were fitted
    iterations: int


def predict_points(model: ModelSpec, hardware: HardwareSpec, points: list[ProfilePoint],
                   policies: dict[str, Policy], efficiency: MachineEfficiency) -> tuple[np.ndarray, np.ndarray]:
    """The cost model's (prefill_s, step_s) for every point."""
    prefill, step = np.empty(len(points)), np.empty(len(points))
    for i, point in enumerate(points):
        policy = point_policy(policies[point.placement], point)
        prediction = evaluate(model, hardware, policy, Workload(point.prompt_len, point.output_len), efficiency)
        prefill[i], step[i] = prediction.prefill_s, prediction.decode_step_s
    return prefill, step


def phase_accuracy(points: list[ProfilePoint], prefill_s: np.ndarray, step_s: np.ndarray) -> dict[str, Accuracy]:
    """Accuracy of predicted times, compared as tokens/s: "prefill" over every point, "decode" where o > 1."""
    batch = np.array([pt.batch_size for pt in points], dtype=float)
    tokens = batch * np.array([pt.prompt_len for pt in points], dtype=float)
    result = {"prefill": accuracy(tokens / prefill_s, [pt.prefill_tokens_per_s for pt in points])}
    decoding = [i for i, pt in enumerate(points) if pt.step_s is not None]
    if decoding:
        result["decode"] = accuracy(batch[decoding] / step_s[decoding],
                                    [points[i].decode_tokens_per_s for i in decoding])
    return result


# The factors a decode step's time depends on (its reads, the blocks' and the step's fixed costs, a few-row step's
# re-reads): fitted to the decode steps alone. The rest (matmul_fraction, prefill_layer_overhead_s, the link's and
# the disk's) are fitted to the prefills, the decode factors held. Issue 23: fitted together on every point, the
# prefills (twice as many as the decode steps in a calibration grid) pulled the decode factors wherever the cost model
# prices a prefill otherwise than it runs (a prefill reads its weights weight_reread_rows times at the decode rate):
# the thin model's prefills ran ~25% faster than predicted, the fit sped decode up and cut the re-reads (1.83 to
# 1.53), and the decode MAPE went from 21% uncalibrated to 41% calibrated.
DECODE_FACTORS = frozenset({"bandwidth_fraction", "layer_overhead_s", "step_overhead_s", "weight_reread_rows",
                            "row_overhead_s"})
FIT_ROUNDS = 8  # decode, then prefill, again until neither moves (a decode step's FLOPs read matmul_fraction)


def fit_efficiency(model: ModelSpec, hardware: HardwareSpec, points: list[ProfilePoint], policies: dict[str, Policy],
                   base: MachineEfficiency | None = None, factors: tuple[str, ...] | None = None,
                   name: str = "calibrated:profile", max_iterations: int = 20,
                   robust_threshold: float | None = ROBUST_THRESHOLD) -> EfficiencyFit:
    """Fit the accelerator's efficiency factors so the cost model's prefill and decode times match the points.

    Least squares of log(predicted / measured), factors within their valid ranges (fractions in (0, 1]), by
    Gauss-Newton with a line search (a resident run's time is linear in the factors, so it converges in a few
    steps): the decode factors (DECODE_FACTORS) to the decode steps, the others to the prefills, in turn until
    neither moves. A tiny pull toward the starting values settles factors the points cannot tell apart (a per-block
    and a per-step overhead, with one model). On a CPU-only machine the host set is the same as the accelerator's.
    `factors`: default_fit_factors(hardware) unless given.

    On a shared machine a burst of load can slow every repeat of a point. So the loss is Huber's: a log ratio
    beyond `robust_threshold` (0.1: ~10%) counts linearly, not squared, and such a point pulls the factors as much
    as any point that is off by 10%, no more (iteratively reweighted; None: plain least squares).
    """
    factors = _checked_factors(hardware, points, policies, factors)
    base = base or measured_efficiency(hardware)
    fitter = _PhaseFitter(model, hardware, points, policies, base, tuple(factors), name, robust_threshold)
    theta, iterations = fitter.theta0.copy(), 0
    decode = [i for i, n in enumerate(fitter.names) if n in DECODE_FACTORS]
    prefill = [i for i, n in enumerate(fitter.names) if n not in DECODE_FACTORS]
    for _ in range(FIT_ROUNDS):
        before = theta.copy()
        for free, phase in ((decode, "decode"), (prefill, "prefill")):
            theta, used = fitter.fit(theta, free, phase, max_iterations)
            iterations += used
        if np.max(np.abs(theta - before) / fitter.scale, initial=0.0) < 1e-6:
            break
    fitted = fitter.machine_eff(theta)
    names = fitter.names
    acc = dataclasses.replace(fitted.accelerator, source=f"fitted to {len(points)} measured points of {model.name} "
                                                           f"(prefill and decode steps; {', '.join(names)})")
    fitted = MachineEfficiency(acc, acc if fitter.cpu_only else base.host)
    before_prefill, before_step = predict_points(model, hardware, points, policies, base)
    after_prefill, after_step = predict_points(model, hardware, points, policies, fitted)
    return EfficiencyFit(
        efficiency=fitted,
        before=phase_accuracy(points, before_prefill, before_step),
        after=phase_accuracy(points, after_prefill, after_step),
        factors=names, iterations=iterations,
    )


def _checked_factors(hardware: HardwareSpec, points: list[ProfilePoint], policies: dict[str, Policy],
                     factors: tuple[str, ...] | None) -> tuple[str, ...]:
    """The factors to fit (default_fit_factors(hardware) unless given), after checking the fit can run."""
    if not points:
        raise InputError("no profile points to calibrate from")
    factors = default_fit_factors(hardware) if factors is None else factors
    unknown = [f for f in factors if f not in _FACTORS]
    if unknown:
        raise InputError(f"unknown efficiency factor {unknown[0]!r}; choose from {', '.join(_FACTORS)}")
    missing = {pt.placement for pt in points} - set(policies)
    if missing:
        raise InputError(f"profile points use placement {sorted(missing)[0]!r}, which has no policy")
    return tuple(factors)


class _PhaseFitter:
    """fit_efficiency's parameters (fractions as their inverse, bounded, scaled) and its Gauss-Newton steps on one
    phase's residuals with some of the parameters free."""

    RIDGE = 1e-4  # pull toward the start, in units of each factor's scale: negligible beside real residuals

    def __init__(self, model, hardware, points, policies, base: MachineEfficiency, names: tuple[str, ...],
                 name: str, robust_threshold: float | None):
        self.model, self.hardware, self.points, self.policies = model, hardware, points, policies
        self.names, self.name, self.threshold = names, name, robust_threshold
        self.cpu_only, self.base, self.start = not hardware.gpus, base, base.accelerator
        self.lower = np.array([_FACTORS[n][0] for n in names])
        self.upper = np.array([_FACTORS[n][1] for n in names])
        self.scale = np.array([max(_FACTORS[n][2], abs(v)) for n, v in zip(names, _to_theta(self.start, names))])
        self.theta0 = np.clip(_to_theta(self.start, names), self.lower, self.upper)
        self.prefill_s = np.array([pt.prefill_s for pt in points])
        self.decoding = np.array([pt.step_s is not None for pt in points])
        self.step_s = np.array([pt.step_s if pt.step_s is not None else 1.0 for pt in points])

    def machine_eff(self, theta: np.ndarray) -> MachineEfficiency:
        acc = from_fitted(self.start, self.names, theta, self.name)
        return MachineEfficiency(acc, acc if self.cpu_only else self.base.host)

    def residuals(self, theta: np.ndarray, phase: str) -> np.ndarray:
        """log(predicted / measured) of the phase's times: over- and under-prediction by the same factor weigh the
        same (relative errors of time would let one point predicted 5x too slow outweigh every point 2x too fast)."""
        prefill, step = predict_points(self.model, self.hardware, self.points, self.policies, self.machine_eff(theta))
        if phase == "prefill":
            return np.log(prefill / self.prefill_s)
        return np.log(step / self.step_s)[self.decoding]

    def loss(self, r: np.ndarray) -> float:
        if self.threshold is None:
            return float(r @ r)
        size, t = np.abs(r), self.threshold
        return float(np.sum(np.where(size <= t, size**2, 2 * t * size - t**2)))

    def row_weights(self, r: np.ndarray) -> np.ndarray:
        """Square roots of the IRLS weights: 1 inside the threshold, sqrt(threshold / |r|) beyond it."""
        if self.threshold is None:
            return np.ones_like(r)
        return np.sqrt(np.minimum(1.0, self.threshold / np.maximum(np.abs(r), 1e-300)))

    def fit(self, theta: np.ndarray, free: list[int], phase: str, max_iterations: int) -> tuple[np.ndarray, int]:
        """theta with its `free` parameters fitted to the phase's residuals (Gauss-Newton with a line search), and
        the iterations taken; unchanged where nothing is free or the phase has no points."""
        r = self.residuals(theta, phase)
        if not free or not r.size:
            return theta, 0
        cost, iterations = self.loss(r), 0
        for iterations in range(1, max_iterations + 1):
            candidate = self.step(theta, free, r, phase)
            if candidate is None:
                break
            step_size = 1.0
            while True:
                trial = theta + step_size * (candidate - theta)
                r_trial = self.residuals(trial, phase)
                cost_trial = self.loss(r_trial)
                if cost_trial <= cost * (1 + 1e-12) or step_size < 1e-3:
                    break
                step_size /= 2
            moved = np.max(np.abs(trial - theta) / self.scale)
            if cost_trial <= cost * (1 + 1e-12):
                theta, r, cost = trial, r_trial, cost_trial
            if moved < 1e-6:
                break
        return theta, iterations

    def step(self, theta: np.ndarray, free: list[int], r: np.ndarray, phase: str) -> np.ndarray | None:
        """The linearized (reweighted, ridged) problem's solution for the free parameters, the others as they are;
        None where it cannot be solved (non-finite derivatives or residuals)."""
        scale = self.scale[free]
        jac = np.stack([(self.residuals(theta + d, phase) - r) / d.sum()
                        for d in (self.scale[i] * 1e-3 * np.eye(len(theta))[i] for i in free)], axis=1)
        if not np.isfinite(jac).all():  # a factor at the edge of its range predicts no finite time: stop here
            return None
        w = self.row_weights(r)
        # in x = theta_free / scale, with the ridge rows appended
        a = np.vstack([jac * scale * w[:, None], self.RIDGE * np.eye(len(free))])
        b = np.concatenate([w * (jac @ theta[free] - r), self.RIDGE * self.theta0[free] / scale])
        solved = _bounded_lstsq(a, b, self.lower[free] / scale, self.upper[free] / scale)
        if solved is None:
            return None
        candidate = theta.copy()
        candidate[free] = solved * scale
        return candidate


# ---- the calibration a machine keeps ------------------------------------------------------------------------------
def efficiency_to_dict(eff: Efficiency) -> dict:
    return dataclasses.asdict(eff)


def efficiency_from_dict(doc: dict) -> Efficiency:
    known = {f.name for f in dataclasses.fields(Efficiency)}
    values = {k: v for k, v in doc.items() if k in known}
    if "prefill_layer_overhead_s" not in values and "layer_overhead_s" in values:  # written before it existed
        values["prefill_layer_overhead_s"] = values["layer_overhead_s"]
    return Efficiency(**values)


@dataclass(frozen=True)
class Calibration:
    """What `hivekeeper profile` learned on one machine: fitted efficiency factors (they apply to any model the
    planner plans on this machine) and the idealized-runtime fits of the profiled model, with the measured grid
    and the accuracy of every form, so a report can be drawn later without running anything."""

    machine_id: str  # the machine profile's fingerprint
    model: ModelSpec  # the model profiled
    model_path: str
    hardware: dict  # hardware_to_json of the spec the factors were fitted against
    accelerator: Efficiency  # fitted; its name starts with "calibrated:"
    host: Efficiency
    uncalibrated_accelerator: Efficiency  # the starting set, for the report's "uncalibrated" column
    uncalibrated_host: Efficiency
    policies: dict[str, Policy]  # placement name -> policy (batch 1)
    points: tuple[ProfilePoint, ...]
    idealized: tuple[IdealizedFit, ...]
    accuracy: dict[str, dict[str, Accuracy]]  # form -> "decode" / "prefill" / "runtime" -> Accuracy
    created: float  # unix time
    profile_seconds: float  # wall time of the measurements and the fit
    device: str = "cpu"
    threads: int = 0
    calibrated: bool = True  # the flag a Plan page shows ("calibrated on this machine")
    notes: tuple[str, ...] = field(default_factory=tuple)  # e.g. the grid's passes off the measured pace (profiling)

    @property
    def efficiency(self) -> MachineEfficiency:
        return MachineEfficiency(self.accelerator, self.host)

    @property
    def uncalibrated(self) -> MachineEfficiency:
        return MachineEfficiency(self.uncalibrated_accelerator, self.uncalibrated_host)

    def idealized_for(self, batch_size: int, placement: str = "resident") -> IdealizedFit | None:
        return next((f for f in self.idealized if f.batch_size == batch_size and f.placement == placement), None)

    def as_dict(self) -> dict:
        return {
            "machine_id": self.machine_id, "model": dataclasses.asdict(self.model), "model_path": self.model_path,
            "hardware": self.hardware,
            "efficiency": {"accelerator": efficiency_to_dict(self.accelerator), "host": efficiency_to_dict(self.host)},
            "uncalibrated_efficiency": {"accelerator": efficiency_to_dict(self.uncalibrated_accelerator),
                                        "host": efficiency_to_dict(self.uncalibrated_host)},
            "policies": {name: policy_to_dict(p) for name, p in self.policies.items()},
            "points": [p.as_dict() for p in self.points],
            "idealized": [f.as_dict() for f in self.idealized],
            "accuracy": {form: {q: a.as_dict() for q, a in table.items()} for form, table in self.accuracy.items()},
            "created": self.created, "profile_seconds": _round(self.profile_seconds),
            "device": self.device, "threads": self.threads, "calibrated": self.calibrated, "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, doc: dict, where: str = "calibration") -> "Calibration":
        """A saved calibration (as_dict's), every part read by _CalibrationReader (fields.Fields): a part missing or
        malformed is one InputError naming the field, dotted (`where` names the calibration: "FILE: field
        'calibration'", or a plain name), and what to do (PROFILE_AGAIN)."""
        try:
            return cls._read(_CalibrationReader.of(doc, where))
        except InputError as exc:
            raise InputError(f"{exc}; {PROFILE_AGAIN}") from None

    @classmethod
    def _read(cls, read: "_CalibrationReader") -> "Calibration":
        eff, unc = read.table("efficiency"), read.table("uncalibrated_efficiency")
        return cls(
            machine_id=read.text("machine_id"), model=model_from_fields(read.table("model")),
            model_path=read.text("model_path"), hardware=read.table("hardware").doc,
            accelerator=eff.part("accelerator", efficiency_from_dict), host=eff.part("host", efficiency_from_dict),
            uncalibrated_accelerator=unc.part("accelerator", efficiency_from_dict),
            uncalibrated_host=unc.part("host", efficiency_from_dict),
            policies=read.table("policies").parts(policy_from_dict),
            points=tuple(read.each("points", ProfilePoint.from_dict)),
            idealized=tuple(read.each("idealized", IdealizedFit.from_dict)),
            accuracy={form: table.parts(Accuracy.from_dict) for form, table in read.table("accuracy").tables()},
            created=read.number("created", -math.inf, math.inf),
            profile_seconds=read.number("profile_seconds", -math.inf, math.inf),
            device=read.text("device", default="cpu"), threads=read.integer("threads", default=0, low=0),
            calibrated=read.flag("calibrated", True), notes=tuple(str(n) for n in read.each("notes", str, ())),
        )


# what a calibration that cannot be read advises: `profile` (and `measure`) read the saved profile first, so the
# field must go before it runs again
PROFILE_AGAIN = ("remove the field 'calibration' from the file (or delete the file) and run `hivekeeper profile` "
                 "again")
MODEL_ZERO_COUNTS = frozenset({"learned_positions", "embed_proj_dim"})  # ModelSpec's counts where 0 means none


def model_from_fields(fields: Fields) -> ModelSpec:
    """The ModelSpec a calibration saved (dataclasses.asdict's), each field checked as its type says (an int a count
    of at least 1, or 0 where MODEL_ZERO_COUNTS; a bool true/false; a str text): `"num_layers": "a"` was taken."""
    fields.check_keys({spec.name for spec in dataclasses.fields(ModelSpec)}, "a field of a model")
    values = {}
    for spec in dataclasses.fields(ModelSpec):
        default = REQUIRED if spec.default is dataclasses.MISSING else spec.default
        kind = getattr(spec.type, "__name__", spec.type)
        if kind == "int":
            low = 0 if spec.name in MODEL_ZERO_COUNTS else 1
            values[spec.name] = fields.integer(spec.name, default=default, low=low)
        elif kind == "bool":
            values[spec.name] = fields.flag(spec.name, default)
        else:
            values[spec.name] = fields.text(spec.name, default=default, max_len=1000)
    return ModelSpec(**values)


def _file_and_path(where: str) -> tuple[str, str]:
    """("FILE", "calibration") of "FILE: field 'calibration'" (how a profile names its calibration), so that errors
    name "FILE: field 'calibration.points[1]'"; (where, "") of a plain name."""
    file, marker, path = where.rpartition(": field '")
    return (file, path[:-1]) if marker and path.endswith("'") else (where, "")


class _CalibrationReader(Fields):
    """fields.Fields with what a calibration holds beyond plain fields: nested objects that must be given, lists,
    and parts built by their own from_dict, whose errors name the part, never in Python's words."""

    @classmethod
    def of(cls, doc, where: str) -> "_CalibrationReader":
        return cls(doc, *_file_and_path(where))

    def table(self, key: str) -> "_CalibrationReader":
        """The nested object `key`: "is missing" when absent, "must be an object" when it is not one."""
        if not self.has(key):
            return self.missing(key)
        if not isinstance(self.doc[key], dict):
            raise self.error(key, "must be an object")
        return _CalibrationReader(self.doc[key], self.where, self.name(key))

    def tables(self) -> list[tuple[str, "_CalibrationReader"]]:
        """(key, table) of every field, each an object."""
        return [(key, self.table(key)) for key in self.doc]

    def parts(self, build: Callable) -> dict:
        """`build` of every field (part)."""
        return {key: self.part(key, build) for key in self.doc}

    def each(self, key: str, build: Callable, default=REQUIRED) -> list:
        """`build` of every entry of the list at `key`; `default` when absent (REQUIRED: 'is missing')."""
        if not self.has(key):
            return self.missing(key, default)
        entries = self.doc[key]
        if not isinstance(entries, (list, tuple)):
            raise self.error(key, "must be a list")
        return [self.built(f"{key}[{i}]", build, entry) for i, entry in enumerate(entries)]

    def part(self, key: str, build: Callable):
        """`build` of the field `key`, which must be given (built)."""
        return self.built(key, build, self.doc[key]) if self.has(key) else self.missing(key)

    def built(self, name: str, build: Callable, value):
        """`build(value)`; a value it cannot take is an error naming `name`: its own InputError's words (an
        efficiency's limits) where it says one, never Python's."""
        try:
            return build(value)
        except InputError as exc:
            raise self.error(name, f"is not one `hivekeeper profile` saves ({exc})") from None
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
            raise self.error(name, "is malformed: it is not what `hivekeeper profile` saves there") from None


# ---- predicted vs measured, for every form ------------------------------------------------------------------------
FORMS = ("uncalibrated", "calibrated", "idealized")


@dataclass(frozen=True)
class FormPrediction:
    """One form's predictions at every point (seconds); nan where the form has nothing to say."""

    prefill_s: np.ndarray
    step_s: np.ndarray
    runtime_s: np.ndarray


def idealized_predictions(points: list[ProfilePoint], fits: Sequence[IdealizedFit]) -> FormPrediction:
    """α(p) as the prefill, β as the decode step and α + β(o − 1) as the runtime of each point's own fit."""
    prefill, step, runtime = (np.full(len(points), np.nan) for _ in range(3))
    for i, pt in enumerate(points):
        fit = next((f for f in fits if f.batch_size == pt.batch_size and f.placement == pt.placement), None)
        if fit is None:
            continue
        prefill[i] = fit.alpha(pt.prompt_len)
        step[i] = fit.beta_s
        runtime[i] = fit.runtime(pt.prompt_len, pt.output_len)
    return FormPrediction(prefill, step, runtime)


def cost_model_predictions(model: ModelSpec, hardware: HardwareSpec, points: list[ProfilePoint],
                           policies: dict[str, Policy], efficiency: MachineEfficiency) -> FormPrediction:
    prefill, step = predict_points(model, hardware, points, policies, efficiency)
    outputs = np.array([pt.output_len for pt in points], dtype=float)
    return FormPrediction(prefill, step, prefill + (outputs - 1.0) * step)


def form_accuracy(points: list[ProfilePoint], predicted: FormPrediction) -> dict[str, Accuracy]:
    """"prefill" and "decode" (as tokens/s) and "runtime" (seconds) accuracy of one form over the points it covers."""
    usable = [i for i in range(len(points)) if np.isfinite(predicted.prefill_s[i])]
    if not usable:
        return {}
    chosen = [points[i] for i in usable]
    # a form may predict no time at all (α = 0 or β = 0 on noisy points): a floor keeps that an error, a huge one
    floor = 1e-9
    step = predicted.step_s[usable]
    result = phase_accuracy(chosen, np.maximum(predicted.prefill_s[usable], floor),
                            np.where(np.isfinite(step), np.maximum(step, floor), np.inf))
    result["runtime"] = accuracy(np.maximum(predicted.runtime_s[usable], floor), [pt.runtime_s for pt in chosen])
    return result


def linear_alpha_fits(points: list[ProfilePoint]) -> tuple[IdealizedFit, ...]:
    """The idealized form with α linear in p (no breaks), per batch and placement: the form that breaks at long
    contexts, kept beside the piecewise fit in reports."""
    return fit_idealized_groups(points, max_breaks=0)


def fit_idealized_groups(points: list[ProfilePoint], max_breaks: int = 2) -> tuple[IdealizedFit, ...]:
    """One idealized fit per (placement, batch size) with at least two prompt lengths."""
    fits = []
    groups = sorted({(pt.placement, pt.batch_size) for pt in points})
    for placement, batch in groups:
        group = [pt for pt in points if pt.placement == placement and pt.batch_size == batch]
        if len({pt.prompt_len for pt in group}) < 2:
            continue
        fits.append(fit_idealized([pt.prompt_len for pt in group], [pt.output_len for pt in group],
                                  [pt.runtime_s for pt in group], max_breaks=max_breaks, batch_size=batch,
                                  placement=placement))
    return tuple(fits)


def compare_forms(calibration: Calibration, hardware: HardwareSpec) -> dict[str, FormPrediction]:
    """Predictions of every form (plus "linear-alpha", the idealized form with α linear in p) at the calibration's
    points, against the hardware spec the factors were fitted to."""
    points = list(calibration.points)
    return {
        "uncalibrated": cost_model_predictions(calibration.model, hardware, points, calibration.policies,
                                               calibration.uncalibrated),
        "calibrated": cost_model_predictions(calibration.model, hardware, points, calibration.policies,
                                             calibration.efficiency),
        "idealized": idealized_predictions(points, calibration.idealized),
        "linear-alpha": idealized_predictions(points, linear_alpha_fits(points)),
    }


def build_calibration(model: ModelSpec, model_path: str, hardware: HardwareSpec, hardware_doc: dict, machine_id: str,
                      points: list[ProfilePoint], policies: dict[str, Policy], *, created: float,
                      profile_seconds: float, base: MachineEfficiency | None = None, device: str = "cpu",
                      threads: int = 0, factors: tuple[str, ...] | None = None,
                      clock: Callable[[], float] | None = None, notes: tuple[str, ...] = ()) -> Calibration:
    """Fit the efficiency factors and the idealized forms to a measured grid; the Calibration to save.

    profile_seconds is the time spent measuring; the fit's own time is added when `clock` (time.perf_counter) is
    given, so the figure is the whole calibration.
    """
    started = clock() if clock else 0.0
    base = base or measured_efficiency(hardware)
    fitted = fit_efficiency(model, hardware, points, policies, base, factors, name=f"{CALIBRATED_PREFIX}{machine_id}")
    ideal = fit_idealized_groups(points)
    calibration = Calibration(
        machine_id=machine_id, model=model, model_path=model_path, hardware=hardware_doc,
        accelerator=fitted.efficiency.accelerator, host=fitted.efficiency.host,
        uncalibrated_accelerator=base.accelerator, uncalibrated_host=base.host, policies=dict(policies),
        points=tuple(points), idealized=ideal, accuracy={}, created=created, profile_seconds=profile_seconds,
        device=device, threads=threads, notes=tuple(notes),
    )
    predictions = compare_forms(calibration, hardware)
    table = {form: form_accuracy(points, predictions[form]) for form in (*FORMS, "linear-alpha")}
    seconds = profile_seconds + ((clock() - started) if clock else 0.0)
    return dataclasses.replace(calibration, accuracy=table, profile_seconds=seconds)
