"""`hivekeeper measure`: micro-benchmark this machine and save the results as its profile for the planner.

RAM read bandwidth, matmul FLOP/s per dtype at decode and prefill shapes, decode weight streaming, a bf16 decode
step against fp32 where the CPU has native bf16 math (it decides what 16-bit plans compute in: "CPU 16-bit plans:"
says which and why), disk read/write past the page cache, host<->GPU copies (pinned and pageable) and GPU
memory/matmuls when there is a GPU, and RTT/bandwidth to peers given with --peer. `--listen PORT` instead runs the
peer side of the bandwidth test until interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hivekeeper.planner.errors import InputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small buffers and 2 repeats (seconds, rougher numbers)")
    parser.add_argument("--peer", action="append", default=[], metavar="ADDR",
                        help="measure RTT (and bandwidth, if it runs `measure --listen`) to HOST:PORT or a multiaddr; "
                             "repeatable")
    parser.add_argument("--disk-folder", metavar="DIR",
                        help="folder on the disk to measure (default: the data folder, where models are kept)")
    parser.add_argument("--no-disk", action="store_true", help="skip the disk benchmark")
    parser.add_argument("--no-gpu", action="store_true", help="skip GPU benchmarks")
    parser.add_argument("--repeats", metavar="N", help="repeats per benchmark (default 5, --quick 2)")
    parser.add_argument("--out", metavar="FILE", help="also write the measured machine as a hardware JSON file "
                                                      "(usable as `plan --hardware FILE`)")
    parser.add_argument("--no-save", action="store_true", help="do not save the machine profile")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--listen", metavar="[HOST:]PORT", help="serve the peer side of the bandwidth test and wait")


def _listen(spec: str) -> int:
    from hivekeeper.core.machine.measure import BandwidthServer

    host, _, port_text = spec.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        raise InputError(f"--listen {spec!r}: port must be a number") from None
    if not 0 <= port < 65536:
        raise InputError(f"--listen {spec!r}: port must be 0-65535")
    try:
        server = BandwidthServer(host or "0.0.0.0", port)
    except OSError as exc:
        raise InputError(f"--listen {spec}: cannot listen ({exc.strerror or exc})") from None
    print(f"listening on {server.address} for `hivekeeper measure --peer HOST:{server.server_address[1]}`", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def _disk_folder(args: argparse.Namespace) -> Path | None:
    if args.no_disk:
        return None
    if args.disk_folder:
        folder = Path(args.disk_folder).expanduser()
        if not folder.is_dir():
            raise InputError(f"--disk-folder {folder}: not a folder")
        return folder
    from hivekeeper.core.machine.detect import default_data_dir

    folder = default_data_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"data folder {folder}: cannot create it ({exc.strerror or exc}); "
                         "pass --disk-folder") from None
    return folder


def run(args: argparse.Namespace) -> int:
    if args.listen:
        return _listen(args.listen)
    import dataclasses
    import time

    import torch

    from hivekeeper.planner.hardware_catalog import hardware_to_json

    from hivekeeper.core.atomic_file import in_existing_folder
    from hivekeeper.core.machine.cpu_dtype import choose
    from hivekeeper.core.machine.cpu_dtype import forget as forget_choice
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.measurement import busy_words, quiet_load
    from hivekeeper.core.offload.offloaded_model import use_physical_cores
    from hivekeeper.core.machine.profiles import (comparison_rows, load_machine_profile, machine_fingerprint, new_profile,
                                  save_profile, write_json_atomic)
    from hivekeeper.core.machine.measure import TerminalProgress, parse_peer, run_benchmarks, sizes_from_environment
    from hivekeeper.core.machine.first_measure import ANOTHER_MEASURES
    from hivekeeper.core.machine.profile_files import measuring

    for peer in args.peer:
        parse_peer(peer)  # bad addresses fail before minutes of benchmarks
    sizes = sizes_from_environment("quick" if args.quick else "full")  # HIVEKEEPER_MEASURE_SIZES names others
    if args.repeats is not None:
        try:
            repeats = int(args.repeats)
        except ValueError:
            raise InputError(f"--repeats must be an integer, got {args.repeats!r}") from None
        if not 1 <= repeats <= 100:
            raise InputError(f"--repeats must be from 1 to 100, got {repeats}")
        sizes = dataclasses.replace(sizes, repeats=repeats)
    out = in_existing_folder("--out", args.out) if args.out else None

    threads = use_physical_cores()
    detected = detect_hardware()
    with measuring(machine_fingerprint(detected), waiting=lambda: print(f"note: {ANOTHER_MEASURES}", file=sys.stderr,
                                                                        flush=True)):
        started = time.time()
        measurements = run_benchmarks(sizes, disk_folder=_disk_folder(args), peers=tuple(args.peer),
                                      gpu=not args.no_gpu, progress=TerminalProgress("measure "))
    previous = load_machine_profile(detected)
    profile = new_profile(detected)
    profile.measurements, profile.measured_at, profile.threads = measurements, started, threads
    dropped = previous is not None and previous.calibration is not None
    path = None if args.no_save else save_profile(profile)
    hardware = profile.hardware(detected)
    if out is not None:
        write_json_atomic(out, hardware_to_json(dataclasses.replace(hardware, id=out.stem)))

    forget_choice()  # this process decides again with the new profile
    choice = choose(measurements)
    if args.json:
        print(json.dumps({
            "profile": str(path) if path else None, "fingerprint": machine_fingerprint(detected),
            "threads": threads, "torch": torch.__version__, "seconds": round(time.time() - started, 2),
            "calibration_dropped": dropped, "measurements": [m.as_dict() for m in measurements],
            "cpu_sixteen_bit": {"dtype": choice.dtype, "reason": choice.reason},
            "hardware": hardware_to_json(hardware),
        }))
        return 0
    print(render(comparison_rows(detected, profile)))
    print(choice.line())
    print(f"{len(measurements)} measurements in {time.time() - started:.1f} s, {threads} CPU threads, "
          f"load average {max((m.loadavg for m in measurements), default=0):.1f}")
    if path:
        print(f"saved: {path} (used by `hivekeeper plan --hardware auto` on this machine)")
    busy = busy_words(measurements, os.cpu_count() or 1)
    if path and busy:  # saved all the same: the first plan at a quiet moment measures again (first_measure.why_measure)
        print(f"note: measured {busy}; the first `plan --hardware auto` at a load of at most "
              f"{quiet_load(os.cpu_count() or 1):g} measures it again quickly", file=sys.stderr)
    if dropped:
        print("the previous calibration was fitted to the old numbers and is dropped: run `hivekeeper profile` again",
              file=sys.stderr)
    if out is not None:
        print(f"hardware file: {out}")
    return 0


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "B/s":
        return f"{value / 1e9:.3g} GB/s"
    if unit == "FLOP/s":
        return f"{value / 1e9:.3g} GFLOP/s" if value < 1e12 else f"{value / 1e12:.3g} TFLOP/s"
    if unit == "bit/s":
        return f"{value / 1e6:.4g} Mbit/s"
    if unit == "s":
        return f"{value * 1e3:.3g} ms"
    if unit == "weights/s":
        return f"{value / 1e9:.3g} G weights/s"
    return f"{value:.3g}{unit}" if unit == "x" else f"{value:.3g} {unit}"


def render(rows) -> str:
    """A table: part, quantity, catalog (or estimate), measured, spread of the repeats (comparison_rows: every saved
    measurement has a row); a measured "weights in cache" row is marked, and a note under the table says what it
    times (cached_note)."""
    from hivekeeper.core.machine.measurement import PACKED_CACHED_KEY

    lines = [("part", "quantity", "catalog/estimate", "measured", "spread")]
    cached = False
    for r in rows:
        if r.measured is None and r.catalog is None:
            continue
        marked = r.measured is not None and r.key.startswith(PACKED_CACHED_KEY)
        cached = cached or marked
        lines.append((r.part, r.quantity + (" *" if marked else ""), _value(r.catalog, r.unit),
                      _value(r.measured, r.unit), "-" if r.spread is None else f"{100 * r.spread:.0f}%"))
    widths = [max(len(line[i]) for line in lines) for i in range(5)]
    table = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)
    return f"{table}\n{cached_note()}" if cached else table


def cached_note() -> str:
    """What the "weights in cache" rows time, and why they can read below the streamed rows (measure.py's
    CACHED_RATE_CAVEAT), wrapped under the table."""
    import textwrap

    from hivekeeper.core.machine.measure import CACHED_RATE_CAVEAT

    return textwrap.fill("* weights in cache: one-row decode steps of a span a third of the last-level cache (a few "
                         "blocks) stepped again and again, its weights over each step less its blocks' fitted fixed "
                         f"cost; {CACHED_RATE_CAVEAT}.", width=116, subsequent_indent="  ")
