"""`hivekeeper detect`: show this machine's hardware as plans for it see it, or save it as a hardware JSON file.

Once `hivekeeper measure` has saved a profile of this machine, its measured numbers replace the estimates (as they do
for `plan --hardware auto`: profiles.MachineProfile.hardware), and the text says so, with the profile's file and
when it was measured (and when `hivekeeper profile` read its decode steps and prefill passes again, if it did);
before, the numbers are the detected ones and estimates, marked as such. The text also says
which CPU flags decisions use (pinned or reported), whether the native decode kernels run, and what 16-bit plans
compute in on this CPU and why (core/machine/cpu_dtype.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hivekeeper.planner.errors import InputError

from hivekeeper.core.atomic_file import in_existing_folder, write_json_atomic
from hivekeeper.core.machine.measurement import RAISED_RAM_WORDS, busy_words, figures_read_again
from hivekeeper.planner.hardware import HardwareSpec
from hivekeeper.planner.hardware_catalog import hardware_to_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the spec as a hardware JSON document")
    parser.add_argument("--out", metavar="FILE", help="write the spec to FILE (hardware JSON, usable as --hardware FILE)")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="folder whose filesystem holds models (default: HIVEKEEPER_DATA_DIR or the user data folder)")


def write_json_atomically(path: Path, doc: dict) -> None:
    """Write the spec for --out; the folder must exist (a typo in it should not create folders)."""
    write_json_atomic(in_existing_folder("--out", path), doc, indent=2)


def _source_tag(sources: dict[str, str], key: str) -> str:
    """" [estimated]", " [measured]", " [default]"...: the first word of the number's source (its date, for a
    measured one, is on the "numbers:" line); "" for a number read from the system."""
    label = sources.get(key, "").split(":", 1)[0].split(" ", 1)[0]
    return f" [{label}]" if label and label != "detected" else ""


def measured_or_estimated(data_dir: str | None) -> tuple[HardwareSpec, str]:
    """(this machine as plans for it see it, the line saying where its numbers come from): detected, with its saved
    profile's measured numbers in place of the estimates where `hivekeeper measure` ran here."""
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.profile_files import profiles_dir
    from hivekeeper.core.machine.profiles import load_machine_profile

    detected = detect_hardware(data_dir)
    profile = load_machine_profile(detected)
    if profile is None or not profile.measurements:
        return detected, (f"numbers: estimates, marked [estimated] or [default] (no measured profile of this "
                          f"machine in {profiles_dir()}: `hivekeeper measure` measures it and saves one)")
    when = _moment(profile.measured_at) if profile.measured_at else "?"
    busy = busy_words(profile.measurements, detected.cpu.cores or 1)
    return profile.hardware(detected), (f"numbers: measured {when} on this machine (by `hivekeeper measure` or a "
                                        f"first plan's quick measurement), from the profile {profile.path}"
                                        f"{f' ({busy})' if busy else ''}{read_again_words(profile)}; those marked "
                                        "[measured] replace the estimates")


def _moment(unix_time: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(unix_time))


def read_again_words(profile) -> str:
    """Where `hivekeeper profile` read the measurement's decode steps and prefill passes again and kept the new
    reading (read_again.SecondLook: its grid ran faster than the measurement predicts), words saying so and when
    (the saved calibration's time, that profile run's); "" otherwise. Without them a "busy" label, which the
    measurement's other figures earn, read as the whole story of figures read again at a quieter moment."""
    again = figures_read_again(profile.measurements)
    if not again:
        return ""
    when = f" {_moment(profile.calibration.created)}" if profile.calibration is not None else ""
    return (f"; its decode steps and prefill passes ({len(again)} figures) were read again{when} by `hivekeeper "
            f"profile`, whose grid ran faster than the measurement predicts, and plans use that reading")


def ram_words(sources: dict) -> str:
    """Where the RAM bandwidth shown is the rate measured decode steps read RAM at, above the plain read benchmark
    (profiles.apply_measurements): words that say so ("" otherwise). A newcomer (session 22) read 22 GB/s here
    beside `measure`'s "RAM read bandwidth" row of 8.5 GB/s."""
    if RAISED_RAM_WORDS not in sources.get("memory_bandwidth", ""):
        return ""
    return " (the rate decode steps read it at, which plans use; `hivekeeper measure` lists the plain read beside it)"


def describe(spec: HardwareSpec, origin: str = "") -> str:
    """A few human-readable lines; numbers not read from the system carry their source in brackets, and `origin`
    (measured_or_estimated's line), when given, follows the machine's name."""
    lines = [f"machine: {spec.description or spec.id}", *([origin] if origin else [])]
    for index, gpu in enumerate(spec.gpus):
        best = max(gpu.flops.get(dtype, 0.0) for dtype in ("fp16", "bf16", "fp32"))
        link = "unified memory" if gpu.unified_memory else f"host link {gpu.host_link_bandwidth / 1e9:.1f} GB/s"
        lines.append(f"GPU {index}: {gpu.name}, {gpu.memory_bytes / 1e9:.1f} GB, "
                     f"{gpu.memory_bandwidth / 1e9:.0f} GB/s{_source_tag(gpu.sources, 'memory_bandwidth')}, "
                     f"{best / 1e12:.1f} TFLOP/s fp16{_source_tag(gpu.sources, 'flops')}, {link}, "
                     f"{gpu.power_watts:.0f} W")
    cpu = spec.cpu
    lines.append(f"CPU: {cpu.name}, {cpu.cores} cores, {cpu.flops['fp32'] / 1e12:.2f} TFLOP/s fp32"
                 f"{_source_tag(cpu.sources, 'flops')}")
    lines.append(f"RAM: {cpu.memory_bytes / 1e9:.1f} GB, {cpu.memory_bandwidth / 1e9:.0f} GB/s"
                 f"{_source_tag(cpu.sources, 'memory_bandwidth')}{ram_words(cpu.sources)}")
    disk = spec.disk
    lines.append(f"disk: {disk.capacity_bytes / 1e9:.0f} GB ({disk.sources.get('capacity_bytes', '')}), "
                 f"read {disk.read_bandwidth / 1e9:.2f} GB/s, write {disk.write_bandwidth / 1e9:.2f} GB/s"
                 f"{_source_tag(disk.sources, 'read_bandwidth')}")
    net = spec.network
    lines.append(f"network: {net.upload_bps / 1e6:.0f} Mbit/s up, {net.download_bps / 1e6:.0f} Mbit/s down, "
                 f"rtt {net.rtt_s * 1e3:.0f} ms{_source_tag(net.sources, 'rtt_s')}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.data_dir and Path(args.data_dir).expanduser().exists() and not Path(args.data_dir).expanduser().is_dir():
        raise InputError(f"--data-dir {args.data_dir}: not a folder (the folder whose filesystem will hold models; "
                         "one not made yet is read at its nearest existing parent)")
    spec, origin = measured_or_estimated(args.data_dir)
    doc = hardware_to_json(spec)
    if args.out:
        write_json_atomically(Path(args.out), doc)
        print(f"wrote {args.out}; {origin}", file=sys.stderr)
    if args.json:
        print(json.dumps(doc, indent=2))
    elif not args.out:
        from hivekeeper.core.machine import cpu_features
        from hivekeeper.core.machine.cpu_dtype_rule import choice_for
        from hivekeeper.core.runtime.kernels import native_kernels

        print(describe(spec, origin))
        print(f"CPU flags: {cpu_features.describe()}")
        print(f"CPU decode kernels: {native_kernels.status()}")  # built here on first use: it may take a second
        print(choice_for(spec).line())
    return 0
