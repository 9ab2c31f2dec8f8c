"""Issue 14 item 12 through the real `hivekeeper generate --plan auto`: a run is a plan for this machine too, so on a
machine never measured it measures it quickly first (as `plan --hardware auto` does), says so and saves the profile,
and its prediction comes from that profile (before, generate planned from the detected estimates: 11 tokens/s
predicted beside 41 measured). The next run reuses the profile; --no-measure plans with estimates and saves nothing.
The first run is a real child process; the others run the same `main()` in this process (the `cli` fixture)."""

from __future__ import annotations

import json
import os
import sys

from hivekeeper.core.machine.measurement import QUICK_TAKES, SIZES_ENV

from ...child_output import run

GENERATE = ("generate", "--prompt", "hello", "--max-new-tokens", "2", "--ignore-eos", "--json")


def predicted(stdout: str) -> dict:
    return json.loads(stdout)["plan"]["predicted"]


def test_the_first_run_measures_this_machine_and_predicts_from_it(tiny_checkpoint, tmp_path, cli, monkeypatch):
    # the sizes of a few megabytes (the switch the app's tests use too): what is tested here is the wiring
    env = {**os.environ, "HIVEKEEPER_CONFIG_DIR": str(tmp_path), SIZES_ENV: "tiny"}
    first = run([sys.executable, "-m", "hivekeeper.core.cli.main", *GENERATE, "--model", str(tiny_checkpoint)],
                timeout=300, env=env)
    assert first.returncode == 0, first.stderr
    # said before it starts (the wait explained while it lasts), each step as it starts, then where it was saved
    assert first.stderr.index("measuring it quickly first") < first.stderr.index("measured it quickly (")
    assert QUICK_TAKES in first.stderr and "0%  RAM bandwidth" in first.stderr
    profiles = list((tmp_path / "profiles").glob("*.json"))
    assert len(profiles) == 1 and str(profiles[0]) in first.stderr

    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path))
    again = cli(*GENERATE, "--model", str(tiny_checkpoint))
    assert again.returncode == 0 and "measured it quickly" not in again.stderr, again.stderr
    # the first run planned from the profile it had just measured: the same prediction as a run that reads it
    assert predicted(again.stdout) == predicted(first.stdout)
    assert list((tmp_path / "profiles").glob("*.json")) == profiles


def test_no_measure_runs_with_estimates_and_saves_nothing(tiny_checkpoint, tmp_path, cli, monkeypatch):
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path))
    done = cli(*GENERATE, "--model", str(tiny_checkpoint), "--no-measure")
    assert done.returncode == 0, done.stderr
    assert "measur" not in done.stderr and not (tmp_path / "profiles").exists()
    assert predicted(done.stdout)["decode_tokens_per_s"] > 0
