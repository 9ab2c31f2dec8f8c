"""`hivekeeper detect` before and after `hivekeeper measure`, in a config folder of its own: before any profile it
shows the estimates and says so; once the real `measure` command (at tiny sizes: the wiring is what is tested) has
saved this machine's profile, `detect` shows the measured numbers `plan --hardware auto` plans with, and says from
which profile file and when they were measured. `measure` and the text of `detect` are real child processes; the
variations run the same `main()` in this process (the `cli` fixture)."""

from __future__ import annotations

import json
import os
import sys
import time

from hivekeeper.core.machine.measurement import RAISED_RAM_WORDS, SIZES_ENV
from hivekeeper.planner.hardware_catalog import hardware_to_json

from ...child_output import run


def hivekeeper(*args: str):
    return run([sys.executable, "-m", "hivekeeper.core.cli.main", *args], timeout=300,
               env={**os.environ, SIZES_ENV: "tiny"})


def ram_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("RAM: "))


def test_detect_shows_estimates_then_the_measured_profile(tmp_path, cli, monkeypatch):
    from hivekeeper.core.machine.profiles import detect_or_load_profile, load_profile

    config = tmp_path / "config"
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(config))
    before = cli("detect")
    assert before.returncode == 0, before.stderr
    assert "\nnumbers: estimates, marked [estimated]" in before.stdout and "[measured]" not in before.stdout
    assert ram_line(before.stdout).endswith(" [estimated]")

    measured = hivekeeper("measure", "--quick", "--no-disk", "--repeats", "1")
    assert measured.returncode == 0, measured.stderr
    [path] = (config / "profiles").glob("*.json")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(load_profile(path).measured_at))

    after = hivekeeper("detect")
    assert after.returncode == 0, after.stderr
    assert (f"\nnumbers: measured {when} on this machine (by `hivekeeper measure` or a first plan's quick "
            f"measurement), from the profile {path}") in after.stdout
    hardware, _ = detect_or_load_profile()  # the numbers `plan --hardware auto` plans with
    line = ram_line(after.stdout)
    assert f", {hardware.cpu.memory_bandwidth / 1e9:.0f} GB/s [measured]" in line
    # the decode steps' rate where it is above the plain read (whichever this machine measured), and said so
    raised = RAISED_RAM_WORDS in hardware.cpu.sources["memory_bandwidth"]
    assert line.endswith("[measured]") != raised and ("the rate decode steps read it at" in line) == raised
    assert f"{hardware.cpu.flops['fp32'] / 1e12:.2f} TFLOP/s fp32 [measured]" in after.stdout
    as_json = cli("detect", "--json")  # the hardware document too (and so `detect --out`)
    assert as_json.returncode == 0, as_json.stderr
    cpu, expected = json.loads(as_json.stdout)["cpu"], hardware_to_json(hardware)["cpu"]
    for field in ("ram_bandwidth_gbps", "flops_tflops", "decode_streaming", "sources"):  # not in_use_gb: it moves
        assert cpu[field] == expected[field], field


def test_the_ram_line_says_when_it_is_the_decode_steps_rate(tmp_path, cli, monkeypatch):
    """A newcomer (session 22) read "RAM: ... 22 GB/s [measured]" beside `measure`'s RAM read row of 8.5 GB/s: the
    planner takes the rate whole decode steps read RAM at where it is higher, and `detect` now says which it shows."""
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.measurement import BLOCK_OVERHEAD_KEY, WEIGHT_STREAM_KEY, Measurement
    from hivekeeper.core.machine.profiles import new_profile, save_profile

    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path))

    def ram_shown(stream: float) -> str:
        profile = new_profile(detect_hardware())
        profile.measurements = [Measurement(key, key, value, unit, 0.0, 1, 0.5, "fixed by this test", [value])
                                for key, value, unit in (("ram_read", 8.5e9, "B/s"), (WEIGHT_STREAM_KEY, stream, "B/s"),
                                                         (BLOCK_OVERHEAD_KEY, 1e-4, "s"))]
        profile.measured_at = 1.7e9
        save_profile(profile)
        done = cli("detect")
        assert done.returncode == 0, done.stderr
        return ram_line(done.stdout)

    assert ram_shown(22e9).endswith(" 22 GB/s [measured] (the rate decode steps read it at, which plans use; "
                                    "`hivekeeper measure` lists the plain read beside it)")
    assert ram_shown(5e9).endswith(" 8 GB/s [measured]")  # the plain read, higher: shown as it is
