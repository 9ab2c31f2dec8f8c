"""Where machine profiles live and which file is a machine's: the profile folder, the hardware fingerprint, reading
a profile file's JSON and measurements, and the lock that keeps two processes from measuring the machine at once.

Kept apart from profiles.py, which detects this machine when asked, so that detection itself can read the saved
measurement that decides what 16-bit CPU plans compute in (core/machine/cpu_dtype_rule.py) without an import cycle.
Torch-free, as profiles.py is.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # Windows: no advisory file locks here, measurements are not serialized
    fcntl = None

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import HardwareSpec
from hivekeeper.planner.hardware_catalog import GIB

from hivekeeper.core.machine.measurement import Measurement, value_problem

PROFILE_VERSION = 1
# what a profile file that cannot be read advises (not "or": `measure` and `profile` read the saved profile too, and
# stop at the same error while the file is there)
MEASURE_AGAIN = "delete the file and run `hivekeeper measure` again"


def config_dir() -> Path:
    """HIVEKEEPER_CONFIG_DIR, else the platform's user config folder (e.g. ~/.config/hivekeeper)."""
    explicit = os.environ.get("HIVEKEEPER_CONFIG_DIR")
    if explicit:
        return Path(explicit).expanduser()
    import platformdirs

    return Path(platformdirs.user_config_dir("hivekeeper", appauthor=False))


def profiles_dir() -> Path:
    return config_dir() / "profiles"


def fingerprint_fields(spec: HardwareSpec) -> dict:
    """What identifies a machine's hardware: CPU name and cores, RAM in whole GiB, GPU names."""
    return {"cpu": spec.cpu.name, "cores": spec.cpu.cores or 1, "ram_gib": round(spec.cpu.memory_bytes / GIB),
            "gpus": [gpu.name for gpu in spec.gpus]}


def machine_fingerprint(spec: HardwareSpec) -> str:
    """16 hex digits of SHA-256 over the fingerprint fields."""
    text = json.dumps(fingerprint_fields(spec), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def profile_path(fingerprint: str) -> Path:
    return profiles_dir() / f"{fingerprint}.json"


def read_profile_json(path: Path):
    """A profile file's JSON; errors name the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot read machine profile ({exc.strerror or exc})") from None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc}); {MEASURE_AGAIN}") from None


def check_profile_doc(doc, where: str) -> None:
    """A profile's JSON must be an object of this PROFILE_VERSION."""
    if not isinstance(doc, dict):
        raise InputError(f"{where}: a machine profile must be a JSON object")
    if doc.get("version") != PROFILE_VERSION:
        raise InputError(f"{where}: field 'version' is {doc.get('version')!r}, expected {PROFILE_VERSION}; "
                         f"{MEASURE_AGAIN}")


def measurements_from(doc: dict, where: str) -> list[Measurement]:
    """The 'measurements' of a profile's JSON object, each entry checked (measurement_from): a value no measurement
    gives is one error naming the file and the field, never read as is."""
    entries = doc.get("measurements") or []
    if not isinstance(entries, list):
        raise _bad_field(where, "measurements", "must be a list")
    return [measurement_from(entry, f"measurements[{i}]", where) for i, entry in enumerate(entries)]


_NUMBERS = ("spread", "repeats", "loadavg")  # optional numeric fields of a saved measurement


def _bad_field(where: str, name: str, problem: str) -> InputError:
    return InputError(f"{where}: field {name!r} {problem}; {MEASURE_AGAIN}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def measurement_from(entry, name: str, where: str) -> Measurement:
    """One saved measurement (`name`: its field, e.g. "measurements[0]"), its fields checked: key and unit strings,
    a value a measurement in that unit gives (measurement.value_problem), finite numbers elsewhere."""
    if not isinstance(entry, dict):
        raise _bad_field(where, name, "must be an object")
    for text in ("key", "unit"):
        if not isinstance(entry.get(text), str) or not entry[text]:
            raise _bad_field(where, f"{name}.{text}", "must be a non-empty string")
    value, unit, which = entry.get("value"), entry["unit"], f"(measurement {entry['key']!r})"
    if not _is_number(value):
        raise _bad_field(where, f"{name}.value", f"{which} must be a number, got {json.dumps(value)}")
    problem = value_problem(float(value), unit)
    if problem:
        raise _bad_field(where, f"{name}.value", f"{which} {problem}, got {float(value):g}, which no measurement gives")
    for number in _NUMBERS:
        if number in entry and not (_is_number(entry[number]) and math.isfinite(entry[number])):
            raise _bad_field(where, f"{name}.{number}", "must be a finite number")
    samples = entry.get("samples", [])
    if not isinstance(samples, list) or not all(_is_number(x) for x in samples):
        raise _bad_field(where, f"{name}.samples", "must be a list of numbers")
    return Measurement.from_dict(entry)


def saved_measurements(path: Path) -> list[Measurement]:
    """The measurements of the profile at `path`; none when there is no file there."""
    if not path.is_file():
        return []
    doc = read_profile_json(path)
    check_profile_doc(doc, str(path))
    return measurements_from(doc, str(path))


# how often a process waiting for another's measurement looks again (and checks whether it was asked to stop)
MEASURING_POLL_S = 0.2


@contextmanager
def measuring(fingerprint: str, waiting: Callable[[], None] = lambda: None,
              should_stop: Callable[[], bool] = lambda: False) -> Iterator[bool]:
    """Holds this machine's measuring lock (an advisory lock on `<profiles>/<fingerprint>.measuring`) for the block:
    one measurement of a machine at a time, across processes. Two at once (the app's first quick measurement and an
    API child's first plan, or `hivekeeper measure` while the app measures) would each slow the other's figures.
    When another process holds it, `waiting()` is called once and the lock is tried again every MEASURING_POLL_S until
    it is free (the holder's exit frees it too) or `should_stop()`: the block then runs with False (not held; the
    caller stops). Where the platform has no fcntl (Windows) nothing is locked."""
    if fcntl is None:
        yield True
        return
    folder = profiles_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / f"{fingerprint}.measuring", "a+b")
    except OSError as exc:
        raise InputError(f"{folder}: cannot hold this machine's profiles ({exc.strerror or exc}); "
                         f"HIVEKEEPER_CONFIG_DIR, when set, must name a folder") from None
    with lock:
        held = _take(lock.fileno(), waiting, should_stop)
        try:
            yield held
        finally:
            if held:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _take(fd: int, waiting: Callable[[], None], should_stop: Callable[[], bool]) -> bool:
    """Take the lock on `fd`, waiting (said once) while another process holds it; False when stopped first."""
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if not said:
            waiting()
            said = True
        if should_stop():
            return False
        time.sleep(MEASURING_POLL_S)
