"""Stepping aside for the machine's owner: when a serving node pauses, what tells it, and the limits it keeps to.

A node with PauseSettings pauses while any of its conditions holds, and serves again once none does:
- the user is active: input idle for less than `idle_minutes`;
- the machine runs on battery (`on_battery`);
- other programs use more than `cpu_above` percent of the CPUs (this process and its children not counted);
- the local time is outside `serve_hours` ("22-7": from 22:00 to 07:00; "9:30-17" works too);
- the owner paused it by hand until some time (the app's "Pause 1 h": `PauseWatch.pause_for`).

The readings come from a ConditionProvider, an object with `read() -> Readings`. `system_provider()` picks this
platform's: on Linux logind's IdleHint (`loginctl show-session`), /sys/class/power_supply and psutil; the Windows
(GetLastInputInfo, GetSystemPowerStatus) and macOS (ioreg's HIDIdleTime, pmset) providers are written but unchecked
(no such machine here). Tests drive the conditions with a provider of their own. A reading that is unknown (None:
no logind session, no battery) never pauses the node.

Limits (`ResourceLimits`): CPU threads (the process's CPU affinity and torch's threads), RAM and GPU memory the node
may hold (the span and its KV cache are sized within them; on CUDA the allocator is capped as well).

Every setting is a `serve` flag, so the headless node's --config file takes the same keys without the dashes
("pause-when-active": 5, "pause-on-battery": true, ...); a bad value is an InputError naming the flag. Torch-free:
the app's settings page reads the same names.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

logger = logging.getLogger("hivekeeper.swarm.pause")

POWER_SUPPLY = Path("/sys/class/power_supply")
DEFAULT_CHECK_PERIOD_S = 10.0
CPU_SAMPLE_S = 0.0  # psutil's cpu_percent against its previous call (the check period)


# ---- settings --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PauseSettings:
    idle_minutes: float = 0.0  # pause while input was idle for less than this (0: never for this reason)
    on_battery: bool = False
    cpu_above: float = 0.0  # pause while other programs use more than this percent of the CPUs (0: never)
    serve_hours: str = ""  # "H[:MM]-H[:MM]": serve only then ("" all day)
    check_period: float = DEFAULT_CHECK_PERIOD_S

    @property
    def any(self) -> bool:
        return bool(self.idle_minutes or self.on_battery or self.cpu_above or self.serve_hours)


@dataclass(frozen=True)
class ResourceLimits:
    cpu_threads: int | None = None
    ram_gib: float | None = None
    gpu_gib: float | None = None


@dataclass(frozen=True)
class Readings:
    idle_seconds: float | None = None  # time since the last keyboard/mouse input; None: unknown
    on_battery: bool | None = None  # None: no battery, or unknown
    other_cpu_percent: float | None = None  # 0-100 of all CPUs
    now: datetime.datetime | None = None  # local time (None: the clock's)


class ConditionProvider(Protocol):
    def read(self) -> Readings: ...


# ---- the decision ----------------------------------------------------------------------------------------------------
def parse_hours(text: str) -> tuple[int, int]:
    """'22-7' or '9:30-17:00' -> (start, end) in minutes after midnight; ValueError naming the problem."""
    match = re.fullmatch(r"\s*(\d{1,2})(?::(\d\d))?\s*-\s*(\d{1,2})(?::(\d\d))?\s*", text)
    if not match:
        raise ValueError(f"{text!r}: expected hours like 22-7 or 9:30-17:00")
    h1, m1, h2, m2 = (int(part or 0) for part in match.groups())
    if h1 > 23 or h2 > 24 or m1 > 59 or m2 > 59 or (h2 == 24 and m2):
        raise ValueError(f"{text!r}: hours are 0-24 and minutes 0-59")
    start, end = h1 * 60 + m1, h2 * 60 + m2
    if start == end % 1440:
        raise ValueError(f"{text!r}: the start and the end are the same time")
    return start, end


def within_hours(hours: str, now: datetime.datetime) -> bool:
    start, end = parse_hours(hours)
    minute = now.hour * 60 + now.minute
    return start <= minute < end if start < end else (minute >= start or minute < end)


def pause_reason(settings: PauseSettings, readings: Readings) -> str | None:
    """Why the node should pause now (words for the owner), or None to serve."""
    if settings.idle_minutes and readings.idle_seconds is not None \
            and readings.idle_seconds < settings.idle_minutes * 60:
        return f"you are using this computer (idle under {settings.idle_minutes:g} min)"
    if settings.on_battery and readings.on_battery:
        return "on battery"
    if settings.cpu_above and readings.other_cpu_percent is not None \
            and readings.other_cpu_percent > settings.cpu_above:
        return f"other programs use {readings.other_cpu_percent:.0f}% CPU (limit {settings.cpu_above:g}%)"
    now = readings.now or datetime.datetime.now()
    if settings.serve_hours and not within_hours(settings.serve_hours, now):
        return f"outside serving hours ({settings.serve_hours})"
    return None


class PauseWatch:
    """The settings, a provider and a pause by hand: `reason()` says whether to pause now, and why."""

    def __init__(self, settings: PauseSettings, provider: ConditionProvider | None = None):
        self.settings = settings
        self.provider = provider or system_provider()
        self.manual_until = 0.0  # time.time() until which the owner paused the node by hand

    def pause_for(self, seconds: float) -> None:
        self.manual_until = time.time() + max(0.0, seconds)

    def resume(self) -> None:
        self.manual_until = 0.0

    def reason(self) -> str | None:
        if self.manual_until > time.time():
            return f"paused by you until {time.strftime('%H:%M', time.localtime(self.manual_until))}"
        if not self.settings.any:
            return None
        return pause_reason(self.settings, self.provider.read())


# ---- providers -------------------------------------------------------------------------------------------------------
def parse_loginctl(text: str, monotonic_now: float) -> float | None:
    """Seconds of input idleness from `loginctl show-session -p IdleHint -p IdleSinceHintMonotonic` output: 0 while
    logind says the session is not idle; None when it does not say."""
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    hint = values.get("IdleHint")
    if hint == "no":
        return 0.0
    since = values.get("IdleSinceHintMonotonic", "")
    if hint != "yes" or not since.isdigit() or int(since) == 0:
        return None
    return max(0.0, monotonic_now - int(since) / 1e6)


def linux_idle_seconds() -> float | None:
    """logind's idle hint for this session (a desktop sets it after its own idle delay); None without a session."""
    session = os.environ.get("XDG_SESSION_ID") or "auto"
    try:
        out = subprocess.run(["loginctl", "show-session", session, "-p", "IdleHint", "-p", "IdleSinceHintMonotonic"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return parse_loginctl(out.stdout, time.clock_gettime(time.CLOCK_MONOTONIC))


def linux_on_battery(root: Path = POWER_SUPPLY) -> bool | None:
    """From /sys/class/power_supply: True when a battery discharges and no mains supply is online; None when there
    is no battery."""
    batteries, mains_online = [], False
    for supply in sorted(root.glob("*")) if root.is_dir() else []:
        kind = _read(supply / "type")
        if kind == "Battery" and _read(supply / "scope") != "Device":  # not a mouse's battery
            batteries.append(_read(supply / "status"))
        elif kind in ("Mains", "USB", "USB_C", "USB_PD") and _read(supply / "online") == "1":
            mains_online = True
    if not batteries:
        return None
    return not mains_online and "Discharging" in batteries


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def windows_idle_seconds() -> float | None:  # unchecked: written for Windows, never run here
    class LastInput(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

    info = LastInput()
    info.cbSize = ctypes.sizeof(info)
    if not ctypes.windll.user32.GetLastInputInfo(ctypes.byref(info)):
        return None
    return ((ctypes.windll.kernel32.GetTickCount() - info.dwTime) & 0xFFFFFFFF) / 1000.0


def windows_on_battery() -> bool | None:  # unchecked
    class PowerStatus(ctypes.Structure):
        _fields_ = [("ACLineStatus", ctypes.c_byte), ("BatteryFlag", ctypes.c_byte),
                    ("BatteryLifePercent", ctypes.c_byte), ("SystemStatusFlag", ctypes.c_byte),
                    ("BatteryLifeTime", ctypes.c_ulong), ("BatteryFullLifeTime", ctypes.c_ulong)]

    status = PowerStatus()
    if not ctypes.windll.kernel32.GetSystemPowerStatus(ctypes.byref(status)) or status.BatteryFlag & 128:
        return None  # no system battery
    return status.ACLineStatus == 0


def macos_idle_seconds() -> float | None:  # unchecked
    try:
        out = subprocess.run(["ioreg", "-c", "IOHIDSystem", "-d", "4"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', out.stdout)
    return int(match.group(1)) / 1e9 if match else None


def macos_on_battery() -> bool | None:  # unchecked
    try:
        out = subprocess.run(["pmset", "-g", "batt"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if "InternalBattery" not in out.stdout:
        return None
    return "'Battery Power'" in out.stdout


class OtherCpu:
    """Other programs' share of all CPUs since the previous call: the system's use minus this process tree's."""

    def __init__(self):
        import psutil

        self.psutil = psutil
        self.me = psutil.Process()
        self.cpus = psutil.cpu_count() or 1
        self.seen: dict[int, object] = {}
        self.percent()  # the first call only starts the counters

    def percent(self) -> float:
        total = self.psutil.cpu_percent(interval=CPU_SAMPLE_S or None)
        ours = 0.0
        try:
            tree = [self.me, *self.me.children(recursive=True)]
        except self.psutil.Error:
            tree = [self.me]
        for process in tree:
            known = self.seen.setdefault(process.pid, process)
            try:
                ours += known.cpu_percent(None)
            except self.psutil.Error:
                self.seen.pop(process.pid, None)
        return max(0.0, total - ours / self.cpus)


class SystemProvider:
    """This machine's readings (the platform's idle and battery functions, psutil for the CPU)."""

    def __init__(self, idle, battery):
        self.idle, self.battery = idle, battery
        self.cpu = OtherCpu()

    def read(self) -> Readings:
        return Readings(idle_seconds=self.idle(), on_battery=self.battery(), other_cpu_percent=self.cpu.percent(),
                        now=datetime.datetime.now())


def system_provider() -> SystemProvider:
    if sys.platform == "win32":
        return SystemProvider(windows_idle_seconds, windows_on_battery)
    if sys.platform == "darwin":
        return SystemProvider(macos_idle_seconds, macos_on_battery)
    return SystemProvider(linux_idle_seconds, linux_on_battery)


# ---- serve's flags (and so the node config file's keys) --------------------------------------------------------------
def _number(low: float, high: float | None = None, integer: bool = False):
    def parse(text: str):
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if integer else 'a number'}") from None
        if not value >= low or (high is not None and value > high):
            bound = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be {bound}")
        return value

    return parse


def _hours(text: str) -> str:
    if not text.strip():
        return ""  # all day
    try:
        parse_hours(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def add_pause_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("stepping aside for the owner (issue 20)")
    group.add_argument("--pause-when-active", type=_number(0), default=0.0, metavar="MIN",
                       help="pause while the keyboard and mouse were idle for less than MIN minutes (0: never)")
    group.add_argument("--pause-on-battery", action="store_true", help="pause while the machine runs on battery")
    group.add_argument("--pause-cpu-above", type=_number(0, 100), default=0.0, metavar="PCT",
                       help="pause while other programs use more than PCT%% of the CPUs (0: never)")
    group.add_argument("--serve-hours", type=_hours, default="", metavar="H-H",
                       help="serve only within these local hours, e.g. 22-7 or 9:30-17:00 (default: all day)")
    group.add_argument("--pause-check-period", type=_number(0.05), default=DEFAULT_CHECK_PERIOD_S, metavar="S",
                       help=f"seconds between checks of the pause conditions (default {DEFAULT_CHECK_PERIOD_S:g})")
    group.add_argument("--max-cpu-threads", type=_number(1, integer=True), metavar="N",
                       help="CPU threads the node may use (its CPU affinity; default: all)")
    group.add_argument("--max-ram-gib", type=_number(0.01), metavar="GIB",
                       help="RAM the node's blocks and KV cache may hold (default: 80%% of the free RAM)")
    group.add_argument("--max-gpu-gib", type=_number(0.01), metavar="GIB",
                       help="GPU memory the node may hold (the CUDA allocator is capped to it)")
    group.add_argument("--control-stdin", action="store_true",
                       help='take {"command": "pause", "seconds": S} and {"command": "resume"} JSON lines on stdin')


def pause_settings(args: argparse.Namespace) -> PauseSettings:
    return PauseSettings(idle_minutes=args.pause_when_active, on_battery=args.pause_on_battery,
                         cpu_above=args.pause_cpu_above, serve_hours=args.serve_hours,
                         check_period=args.pause_check_period)


def resource_limits(args: argparse.Namespace) -> ResourceLimits:
    return ResourceLimits(cpu_threads=args.max_cpu_threads, ram_gib=args.max_ram_gib, gpu_gib=args.max_gpu_gib)


# ---- applying the limits ---------------------------------------------------------------------------------------------
def limit_cpu_threads(threads: int) -> int:
    """Keep this process (and what it starts later) on `threads` of the CPUs it may use; returns how many."""
    import psutil

    process = psutil.Process()
    try:
        allowed = process.cpu_affinity()
        process.cpu_affinity(allowed[:threads])
        return min(threads, len(allowed))
    except (AttributeError, psutil.Error, OSError):  # macOS has no affinity: torch's threads alone
        return threads


def memory_budget(free_bytes: float, limit_gib: float | None) -> float:
    """The bytes a node may plan its span and cache in: the free memory, within the limit."""
    return free_bytes if limit_gib is None else min(free_bytes, limit_gib * 2**30)


def apply_limits(limits: ResourceLimits, device: str) -> None:
    """CPU threads: this process's affinity and torch's threads; GPU memory: the CUDA allocator's cap (unchecked
    here: no GPU). RAM is kept by sizing the span within `memory_budget`."""
    import torch

    if limits.cpu_threads:
        threads = limit_cpu_threads(limits.cpu_threads)
        torch.set_num_threads(min(torch.get_num_threads(), threads))
    if limits.gpu_gib and device.startswith("cuda"):
        index = torch.device(device).index or 0
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limits.gpu_gib * 2**30 / total), index)


def owner_watch(args: argparse.Namespace) -> PauseWatch | None:
    """The pause watch serve's flags ask for: None when nothing can pause the node."""
    settings = pause_settings(args)
    return PauseWatch(settings) if settings.any or args.control_stdin else None


def read_commands(stream, deliver: Callable[[dict], None]) -> threading.Thread:
    """Read JSON command lines from `stream` on a thread and hand each object to `deliver` (serve --control-stdin);
    a line that is not a JSON object is logged and skipped, the end of the stream ends the thread."""
    def run() -> None:
        for line in stream:
            try:
                command = json.loads(line)
            except ValueError:
                command = None
            if isinstance(command, dict):
                deliver(command)
            elif line.strip():
                logger.warning("ignoring a control line that is not a JSON object: %.80s", line.strip())

    thread = threading.Thread(target=run, name="control-stdin", daemon=True)
    thread.start()
    return thread
