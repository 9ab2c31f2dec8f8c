"""Checked reads of JSON fields: the one field checker behind every file the project reads.

Model configs (model_config.py), hardware JSON (hardware_catalog.py), the app's settings (gui/settings.py), plan
files (core/offload/local_plan.py) and saved calibrations (calibration.py, a machine profile's field 'calibration')
all read their fields through `Fields`, so a bad value gives the same kind of message everywhere: one line naming
the file and the field, dotted inside nested objects, as an InputError (the CLI's exit 2), e.g. `hw.json: field
'cpu.cores' must be at least 1, got 0`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .errors import InputError

LARGEST_COUNT = 10**8  # the default upper bound of an integer field: larger counts are typos, not models
REQUIRED = object()  # the default of a field that must be given ("is missing" when it is not)


def field_error(where: str, name: str, problem: str) -> InputError:
    """InputError('<where>: field <name> <problem>'): the one shape of a field's error."""
    return InputError(f"{where}: field {name!r} {problem}")


def is_number(value: Any) -> bool:
    """A finite JSON number (true/false are not numbers here, although Python counts them as ints)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_number(value: Any, low: float, high: float, *, where: str, name: str, hint: str = "") -> float:
    """`value` as a float inside [low, high], else InputError naming the file and field (`hint` ends the
    message when the value is too large, e.g. '(check the unit)')."""
    if not is_number(value):
        raise field_error(where, name, f"must be a number, got {value!r}")
    if value < low:
        raise field_error(where, name, f"must be at least {low:g}, got {value:g}")
    if value > high:
        raise field_error(where, name, f"must be at most {high:g}, got {value:g}" + (f" {hint}" if hint else ""))
    return float(value)


def check_integer(value: Any, low: int, high: int, *, where: str, name: str) -> int:
    """`value` as an int inside [low, high] (a whole float such as 2.0 counts), else InputError."""
    if not is_number(value) or int(value) != value:
        raise field_error(where, name, f"must be an integer from {low} to {high}, got {value!r}")
    if not low <= value <= high:
        raise field_error(where, name, f"must be an integer from {low} to {high}, got {int(value)}")
    return int(value)


class Fields:
    """One JSON object's fields, read with checks. `path` is the object's dotted place in the file ('' at the top,
    'cpu', 'plan'), so that errors name 'cpu.cores' rather than 'cores'."""

    def __init__(self, doc: Any, where: str, path: str = ""):
        if not isinstance(doc, dict):
            if not path:
                raise InputError(f"{where}: expected a JSON object")
            raise field_error(where, path, f"must be a JSON object, got {type(doc).__name__}")
        self.doc, self.where, self.path = doc, where, path

    def name(self, key: str) -> str:
        """The dotted name of a field, as errors give it."""
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, problem: str) -> InputError:
        return field_error(self.where, self.name(key), problem)

    def has(self, key: str) -> bool:
        """Whether the field is given (null counts as absent)."""
        return self.doc.get(key) is not None

    def first(self, keys: tuple[str, ...]) -> str | None:
        """The first of `keys` that is given (aliases such as n_layer / num_hidden_layers)."""
        return next((key for key in keys if self.has(key)), None)

    def section(self, key: str) -> Fields:
        """The nested object `key` ({} when absent)."""
        value = self.doc.get(key)
        return Fields({} if value is None else value, self.where, self.name(key))

    def check_keys(self, allowed: set[str] | frozenset[str], what: str = "a known field here",
                   ignored: frozenset[str] = frozenset()) -> None:
        """Refuse unknown keys (usually typos), naming the first one and the known ones; `ignored` keys are
        allowed without being listed (comments, sources)."""
        unknown = sorted(set(self.doc) - set(allowed) - ignored)
        if unknown:
            raise self.error(unknown[0], f"is not {what} (known: {', '.join(sorted(allowed))})")

    def missing(self, key: str, default: Any = REQUIRED, hint: str = "") -> Any:
        """`default`, or the 'is missing' error when the field is REQUIRED."""
        if default is REQUIRED:
            raise self.error(key, "is missing" + (f" {hint}" if hint else ""))
        return default

    def integer(self, *keys: str, default: Any = REQUIRED, low: int = 1, high: int = LARGEST_COUNT) -> int:
        """The first of `keys` given, as an integer in [low, high]; `default` when none is given (REQUIRED: the
        'is missing' error)."""
        key = self.first(keys)
        if key is None:
            return self.missing(keys[0], default)
        return check_integer(self.doc[key], low, high, where=self.where, name=self.name(key))

    def number(self, key: str, low: float, high: float, *, default: Any = REQUIRED, hint: str = "") -> float:
        """The field as a finite number in [low, high]; `default` when absent (REQUIRED: 'is missing')."""
        if not self.has(key):
            return self.missing(key, default)
        return check_number(self.doc[key], low, high, where=self.where, name=self.name(key), hint=hint)

    def flag(self, key: str, default: Any = REQUIRED) -> bool:
        """The field as true/false; `default` when absent (REQUIRED: 'is missing')."""
        if not self.has(key):
            return self.missing(key, default)
        value = self.doc[key]
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def text(self, key: str, *, default: Any = REQUIRED, choices: tuple[str, ...] | None = None,
             max_len: int = 100_000, non_empty: bool = False) -> str:
        """The field as a string of at most `max_len` characters, one of `choices` when given; `default` when
        absent (REQUIRED: 'is missing')."""
        if not self.has(key):
            return self.missing(key, default)
        value = self.doc[key]
        if not isinstance(value, str) or len(value) > max_len or (non_empty and not value.strip()):
            size = f"{'non-empty ' if non_empty else ''}text of at most {max_len} characters"
            raise self.error(key, f"must be {size}, got {value!r}"[:300])
        if choices is not None and value not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}, got {value!r}")
        return value


def read_json_file(path: str | Path) -> Any:
    """The JSON document in a file, or InputError naming the file: it cannot be read, or it is not JSON."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from None
