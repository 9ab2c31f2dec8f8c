"""`make mutate`'s warm skip (tests/mutate.py): a scope whose tracked verdicts decide every mutant of the current
code does not run mutmut, even in a fresh clone (no build/); a changed function, or a mutant without a verdict, makes
it run again.

A toy project stands in for the repository (tests/mutate.py's ROOT, WORK and VERDICTS point into tmp_path): one
scope over planner/toy.py. mutmut itself is not run: `run_mutmut` is replaced by a stand-in that records the call and
writes what mutmut would (a verdict for every mutant, named and hashed by mutmut's own mutate_file_contents). The
checks of the skip (mutant names and function hashes of the current code) run for real.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("mutmut")

PYPROJECT = """[project]
name = "toy"

[tool.mutmut]
pytest_add_cli_args = []

[tool.mutmut.scopes.toy]
files = ["planner/toy.py"]
tests = ["tests/test_toy.py"]
minutes = 1
"""
TOY = "def double(x):\n    return x * 2\n\n\ndef clamp(x, low, high):\n    return max(low, min(x, high))\n"


@pytest.fixture
def mutate(tmp_path, monkeypatch):
    """tests/mutate.py as a fresh module, run on a toy project in tmp_path; `mutate.calls` lists the mutmut runs."""
    spec = importlib.util.spec_from_file_location("mutate_under_test", Path(__file__).parent / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = tmp_path / "project"
    (root / "planner").mkdir(parents=True)
    (root / "core").mkdir()
    (root / "tests").mkdir()
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "planner" / "toy.py").write_text(TOY)
    (root / "tests" / "test_toy.py").write_text("def test_nothing_here():\n    pass\n")
    monkeypatch.setattr(module, "ROOT", root)
    monkeypatch.setattr(module, "WORK", root / "build" / "mutate")
    monkeypatch.setattr(module, "VERDICTS", root / "tests" / "mutation_verdicts")
    module.calls, module.named, module.survivor_left = [], [], True

    def mutmut_stand_in(folder, jobs, seconds, names=(), scope=None):
        """What `mutmut run` leaves: a verdict for every current mutant of the scope's file."""
        from mutmut.mutation.file_mutation import mutate_file_contents

        module.calls.append(folder)
        module.named.append(sorted(names))
        monkeypatch.chdir(folder)
        path = "src/hivekeeper/planner/toy.py"
        mutated = mutate_file_contents(path, (folder / path).read_text())
        # every mutant killed (exit code 1) but double's first, which survives (0) until a test is added for it
        survivor = "hivekeeper.planner.toy.x_double__mutmut_1"
        meta = {"exit_code_by_key": {f"hivekeeper.planner.toy.{name}": int(not module.survivor_left or
                                                                           f"hivekeeper.planner.toy.{name}" != survivor)
                                     for name in mutated.mutant_names},
                "hash_by_function_name": dict(mutated.hash_by_function_name), "type_check_error_by_key": {},
                "durations_by_key": {}, "estimated_durations_by_key": {}}
        (folder / "mutants" / f"{path}.meta").parent.mkdir(parents=True, exist_ok=True)
        (folder / "mutants" / f"{path}.meta").write_text(json.dumps(meta))
        return 0, ""

    monkeypatch.setattr(module, "run_mutmut", mutmut_stand_in)
    return module


def fresh_clone_run(mutate, capsys) -> tuple[dict, str]:
    """`python tests/mutate.py toy` with build/ removed (as in a fresh clone): its JSON line and stderr."""
    shutil.rmtree(mutate.WORK, ignore_errors=True)
    capsys.readouterr()
    assert mutate.main(["toy"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out.splitlines()[-1]), out.err


def test_a_fresh_clone_with_complete_verdicts_skips_mutmut_and_a_changed_function_runs_it(mutate, capsys):
    first, _ = fresh_clone_run(mutate, capsys)  # no verdicts yet: mutmut runs and its verdicts are tracked
    assert len(mutate.calls) == 1 and first["killed"] == first["mutants"] - 1 > 4 and first["survived"] == 1
    tracked = (mutate.VERDICTS / "toy.jsonl").read_text()
    assert "x_double" in tracked and "x_clamp" in tracked

    again, err = fresh_clone_run(mutate, capsys)
    assert len(mutate.calls) == 1, "mutmut ran although every mutant had a verdict"
    assert "every mutant of the current code has a verdict; mutmut not run" in err
    assert again["killed"] == first["killed"] and again["survived_names"] == first["survived_names"]

    toy = mutate.ROOT / "planner" / "toy.py"
    toy.write_text(TOY.replace("max(low, min(x, high))", "min(high, max(x, low))"))  # clamp changed
    fresh_clone_run(mutate, capsys)
    assert len(mutate.calls) == 2, "mutmut did not run for a changed function"


def test_a_mutant_without_a_verdict_makes_mutmut_run(mutate, capsys):
    fresh_clone_run(mutate, capsys)
    verdicts = mutate.VERDICTS / "toy.jsonl"
    lines = [json.loads(line) for line in verdicts.read_text().splitlines()]
    for line in lines:  # forget one verdict of double's
        (path, value), = line.items()
        if "hashes" not in value and any(name.endswith("x_double") for name in value):
            codes = next(iter(value.values()))
            codes.pop(sorted(codes)[0])
    verdicts.write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
    fresh_clone_run(mutate, capsys)
    assert len(mutate.calls) == 2


def test_a_survivors_run_tests_the_survivors_and_the_changed_functions_mutants_in_one_mutmut_run(mutate, capsys):
    """After new tests and a code change (clamp), `--survivors` hands mutmut both: double's survivor, and every mutant
    of clamp (whose verdicts went stale with its hash), not double's killed mutants."""
    fresh_clone_run(mutate, capsys)
    toy = mutate.ROOT / "planner" / "toy.py"
    toy.write_text(TOY.replace("max(low, min(x, high))", "min(high, max(x, low))"))
    mutate.survivor_left = False  # the new test kills it
    assert mutate.main(["toy", "--survivors"]) == 0
    named = mutate.named[-1]
    assert "hivekeeper.planner.toy.x_double__mutmut_1" in named
    assert not [name for name in named if "x_double" in name and not name.endswith("__mutmut_1")]
    clamp = [name for name in named if "x_clamp__mutmut_" in name]
    assert len(clamp) > 3 and len(named) == len(clamp) + 1
    assert json.loads(capsys.readouterr().out.splitlines()[-1]).get("survived", 0) == 0


def test_a_changed_test_list_drops_mutmuts_recorded_test_runs_not_the_verdicts(mutate, capsys):
    """mutmut resets every verdict when its test selection changed since its recorded test runs (mutmut-stats.json):
    a warm scope folder whose tests changed loses those runs instead (mutmut collects them again, as in a fresh
    clone) and keeps its verdicts; with the same tests a warm run keeps them."""
    fresh_clone_run(mutate, capsys)
    folder = mutate.WORK / "toy"
    stats, meta = folder / "mutants" / "mutmut-stats.json", folder / "mutants" / "src/hivekeeper/planner/toy.py.meta"
    stats.write_text("{}")
    verdicts = meta.read_text()
    shared, scopes = mutate.settings()
    mutate.prepare("toy", shared, scopes["toy"])
    assert stats.is_file(), "the same tests dropped mutmut's recorded runs"
    pyproject = mutate.ROOT / "pyproject.toml"
    pyproject.write_text(PYPROJECT.replace('"tests/test_toy.py"]', '"tests/test_toy.py", "tests/test_more.py"]'))
    shared, scopes = mutate.settings()
    mutate.prepare("toy", shared, scopes["toy"])
    assert not stats.exists() and meta.read_text() == verdicts
    stats.write_text("{}")
    pyproject.write_text(pyproject.read_text().replace("pytest_add_cli_args = []", 'pytest_add_cli_args = ["-x"]'))
    shared, scopes = mutate.settings()
    mutate.prepare("toy", shared, scopes["toy"])
    assert not stats.exists(), "changed pytest arguments kept mutmut's recorded runs"
