"""What this machine has given the swarm: requests and tokens served, uptime and energy, today and in total.

A serving node's handler counts requests and tokens from zero each time it starts; `ContributionLedger` turns those
running counts into lasting totals. It is fed every status event of the node (`record`), adds what was served and
how long the node was serving since the previous event, and keeps the sums in one JSON file (`contribution.json` in
the data folder) written atomically (core/atomic_file.py): a crash loses at most the last `save_period_s`, never the
file. Two nodes on one machine would each add their own share (each reads the file before adding).

Energy is uptime × the plan's power figure for the devices serving (the CPU's package power, plus the GPUs' board
power when serving on CUDA), or, on an NVIDIA GPU, the GPUs' own energy counters (NVML) plus the CPU's share.

`hivekeeper node stats` and the app's Monitor page read the file (`read_contribution`, `contribution_summary`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Callable

from hivekeeper.core.atomic_file import write_json_atomic
from hivekeeper.planner.errors import InputError

FILE_NAME = "contribution.json"
KEEP_DAYS = 400  # per-day rows kept in the file (the totals keep everything)
COUNTERS = ("requests", "tokens", "uptime_s", "energy_wh")
SERVING_STATES = ("online", "stats", "moving")  # while the node reports these, it is up and serving


def contribution_path() -> Path:
    from hivekeeper.core.machine.detect import default_data_dir

    return default_data_dir() / FILE_NAME


def _zero() -> dict[str, float]:
    return {name: 0 for name in COUNTERS}


def read_contribution(path: str | Path | None = None) -> dict:
    """The ledger file as {"total": {...}, "days": {"YYYY-MM-DD": {...}}}; an empty one when there is none yet.
    A file that is not such an object is one InputError naming it."""
    path = Path(path) if path is not None else contribution_path()
    if not path.exists():
        return {"total": _zero(), "days": {}}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a readable contribution file ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("total"), dict) or not isinstance(doc.get("days"), dict):
        raise InputError(f"{path}: not a contribution file (expected an object with 'total' and 'days')")
    for row in (doc["total"], *doc["days"].values()):
        for name in COUNTERS:
            value = row.get(name, 0) if isinstance(row, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InputError(f"{path}: field {name!r} must be a number >= 0, got {value!r}")
    return doc


def contribution_summary(doc: dict, today: date | None = None) -> dict:
    """{"today": {...}, "total": {...}} with every counter present (0 where nothing was served)."""
    key = (today or date.today()).isoformat()
    return {"today": {**_zero(), **doc["days"].get(key, {})}, "total": {**_zero(), **doc["total"]}}


def fmt_duration(seconds: float) -> str:
    """3 h 05 min, 12 min 30 s, 45 s."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def fmt_energy(wh: float) -> str:
    """12.3 Wh, 4.56 kWh."""
    return f"{wh / 1000:.2f} kWh" if wh >= 1000 else f"{wh:.1f} Wh"


def nvml_energy_mj() -> float | None:
    """The NVIDIA GPUs' total energy counters in millijoules (NVML, Volta or newer), or None without them."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return float(sum(pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(i))
                             for i in range(pynvml.nvmlDeviceGetCount())))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, no driver, no GPU, or a GPU without the counter
        return None


@dataclass
class PowerSource:
    """Where the energy figure comes from: watts for the whole time serving, plus the GPUs' NVML counters when
    `use_nvml` (then `watts` is the CPU's share only)."""

    watts: float | None  # None: unknown (no plan), energy stays 0
    use_nvml: bool = False
    read_nvml: Callable[[], float | None] = nvml_energy_mj


@dataclass
class ContributionLedger:
    """Adds a running node's counts to the file at `path` as its status events arrive."""

    path: Path
    power: PowerSource = field(default_factory=lambda: PowerSource(None))
    save_period_s: float = 10.0
    clock: Callable[[], float] = time.time
    _seen: dict[str, float] = field(default_factory=lambda: {"requests": 0, "tokens": 0})
    _pending: dict[str, float] = field(default_factory=_zero)
    _serving_since: float | None = None
    _nvml_at: float | None = None
    _saved_at: float = 0.0

    def record(self, event: dict, requests: int | None = None, tokens: int | None = None) -> dict | None:
        """Take one status event (and the handler's running counts, when the event lacks them); returns today's
        and the total contribution after it when it was saved, else None."""
        now = self.clock()
        requests = event.get("requests_served", requests)
        tokens = event.get("tokens_served", tokens)
        for name, count in (("requests", requests), ("tokens", tokens)):
            if count is not None and count >= self._seen[name]:
                self._pending[name] += count - self._seen[name]
                self._seen[name] = count
        self._add_uptime(now, serving=event.get("state") in SERVING_STATES)
        final = event.get("state") in ("offline", "error")
        if final or now - self._saved_at >= self.save_period_s:
            return self.save(now)
        return None

    def _add_uptime(self, now: float, serving: bool) -> None:
        if self._serving_since is not None:
            seconds = max(0.0, now - self._serving_since)
            self._pending["uptime_s"] += seconds
            self._pending["energy_wh"] += self._energy_wh(seconds)
        self._serving_since = now if serving else None
        if not serving:
            self._nvml_at = None

    def _energy_wh(self, seconds: float) -> float:
        watts = self.power.watts or 0.0
        energy = watts * seconds / 3600.0
        if self.power.use_nvml:
            reading = self.power.read_nvml()
            if reading is not None and self._nvml_at is not None and reading >= self._nvml_at:
                energy += (reading - self._nvml_at) / 3.6e6  # mJ -> Wh
            self._nvml_at = reading
        return energy

    def save(self, now: float | None = None) -> dict:
        """Add what is pending to the file (read afresh) and write it atomically; returns the summary."""
        now = self.clock() if now is None else now
        doc = read_contribution(self.path)
        day = datetime.fromtimestamp(now).date()
        row = doc["days"].setdefault(day.isoformat(), _zero())
        for name, value in self._pending.items():
            doc["total"][name] = doc["total"].get(name, 0) + value
            row[name] = row.get(name, 0) + value
        for old in sorted(doc["days"])[:-KEEP_DAYS]:
            del doc["days"][old]
        doc["updated"] = now
        write_json_atomic(self.path, doc)
        self._pending = _zero()
        self._saved_at = now
        return contribution_summary(doc, day)


def serving_power(device: str) -> PowerSource:
    """The power figure of a node serving on `device`: the plan's CPU package power, plus the GPUs' board power on
    CUDA, or the GPUs' NVML energy counters when they can be read (unchecked here: no NVIDIA GPU on the test
    machines). Unknown (None) when this machine cannot be described to the planner."""
    try:
        from hivekeeper.core.machine.profiles import detect_or_load_profile

        hardware, _ = detect_or_load_profile()
    except Exception:  # noqa: BLE001 - energy is a nicety: a machine we cannot describe still serves
        return PowerSource(None)
    cpu = float(hardware.cpu.power_watts)
    if not device.startswith("cuda"):
        return PowerSource(cpu)
    if nvml_energy_mj() is not None:
        return PowerSource(cpu, use_nvml=True)
    return PowerSource(cpu + float(sum(gpu.power_watts for gpu in hardware.gpus)))


def counting_status(ledger: ContributionLedger, handler_of: Callable[[], object],
                    then: Callable[[dict], None]) -> Callable[[dict], None]:
    """A server's status callback that adds each event to `ledger` (with the handler's token count, and the
    contribution so far as "contribution" whenever the ledger saved) and hands it on to `then`."""
    def status(event: dict) -> None:
        handler = handler_of()
        if handler is not None:
            event.setdefault("requests_served", handler.requests_served)
            event.setdefault("tokens_served", handler.tokens_served)
        summary = ledger.record(event)
        if summary is not None:
            event["contribution"] = summary
        then(event)

    return status
