"""Runtime profiles on a real (tiny) checkpoint through the engine and generate(); the calibration they give."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from hivekeeper.core.machine.detect import detect_hardware
from hivekeeper.core.machine.profiles import detect_or_load_profile, load_machine_profile, new_profile, save_profile
from hivekeeper.core.machine.profiling import (ProfileGrid, Run, calibration_hardware, denoise, measure_grid,
                                       placement_policy, profile_model, render_report, report_dict, write_report_png)
from hivekeeper.planner.calibration import (ROBUST_THRESHOLD, Calibration, is_calibrated, measured_efficiency,
                                            predict_points)
from hivekeeper.planner.efficiency import MachineEfficiency
from hivekeeper.planner.errors import InputError

GRID = ProfileGrid(prompt_lens=(4, 16, 48), output_lens=(1, 4), batch_sizes=(1, 2), repeats=2)


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    folder = tmp_path / "config"
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def calibration(tiny_checkpoint) -> Calibration:
    hardware = detect_hardware()
    return profile_model(tiny_checkpoint, GRID, hardware, "test-machine", base=measured_efficiency(hardware),
                         device="cpu")


def test_denoise_keeps_the_median_repeat_and_the_spread():
    runs = [Run(16, 4, 1, "resident", 0.30, 0.010, 0.33, 1.0), Run(16, 4, 1, "resident", 0.20, 0.012, 0.25, 2.5),
            Run(16, 4, 1, "resident", 0.26, 0.020, 0.40, 0.7), Run(16, 1, 1, "resident", 0.21, None, 0.21, 0.5),
            Run(8, 4, 1, "resident", 0.10, 0.010, 0.20, 0.5), Run(8, 4, 1, "resident", 0.14, 0.014, 0.30, 0.5)]
    points = {(p.prompt_len, p.output_len): p for p in denoise(runs)}
    point = points[(16, 4)]
    assert (point.prefill_s, point.step_s, point.runtime_s) == (0.26, 0.012, 0.33)  # each time's own median
    assert point.spread == pytest.approx((0.40 - 0.25) / 0.25) and point.repeats == 3 and point.loadavg == 2.5
    two = points[(8, 4)]  # of two repeats, their mean
    assert (two.prefill_s, two.step_s, two.runtime_s) == pytest.approx((0.12, 0.012, 0.25))
    assert points[(16, 1)].step_s is None and points[(16, 1)].decode_tokens_per_s is None


def test_grid_is_checked():
    with pytest.raises(InputError, match="two prompt lengths"):
        ProfileGrid(prompt_lens=(64,))
    with pytest.raises(InputError, match="placement"):
        ProfileGrid(placements=("cloud",))
    with pytest.raises(InputError, match="ram"):
        placement_policy("ram", on_gpu=False, weight_format="fp32")
    assert placement_policy("disk", on_gpu=False, weight_format="fp32").weights.disk == 0.5


def test_grid_longer_than_the_context_is_refused(tiny_checkpoint):
    with pytest.raises(InputError, match="context"):
        measure_grid(tiny_checkpoint, ProfileGrid(prompt_lens=(16, 4000), output_lens=(1,), batch_sizes=(1,),
                                                  repeats=1))


def test_every_point_is_timed_through_the_engine_with_each_placement(tiny_checkpoint):
    grid = ProfileGrid(prompt_lens=(4, 12), output_lens=(1, 3), batch_sizes=(1,), placements=("resident", "disk"),
                       repeats=2)
    seen = []
    runs, policies = measure_grid(tiny_checkpoint, grid, progress=lambda f, label: seen.append(f))
    assert len(runs) == grid.runs == 16
    assert set(policies) == {"resident", "disk"} and policies["disk"].weights.disk == 0.5
    for run in runs:
        assert run.prefill_s > 0 and run.runtime_s >= run.prefill_s
        assert (run.step_s is None) == (run.output_len == 1)
    assert seen == sorted(seen) and seen[-1] == 1.0


def test_profile_fits_every_form(calibration):
    points = calibration.points
    assert len(points) == 3 * 2 * 2 and all(p.repeats == 2 for p in points)
    assert is_calibrated(calibration.accelerator.name) and calibration.calibrated
    assert calibration.accelerator.name == "calibrated:test-machine"
    assert {(f.batch_size, f.placement) for f in calibration.idealized} == {(1, "resident"), (2, "resident")}
    table = calibration.accuracy
    assert set(table) == {"uncalibrated", "calibrated", "idealized", "linear-alpha"}
    assert set(table["calibrated"]) == {"prefill", "decode", "runtime"}
    # the fit never ends worse than it started on what it minimizes (Huber losses of log errors): the decode factors'
    # on the decode steps, the prefill factors' on the prefills, each with the other phase's factors as fitted
    hardware = calibration_hardware(calibration)
    fitted, start = calibration.efficiency.accelerator, calibration.uncalibrated.accelerator

    def loss(phase: str, reset: tuple[str, ...] = ()) -> float:
        eff = dataclasses.replace(fitted, **{name: getattr(start, name) for name in reset})
        prefill, step = predict_points(calibration.model, hardware, list(points), calibration.policies,
                                       MachineEfficiency(eff, eff))
        logs = np.array([np.log(prefill[i] / p.prefill_s) for i, p in enumerate(points)] if phase == "prefill" else
                        [np.log(step[i] / p.step_s) for i, p in enumerate(points) if p.step_s is not None])
        size, t = np.abs(logs), ROBUST_THRESHOLD
        return float(np.sum(np.where(size <= t, size**2, 2 * t * size - t**2)))

    decode_fields = ("bandwidth_fraction", "layer_overhead_s", "row_overhead_s", "step_overhead_s",
                     "weight_reread_rows")
    assert loss("decode") <= loss("decode", decode_fields) * (1 + 1e-6)
    assert loss("prefill") <= loss("prefill", ("matmul_fraction", "prefill_layer_overhead_s")) * (1 + 1e-6)
    assert calibration.profile_seconds > 0


def test_report_text_json_and_png(calibration, tmp_path):
    text = render_report(calibration)
    for words in ("cost model, uncalibrated", "cost model, calibrated", "idealized, piecewise α", "MAPE",
                  "α linear in p instead", "efficiency factors"):
        assert words in text
    assert len([line for line in text.splitlines() if line.startswith("resident")]) == len(calibration.points)
    doc = json.loads(json.dumps(report_dict(calibration)))
    assert len(doc["points"]) == len(calibration.points)
    assert set(doc["points"][0]["predicted"]) == {"uncalibrated", "calibrated", "idealized", "linear-alpha"}
    png = write_report_png(calibration, tmp_path / "report.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.png"]
    with pytest.raises(InputError, match="does not exist"):
        write_report_png(calibration, tmp_path / "missing" / "r.png")


def test_saved_calibration_is_what_the_planner_uses(calibration, config_dir):
    detected = detect_hardware()
    profile = new_profile(detected)
    profile.calibration = calibration
    save_profile(profile)
    loaded = load_machine_profile(detected)
    assert loaded.calibrated and loaded.calibration.accelerator == calibration.accelerator
    assert loaded.calibration.points == calibration.points
    _, efficiency = detect_or_load_profile()
    assert is_calibrated(efficiency.name)


def test_profile_command_then_report_then_plan(tiny_checkpoint, config_dir, tmp_path, capsys):
    from hivekeeper.core.cli.main import main

    assert main(["profile", "--report"]) == 2
    assert "no saved profile" in capsys.readouterr().err
    assert main(["profile", "--model", str(tiny_checkpoint), "--prompt-lens", "4,16", "--output-lens", "1,3",
                 "--batch-sizes", "1", "--repeats", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["saved"] and len(doc["points"]) == 4
    png = tmp_path / "r.png"
    assert main(["profile", "--report", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "cost model, calibrated" in out and png.is_file()
    assert main(["plan", "--model", str(tiny_checkpoint), "--json"]) == 0
    assert is_calibrated(json.loads(capsys.readouterr().out)["efficiency"])
    assert main(["profile", "--model", str(tiny_checkpoint), "--prompt-lens", "4,x"]) == 2
    assert "--prompt-lens" in capsys.readouterr().err


# ---- the host's pace during the grid (issue 23, session 21) -------------------------------------------------------
PACE_GRID = ProfileGrid(prompt_lens=(4, 12), output_lens=(1, 3), batch_sizes=(1,), repeats=1)


def measured_hardware(scale: float):
    """This machine measured at the suite's fixed figures, every rate divided by `scale`."""
    from tests.conftest import SUITE_PROFILE_FIGURES
    from hivekeeper.core.machine.measurement import Measurement
    from hivekeeper.core.machine.profiles import apply_measurements

    measurements = [Measurement(key, key, value / scale, unit, 0.0, 1, 0.5, "fed in by the test", [value / scale])
                    for key, (value, unit) in SUITE_PROFILE_FIGURES.items()]
    return apply_measurements(detect_hardware(), measurements, 1.7e9)


def runs_at_pace(spec, hardware, efficiency, policy, pace: float, grid_pass: int) -> list[Run]:
    """The grid's runs as if the host ran at `pace` (predicted / measured time) of the cost model's predictions."""
    from hivekeeper.planner.calibration import ProfilePoint, cost_model_predictions

    shapes = PACE_GRID.points()
    points = [ProfilePoint(p, o, b, prefill_s=1.0, step_s=1.0 if o > 1 else None, runtime_s=1.0) for p, o, b in shapes]
    predicted = cost_model_predictions(spec, hardware, points, {"resident": policy}, efficiency)
    return [Run(p, o, b, "resident", predicted.prefill_s[i] / pace,
                predicted.step_s[i] / pace if o > 1 else None, predicted.runtime_s[i] / pace, 0.5, grid_pass)
            for i, (p, o, b) in enumerate(shapes)]


def test_a_pass_off_the_measured_pace_is_timed_again_and_the_steady_pass_is_fitted(tiny_checkpoint):
    from hivekeeper.core.machine.profiling import MEASURED_SLOW_WORDS, PACE_TOLERANCE, PaceCheck
    from hivekeeper.planner.model_catalog import load_model_spec

    spec, hardware = load_model_spec(str(tiny_checkpoint)), measured_hardware(1.0)
    efficiency, policy = measured_efficiency(hardware), placement_policy("resident", False, "fp32")
    assert PaceCheck.applies(efficiency) and not PaceCheck.applies(measured_efficiency(detect_hardware()))
    check = PaceCheck(spec, hardware, efficiency)
    slow, steady = (runs_at_pace(spec, hardware, efficiency, policy, pace, i) for i, pace in enumerate((0.8, 0.97)))
    assert check(slow, policy, 0)  # 0.8 of the measured pace: time the grid again
    assert not check(steady, policy, 1)
    assert [round(p.prefill, 3) for p in check.paces] == [0.8, 0.97] and check.paces[0].decode == pytest.approx(0.8)
    assert check.kept(slow + steady) == steady
    (note,) = check.notes()
    assert "pass 1 (resident): prefill 0.80, decode 0.80" in note and "fitted on pass 2" in note
    # a pace within the tolerance the first time: one pass, nothing to note
    quiet = PaceCheck(spec, hardware, efficiency)
    assert not quiet(runs_at_pace(spec, hardware, efficiency, policy, 1.05, 0), policy, 0) and quiet.notes() == ()
    # off every time: at most EXTRA_PASSES more, then all of them fitted, and the note says so
    busy = PaceCheck(spec, hardware, efficiency, extra_passes=1)
    runs = [runs_at_pace(spec, hardware, efficiency, policy, PACE_TOLERANCE * 1.1, i) for i in range(2)]
    assert busy(runs[0], policy, 0) and not busy(runs[1], policy, 1)
    assert busy.kept(runs[0] + runs[1]) == runs[0] + runs[1]
    assert "no pass ran at the measured pace" in busy.notes()[0]
    assert MEASURED_SLOW_WORDS in busy.notes()[0]  # faster than measured every time: the measurement read slow
    # slower than measured every time: the host was busy throughout (or the model's own error), no advice to measure
    slower = PaceCheck(spec, hardware, efficiency, extra_passes=1)
    runs = [runs_at_pace(spec, hardware, efficiency, policy, 0.8, i) for i in range(2)]
    assert slower(runs[0], policy, 0) and not slower(runs[1], policy, 1)
    assert "no pass ran at the measured pace" in slower.notes()[0] and MEASURED_SLOW_WORDS not in slower.notes()[0]


def test_profile_times_the_grid_again_while_it_runs_off_the_measured_pace(tiny_checkpoint):
    from hivekeeper.core.machine.profiling import EXTRA_PASSES

    hardware = measured_hardware(1000.0)  # a measurement 1000x slower than any host runs the tiny model
    calibration = profile_model(tiny_checkpoint, PACE_GRID, hardware, "test-machine",
                                base=measured_efficiency(hardware), device="cpu")
    assert all(p.repeats == 1 + EXTRA_PASSES for p in calibration.points)
    (note,) = calibration.notes
    assert note.count("(resident): prefill") == 1 + EXTRA_PASSES and "no pass ran at the measured pace" in note
    assert f"note: {note}" in render_report(calibration) and report_dict(calibration)["notes"] == [note]
    unmeasured = profile_model(tiny_checkpoint, PACE_GRID, detect_hardware(), "test-machine", device="cpu")
    assert all(p.repeats == 1 for p in unmeasured.points) and unmeasured.notes == ()


def test_the_default_gguf_is_profiled_in_the_packed_format_the_runtime_runs(monkeypatch):
    """A new user's `profile --model` on the built-in Q4_1 GGUF: the runtime keeps its linears packed on a CPU, so the
    predictions the calibration compares with (and fits to) must be of q4_1, not fp32 (they were: decode predicted
    ~0.3x the measured rate, and that fit was saved for every plan). HIVEKEEPER_GGUF_PACKED=0 runs and plans fp32."""
    from hivekeeper.core.runtime.default_model import default_model_file

    grid = ProfileGrid(prompt_lens=(4, 8), output_lens=(1,), batch_sizes=(1,), repeats=1)
    runs, policies = measure_grid(default_model_file(), grid)
    assert policies["resident"].weight_format == "q4_1" and len(runs) == 2
    monkeypatch.setenv("HIVEKEEPER_GGUF_PACKED", "0")
    _, unpacked = measure_grid(default_model_file(), grid)
    assert unpacked["resident"].weight_format == "fp32"


# ---- a measurement that read slow, read again after the grid (issue 23, session 24) -------------------------------
def slow_stream_measurements():
    """The suite's figures, every rate 1000x slow, with the decode steps' and prefill passes' figures of a measurement
    whose streaming read 10 MB/s and prefill 40 MFLOP/s: any host runs the tiny model far faster than that
    predicts."""
    from tests.conftest import SUITE_PROFILE_FIGURES
    from hivekeeper.core.machine.measure import TINY, stream_span_configs
    from hivekeeper.core.machine.measurement import (BLOCK_OVERHEAD_KEY, PREFILL_BLOCK_KEY, PREFILL_FLOPS_KEY,
                                                     PREFILL_HALF_ROWS_KEY, PREFILL_PEAK_KEY, SMALL_ROWS_READS_KEY,
                                                     WEIGHT_STREAM_KEY, Measurement)

    figures = {key: (value / 1000, unit) for key, (value, unit) in SUITE_PROFILE_FIGURES.items()}
    figures.update({WEIGHT_STREAM_KEY: (1e7, "B/s"), BLOCK_OVERHEAD_KEY: (0.0, "s"), SMALL_ROWS_READS_KEY: (1.0, "x"),
                    PREFILL_FLOPS_KEY: (4e7, "FLOP/s"), PREFILL_BLOCK_KEY: (0.0, "s")})
    for config in stream_span_configs(TINY.stream_hidden, TINY.stream_bytes, TINY.cache_bytes, TINY.stream_thin):
        figures.update({f"{PREFILL_PEAK_KEY}{config.hidden_size}": (4e7, "FLOP/s"),  # the rate by rows at each width
                        f"{PREFILL_HALF_ROWS_KEY}{config.hidden_size}": (10.0, "rows")})  # of TINY's spans
    return [Measurement(key, key, value, unit, 0.0, 1, 0.5, "fed in by the test", [value])
            for key, (value, unit) in figures.items()]


def stream_rate(measurements) -> float:
    from hivekeeper.core.machine.measurement import WEIGHT_STREAM_KEY

    return next(m.value for m in measurements if m.key == WEIGHT_STREAM_KEY)


def test_a_grid_running_faster_than_measured_reads_the_decode_steps_again_and_fits_against_them(tiny_checkpoint):
    """Session 23: a quick measurement that caught a slow moment stayed slow through calibration (the fit keeps a
    CPU's measured per-byte rate): calibrated 14.9% off, uncalibrated 15.0%. Where every pass runs faster than
    the measurement predicts, profile_model reads the decode steps again (here at TINY sizes, for real), and the
    calibration is fitted against the measurement it returns."""
    from hivekeeper.core.machine.measurement import PREFILL_BLOCK_KEY, PREFILL_FLOPS_KEY
    from hivekeeper.core.machine.read_again import AFTER_GRID, read_measurement_again
    from hivekeeper.core.machine.measure import TINY
    from hivekeeper.core.machine.profiles import apply_measurements
    from hivekeeper.core.machine.profiling import READ_AGAIN_WORDS

    detected, slow = detect_hardware(), slow_stream_measurements()
    hardware, asked = apply_measurements(detected, slow, 1.7e9), []

    def read_again():
        asked.append(read_measurement_again(slow, TINY))
        return apply_measurements(detected, asked[-1], 1.7e9)

    calibration = profile_model(tiny_checkpoint, PACE_GRID, hardware, "test-machine",
                                base=measured_efficiency(hardware), device="cpu", read_again=read_again)
    (read,) = asked
    again = {m.key: m for m in read}
    assert stream_rate(read) > 100 * stream_rate(slow)  # three readings now outvote the slow one
    assert AFTER_GRID in next(m.detail for m in read if m.value == stream_rate(read))
    assert again["ram_read"] == next(m for m in slow if m.key == "ram_read")  # what was not read again is kept
    prefill = again[PREFILL_FLOPS_KEY]  # the prefill passes: the median reading by rate, a real one here
    assert prefill.value > 100 * 4e7 and AFTER_GRID in prefill.detail and AFTER_GRID in again[PREFILL_BLOCK_KEY].detail
    assert calibration_hardware(calibration).cpu.flops["fp32"] == pytest.approx(prefill.value, rel=1e-5)
    fitted_on = calibration_hardware(calibration).cpu.memory_bandwidth  # the rate decode steps read RAM at, now
    assert fitted_on == pytest.approx(stream_rate(read), rel=1e-5) and fitted_on > 100 * hardware.cpu.memory_bandwidth
    (note,) = calibration.notes
    before, _, after = note.partition(READ_AGAIN_WORDS)
    assert "pass 1 (resident)" in before and "pass 1 (resident)" in after  # the paces against both measurements
    # without read_again (or where the grid ran at the measured pace) nothing is read: the advice to measure again
    unread = profile_model(tiny_checkpoint, PACE_GRID, hardware, "test-machine", base=measured_efficiency(hardware),
                           device="cpu")
    assert READ_AGAIN_WORDS not in unread.notes[0] and calibration_hardware(unread) == hardware


def test_the_profile_command_saves_the_decode_steps_it_read_again(tiny_checkpoint, config_dir, monkeypatch, capsys):
    """The user's path: a saved profile whose measurement read slow, `hivekeeper profile`; the profile saved then
    holds the decode steps' new reading beside the calibration fitted against it."""
    from hivekeeper.core.cli.main import main
    from hivekeeper.core.machine.measure import SIZES_ENV
    from hivekeeper.core.machine.profiling import READ_AGAIN_WORDS

    monkeypatch.setenv(SIZES_ENV, "tiny")  # the reading's spans: a few megabytes
    detected = detect_hardware()
    profile = new_profile(detected)
    profile.measurements, profile.measured_at = slow_stream_measurements(), 1.7e9
    save_profile(profile)
    assert main(["profile", "--model", str(tiny_checkpoint), "--prompt-lens", "4,12", "--output-lens", "1,3",
                 "--batch-sizes", "1", "--repeats", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert any(READ_AGAIN_WORDS in note for note in doc["notes"])
    saved = load_machine_profile(detected)
    assert stream_rate(saved.measurements) > 100 * stream_rate(profile.measurements)
    assert saved.calibration is not None
    assert calibration_hardware(saved.calibration).cpu.memory_bandwidth == pytest.approx(  # (saved to 6 digits)
        saved.hardware(detected).cpu.memory_bandwidth, rel=1e-5)


def test_the_packed_kernels_are_read_again_with_the_measurement_counted_as_one_reading():
    """A measurement's packed figures (here read slow, 1000x) beside readings taken now: each becomes the median of
    its value and theirs, a cost never below 0; a figure the new readings lack is kept. Then read for real at small
    sizes: the packed kernels' rates move to this host's."""
    from dataclasses import replace

    from hivekeeper.core.machine.read_again import AFTER_GRID, fold_packed_readings, read_measurement_again
    from hivekeeper.core.machine.measure import TINY
    from hivekeeper.core.machine.measurement import PACKED_BLOCK_KEY, PACKED_KERNEL_KEY, Measurement

    def figure(key, value, unit):
        return Measurement(key, key, value, unit, 0.0, 1, 0.5, "fed in by the test", [value])

    q4 = f"{PACKED_KERNEL_KEY}q4_1"
    slow = [figure(q4, 1e7, "weights/s"), figure(PACKED_BLOCK_KEY, 1e-5, "s"), figure("ram_read", 1e7, "B/s")]
    later = [[figure(q4, rate, "weights/s"), figure(PACKED_BLOCK_KEY, cost, "s")]
             for rate, cost in ((3e10, -2e-5), (2e10, -1e-5), (4e10, -3e-5))]
    folded = {m.key: m for m in fold_packed_readings(slow, later)}
    assert folded[q4].value == 2.5e10  # the median of 1e7 and the three readings now: the middle two's mean
    assert folded[PACKED_BLOCK_KEY].value == 0.0 and folded["ram_read"] == slow[2]
    assert AFTER_GRID in folded[q4].detail and "1e+07" in folded[q4].detail

    small = replace(TINY, packed_hidden=256, packed_bytes=2 << 20)  # spans of a few megabytes, caches ignored
    slower = [replace(slow[0], value=1e5), *slow[1:]]  # (kernels at these sizes: ~1e9 weights/s on this host)
    read = {m.key: m for m in read_measurement_again(slower, small, readings=1)}
    assert set(read) == {m.key for m in slow}  # only what the measurement held
    assert read[q4].value > 100 * slower[0].value  # (1e5 + a real rate) / 2


def test_a_new_reading_is_adopted_only_where_the_grid_agrees_with_it_better(tiny_checkpoint):
    """profiling.second_look: the grid ran 1.5x faster than the measurement; a new reading with faster rates puts
    the passes nearer its pace (adopted); one with slower rates puts them further off (the host moved between the
    grid and the reading: kept as measured, and the note says so). (The tiny model's time is mostly fixed costs,
    so rates 20x move its pace only ~4%: the rule, not the amount, is tested.)"""
    from hivekeeper.core.machine.profiling import KEPT_WORDS, PaceCheck, second_look
    from hivekeeper.planner.model_catalog import load_model_spec

    spec, hardware = load_model_spec(str(tiny_checkpoint)), measured_hardware(1.0)
    base, policy = measured_efficiency(hardware), placement_policy("resident", False, "fp32")
    check = PaceCheck(spec, hardware, base, extra_passes=1)
    runs = [runs_at_pace(spec, hardware, base, policy, 1.5, i) for i in range(2)]
    assert check(runs[0], policy, 0) and not check(runs[1], policy, 1) and check.read_slow()
    nearer, farther = measured_hardware(1 / 20), measured_hardware(4)
    looked, fitted_on, _ = second_look(check, nearer, hardware, base, runs[0] + runs[1], {"resident": policy})
    assert fitted_on is nearer and looked.distance() < check.distance() and looked.earlier == check.paces
    kept, fitted_on, kept_base = second_look(check, farther, hardware, base, runs[0] + runs[1], {"resident": policy})
    assert kept is check and fitted_on is hardware and kept_base is base
    assert KEPT_WORDS in check.notes()[0] and all(p.prefill > 1.5 for p in check.declined)


def test_the_saved_line_names_the_factors_moved_or_says_none_moved(calibration):
    """`profile`'s last line: the calibrated factors it moved; where it moved none (the built-in packed model: its
    steps are priced from the measured kernels, which the fit keeps), that plans stay as measured, not that they
    "now use the calibrated factors"."""
    from hivekeeper.core.cli.profile import saved_words

    unmoved = dataclasses.replace(calibration, accelerator=calibration.uncalibrated_accelerator,
                                  policies={name: dataclasses.replace(policy, weight_format="q4_1")
                                            for name, policy in calibration.policies.items()})
    assert saved_words(unmoved) == ("the fit moved no factor (q4_1 steps are priced from the kernels `hivekeeper "
                                    "measure` timed, which it keeps): plans here stay as measured")
    moved = dataclasses.replace(calibration, accelerator=dataclasses.replace(
        calibration.uncalibrated_accelerator, layer_overhead_s=calibration.uncalibrated_accelerator.layer_overhead_s
        + 1e-4))
    assert saved_words(moved) == "plans on this machine now use the calibrated factors: layer_overhead_s"
