"""Child process for the Hardware page: this machine as the planner should see it, as one JSON line.

    python -m hivekeeper.gui.services.hardware_probe [--data-dir DIR]

Detection needs torch (and the GPU driver), and a saved machine profile (`hivekeeper measure` / `profile`, or the
Measure button) is read by code that imports torch too; both stay out of the GUI process. The line holds:
"detected" (hardware JSON of the plain detection), "hardware" (the same with the profile's measured numbers in
place), "efficiency" (the cost-model factors that go with them: {"accelerator": {...}, "host": {...}}, or null for
the defaults), "calibrated", "profile" (its path or null) and "measured_at".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def machine_doc(detected, profile) -> dict:
    """The line for a detected spec and its machine profile (None when the machine has none)."""
    from hivekeeper.planner.hardware_catalog import hardware_to_json

    from hivekeeper.core.machine.measurement import measured_load

    doc = {"event": "machine", "detected": hardware_to_json(detected), "hardware": hardware_to_json(detected),
           "efficiency": None, "calibrated": False, "profile": None, "measured_at": None}
    if profile is not None:
        hardware = profile.hardware(detected)
        efficiency = profile.efficiency(hardware)
        doc.update(hardware=hardware_to_json(hardware), calibrated=profile.calibrated,
                   profile=str(profile.path) if profile.path else None, measured_at=profile.measured_at,
                   measured_load=measured_load(profile.measurements),
                   efficiency={"accelerator": dataclasses.asdict(efficiency.accelerator),
                               "host": dataclasses.asdict(efficiency.host)})
    return doc


def probe(data_dir: str | None = None) -> dict:
    """What the app needs to know about this machine (see the module doc)."""
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.profiles import load_machine_profile

    detected = detect_hardware(data_dir)
    return machine_doc(detected, load_machine_profile(detected))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hardware_probe")
    parser.add_argument("--data-dir")
    args = parser.parse_args(argv)
    from hivekeeper.planner.errors import InputError

    try:
        doc = probe(args.data_dir)
    except InputError as exc:  # a broken profile file: say which, detection alone still works next time
        print(f"hardware_probe: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
