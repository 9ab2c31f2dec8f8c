"""`make mutate`: mutation testing with mutmut, one scope (a module where a silent bug hurts most) at a time.

mutmut names each mutant after its file's path (`src/` stripped) and imports the mutated copy from `mutants/src`,
but this project's packages live in planner/ and core/ under the names hivekeeper.planner and hivekeeper.core
(setuptools package-dir). So each scope runs in its own folder, build/mutate/<scope>/, holding a copy of the tree
laid out as src/hivekeeper/{planner,core}, the tests, and a pyproject.toml whose [tool.mutmut] is the project's
shared settings plus the scope's files, tests and functions (pyproject.toml, [tool.mutmut.scopes.*]); a scope's other
keys (e.g. timeout_multiplier) are mutmut settings of that scope.

Functions a scope leaves out get mutmut's `# pragma: no mutate block` in the copy only. Results stay in the scope's
folder: a later run tests only the mutants of functions that changed (mutmut's cache). build/ does not survive a
fresh clone, so each run also keeps its verdicts (each mutant's exit code, with the hash of its function's source) in
tests/mutation_verdicts/<scope>.json, and a scope folder without mutmut's files starts from them: only the mutants of
functions changed since, or never tested, run again; a scope whose verdicts decide every mutant of the current code
skips mutmut (whose own warm start runs the scope's tests twice). Each scope runs under a
deadline; at the deadline mutmut is stopped (what it finished is kept, the next run goes on from there) and its
output so far is shown. Prints one JSON line per scope: mutant counts, the score, the surviving mutants.

    python tests/mutate.py [--jobs N] [--minutes-scale X] [--survivors] [SCOPE ...] [--mutants PATTERN ...]
    (default: every scope, every mutant not yet tested)
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tokenize
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutate"
VERDICTS = ROOT / "tests" / "mutation_verdicts"  # tracked: the cache's verdicts, for a fresh clone
PACKAGES = ("planner", "core")  # the scopes' code; gui is not mutated
PRAGMA = "  # pragma: no mutate block"
BIN = Path(sys.executable).parent
SCOPE_KEYS = ("files", "tests", "functions", "minutes")  # a scope's other keys are mutmut settings (timeouts)


def settings() -> tuple[dict, dict[str, dict]]:
    """The shared [tool.mutmut] settings and the scopes, from the project's pyproject.toml."""
    config = dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"])
    return config, config.pop("scopes")


def copy_tree(source: Path, target: Path) -> None:
    """Copy a folder keeping modification times (mutmut mutates a file again only when it is newer than its
    mutants)."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def top_level_functions(path: Path) -> list[tuple[str, int]]:
    """(name or Class.name, line of the colon that ends its header) of each module-level function and method."""
    import ast

    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        prefix = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
        for member in members:
            if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + member.name, header_end(path, member.lineno)))
    return found


def header_end(path: Path, def_line: int) -> int:
    """The line of the ':' closing a `def` that starts on def_line (brackets in the signature are skipped)."""
    depth = 0
    with path.open("rb") as source:
        for token in tokenize.tokenize(source.readline):
            if token.start[0] < def_line or token.type != tokenize.OP:
                continue
            if token.string in "([{":
                depth += 1
            elif token.string in ")]}":
                depth -= 1
            elif token.string == ":" and depth == 0:
                return token.start[0]
    raise ValueError(f"{path}:{def_line}: no end of the function header")


def leave_out(path: Path, keep: list[str]) -> list[str]:
    """Mark every function of `path` that no pattern of `keep` matches with mutmut's no-mutate pragma; returns the
    names left out."""
    lines = path.read_text().splitlines(keepends=True)
    left_out = []
    for name, line in top_level_functions(path):
        if not any(fnmatch.fnmatch(name, pattern) for pattern in keep):
            lines[line - 1] = lines[line - 1].rstrip("\n") + PRAGMA + "\n"
            left_out.append(name)
    path.write_text("".join(lines))
    return left_out


def date_scoped_file(path: Path, original: Path) -> None:
    """Give a scoped file the later modification time of its original and of pyproject.toml: mutmut mutates a file
    again when it is newer than its mutants, so a change of either (code, or the scope's settings) reaches them,
    and an unchanged pair keeps the cache."""
    newest = max(original.stat().st_mtime_ns, (ROOT / "pyproject.toml").stat().st_mtime_ns)
    os.utime(path, ns=(newest, newest))


def pyproject_for(shared: dict, scope: dict) -> str:
    """The project's pyproject.toml without its mutmut tables, plus a flat [tool.mutmut] for this scope."""
    kept, skipping = [], False
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("["):
            skipping = line.startswith("[tool.mutmut")
        if not skipping:
            kept.append(line)
    values = dict(shared, source_paths=["src/hivekeeper"],
                  only_mutate=[f"src/hivekeeper/{file}" for file in scope["files"]],
                  pytest_add_cli_args_test_selection=scope["tests"],
                  **{key: value for key, value in scope.items() if key not in SCOPE_KEYS})
    kept += ["", "[tool.mutmut]", *(f"{key} = {json.dumps(value)}" for key, value in values.items())]
    return "\n".join(kept) + "\n"


def prepare(name: str, shared: dict, scope: dict) -> Path:
    """build/mutate/<name>/ with the current code and tests, ready for `mutmut run` (its mutants/ kept)."""
    folder = WORK / name
    for package in PACKAGES:
        copy_tree(ROOT / package, folder / "src" / "hivekeeper" / package)
    copy_tree(ROOT / "tests", folder / "tests")
    (folder / "pyproject.toml").write_text(pyproject_for(shared, scope))
    forget_stats_of_other_tests(folder, shared, scope)
    for file in scope["files"]:
        copy = folder / "src" / "hivekeeper" / file
        if "functions" in scope:
            leave_out(copy, scope["functions"])
        date_scoped_file(copy, ROOT / file)
    # data files are copied into mutants/ only when missing: drop the old copies so that changes reach the tests
    mutated = folder / "mutants" / "src"
    if mutated.is_dir():
        for path in mutated.rglob("*"):
            if path.is_file() and path.suffix not in (".py", ".meta", ".spans"):
                path.unlink()
    return folder


def forget_stats_of_other_tests(folder: Path, shared: dict, scope: dict) -> None:
    """Drop mutmut's recorded test runs (mutants/mutmut-stats.json) where the scope's tests or pytest arguments
    changed since they were recorded (build/mutate/<scope>/tests.json). With them, mutmut would see its settings
    changed and reset every verdict (session 13: 2193 costmodel verdicts lost to two added test files); without them
    it collects the tests' runs again, as in a fresh clone, and keeps each verdict whose function is unchanged."""
    tests = json.dumps({"args": shared.get("pytest_add_cli_args", []), "tests": scope["tests"]})
    record, stats = folder / "tests.json", folder / "mutants" / "mutmut-stats.json"
    if stats.is_file() and (not record.is_file() or record.read_text() != tests):
        stats.unlink()
    record.write_text(tests)


def save_verdicts(name: str, folder: Path) -> None:
    """The scope's decided verdicts, by mutmut's meta file: the function hashes, and per mutated function its
    mutants' numbers and exit codes (one line per function)."""
    saved = {}
    for meta_path in sorted((folder / "mutants").rglob("*.py.meta")):
        meta = json.loads(meta_path.read_text())
        verdicts: dict[str, dict[str, int]] = {}
        for key, code in meta["exit_code_by_key"].items():
            if code is not None:
                function, number = key.rsplit("__mutmut_", 1)
                verdicts.setdefault(function, {})[number] = code
        saved[str(meta_path.relative_to(folder / "mutants"))] = {"hashes": meta["hash_by_function_name"],
                                                                  "verdicts": verdicts}
    VERDICTS.mkdir(exist_ok=True)
    lines = [json.dumps({path: {"hashes": data["hashes"]}}, sort_keys=True) for path, data in saved.items()]
    lines += [json.dumps({path: {function: codes}}, sort_keys=True)
              for path, data in saved.items() for function, codes in sorted(data["verdicts"].items())]
    (VERDICTS / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def restore_verdicts(name: str, folder: Path) -> int:
    """Write mutmut's meta files from tests/mutation_verdicts/<name>.jsonl where the folder has none (a fresh
    clone); mutmut keeps a verdict while its function's hash is unchanged. Returns the verdicts restored."""
    source = VERDICTS / f"{name}.jsonl"
    if not source.is_file():
        return 0
    metas: dict[str, dict] = {}
    for line in source.read_text().splitlines():
        (path, value), = json.loads(line).items()
        meta = metas.setdefault(path, {"exit_code_by_key": {}, "hash_by_function_name": {},
                                       "type_check_error_by_key": {}, "durations_by_key": {},
                                       "estimated_durations_by_key": {}})
        if set(value) == {"hashes"}:
            meta["hash_by_function_name"] = value["hashes"]
        else:
            (function, codes), = value.items()
            meta["exit_code_by_key"].update({f"{function}__mutmut_{n}": code for n, code in codes.items()})
    restored = 0
    for path, meta in metas.items():
        target = folder / "mutants" / path
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(meta, indent=4))
            restored += len(meta["exit_code_by_key"])
    return restored


# Run in the scope's folder (mutmut reads its settings there): each scoped file's mutant names and function hashes,
# as `mutmut run` would generate them, without its copying, coverage or test runs.
CURRENT_MUTANTS = """
import json, sys
from mutmut.mutation.file_mutation import mutate_file_contents
found = {}
for path in sys.argv[1:]:
    mutated = mutate_file_contents(path, open(path).read())
    found[path] = {"names": list(mutated.mutant_names), "hashes": dict(mutated.hash_by_function_name)}
print(json.dumps(found))
"""


def current_mutants(folder: Path, scope: dict) -> dict[str, bool] | None:
    """Each mutant of the scope's current code (by mutmut's full name) and whether the folder's verdicts (mutmut's,
    or those restored from the tracked .jsonl) decide it: a verdict recorded while its function's hash was the
    same. None where mutmut's generator could not tell."""
    paths = [f"src/hivekeeper/{file}" for file in scope["files"]]
    try:
        found = subprocess.run([sys.executable, "-c", CURRENT_MUTANTS, *paths], cwd=folder, capture_output=True,
                               text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None
    if found.returncode != 0:
        return None
    decided = {}
    for path, current in json.loads(found.stdout).items():
        meta_path = folder / "mutants" / f"{path}.meta"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        module = path.removeprefix("src/").removesuffix(".py").replace("/", ".")
        codes, hashes = meta.get("exit_code_by_key", {}), meta.get("hash_by_function_name", {})
        for name in current["names"]:
            function = name.rsplit("__mutmut_", 1)[0]
            decided[f"{module}.{name}"] = hashes.get(function) == current["hashes"].get(function) \
                and codes.get(f"{module}.{name}") is not None
    return decided


def up_to_date(folder: Path, scope: dict) -> bool:
    """True when the folder's verdicts decide every mutant of the scope's current code: same function hashes, no
    mutant untested. A warm run then skips mutmut, whose setup alone (coverage and a clean run of the scope's tests)
    takes minutes per scope on a busy machine."""
    decided = current_mutants(folder, scope)
    return decided is not None and all(decided.values())


def survivors_and_undecided(folder: Path, scope: dict, patterns: list[str]) -> list[str]:
    """What a `--survivors` run tests: the survivors of the current code and, in the same mutmut run (one setup of
    minutes instead of two), the mutants it has no verdict for (functions changed or added since), each matching one
    of `patterns` if any are given."""
    cached = results(folder)
    decided = current_mutants(folder, scope)
    survivors = cached.get("survived", []) + cached.get("no tests", [])
    if decided is None:  # the generator failed: the survivors only, as the cache names them
        names = survivors
    else:
        names = [name for name in survivors if decided.get(name)] + [name for name, ok in decided.items() if not ok]
    return [name for name in dict.fromkeys(names)
            if not patterns or any(fnmatch.fnmatch(name, pattern) for pattern in patterns)]


# Each mutant's test run is a pytest session of its own, and tests/conftest.py gives every session a fresh cache
# folder: the native kernels (core/runtime/kernels/native_kernels.py) were compiled again for every mutant whose tests
# run a model (20-40 s of a busy 2-core machine each). This C compiler wrapper keeps one build per source and flags.
REUSING_CC = """#!/bin/sh
case "$1" in --version|-v) exec "$HIVEKEEPER_MUTATE_CC" "$@";; esac
key="" out="" previous=""
for arg in "$@"; do
  if [ "$previous" = "-o" ]; then out="$arg"; else key="$key $arg"; fi
  case "$arg" in *.c) key="$key $(sha256sum < "$arg")";; esac
  previous="$arg"
done
[ -n "$out" ] || exec "$HIVEKEEPER_MUTATE_CC" "$@"
kept="$HIVEKEEPER_MUTATE_BUILDS/$(printf %s "$key" | sha256sum | cut -c1-32)"
if [ ! -f "$kept" ]; then
  "$HIVEKEEPER_MUTATE_CC" "$@" || exit $?
  cp "$out" "$kept.$$" && mv "$kept.$$" "$kept"
  exit 0
fi
cp "$kept" "$out"
"""


# A pytest plugin (PYTEST_PLUGINS, from WORK on PYTHONPATH): a mutant's tests run in the order of the scope's `tests`
# list, whatever order mutmut names them in (a set's). mutmut runs them with -x, so a scope that lists its fast
# in-process tests first stops a killed mutant before any slow one (a P2P daemon, a model) starts. It is loaded
# through the environment, not mutmut's pytest arguments: a change of those makes mutmut drop every verdict.
ORDER_PLUGIN = """import json, os
ORDER = json.loads(os.environ.get("HIVEKEEPER_MUTATE_ORDER", "[]"))
def rank(item):
    path = item.nodeid.removeprefix("mutants/")
    return next((i for i, listed in enumerate(ORDER) if path == listed or path.startswith(listed + "::")),
                len(ORDER))
def pytest_collection_modifyitems(items):
    items.sort(key=rank)
"""


def mutmut_environment(scope: dict | None = None) -> dict[str, str]:
    """The environment of a mutmut run: hypothesis's "mutate" profile, the scope's test order (ORDER_PLUGIN), and
    CC reusing native builds (REUSING_CC) unless CC is set or no compiler is found."""
    env = dict(os.environ)
    env.setdefault("HYPOTHESIS_PROFILE", "mutate")  # a failing property test is not shrunk (tests/conftest.py)
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "hk_mutate_order.py").write_text(ORDER_PLUGIN)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORK), env.get("PYTHONPATH")]))
    env["PYTEST_PLUGINS"] = ",".join(filter(None, ["hk_mutate_order", env.get("PYTEST_PLUGINS")]))
    env["HIVEKEEPER_MUTATE_ORDER"] = json.dumps((scope or {}).get("tests", []))
    compiler = shutil.which("cc") or shutil.which("gcc")
    if "CC" in env or compiler is None:
        return env
    wrapper, builds = WORK / "reusing-cc", WORK / "native-builds"
    builds.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(REUSING_CC)
    wrapper.chmod(0o755)
    env.update(CC=str(wrapper), HIVEKEEPER_MUTATE_CC=compiler, HIVEKEEPER_MUTATE_BUILDS=str(builds))
    return env


def run_mutmut(folder: Path, jobs: int, seconds: float, names: list[str] = (), scope: dict | None = None) \
        -> tuple[int | None, str]:
    """`mutmut run [names]` in folder, stopped (with its process group) at the deadline; (exit code or None,
    output). Named mutants are tested again even when the cache has a result for them."""
    log = folder / "run.log"
    with log.open("wb") as out:
        child = subprocess.Popen([str(BIN / "mutmut"), "run", "--max-children", str(jobs), *names], cwd=folder,
                                 stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=mutmut_environment(scope))
        try:
            code = child.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            code = None
    return code, log.read_bytes().decode(errors="replace").replace("\r", "\n")


def results(folder: Path) -> dict[str, list[str]]:
    """Mutant names by status ("killed", "survived", "no tests", "timeout", "not checked", ...), from the cache."""
    from mutmut.stats import status_by_exit_code

    by_status: dict[str, list[str]] = {}
    for meta in (folder / "mutants").rglob("*.py.meta"):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            by_status.setdefault(status_by_exit_code[code], []).append(name)
    return by_status


def summary(name: str, by_status: dict[str, list[str]], code: int | None, seconds: float) -> dict:
    """One scope's line: counts, the score (killed, timed out or crashed, over the mutants tested) and the
    survivors. A segfault is caught: the test run that met the mutant failed."""
    count = {status: len(names) for status, names in by_status.items()}
    caught = count.get("killed", 0) + count.get("timeout", 0) + count.get("caught by type check", 0) \
        + count.get("segfault", 0)
    tested = caught + count.get("survived", 0) + count.get("no tests", 0) + count.get("suspicious", 0)
    return {"scope": name, "finished": code == 0, "seconds": round(seconds), "mutants": sum(count.values()),
            **count, "score": round(caught / tested, 3) if tested else None,
            "survived_names": sorted(by_status.get("survived", []) + by_status.get("no tests", []))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scopes", nargs="*", help="scopes of [tool.mutmut.scopes] (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    parser.add_argument("--minutes-scale", type=float, default=1.0, help="multiply every scope's time limit")
    parser.add_argument("--survivors", action="store_true",
                        help="test again the mutants that survived (after tests were added: mutmut's cache "
                             "keeps a verdict until the function changes), and those of functions changed since")
    parser.add_argument("--mutants", nargs="+", default=[], metavar="PATTERN",
                        help="test again only the mutants whose names match these fnmatch patterns (after the "
                             "scopes: SCOPE --mutants '*BanList*'); with --survivors, the survivors that match")
    args = parser.parse_args(argv)
    shared, scopes = settings()
    unknown = [name for name in args.scopes if name not in scopes]
    if unknown:
        print(f"mutate: unknown scope {unknown[0]!r}; choose from {', '.join(scopes)}", file=sys.stderr)
        return 2
    results_ok = [run_scope(name, shared, scopes[name], args) for name in args.scopes or list(scopes)]
    return 0 if all(results_ok) else 1


def run_scope(name: str, shared: dict, scope: dict, args: argparse.Namespace) -> bool:
    """Prepare and run one scope, print its line; False when mutmut itself failed."""
    folder = prepare(name, shared, scope)
    restored = restore_verdicts(name, folder)
    if restored:
        print(f"mutate: {name}: {restored} verdicts from {VERDICTS.relative_to(ROOT)}/{name}.jsonl", file=sys.stderr)
    names, chosen = list(args.mutants), args.survivors or bool(args.mutants)
    if args.survivors:
        names = survivors_and_undecided(folder, scope, args.mutants)
    started = time.monotonic()
    if not chosen and up_to_date(folder, scope):
        print(f"mutate: {name}: every mutant of the current code has a verdict; mutmut not run", file=sys.stderr)
        chosen = True
    code, output = run_mutmut(folder, args.jobs, 60 * scope["minutes"] * args.minutes_scale, names, scope) \
        if names or not chosen else (0, "")
    if code not in (0, None):  # mutmut itself failed (a test failing without mutants, a setup error)
        print(f"mutate: mutmut failed in {folder} (exit {code}):\n{output[-3000:]}", file=sys.stderr)
    elif code is None:
        print(f"mutate: {name} stopped at its {scope['minutes'] * args.minutes_scale:g}-minute limit; the next run "
              f"goes on from here. Last output:\n{output[-600:]}", file=sys.stderr)
    print(json.dumps(summary(name, results(folder), code, time.monotonic() - started)), flush=True)
    if code in (0, None):
        save_verdicts(name, folder)
    return code in (0, None)


if __name__ == "__main__":
    sys.exit(main())
