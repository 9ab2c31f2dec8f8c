"""`hivekeeper profile`: time the real runtime over a grid and calibrate the planner; `--report` shows how well
each form (uncalibrated and calibrated cost model, idealized α(p) + β(o − 1)) predicts what was measured."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hivekeeper.planner.errors import InputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID

    parser.add_argument("--model", default=DEFAULT_MODEL_ID,
                        help=f"checkpoint folder, GGUF file or hub id (from the local cache) to profile; default "
                             f"{DEFAULT_MODEL_ID}, the built-in model (as chat and generate)")
    parser.add_argument("--quick", action="store_true", help="a small grid, 2 repeats (for a first look and tests)")
    parser.add_argument("--prompt-lens", metavar="N,N,...", help="prompt lengths (default 16,64,256,1024)")
    parser.add_argument("--output-lens", metavar="N,N,...", help="output lengths (default 1,32)")
    parser.add_argument("--batch-sizes", metavar="N,N,...", help="batch sizes (default 1,2,4)")
    parser.add_argument("--placements", metavar="NAME,...",
                        help="resident (default), ram (GPU: weights streamed from RAM), disk (half the blocks on disk)")
    parser.add_argument("--repeats", metavar="N",
                        help="repeats of the whole grid; each point keeps their median (default 3)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--no-save", action="store_true", help="do not save the calibration in the machine profile")
    parser.add_argument("--report", action="store_true", help="report the saved calibration instead of profiling")
    parser.add_argument("--png", metavar="FILE", help="also draw the report as a PNG (needs matplotlib)")
    parser.add_argument("--profile-file", metavar="FILE",
                        help="the machine profile to report (default: this machine's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _int_list(text: str | None, option: str, default: tuple[int, ...], high: int) -> tuple[int, ...]:
    if text is None:
        return default
    return tuple(sorted({_int_value(part, option, high, listed=text) for part in text.split(",")}))


def _int_value(text: str, option: str, high: int, listed: str | None = None) -> int:
    """One integer from 1 to `high` of an option (`listed`: the whole comma-separated value it is part of); an
    InputError naming the option otherwise."""
    try:
        value = int(text.strip())
    except ValueError:
        raise InputError(f"--{option} must be integers separated by commas, got {listed!r}" if listed is not None
                         else f"--{option} must be an integer, got {text!r}") from None
    if not 1 <= value <= high:
        raise InputError(f"--{option} {'values ' if listed is not None else ''}must be from 1 to {high}, got {value}")
    return value


def build_grid(args: argparse.Namespace):
    from hivekeeper.core.machine.profiling import QUICK_GRID, ProfileGrid

    base = QUICK_GRID if args.quick else ProfileGrid()
    repeats = base.repeats
    if args.repeats is not None:
        repeats = _int_value(args.repeats, "repeats", 50)
    placements = base.placements
    if args.placements:
        placements = tuple(p.strip() for p in args.placements.split(",") if p.strip())
    return ProfileGrid(
        prompt_lens=_int_list(args.prompt_lens, "prompt-lens", base.prompt_lens, 10_000_000),
        output_lens=_int_list(args.output_lens, "output-lens", base.output_lens, 10_000_000),
        batch_sizes=_int_list(args.batch_sizes, "batch-sizes", base.batch_sizes, 65536),
        placements=placements, repeats=repeats,
    )


def given_profile(text: str):
    """The machine profile at --profile-file, a file the user chose: one that is no profile is said to be so, with
    what was expected, not this machine's own profile's advice (delete it, measure again)."""
    from hivekeeper.core.machine.profile_files import profiles_dir
    from hivekeeper.core.machine.profiles import MachineProfile

    path = Path(text).expanduser()
    profile = f"a profile is the JSON file `hivekeeper measure` and `hivekeeper profile` save in {profiles_dir()}"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"--profile-file {path}: cannot read it ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputError(f"--profile-file {path}: not a machine profile (not one JSON document); {profile}") from None
    if not isinstance(doc, dict) or not {"version", "fingerprint"} & doc.keys():
        raise InputError(f"--profile-file {path}: not a machine profile (not a JSON object with 'version' and "
                         f"'fingerprint'); {profile}")
    return MachineProfile.from_dict(doc, str(path))


def _report(args: argparse.Namespace) -> int:
    from hivekeeper.core.machine.profiles import load_machine_profile
    from hivekeeper.core.machine.profiling import render_report, report_dict, write_report_png

    if args.profile_file:
        profile = given_profile(args.profile_file)
    else:
        profile = load_machine_profile()
        if profile is None:
            raise InputError("this machine has no saved profile: run `hivekeeper profile` first")
    if profile.calibration is None:
        raise InputError(f"{profile.path}: no calibration in this profile: run `hivekeeper profile`")
    png = write_report_png(profile.calibration, args.png) if args.png else None
    if args.json:
        doc = report_dict(profile.calibration)
        doc["png"] = str(png) if png else None
        print(json.dumps(doc))
    else:
        print(render_report(profile.calibration))
        if png:
            print(f"plot: {png}")
    return 0


def saved_words(calibration) -> str:
    """What the saved calibration changes for the plans here: the factors it moved, or that it moved none (a packed
    model's steps are priced from the kernels `measure` timed, which the fit keeps: it then changes no plan)."""
    from hivekeeper.core.machine.profiling import moved_factors
    from hivekeeper.planner.formats import PACKED_FORMATS

    moved = moved_factors(calibration)
    if moved:
        return f"plans on this machine now use the calibrated factors: {', '.join(moved)}"
    formats = {policy.weight_format for policy in calibration.policies.values()}
    why = (f"{'/'.join(sorted(formats))} steps are priced from the kernels `hivekeeper measure` timed, which it keeps"
           if formats <= set(PACKED_FORMATS) else "the measurement already predicts these runs as well as it can")
    return f"the fit moved no factor ({why}): plans here stay as measured"


def run(args: argparse.Namespace) -> int:
    if args.report:
        return _report(args)
    if args.device not in (None, "cpu", "cuda") and not str(args.device).startswith("cuda:"):
        raise InputError(f"--device must be cpu or cuda, got {args.device!r}")
    grid = build_grid(args)
    if args.png and not Path(args.png).expanduser().parent.is_dir():
        raise InputError(f"--png {args.png}: folder does not exist")

    from hivekeeper.planner.calibration import measured_efficiency

    from hivekeeper.core.runtime.checkpoint import resolve_checkpoint
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.offload.offloaded_model import use_physical_cores
    from hivekeeper.core.machine.profiles import load_machine_profile, new_profile, save_profile
    from hivekeeper.core.machine.measure import TerminalProgress, sizes_from_environment
    from hivekeeper.core.machine.read_again import SecondLook
    from hivekeeper.core.machine.profiling import profile_model, render_report, report_dict, write_report_png

    path = resolve_checkpoint(args.model)
    threads = use_physical_cores()
    detected = detect_hardware()
    profile = load_machine_profile(detected) or new_profile(detected)
    if not profile.measurements:
        print("note: this machine has not been measured (`hivekeeper measure`): the planner's numbers are estimates, "
              "and calibration can only scale them down", file=sys.stderr)
    hardware = profile.hardware(detected)
    base = measured_efficiency(hardware)  # what the planner uses before calibration; every fit starts from it
    look = SecondLook(profile.measurements, detected, profile.measured_at, sizes_from_environment("quick"))
    calibration = profile_model(path, grid, hardware, profile.fingerprint, base=base, device=args.device,
                                progress=TerminalProgress("profile "), threads=threads, read_again=look)
    profile.measurements = look.kept(calibration)  # the new reading where the fit was made against it
    saved = None
    if not args.no_save:
        profile.calibration = calibration
        saved = save_profile(profile)
    png = write_report_png(calibration, args.png) if args.png else None
    if args.json:
        doc = report_dict(calibration)
        doc.update(saved=str(saved) if saved else None, png=str(png) if png else None)
        print(json.dumps(doc))
        return 0
    print(render_report(calibration))
    if saved:
        print(f"saved: {saved} ({saved_words(calibration)})")
    if png:
        print(f"plot: {png}")
    return 0

