"""Options argparse checks (a number typed as a word, a missing required option, an unknown choice) are refused in
one line on stderr naming the argument, with exit status 2, as the README promises of bad input: not the command's
13-line usage block. One real child process; every typed option of every command through the same `main()` in this
process (the `cli` fixture). Also what `hivekeeper --help` says of `swarm`, and that docs/plan-json.md's synopsis
lists every option of `plan`."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import pytest

from hivekeeper.core.cli.main import build_parser

from ...child_output import run

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def typed_options(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> list[tuple[tuple, str, str]]:
    """(the command's words, option, type name) of each option that argparse converts to an int or a float, in
    `parser` and its subcommands."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += typed_options(sub, (*words, name))
        elif action.option_strings and action.type in (int, float):
            found.append((words, action.option_strings[-1], action.type.__name__))
    return found


def test_a_word_for_a_number_is_one_line_naming_the_option():
    done = run([sys.executable, "-m", "hivekeeper.core.cli.main", "generate", "--prompt", "hi", "--temperature", "abc"],
               timeout=120, env=ENV)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("hivekeeper generate: error: argument --temperature: invalid float value: 'abc' "
                           "(see hivekeeper generate --help)\n")


def test_every_typed_option_of_every_command_is_refused_in_one_line(cli):
    options = typed_options(build_parser())
    assert {words[0] for words, _, _ in options} >= {"generate", "chat", "api", "serve", "finetune", "models"}
    for words, option, kind in options:
        done = cli(*words, option, "abc")
        command = " ".join(("hivekeeper", *words))
        assert done.returncode == 2 and done.stdout == "", (words, option, done)
        assert done.stderr == (f"{command}: error: argument {option}: invalid {kind} value: 'abc' "
                               f"(see {command} --help)\n"), (words, option)


@pytest.mark.parametrize("argv, said", [
    (["swarm", "status"], "hivekeeper swarm status: error: the following arguments are required: --model "
                          "(see hivekeeper swarm status --help)"),
    (["demo-model", "out", "--dtype", "fp7"], "hivekeeper demo-model: error: argument --dtype: invalid choice: 'fp7'"),
    (["no-such-command"], "hivekeeper: error: argument COMMAND: invalid choice: 'no-such-command'"),
])
def test_a_missing_option_or_an_unknown_choice_is_one_line_too(argv, said, cli):
    done = cli(*argv)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(said) and done.stderr.count("\n") == 1, done.stderr


def test_help_still_prints_the_whole_usage(cli):
    done = cli("generate", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: hivekeeper generate") and "--temperature" in done.stdout


def test_the_help_names_both_swarm_commands(cli):
    done = cli("--help")
    listed = " ".join(done.stdout.split())  # argparse wraps the help column
    assert done.returncode == 0 and "swarm status" in listed and "swarm models" in listed


def test_the_plan_json_synopsis_lists_every_plan_option():
    plan = build_parser(only="plan")._subparsers._group_actions[0].choices["plan"]
    doc = (Path(__file__).resolve().parents[3] / "docs" / "plan-json.md").read_text(encoding="utf-8")
    synopsis = doc.split("```")[1]
    options = [action.option_strings[-1] for action in plan._actions if action.option_strings[-1:] != ["--help"]]
    assert "--no-measure" in options
    assert [option for option in options if not re.search(rf"\[{option}[ \]]", synopsis)] == [], synopsis
