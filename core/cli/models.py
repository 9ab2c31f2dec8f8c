"""`hivekeeper models`: the models on this machine (core/runtime/library.py).

    hivekeeper models list [--json]   every model found: id, where it is, size, format, quantization, whether it
                                      fits here (the planner, for a chat with the default headroom), and its path
                                      (what --model takes)
    hivekeeper models rm ID           delete a model from Hivekeeper's folder or the Hugging Face cache; a model of
                                      Ollama, LM Studio or the bundled default is refused (exit 2, saying why)
"""

from __future__ import annotations

import argparse
import json
import sys

from hivekeeper.planner.errors import InputError

FOLDERS = ("Searched: the bundled default; Hivekeeper's models folder (HIVEKEEPER_MODELS_DIR, else the data "
           "folder's models/); the Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub); Ollama's models "
           "(OLLAMA_MODELS, else ~/.ollama/models); LM Studio's (HIVEKEEPER_LMSTUDIO_DIRS, else ~/.lmstudio/models "
           "and ~/.cache/lm-studio/models). Nothing is copied or downloaded.")
COLUMNS = ("ID", "SOURCE", "FORMAT", "QUANT", "SIZE", "FITS HERE", "PATH")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    listing = sub.add_parser("list", help="every model on this machine, with its size, format and fit",
                             description=FOLDERS)
    listing.add_argument("--json", action="store_true", help="a JSON list of objects instead of the table")
    listing.add_argument("--no-fit", action="store_true", help="skip the planner's fit (faster)")
    remove = sub.add_parser("rm", help="delete a model from Hivekeeper's folder or the Hugging Face cache")
    remove.add_argument("id", metavar="ID", help="the model's id, as `models list` shows it")


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        return list_models(args)
    if args.action == "rm":
        return remove(args.id)
    raise InputError("say what to do: `hivekeeper models list` or `hivekeeper models rm ID`")


def list_models(args: argparse.Namespace) -> int:
    from hivekeeper.core.runtime.library import add_fits, scan_library

    models = scan_library()
    if not args.no_fit:
        add_fits(models)
    if args.json:
        print(json.dumps([m.as_dict() for m in models], indent=2))
    elif not models:
        print("no models found (`hivekeeper models list --help` names the folders searched)", file=sys.stderr)
    else:
        print(table([row(m) for m in models]))
    return 0


def row(model) -> tuple[str, ...]:
    return (model.id, model.source, model.format, model.quantization, human_bytes(model.size_bytes),
            model.fit or "-", model.path)


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS) - 1)]
    lines = []
    for r in [COLUMNS, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1])
    return "\n".join(line.rstrip() for line in lines)


def human_bytes(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def remove(model_id: str) -> int:
    from hivekeeper.core.runtime.library import find_model, remove_model, scan_library

    model = find_model(scan_library(), model_id)
    freed = remove_model(model)
    print(f"removed {model.id} from {model.root} ({human_bytes(freed)} freed)")
    return 0
