"""Issue 14 item 12 (first half) through the real `hivekeeper plan --hardware auto`: the first plan for a machine
that was never measured measures it quickly (as `measure --quick` does), says so and saves its profile; later plans
use the profile without measuring again; --no-measure plans with the estimates. The first plan is a real child
process; the others run the same `main()` in this process (the `cli` fixture), with the same config folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from hivekeeper.core.machine.measurement import QUICK_TAKES, SIZES_ENV

from ...child_output import ChildOutput, run

MODEL = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


def plan(config_dir, *args: str):
    """A real child's plan; its measurement at sizes of a few megabytes (what is tested here is the wiring)."""
    env = {**os.environ, "HIVEKEEPER_CONFIG_DIR": str(config_dir), SIZES_ENV: "tiny"}
    return run([sys.executable, "-m", "hivekeeper.core.cli.main", "plan", "--model", MODEL, "--hardware", "auto",
                "--json", *args], timeout=300, env=env)


def plan_here(cli, monkeypatch, config_dir, *args: str):
    """plan() through `main()` in this process."""
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(config_dir))
    return cli("plan", "--model", MODEL, "--hardware", "auto", "--json", *args)


def test_the_first_plan_measures_this_machine_once(tmp_path, cli, monkeypatch):
    first = plan(tmp_path)
    assert first.returncode == 0, first.stderr
    assert "note: the first plan for this machine: measured it quickly" in first.stderr
    # said before the measurement too, so that a terminal's wait is explained while it lasts
    assert first.stderr.index("measuring it quickly first") < first.stderr.index("measured it quickly (")
    # how long it takes (it said "a few seconds" and took 32-47 s busy), then each step as it starts
    during = first.stderr[first.stderr.index("measuring it quickly first"):first.stderr.index("measured it quickly (")]
    assert QUICK_TAKES in during and "0%  RAM bandwidth" in during and "%  CPU decode steps" in during
    profiles = list((tmp_path / "profiles").glob("*.json"))
    assert len(profiles) == 1 and str(profiles[0]) in first.stderr
    saved = json.loads(profiles[0].read_text())
    assert {m["key"] for m in saved["measurements"]} >= {"ram_read"}
    assert json.loads(first.stdout)["efficiency"].startswith("measured")

    again = plan_here(cli, monkeypatch, tmp_path)
    assert again.returncode == 0 and "measured it quickly" not in again.stderr
    assert json.loads(again.stdout)["efficiency"] == json.loads(first.stdout)["efficiency"]
    assert list((tmp_path / "profiles").glob("*.json")) == profiles


def test_no_measure_plans_with_estimates(tmp_path, cli, monkeypatch):
    result = plan_here(cli, monkeypatch, tmp_path, "--no-measure")
    assert result.returncode == 0, result.stderr
    assert "measured" not in result.stderr and not (tmp_path / "profiles").exists()
    assert json.loads(result.stdout)["efficiency"].startswith("default")


def test_a_plan_for_this_machine_says_so(tmp_path, cli, monkeypatch):
    """The readable plan for --hardware auto named the machine 'detected' ("... on detected (goal: chat)")."""
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path))
    done = cli("plan", "--hardware", "auto", "--no-measure")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith(" on this machine (goal: chat)"), done.stdout


def test_a_plan_waits_for_another_process_measuring_and_plans_from_what_it_saved(tmp_path, measured_machine,
                                                                                 monkeypatch):
    """Two first measurements at once (the app's, and an API child's first plan) would slow each other's figures: a
    plan that finds this machine being measured waits, then plans from the profile the other process saved."""
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.first_measure import ANOTHER_MEASURES, MEASURED_BY_ANOTHER
    from hivekeeper.core.machine.profile_files import machine_fingerprint, measuring

    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path))
    env = {**os.environ, SIZES_ENV: "tiny"}
    command = [sys.executable, "-m", "hivekeeper.core.cli.main", "plan", "--model", MODEL, "--hardware", "auto", "--json"]
    with measuring(machine_fingerprint(detect_hardware())) as held:  # this test process is "the other process"
        assert held
        child = ChildOutput(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
        try:
            child.wait_for(re.escape(ANOTHER_MEASURES), stream="stderr", timeout=120)
            assert child.proc.poll() is None  # still waiting
            saved = measured_machine(tmp_path)  # what the other process measured and saved
        except BaseException:
            child.close()
            raise
    try:
        assert child.wait(timeout=120) == 0, child.report()
    finally:
        child.close()
    assert MEASURED_BY_ANOTHER in child.stderr and "measured it quickly" not in child.stderr, child.stderr
    assert json.loads(child.stdout)["efficiency"].startswith("measured")
    assert sorted(p.name for p in saved.parent.glob("*.json")) == [saved.name]
