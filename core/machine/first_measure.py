"""The first plan for this machine measures it first.

Every plan "for this machine" (`plan --hardware auto`; `generate`, `chat` and `api` with `--plan auto`) reads the
machine's saved profile. Where there is none, or it was measured at a load above the CPU count and the machine is
quiet now, the plan measures it quickly first (`hivekeeper measure --quick`'s sizes, seconds), saves the profile and
says so, rather than predict from estimates: issue 14 item 12, where `generate --json` put 11 tokens/s predicted (the
estimated 10 GB/s RAM read) beside 41 measured because only `plan` measured. `--no-measure` plans with estimates.
One process measures the machine at a time (profile_files.measuring): a plan that finds another measuring waits, and
plans from the profile the other saved.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def this_machine(measure: bool = True, say: Callable[[str], None] = _stderr):
    """(HardwareSpec, MachineEfficiency or None) of this machine with its saved profile's measured numbers and
    factors, measured quickly first when why_measure says so (and `measure`); `say` gets the notes."""
    from hivekeeper.core.machine.profile_files import machine_fingerprint, measuring
    from hivekeeper.core.machine.profiles import detect_or_load_profile

    hardware, efficiency = detect_or_load_profile()
    why, note = why_measure(efficiency is not None, measure)
    if note or why:
        say(f"note: {note or why}")
    if not why:
        return hardware, efficiency
    with measuring(machine_fingerprint(hardware), waiting=lambda: say(f"note: {ANOTHER_MEASURES}")):
        hardware, efficiency = detect_or_load_profile()  # another process may have measured it while this one waited
        if why_measure(efficiency is not None, measure)[0]:
            say(measure_quickly(say, again=efficiency is not None))
            return detect_or_load_profile()
    say(f"note: {MEASURED_BY_ANOTHER}")
    return hardware, efficiency


ANOTHER_MEASURES = "another hivekeeper process is measuring this machine: waiting for it (two at once slow each other)"
MEASURED_BY_ANOTHER = "another hivekeeper process measured this machine meanwhile: planning from its profile"


def why_measure(profiled: bool, measure: bool) -> tuple[str, str]:
    """(why a plan for this machine measures it quickly before planning, or "", a note when it plans with a busy
    profile). It measures when there is no profile yet (the first plan), or when the profile was measured busy (at a
    load above the CPU count its figures can plan the machine several times too slow) and the machine is quiet now
    (measurement.quiet_load).
    A busy profile while still busy, or with --no-measure, or holding a calibration (measuring would drop it), is
    used, and the note says so."""
    from hivekeeper.core.machine.measurement import QUICK_TAKES, load_now, measured_load, quiet_load
    from hivekeeper.core.machine.profiles import load_machine_profile

    if not profiled:
        return (f"the first plan for this machine: measuring it quickly first (once, {QUICK_TAKES}; `--no-measure` "
                "plans with estimates)") if measure else "", ""
    profile, cpus = load_machine_profile(), os.cpu_count() or 1
    load = measured_load(profile.measurements) if profile is not None else 0.0
    if load <= cpus:
        return "", ""
    busy, now = f"this machine's profile was measured busy (at load {load:.1f} on {cpus} CPUs)", load_now()
    if profile.calibration is not None:  # measuring again would drop it (session 24: a newcomer's, silently)
        return "", (f"{busy}: its figures can be several times too slow; it holds the calibration `hivekeeper "
                    "profile` fitted to them, which measuring again would drop, so it is not measured again by "
                    "itself: run `hivekeeper measure`, then `hivekeeper profile`, at a quiet moment")
    if measure and now <= quiet_load(cpus):
        return (f"{busy}; the load is {now:.1f} now: measuring it again quickly ({QUICK_TAKES}; `--no-measure` "
                "plans with the busy profile)"), ""
    return "", (f"{busy}: its figures can be several times too slow; the first plan at a load of at most "
                f"{quiet_load(cpus):g} measures it again (the load is {now:.1f} now)")


def measure_quickly(say: Callable[[str], None] = _stderr, again: bool = False) -> str:
    """`hivekeeper measure --quick` without its table: this machine's RAM bandwidth, matmuls, decode weight streaming
    and (when the data folder exists) disk, saved as its profile, each step said as it starts; returns the line that
    says so. HIVEKEEPER_MEASURE_SIZES names other sizes (tests: "tiny")."""
    from hivekeeper.core.machine.cpu_dtype import forget
    from hivekeeper.core.machine.detect import default_data_dir, detect_hardware
    from hivekeeper.core.machine.measure import run_benchmarks, sizes_from_environment
    from hivekeeper.core.machine.measurement import busy_words
    from hivekeeper.core.machine.profiles import new_profile, save_profile

    detected = detect_hardware()
    started = time.time()
    folder = default_data_dir()
    measurements = run_benchmarks(sizes_from_environment("quick"), disk_folder=folder if folder.is_dir() else None,
                                  progress=lambda fraction, label: say(f"  {100 * fraction:3.0f}%  {label}"))
    profile = new_profile(detected)
    profile.measurements, profile.measured_at = measurements, started
    path = save_profile(profile)
    forget()  # the 16-bit decision reads the new measurements
    busy = busy_words(measurements, os.cpu_count() or 1)
    # `again`: a busy profile measured again (a newcomer, session 23, read "the first plan" of a measured machine)
    what = "measured this machine again quickly" if again else "the first plan for this machine: measured it quickly"
    return (f"note: {what} ({time.time() - started:.1f} s, like "
            f"`hivekeeper measure --quick`{f', {busy}' if busy else ''}), saved to {path}; `hivekeeper measure` "
            f"measures it fully (--no-measure plans with estimates)")
