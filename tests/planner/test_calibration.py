"""Calibration fits: idealized runtime (piecewise α), efficiency factors, error measures, serialization."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from hivekeeper.planner.calibration import (
    Calibration,
    IdealizedFit,
    ProfilePoint,
    accuracy,
    build_calibration,
    efficiency_from_dict,
    efficiency_to_dict,
    fit_efficiency,
    fit_idealized,
    is_calibrated,
    mape,
    measured_efficiency,
    nonnegative_lstsq,
    policy_from_dict,
    policy_to_dict,
    predict_points,
    r_squared,
    worst_error,
)
from hivekeeper.planner.costmodel import Placement, Policy
from hivekeeper.planner.efficiency import DEFAULTS, MachineEfficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware_catalog import get_hardware, hardware_to_json
from hivekeeper.planner.models import ModelSpec

PROMPTS = np.array([16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048])
OUTPUTS = np.array([1, 8, 32])


def grid() -> tuple[np.ndarray, np.ndarray]:
    p, o = np.meshgrid(PROMPTS, OUTPUTS, indexing="ij")
    return p.ravel().astype(float), o.ravel().astype(float)


# ---- error measures against hand-computed values ----------------------------------------------------------------
def test_error_measures_match_hand_values():
    measured = [1.0, 2.0, 3.0, 4.0]
    predicted = [1.1, 1.8, 3.0, 5.0]
    # relative errors +0.1, -0.1, 0, +0.25
    assert mape(predicted, measured) == pytest.approx(0.45 / 4)
    assert worst_error(predicted, measured) == (pytest.approx(0.25), 3)
    # SS_res = 0.01 + 0.04 + 0 + 1 = 1.05; mean 2.5, SS_tot = 2.25 + 0.25 + 0.25 + 2.25 = 5
    assert r_squared(predicted, measured) == pytest.approx(1 - 1.05 / 5)
    acc = accuracy(predicted, measured)
    assert (acc.points, acc.worst_point) == (4, 3)
    assert r_squared(measured, measured) == 1.0
    assert r_squared([1.0, 2.0], [3.0, 3.0]) == -math.inf  # constant measurements, wrong predictions


def test_error_measures_reject_bad_input():
    with pytest.raises(InputError, match="shape"):
        mape([1.0, 2.0], [1.0])
    with pytest.raises(InputError, match="positive"):
        mape([1.0], [0.0])


# ---- idealized runtime ------------------------------------------------------------------------------------------
def test_linear_alpha_recovered_from_noisy_data():
    p, o = grid()
    rng = np.random.default_rng(1)
    runtime = (0.04 + 0.0015 * p + 0.025 * (o - 1)) * (1 + 0.01 * rng.standard_normal(p.size))
    fit = fit_idealized(p, o, runtime)
    assert fit.breaks == ()  # noise on a straight α adds no break
    assert fit.beta_s == pytest.approx(0.025, rel=0.03)
    assert fit.alpha(1024) == pytest.approx(0.04 + 0.0015 * 1024, rel=0.02)
    assert fit.alpha(16) == pytest.approx(0.04 + 0.0015 * 16, rel=0.03)
    assert fit.r2 > 0.999 and fit.mape < 0.02


@pytest.mark.parametrize("knee", [300.0, 900.0])
def test_piecewise_alpha_breaks_where_the_slope_changes(knee):
    p, o = grid()
    rng = np.random.default_rng(2)
    alpha = 0.05 + 0.001 * p + 0.003 * np.maximum(0.0, p - knee)  # attention takes over past the knee
    runtime = (alpha + 0.02 * (o - 1)) * (1 + 0.01 * rng.standard_normal(p.size))
    fit = fit_idealized(p, o, runtime)
    assert len(fit.breaks) == 1
    assert fit.breaks[0] == pytest.approx(knee, rel=0.15)
    assert fit.beta_s == pytest.approx(0.02, rel=0.05)
    true_alpha = 0.05 + 0.001 * PROMPTS + 0.003 * np.maximum(0.0, PROMPTS - knee)
    assert np.allclose(fit.alpha(PROMPTS), true_alpha, rtol=0.05)
    linear = fit_idealized(p, o, runtime, max_breaks=0)
    assert linear.breaks == ()
    assert linear.mape > 3 * fit.mape  # the form linear in p is visibly worse


def test_idealized_fit_extrapolates_the_end_segments_and_round_trips():
    fit = IdealizedFit(knots_p=(10.0, 100.0, 200.0), alpha_s=(1.0, 2.0, 4.0), beta_s=0.5)
    assert fit.alpha(55.0) == pytest.approx(1.5)
    assert fit.alpha(0.0) == pytest.approx(1.0 - 10 / 90)  # first slope continued
    assert fit.alpha(300.0) == pytest.approx(6.0)  # last slope continued
    assert fit.runtime(100, 5) == pytest.approx(4.0)
    assert fit.breaks == (100.0,)
    again = IdealizedFit.from_dict(json.loads(json.dumps(fit.as_dict())))
    assert again.alpha(150.0) == pytest.approx(fit.alpha(150.0)) and again.beta_s == fit.beta_s


def test_nonnegative_least_squares_matches_the_unconstrained_answer_or_clips_it():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((30, 4))
    inside = np.array([1.0, 2.0, 0.5, 3.0])
    assert np.allclose(nonnegative_lstsq(a, a @ inside), inside)
    b = a @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.01 * rng.standard_normal(30)
    x = nonnegative_lstsq(a, b)
    assert np.all(x >= 0) and x[1] == 0.0
    # optimal: no single coordinate move that stays feasible lowers the error (KKT: gradient <= 0 where x = 0)
    gradient = a.T @ (b - a @ x)
    assert np.all(np.abs(gradient[x > 0]) < 1e-8) and np.all(gradient[x == 0] <= 1e-8)


def test_idealized_fit_never_predicts_negative_times():
    # a slow outlier at a long prompt and a fast one at a long output would pull a free line below zero at p = 64
    p = np.array([64, 64, 256, 256, 1024, 1024, 3072, 3072], dtype=float)
    o = np.array([1, 8, 1, 8, 1, 8, 1, 8], dtype=float)
    runtime = np.array([0.20, 0.18, 0.08, 0.24, 0.94, 0.92, 3.07, 4.67])
    for breaks in (0, 2):
        fit = fit_idealized(p, o, runtime, max_breaks=breaks)
        assert min(fit.alpha_s) >= 0 and fit.beta_s >= 0
        assert np.all(fit.runtime(p, o) >= 0)


def test_idealized_fit_rejects_too_little_data():
    with pytest.raises(InputError, match="two different prompt lengths"):
        fit_idealized([64, 64], [1, 8], [0.1, 0.2])
    with pytest.raises(InputError, match="positive"):
        fit_idealized([16, 64], [1, 1], [0.1, -0.2])


# ---- efficiency factors -----------------------------------------------------------------------------------------
MODEL = ModelSpec(name="test-llama", family="llama", num_layers=8, hidden_size=1024, intermediate_size=2816,
                  num_heads=16, num_kv_heads=4, head_dim=64, vocab_size=8192, tie_word_embeddings=False,
                  max_position_embeddings=4096, torch_dtype="fp32")
RESIDENT = Policy("fp32", weights=Placement(0.0, 1.0, 0.0), kv_cache=Placement(0.0, 1.0, 0.0),
                  activations=Placement(0.0, 1.0, 0.0), prefetch_depth=0)


def synthetic_points(truth: MachineEfficiency, noise: float, seed: int = 0,
                     batches: tuple[int, ...] = (1, 4)) -> list[ProfilePoint]:
    """Points whose times come from the cost model itself with known factors, times multiplicative noise."""
    hardware = get_hardware("cpu-generic")
    rng = np.random.default_rng(seed)
    shells = [ProfilePoint(p, o, b, prefill_s=1.0, step_s=1.0 if o > 1 else None, runtime_s=1.0)
              for p in (8, 32, 128, 512, 1024) for o in (1, 16) for b in batches]
    prefill, step = predict_points(MODEL, hardware, shells, {"resident": RESIDENT}, truth)
    points = []
    for pt, pre, st in zip(shells, prefill, step):
        pre *= 1 + noise * rng.standard_normal()
        st = st * (1 + noise * rng.standard_normal()) if pt.step_s is not None else None
        points.append(dataclasses.replace(pt, prefill_s=pre, step_s=st,
                                          runtime_s=pre + (pt.output_len - 1) * (st or 0.0)))
    return points


KNOWN = dataclasses.replace(DEFAULTS["cpu"], name="truth", bandwidth_fraction=0.35, matmul_fraction=0.22,
                            layer_overhead_s=4e-4, step_overhead_s=3e-3)


def test_fit_recovers_known_efficiency_factors_exactly_without_noise():
    hardware = get_hardware("cpu-generic")
    points = synthetic_points(MachineEfficiency(KNOWN, KNOWN), noise=0.0)
    fit = fit_efficiency(MODEL, hardware, points, {"resident": RESIDENT}, name="calibrated:test")
    got = fit.efficiency.accelerator
    assert got.bandwidth_fraction == pytest.approx(0.35, rel=1e-3)
    assert got.matmul_fraction == pytest.approx(0.22, rel=1e-3)
    # one model cannot separate a per-block from a per-step overhead: their total per step is what is identified
    total = MODEL.num_layers * got.layer_overhead_s + got.step_overhead_s
    assert total == pytest.approx(MODEL.num_layers * 4e-4 + 3e-3, rel=1e-3)
    assert fit.after["decode"].mape < 1e-3 and fit.after["prefill"].mape < 1e-3
    assert fit.before["decode"].mape > 0.3  # the defaults (0.5, 0.5, 0.2 ms, 1 ms) were far off
    assert got.name == "calibrated:test" and is_calibrated(got.name)
    assert fit.efficiency.host == fit.efficiency.accelerator  # CPU-only: one set


@pytest.mark.parametrize("seed", [0, 1])
def test_fit_with_noise_recovers_what_the_points_determine(seed):
    hardware = get_hardware("cpu-generic")
    points = synthetic_points(MachineEfficiency(KNOWN, KNOWN), noise=0.02, seed=seed)
    fit = fit_efficiency(MODEL, hardware, points, {"resident": RESIDENT})
    got = fit.efficiency.accelerator
    assert got.matmul_fraction == pytest.approx(0.22, rel=0.03)  # prefill at long prompts pins it down
    # decode time is weight reads plus overheads, both nearly constant over the grid: their split is loose
    assert got.bandwidth_fraction == pytest.approx(0.35, rel=0.25)
    assert fit.after["decode"].mape < 0.03 and fit.after["prefill"].mape < 0.03  # noise level


def test_fit_recovers_cpu_weight_rereads():
    hardware = get_hardware("cpu-generic")
    truth = dataclasses.replace(KNOWN, weight_reread_rows=2.5)
    points = synthetic_points(MachineEfficiency(truth, truth), noise=0.01, seed=4, batches=(1, 2, 4))
    fit = fit_efficiency(MODEL, hardware, points, {"resident": RESIDENT})
    assert "weight_reread_rows" in fit.factors  # a CPU-only machine fits them
    # within 8% under 1% noise (5.6% here): fitted to the decode steps alone, whose noise it shares with the reads
    assert fit.efficiency.accelerator.weight_reread_rows == pytest.approx(2.5, rel=0.08)
    assert fit.before["decode"].mape > 0.3 and fit.after["decode"].mape < 0.02
    gpu = get_hardware("t4")
    assert "weight_reread_rows" not in fit_efficiency(
        MODEL, gpu, points[:4], {"resident": Policy("fp16")}, max_iterations=1).factors


def test_fit_is_robust_to_points_slowed_by_other_processes():
    hardware = get_hardware("cpu-generic")
    points = synthetic_points(MachineEfficiency(KNOWN, KNOWN), noise=0.0)
    # a burst of load slowed every repeat of three points 2x (prefill and decode alike)
    slowed = [dataclasses.replace(pt, prefill_s=2 * pt.prefill_s, step_s=pt.step_s and 2 * pt.step_s)
              if i in (3, 9, 14) else pt for i, pt in enumerate(points)]
    robust = fit_efficiency(MODEL, hardware, slowed, {"resident": RESIDENT}).efficiency.accelerator
    plain = fit_efficiency(MODEL, hardware, slowed, {"resident": RESIDENT},
                           robust_threshold=None).efficiency.accelerator
    clean = [i for i in range(len(points)) if i not in (3, 9, 14)]
    truth_pre, truth_step = predict_points(MODEL, hardware, [points[i] for i in clean], {"resident": RESIDENT},
                                           MachineEfficiency(KNOWN, KNOWN))

    def error(eff) -> float:
        pre, step = predict_points(MODEL, hardware, [points[i] for i in clean], {"resident": RESIDENT},
                                   MachineEfficiency(eff, eff))
        return float(np.max(np.abs(np.concatenate([pre / truth_pre, step / truth_step]) - 1)))

    # the undisturbed points are predicted within a few % of the true factors' times (Huber bounds each slowed
    # point's pull, it does not drop it); plain least squares is pulled toward the slow ones
    assert error(robust) < 0.04
    assert error(plain) > 3 * error(robust)


def test_fit_keeps_fractions_valid_when_the_machine_beats_its_spec():
    hardware = get_hardware("cpu-generic")
    base = MachineEfficiency(DEFAULTS["cpu"], DEFAULTS["cpu"])
    ideal = dataclasses.replace(DEFAULTS["cpu"], bandwidth_fraction=1.0, matmul_fraction=1.0,
                                layer_overhead_s=0.0, step_overhead_s=0.0)
    points = synthetic_points(MachineEfficiency(ideal, ideal), noise=0.0)
    faster = [dataclasses.replace(pt, prefill_s=pt.prefill_s / 2, step_s=pt.step_s and pt.step_s / 2) for pt in points]
    got = fit_efficiency(MODEL, hardware, faster, {"resident": RESIDENT}, base).efficiency.accelerator
    assert got.bandwidth_fraction == 1.0 and got.matmul_fraction == 1.0  # bounded at the spec, not above it
    assert got.layer_overhead_s == 0.0 and got.step_overhead_s == 0.0


def test_fit_rejects_points_without_a_policy():
    points = synthetic_points(MachineEfficiency(DEFAULTS["cpu"], DEFAULTS["cpu"]), noise=0.0)[:2]
    with pytest.raises(InputError, match="placement 'resident'"):
        fit_efficiency(MODEL, get_hardware("cpu-generic"), points, {})
    with pytest.raises(InputError, match="unknown efficiency factor"):
        fit_efficiency(MODEL, get_hardware("cpu-generic"), points, {"resident": RESIDENT}, factors=("speed",))


def test_measured_numbers_get_fractions_of_one():
    catalog = get_hardware("cpu-generic")
    assert measured_efficiency(catalog).accelerator == DEFAULTS["cpu"]  # nothing measured: the defaults
    cpu = dataclasses.replace(catalog.cpu, sources={**catalog.cpu.sources, "memory_bandwidth": "measured: test",
                                                    "flops": "measured: test"})
    measured = measured_efficiency(dataclasses.replace(catalog, cpu=cpu))
    assert measured.accelerator.bandwidth_fraction == 1.0 and measured.accelerator.matmul_fraction == 1.0
    assert measured.accelerator.layer_overhead_s == DEFAULTS["cpu"].layer_overhead_s
    assert measured.accelerator.name.startswith("measured:") and not is_calibrated(measured.name)


def test_policy_dict_round_trip():
    policy = Policy("bf16", weights=Placement(0.25, 0.5, 0.25), kv_cache=Placement(0.5, 0.5, 0.0),
                    activations=Placement(0.0, 1.0, 0.0), micro_batch_size=4, num_micro_batches=2,
                    prefetch_depth=2, attention_on_cpu=True)
    assert policy_from_dict(json.loads(json.dumps(policy_to_dict(policy)))) == policy


def test_calibration_round_trips_through_json():
    hardware = get_hardware("cpu-generic")
    known = dataclasses.replace(DEFAULTS["cpu"], bandwidth_fraction=0.4, matmul_fraction=0.3)
    points = synthetic_points(MachineEfficiency(known, known), noise=0.01, seed=3)
    calibration = build_calibration(MODEL, "/models/test", hardware, hardware_to_json(hardware), "abc123", points,
                                    {"resident": RESIDENT}, created=1.0e9, profile_seconds=12.5)
    assert calibration.accelerator.name == "calibrated:abc123" and calibration.calibrated
    assert calibration.accuracy["calibrated"]["decode"].mape < 0.03
    assert calibration.accuracy["calibrated"]["prefill"].mape < calibration.accuracy["uncalibrated"]["prefill"].mape
    assert {f.batch_size for f in calibration.idealized} == {1, 4}
    again = Calibration.from_dict(json.loads(json.dumps(calibration.as_dict())))
    assert again.model == MODEL and again.points == calibration.points and again.policies == calibration.policies
    assert again.accelerator == calibration.accelerator and again.efficiency == calibration.efficiency
    assert again.idealized_for(4).beta_s == pytest.approx(calibration.idealized_for(4).beta_s)
    with pytest.raises(InputError, match="calibration: field 'efficiency' is missing"):
        Calibration.from_dict({"machine_id": "x"})


@pytest.mark.parametrize("edit, field, problem", [
    (lambda d: d.update(efficiency="x"), "calibration.efficiency", "must be an object"),  # the newcomer's
    (lambda d: d["points"].__setitem__(1, 5), "calibration.points[1]", "is malformed"),
    (lambda d: d.pop("created"), "calibration.created", "is missing"),
    (lambda d: d["efficiency"]["host"].update(bandwidth_fraction=3), "calibration.efficiency.host",
     "bandwidth_fraction must be in (0, 1]"),
    (lambda d: d["policies"].update(resident=[]), "calibration.policies.resident", "is malformed"),
    (lambda d: d["model"].update(num_layers="a"), "calibration.model.num_layers", "must be an integer"),  # was taken
])
def test_a_malformed_calibration_names_its_field_and_what_to_do(edit, field, problem):
    """A newcomer's profile: `field 'calibration': malformed calibration (TypeError: string indices must be integers,
    not 'str')`. The error names the field inside the calibration and what to do, in no Python words."""
    hardware = get_hardware("cpu-generic")
    points = synthetic_points(MachineEfficiency(DEFAULTS["cpu"], DEFAULTS["cpu"]), noise=0.01, seed=3)
    doc = json.loads(json.dumps(build_calibration(MODEL, "/models/test", hardware, hardware_to_json(hardware), "abc",
                                                  points, {"resident": RESIDENT}, created=1.0e9,
                                                  profile_seconds=1.0).as_dict()))
    edit(doc)
    with pytest.raises(InputError) as error:
        Calibration.from_dict(doc, "p.json: field 'calibration'")
    message = str(error.value)
    assert message.startswith(f"p.json: field '{field}' ") and problem in message, message
    assert "`hivekeeper profile` again" in message and "delete the file" in message, message
    assert not any(word in message for word in ("Error", "indices", "unexpected keyword", "object has no")), message


# ---- measured numbers are not discounted twice ----------------------------------------------------------------------
def _hardware_file(tmp_path, base_id: str, measured: dict[str, list[str]]) -> Path:
    """A hardware JSON of a catalog machine whose listed numbers claim to be measured (as `measure --out` writes)."""
    doc = hardware_to_json(get_hardware(base_id))
    sections = {"cpu": doc["cpu"], "disk": doc["disk"], "gpu": doc["gpus"][0] if doc["gpus"] else None}
    for section, keys in measured.items():
        sections[section]["sources"] = {**sections[section].get("sources", {}),
                                        **{k: "measured 2025-01-01 10.00: test bench" for k in keys}}
    path = tmp_path / f"{base_id}-measured.json"
    path.write_text(json.dumps(doc))
    return path


def test_plans_from_a_measured_hardware_file_use_fractions_of_one(tmp_path):
    from hivekeeper.planner.efficiency import default_efficiency
    from hivekeeper.planner.hardware_catalog import load_hardware_json
    from hivekeeper.planner.policy import search

    model = dataclasses.replace(MODEL, torch_dtype="fp16")
    estimated = load_hardware_json(_hardware_file(tmp_path, "cpu-generic", {}))
    measured = load_hardware_json(_hardware_file(
        tmp_path, "cpu-generic", {"cpu": ["memory_bandwidth", "flops"], "disk": ["read_bandwidth"]}))
    assert default_efficiency(estimated).name == "default:cpu"
    eff = default_efficiency(measured).accelerator
    assert eff.name == "measured:cpu" and not is_calibrated(eff.name)
    assert (eff.bandwidth_fraction, eff.matmul_fraction, eff.disk_fraction) == (1.0, 1.0, 1.0)
    assert eff.layer_overhead_s == DEFAULTS["cpu"].layer_overhead_s  # no benchmark measures overheads
    # the planner's own choice (no efficiency passed) is the measured one: the same numbers are not discounted twice
    plan, slow = search(model, measured, "chat"), search(model, estimated, "chat")
    assert plan.efficiency == "measured:cpu" and slow.efficiency == "default:cpu"
    assert plan.prediction.decode_tokens_per_s > 1.5 * slow.prediction.decode_tokens_per_s
    # what calibration starts from: the CPU defaults with the three measured numbers' fractions at 1, everything
    # else (overheads, link, re-reads, runtime memory) as the defaults, on both sides of a CPU-only machine
    expected = {**dataclasses.asdict(DEFAULTS["cpu"]), "name": "measured:cpu", "bandwidth_fraction": 1.0,
                "matmul_fraction": 1.0, "disk_fraction": 1.0}
    start = measured_efficiency(measured)
    for side in (start.accelerator, start.host):
        assert {k: v for k, v in dataclasses.asdict(side).items() if k != "source"} == \
            {k: v for k, v in expected.items() if k != "source"}
    assert measured_efficiency(estimated).accelerator == DEFAULTS["cpu"]  # nothing measured: the defaults as they are


def test_measured_gpu_numbers_change_only_their_own_fractions(tmp_path):
    from hivekeeper.planner.efficiency import default_efficiency
    from hivekeeper.planner.hardware_catalog import load_hardware_json

    hardware = load_hardware_json(_hardware_file(tmp_path, "t4", {"gpu": ["memory_bandwidth"]}))
    eff = default_efficiency(hardware)
    assert eff.accelerator.name == "measured:inference-gpu" and eff.accelerator.bandwidth_fraction == 1.0
    assert eff.accelerator.matmul_fraction == DEFAULTS["inference-gpu"].matmul_fraction  # FLOP/s still the catalog's
    assert eff.host == DEFAULTS["cpu"]  # the host's RAM was not measured


def test_prefill_and_decode_have_their_own_per_block_overhead():
    """A CPU decode step runs in native kernels, a prefill in torch's ops: each phase pays its own overhead."""
    hardware = get_hardware("cpu-generic")
    points = synthetic_points(MachineEfficiency(KNOWN, KNOWN), noise=0.0)
    slower_prefill = dataclasses.replace(KNOWN, prefill_layer_overhead_s=KNOWN.prefill_layer_overhead_s + 1e-3)
    base_prefill, base_step = predict_points(MODEL, hardware, points, {"resident": RESIDENT},
                                             MachineEfficiency(KNOWN, KNOWN))
    prefill, step = predict_points(MODEL, hardware, points, {"resident": RESIDENT},
                                   MachineEfficiency(slower_prefill, slower_prefill))
    decoding = ~np.isnan(base_step)
    assert np.allclose(prefill - base_prefill, MODEL.num_layers * 1e-3)  # 1 ms more for each block
    assert np.array_equal(step[decoding], base_step[decoding])


def test_efficiency_written_before_the_prefill_overhead_existed_reads_as_before():
    doc = efficiency_to_dict(KNOWN)
    del doc["prefill_layer_overhead_s"]
    assert efficiency_from_dict(doc).prefill_layer_overhead_s == KNOWN.layer_overhead_s


def test_a_fitted_step_that_misses_a_bound_by_a_rounding_is_held_at_the_bound():
    """Issue 23: the quick accuracy bench's fit ended a step at 1 - 1e-16 re-reads, which Efficiency refuses (the
    whole calibration failed). The fitted parameters are held within their bounds exactly."""
    from hivekeeper.planner.calibration import from_fitted
    from hivekeeper.planner.efficiency import default_efficiency
    from hivekeeper.planner.hardware_catalog import get_hardware

    start = default_efficiency(get_hardware("cpu-generic")).accelerator
    names = ("weight_reread_rows", "bandwidth_fraction", "layer_overhead_s")
    eff = from_fitted(start, names, np.array([1.0 - 1e-16, 1.0 - 1e-16, -1e-19]), "calibrated:test")
    assert (eff.weight_reread_rows, eff.bandwidth_fraction, eff.layer_overhead_s) == (1.0, 1.0, 0.0)
    inside = from_fitted(start, names, np.array([2.5, 4.0, 1e-4]), "calibrated:test")
    assert (inside.weight_reread_rows, inside.bandwidth_fraction, inside.layer_overhead_s) == (2.5, 0.25, 1e-4)
