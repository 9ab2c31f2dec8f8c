"""`hivekeeper detect`: show this machine's detected hardware, or save it as a hardware JSON file.

The text also says which CPU flags decisions use (pinned or reported), whether the native decode kernels run, and
what 16-bit plans compute in on this CPU and why (core/machine/cpu_dtype.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hivekeeper.planner.errors import InputError

from hivekeeper.core.atomic_file import write_json_atomic
from hivekeeper.planner.hardware import HardwareSpec
from hivekeeper.planner.hardware_catalog import hardware_to_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the spec as a hardware JSON document")
    parser.add_argument("--out", metavar="FILE", help="write the spec to FILE (hardware JSON, usable as --hardware FILE)")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="folder whose filesystem holds models (default: HIVEKEEPER_DATA_DIR or the user data folder)")


def write_json_atomically(path: Path, doc: dict) -> None:
    """Write the spec for --out; the folder must exist (a typo in it should not create folders)."""
    path = path.expanduser()
    if not path.parent.is_dir():
        raise InputError(f"--out {path}: folder {path.parent} does not exist")
    write_json_atomic(path, doc, indent=2)


def _source_tag(sources: dict[str, str], key: str) -> str:
    label = sources.get(key, "").split(":", 1)[0]
    return f" [{label}]" if label and label != "detected" else ""


def describe(spec: HardwareSpec) -> str:
    """A few human-readable lines; numbers not read from the system carry their source in brackets."""
    lines = [f"machine: {spec.description or spec.id}"]
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
                 f"{_source_tag(cpu.sources, 'memory_bandwidth')}")
    disk = spec.disk
    lines.append(f"disk: {disk.capacity_bytes / 1e9:.0f} GB ({disk.sources.get('capacity_bytes', '')}), "
                 f"read {disk.read_bandwidth / 1e9:.2f} GB/s, write {disk.write_bandwidth / 1e9:.2f} GB/s"
                 f"{_source_tag(disk.sources, 'read_bandwidth')}")
    net = spec.network
    lines.append(f"network: {net.upload_bps / 1e6:.0f} Mbit/s up, {net.download_bps / 1e6:.0f} Mbit/s down, "
                 f"rtt {net.rtt_s * 1e3:.0f} ms{_source_tag(net.sources, 'rtt_s')}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from hivekeeper.core.machine.detect import detect_hardware

    spec = detect_hardware(args.data_dir)
    doc = hardware_to_json(spec)
    if args.out:
        write_json_atomically(Path(args.out), doc)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.json:
        print(json.dumps(doc, indent=2))
    elif not args.out:
        from hivekeeper.core.machine import cpu_features
        from hivekeeper.core.machine.cpu_dtype_rule import choice_for
        from hivekeeper.core.runtime.kernels import native_kernels

        print(describe(spec))
        print(f"CPU flags: {cpu_features.describe()}")
        print(f"CPU decode kernels: {native_kernels.status()}")  # built here on first use: it may take a second
        print(choice_for(spec).line())
    return 0
