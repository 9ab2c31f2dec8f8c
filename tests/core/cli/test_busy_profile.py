"""A machine profile measured busy (a load above the CPU count while measuring: other programs held the cores, and
its figures can plan the machine several times too slow) is not silently planned with: through the real
`hivekeeper plan --hardware auto`, while the machine is still busy the plan uses it and says so; once the load is at
most half the CPU count (others' alone: the measurement's own threads add the rest) the next plan measures again
(why_measure; HIVEKEEPER_LOAD_AVERAGE pins the load, as HIVEKEEPER_CPU_FLAGS pins the CPU). A quiet profile is used
without a word."""

from __future__ import annotations

import json
import os

import pytest

from hivekeeper.core.machine.first_measure import why_measure
from hivekeeper.core.machine.measurement import LOAD_ENV
from hivekeeper.core.machine.profiles import load_profile, save_profile

CPUS = os.cpu_count() or 1


@pytest.fixture
def profile_at(tmp_path, monkeypatch, suite_machine_profile):
    """profile_at(load) -> this machine's profile (the suite's fixed figures) as if measured at `load`, in a config
    folder of its own."""
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path))

    def write(load: float):
        profile = load_profile(suite_machine_profile)
        for measurement in profile.measurements:
            measurement.loadavg = load
        return save_profile(profile)

    return write


def test_a_busy_profile_is_used_with_a_note_while_busy(profile_at, cli, monkeypatch):
    path = profile_at(CPUS + 2.5)
    before = path.read_text()
    # still busy: others hold every core (session 23: at "at most the CPU count" this measured again, the
    # measurement's own threads made it busy again, and every plan measured)
    monkeypatch.setenv(LOAD_ENV, str(CPUS))
    done = cli("plan", "--model", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--hardware", "auto", "--json")
    assert done.returncode == 0, done.stderr
    assert (f"note: this machine's profile was measured busy (at load {CPUS + 2.5:.1f} on {CPUS} CPUs): its figures "
            f"can be several times too slow; the first plan at a load of at most {CPUS / 2:g} measures it again") \
        in done.stderr
    assert "measuring" not in done.stderr and path.read_text() == before  # planned with it, not measured
    assert json.loads(done.stdout)["efficiency"].startswith("measured")


def test_a_busy_profile_is_measured_again_once_quiet(profile_at, monkeypatch):
    profile_at(CPUS + 2.5)
    monkeypatch.setenv(LOAD_ENV, str(CPUS / 2))  # others hold half the cores at most
    why, note = why_measure(profiled=True, measure=True)
    assert note == "" and why.startswith(f"this machine's profile was measured busy (at load {CPUS + 2.5:.1f} on "
                                         f"{CPUS} CPUs); the load is {CPUS / 2:.1f} now: measuring it again quickly")
    why, note = why_measure(profiled=True, measure=False)  # --no-measure: used, and said
    assert why == "" and "measured busy" in note


def test_a_quiet_profile_is_used_without_a_word(profile_at, monkeypatch):
    profile_at(CPUS - 0.5)
    monkeypatch.setenv(LOAD_ENV, "0.4")
    assert why_measure(profiled=True, measure=True) == ("", "")


def test_a_busy_profile_measured_again_is_said_so_not_a_first_plan(profile_at, cli, monkeypatch):
    """Session 23: `api` re-measuring a busy profile said "the first plan for this machine: measured it quickly"."""
    from hivekeeper.core.machine.measurement import SIZES_ENV

    path = profile_at(CPUS + 2.5)
    monkeypatch.setenv(LOAD_ENV, "0")
    monkeypatch.setenv(SIZES_ENV, "tiny")  # the wiring is tested, not the figures
    done = cli("plan", "--model", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--hardware", "auto", "--json")
    assert done.returncode == 0, done.stderr
    assert "note: measured this machine again quickly (" in done.stderr
    assert "the first plan for this machine" not in done.stderr
    assert load_profile(path).measured_at != 1.7e9  # measured now


def test_a_busy_profile_holding_a_calibration_is_not_measured_again_by_itself(profile_at, monkeypatch, cli,
                                                                             tiny_checkpoint):
    """A newcomer measured beside a busy core, then ran `hivekeeper profile` (which read the measurement again and
    calibrated); the next quiet `plan` measured the machine again quickly and the calibration was gone without a
    word (a new measurement drops it). A calibrated profile is planned with as it is, and the note says what to run."""
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.profiling import ProfileGrid, profile_model
    from hivekeeper.planner.calibration import measured_efficiency

    path = profile_at(CPUS + 2.5)
    profile = load_profile(path)
    hardware = profile.hardware(detect_hardware())
    profile.calibration = profile_model(tiny_checkpoint, ProfileGrid(prompt_lens=(4, 8), output_lens=(1, 2),
                                                                     batch_sizes=(1,), repeats=1),
                                        hardware, profile.fingerprint, base=measured_efficiency(hardware), device="cpu")
    save_profile(profile)
    before = path.read_text()
    monkeypatch.setenv(LOAD_ENV, str(CPUS / 2))  # quiet: a profile without a calibration would be measured again
    done = cli("plan", "--model", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--hardware", "auto", "--json")
    assert done.returncode == 0, done.stderr
    assert "it holds the calibration `hivekeeper profile` fitted to them" in done.stderr
    assert "run `hivekeeper measure`, then `hivekeeper profile`, at a quiet moment" in done.stderr
    assert "measuring it again" not in done.stderr and path.read_text() == before  # planned with it, not measured
    assert json.loads(done.stdout)["efficiency"].startswith("calibrated")
