"""`hivekeeper models`: the models on this machine (core/runtime/library.py) and on the hub (core/runtime/hub_library.py).

    hivekeeper models list [--json]   every model found: id, where it is, size, format, quantization, whether it
                                      fits here (the planner, for a chat with the default headroom), and its path
                                      (what --model takes)
    hivekeeper models rm ID           delete a model from Hivekeeper's folder or the Hugging Face cache; a model of
                                      Ollama, LM Studio or the bundled default is refused (exit 2, saying why)
    hivekeeper models search TEXT     hub repos matching TEXT that Hivekeeper runs (llama, mistral, qwen2; GGUF
        [--limit N] [--json]          or safetensors): parameters, estimated size, whether that fits here
    hivekeeper models pull ID         download a hub model into Hivekeeper's models folder, with a progress bar;
        [--file NAME.gguf]            a rerun resumes a cut download; free disk space is checked first
"""

from __future__ import annotations

import argparse
import json
import sys

from hivekeeper.planner.errors import InputError

from hivekeeper.core.runtime.library import human_bytes

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
    search = sub.add_parser("search", help="hub models Hivekeeper runs, with size and fit",
                            description="Asks the Hugging Face hub (HF_ENDPOINT) for repos matching TEXT in GGUF or "
                                        "safetensors format whose architecture Hivekeeper runs. Sizes are estimates "
                                        "from the parameter count (GGUF: a 4-bit file).")
    search.add_argument("text", metavar="TEXT", help="words in the repo id, e.g. 'qwen2.5 0.5b'")
    search.add_argument("--limit", type=int, default=20, help="at most this many results per format (default 20)")
    search.add_argument("--json", action="store_true", help="a JSON list of objects instead of the table")
    search.add_argument("--no-fit", action="store_true", help="skip the fit on this machine")
    pull = sub.add_parser("pull", help="download a hub model into Hivekeeper's models folder",
                          description="Downloads a safetensors checkpoint, or one GGUF file (--file), into "
                                      "Hivekeeper's models folder (HIVEKEEPER_MODELS_DIR, else the data folder's "
                                      "models/) as ORG--NAME, where `models list` finds it. Free disk space is "
                                      "checked before the first byte; an interrupted pull resumes when run again.")
    pull.add_argument("id", metavar="ID", help="the hub repo id, ORG/NAME")
    pull.add_argument("--file", metavar="NAME.gguf", help="the GGUF file to fetch, when the repo holds several")
    pull.add_argument("--json", action="store_true",
                      help="JSON lines on stdout for a program (the app): {\"event\": \"plan\"|\"progress\"|\"done\", "
                           "\"done_bytes\", \"total_bytes\", \"path\"}")


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        return list_models(args)
    if args.action == "rm":
        return remove(args.id)
    if args.action == "search":
        return search(args)
    if args.action == "pull":
        return pull_json(args.id, args.file) if args.json else pull(args.id, args.file)
    raise InputError("say what to do: `hivekeeper models list|search TEXT|pull ID|rm ID`")


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


SEARCH_COLUMNS = ("ID", "FORMAT", "ARCH", "PARAMS", "SIZE (EST.)", "DOWNLOADS", "FITS HERE")


def search(args: argparse.Namespace) -> int:
    from hivekeeper.core.runtime.hub_library import add_size_fits, search_hub

    models = search_hub(args.text, args.limit)
    if not args.no_fit:
        add_size_fits(models)
    if args.json:
        print(json.dumps([m.as_dict() for m in models], indent=2))
    elif not models:
        print(f"no hub model matching {args.text!r} in a format and architecture Hivekeeper runs", file=sys.stderr)
    else:
        rows = [(m.id, m.format, m.architecture, human_count(m.parameters), human_bytes(m.size_bytes),
                 str(m.downloads), m.fit or "-") for m in models]
        print(table(rows, SEARCH_COLUMNS))
    return 0


def human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def pull(repo_id: str, gguf_file: str | None) -> int:
    from hivekeeper.core.runtime import hub_library

    plan = hub_library.plan_pull(repo_id, gguf_file)
    hub_library.check_disk(plan)
    total = sum(plan.files.values())
    print(f"pulling {repo_id} ({len(plan.files)} file(s), {human_bytes(total)}; "
          f"{human_bytes(plan.missing_bytes)} to download) into {hub_library.pull_folder(repo_id)}", file=sys.stderr)
    path = hub_library.pull(plan)
    print(f"pulled {repo_id}: {path}")
    print(f"run it with `hivekeeper chat --model {path}`", file=sys.stderr)
    return 0


PROGRESS_EVERY_S = 0.25


def pull_json(repo_id: str, gguf_file: str | None) -> int:
    """`pull --json`: the plan, then the bytes here every PROGRESS_EVERY_S (polled on a thread: the download
    itself reports to its progress bar on stderr), then the path."""
    import threading

    from hivekeeper.core.runtime import hub_library

    plan = hub_library.plan_pull(repo_id, gguf_file)
    hub_library.check_disk(plan)
    total = sum(plan.files.values())

    def emit(event: str, **fields) -> None:
        print(json.dumps({"event": event, "done_bytes": hub_library.downloaded_bytes(plan), "total_bytes": total,
                          **fields}), flush=True)

    emit("plan", folder=str(hub_library.pull_folder(repo_id)))
    finished = threading.Event()

    def report() -> None:
        while not finished.wait(PROGRESS_EVERY_S):
            emit("progress")

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        path = hub_library.pull(plan)
    finally:
        finished.set()
        reporter.join()
    emit("done", path=str(path))
    return 0


def row(model) -> tuple[str, ...]:
    return (model.id, model.source, model.format, model.quantization, human_bytes(model.size_bytes),
            model.fit or "-", model.path)


def table(rows: list[tuple[str, ...]], columns: tuple[str, ...] = COLUMNS) -> str:
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns) - 1)]
    lines = []
    for r in [columns, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1])
    return "\n".join(line.rstrip() for line in lines)


def remove(model_id: str) -> int:
    from hivekeeper.core.runtime.library import find_model, remove_model, scan_library

    model = find_model(scan_library(), model_id)
    freed = remove_model(model)
    print(f"removed {model.id} from {model.root} ({human_bytes(freed)} freed)")
    return 0
