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
