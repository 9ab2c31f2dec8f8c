"""`hivekeeper profile` as a newcomer meets it (session 23), through the real main() in this process (the `cli`
fixture): without --model it profiles the built-in model, as chat and generate run it, and where that model is not
installed it says how to install it or what else to name; a --profile-file that is no profile is said to be one,
without the advice for this machine's own profile (delete it, measure again)."""

from __future__ import annotations

import json

import pytest

from hivekeeper.core.runtime import default_model
from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, INSTALL_HINT, default_model_file

from .test_cli_defects import one_line

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the smallest grid profile accepts: two prompt lengths and two output lengths (the idealized fit has slopes in both)
TINY_GRID = ("--prompt-lens", "4,8", "--output-lens", "1,2", "--batch-sizes", "1", "--repeats", "1")


@pytest.mark.skipif(default_model_file() is None, reason=f"the default model is not installed ({INSTALL_HINT})")
def test_without_model_it_profiles_the_built_in_model(cli):
    """It said "--model is required (a checkpoint folder or hub id)" while its help named the built-in model."""
    assert f"default {DEFAULT_MODEL_ID}" in " ".join(cli("profile", "--help").stdout.split())
    result = cli("profile", *TINY_GRID, "--no-save", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["model_path"] == str(default_model_file()) and len(report["points"]) == 4
    assert report["saved"] is None


def test_without_the_built_in_model_it_says_how_to_install_it_or_what_to_name(monkeypatch, cli):
    monkeypatch.setattr(default_model, "PACKAGE", "hivekeeper_no_such_package")
    result = cli("profile", *TINY_GRID, "--no-save")
    assert result.returncode == 2 and result.stdout == ""
    line = one_line(result)
    assert DEFAULT_MODEL_ID in line and INSTALL_HINT in line and "a GGUF file" in line, line


@pytest.mark.parametrize("text, why", [('{"a": 1}\n{"b": 2}\n', "not one JSON document"),
                                       ('{"rows": [1, 2]}', "not a JSON object with 'version' and 'fingerprint'"),
                                       ("[1, 2]", "not a JSON object with 'version' and 'fingerprint'")])
def test_a_given_file_that_is_no_profile_is_said_to_be_one(tmp_path, cli, text, why):
    """`profile --report --profile-file data.jsonl` said "not valid JSON (...); delete it or run `hivekeeper measure`
    again": advice about this machine's own profile, given for a file the user chose."""
    given = tmp_path / "data.jsonl"
    given.write_text(text)
    result = cli("profile", "--report", "--profile-file", str(given))
    assert result.returncode == 2 and result.stdout == ""
    line = one_line(result)
    assert f"--profile-file {given}: not a machine profile ({why}); a profile is the JSON file" in line, line
    assert "delete" not in line and "again" not in line, line
    assert given.read_text() == text


def test_repeats_is_one_number_and_said_to_be(cli):
    """`--repeats 0` said "--repeats values must be from 1 to 50" (the words of the comma-separated lists)."""
    for given, words in (("0", "--repeats must be from 1 to 50, got 0"), ("x", "--repeats must be an integer, got 'x'"),
                         ("2,3", "--repeats must be an integer, got '2,3'")):
        result = cli("profile", "--repeats", given, "--no-save")
        assert result.returncode == 2 and words in result.stderr, result.stderr


def test_one_repeat_shows_no_spread(tiny_checkpoint, tmp_path, monkeypatch, cli):
    """`profile --repeats 1` printed a spread of 0% on every point: one timing has no spread ("-")."""
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path / "config"))  # not measured: each point timed once
    result = cli("profile", "--model", str(tiny_checkpoint), *TINY_GRID)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("place "))
    assert lines[header].split()[-2:] == ["spread", "load"]
    rows = lines[header + 1:header + 5]
    assert [row.split()[-2] for row in rows] == ["-"] * 4, "\n".join(lines[header:header + 5])
    report = json.loads(cli("profile", "--report", "--json").stdout)
    assert [point["repeats"] for point in report["points"]] == [1] * 4
