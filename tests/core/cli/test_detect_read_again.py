"""`hivekeeper detect` on a saved profile (a config folder of its own) that `hivekeeper profile` calibrated: where
profile read the measurement's decode steps and prefill passes again (its grid ran faster than the measurement
predicts, read_again.SecondLook) the text says so and when, beside the "busy" label the measurement's figures earn,
which it gave alone before; and a calibration whose saved model holds a bad value (`"num_layers": "a"` was taken) is
one line naming the file and the field. Through `main()` (the `cli` fixture)."""

from __future__ import annotations

import json
import os
import time

import pytest

from hivekeeper.core.machine.detect import detect_hardware
from hivekeeper.core.machine.measurement import BLOCK_OVERHEAD_KEY, WEIGHT_STREAM_KEY, Measurement
from hivekeeper.core.machine.profiles import load_profile, save_profile
from hivekeeper.planner.calibration import ProfilePoint, build_calibration, predict_points
from hivekeeper.planner.costmodel import Placement, Policy
from hivekeeper.planner.hardware_catalog import hardware_to_json
from hivekeeper.planner.model_catalog import get_model

from .test_cli_defects import one_line

CPUS = os.cpu_count() or 1
PROFILED_AT = 1.75e9  # when `hivekeeper profile` ran (the calibration's time), after the measurement (1.7e9)
RESIDENT = Policy("fp32", weights=Placement(0.0, 1.0, 0.0), kv_cache=Placement(0.0, 1.0, 0.0),
                  activations=Placement(0.0, 1.0, 0.0), prefetch_depth=0)


def calibration_of(profile):
    """A calibration of TinyLlama on this machine's profile, fitted to the cost model's own times, saved at
    PROFILED_AT."""
    detected = detect_hardware()
    hardware = profile.hardware(detected)
    model = get_model("TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    shells = [ProfilePoint(p, o, 1, prefill_s=1.0, step_s=1.0 if o > 1 else None, runtime_s=1.0)
              for p in (8, 64) for o in (1, 8)]
    prefill, step = predict_points(model, hardware, shells, {"resident": RESIDENT}, profile.efficiency(hardware))
    points = [ProfilePoint(pt.prompt_len, pt.output_len, 1, prefill_s=float(pre),
                           step_s=float(st) if pt.step_s else None, runtime_s=float(pre + (pt.output_len - 1) * st))
              for pt, pre, st in zip(shells, prefill, step)]
    return build_calibration(model, "/models/tinyllama", hardware, hardware_to_json(hardware), profile.fingerprint,
                             points, {"resident": RESIDENT}, created=PROFILED_AT, profile_seconds=1.0)


@pytest.fixture
def busy_profile(tmp_path, monkeypatch, measured_machine):
    """save(read_again) -> the path of this machine's profile (the suite's figures and a decode step's, measured at a
    load above the CPU count), calibrated at PROFILED_AT; with read_again, its decode figures as `profile` saves
    them after reading them again (read_again.folded_reading)."""
    from hivekeeper.core.machine.read_again import folded_reading

    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path))
    path = measured_machine(tmp_path)
    suite = path.read_text()

    def save(read_again: bool):
        path.write_text(suite)
        profile = load_profile(path)
        profile.measurements += [Measurement(key, key, value, unit, 0.0, 1, 0.0, "fixed by this test", [value])
                                 for key, value, unit in ((WEIGHT_STREAM_KEY, 9e9, "B/s"),
                                                          (BLOCK_OVERHEAD_KEY, 1e-4, "s"))]
        for measurement in profile.measurements:
            measurement.loadavg = CPUS + 2.5
        if read_again:
            profile.measurements = [folded_reading(m, [1.2 * m.value] * 3) if m.key in (WEIGHT_STREAM_KEY,
                                                                                         BLOCK_OVERHEAD_KEY) else m
                                    for m in profile.measurements]
        profile.calibration = calibration_of(profile)
        return save_profile(profile)

    return save


def numbers_line(cli) -> str:
    done = cli("detect")
    assert done.returncode == 0, done.stderr
    return next(line for line in done.stdout.splitlines() if line.startswith("numbers: "))


def test_detect_says_the_decode_steps_were_read_again_and_when(busy_profile, cli):
    busy = f"(at load {CPUS + 2.5:.1f} on {CPUS} CPUs: busy, measure again when quiet)"
    busy_profile(read_again=False)
    plain = numbers_line(cli)
    assert busy in plain and "read again" not in plain
    busy_profile(read_again=True)
    line = numbers_line(cli)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(PROFILED_AT))
    assert busy in line, line  # the measurement's figures still earn it ...
    assert (f"{busy}; its decode steps and prefill passes (2 figures) were read again {when} by `hivekeeper "
            f"profile`, whose grid ran faster than the measurement predicts, and plans use that reading; those marked "
            f"[measured] replace the estimates") in line, line  # ... and the figures read again are said to be


@pytest.mark.parametrize("field, value, problem", [
    ("num_layers", "a", "must be an integer from 1 to 100000000, got 'a'"),
    ("tie_word_embeddings", "no", "must be true or false, got 'no'"),
    ("embed_proj_dim", -1, "must be an integer from 0 to 100000000, got -1"),
])
def test_a_calibration_whose_model_holds_a_bad_value_is_one_line_naming_the_field(busy_profile, cli, field, value,
                                                                                   problem):
    path = busy_profile(read_again=False)
    doc = json.loads(path.read_text())
    doc["calibration"]["model"][field] = value
    path.write_text(json.dumps(doc))
    done = cli("detect")
    assert done.returncode == 2 and done.stdout == ""
    line = one_line(done)
    assert f"{path}: field 'calibration.model.{field}' {problem}; remove the field 'calibration'" in line, line
    assert line.endswith("`hivekeeper profile` again"), line
