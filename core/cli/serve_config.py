"""`hivekeeper serve --config FILE`: a node's flags kept in a JSON file, for the headless node service.

The file is one JSON object whose keys are serve's flags without the leading dashes and whose values are what the
flag takes: {"model": "smollm2-135m-instruct", "new-swarm": true, "num-blocks": 8, "initial-peers": ["/ip4/..."]}.
A switch is true or false, a flag that takes several values takes a list, the others a string or a number
(packaging/linux/node.example.json). The values are checked by serve's own argument parser, so a file accepts
exactly what the command line does; a flag given on the command line as well wins over the file. Every problem
(unreadable file, bad JSON, unknown key, bad value) is one InputError naming the file and the key.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from hivekeeper.planner.errors import InputError

AddArguments = Callable[[argparse.ArgumentParser], None]  # serve's add_arguments (serve imports this module)


class ConfigParser(argparse.ArgumentParser):
    """serve's parser with its errors raised as InputError (argparse would print usage and exit)."""

    def error(self, message: str):
        raise InputError(message)


def config_argv(doc: dict, parser: argparse.ArgumentParser) -> list[str]:
    """The command-line words that say what the config object `doc` says."""
    actions = {option[2:]: action for action in parser._actions for option in action.option_strings
               if option.startswith("--")}
    argv: list[str] = []
    for key, value in doc.items():
        action = actions.get(key)
        if action is None or key in ("config", "help"):
            known = ", ".join(sorted(name for name in actions if name not in ("config", "help")))
            raise InputError(f"unknown key {key!r} (the keys are serve's flags: {known})")
        if action.nargs == 0:  # a switch
            if not isinstance(value, bool):
                raise InputError(f"{key!r} is a switch: true or false, got {value!r}")
            argv += [f"--{key}"] if value else []
        elif action.nargs in ("+", "*"):
            if not isinstance(value, list) or not value or not all(isinstance(v, (str, int, float)) for v in value):
                raise InputError(f"{key!r} takes a non-empty list of values, got {value!r}")
            argv += [f"--{key}", *map(str, value)]
        else:
            if isinstance(value, (bool, list, dict)) or value is None:
                raise InputError(f"{key!r} takes one string or number, got {json.dumps(value)}")
            argv += [f"--{key}={value}"]
    return argv


def read_config(path: str | Path, add_arguments: AddArguments) -> argparse.Namespace:
    """The flags in the config file at `path`, parsed and checked by a parser that `add_arguments` (serve's) fills
    (defaults for the rest)."""
    path = Path(path).expanduser()
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"{path}: cannot read the node config ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise InputError(f"{path}: the node config must be a JSON object of serve's flags, e.g. "
                         '{"model": "smollm2-135m-instruct", "new-swarm": true}')
    parser = ConfigParser(prog="hivekeeper serve", add_help=False)
    add_arguments(parser)
    try:
        return parser.parse_args(config_argv(doc, parser))
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


def apply_config(args: argparse.Namespace, add_arguments: AddArguments) -> argparse.Namespace:
    """`args` with the values of its --config file filled in where the command line left a flag at its default
    (`add_arguments`: serve's flags). Without --config, `args` as it is. Either way --model must be set by then."""
    if getattr(args, "config", None):
        defaults = argparse.ArgumentParser(add_help=False)
        add_arguments(defaults)
        merged = read_config(args.config, add_arguments)
        for name, value in vars(args).items():
            if name != "config" and value != defaults.get_default(name):
                setattr(merged, name, value)
        merged.config = args.config
        args = merged
    if not args.model:
        raise InputError("--model is required (on the command line or as \"model\" in the --config file)")
    return args
