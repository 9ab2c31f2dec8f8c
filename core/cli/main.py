"""The `hivekeeper` command line: a thin dispatcher over one module per subcommand.

Each command module has `add_arguments(parser)` and `run(args) -> int`, and keeps its top-level imports light
(argparse, the planner): torch and hivemind are imported inside `run`, so `hivekeeper plan` and `--help` start fast.
`main` imports only the module of the command it runs (the others are listed by name and help, which COMMANDS holds),
and the versions behind `--version` are read only when it is asked: every `hivekeeper` process starts with what its own
command needs (under load, importing all of them took seconds).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import NoReturn

from hivekeeper.planner.errors import InputError

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("hivekeeper.core.cli.plan", "recommend how to run a model on this machine or in the swarm"),
    "detect": ("hivekeeper.core.cli.detect", "show this machine's hardware: measured numbers once `hivekeeper measure` "
                                             "ran, else estimates (text; --json for a hardware JSON document)"),
    "demo-model": ("hivekeeper.core.cli.demo_model", "write a random-weight Llama checkpoint for offline use"),
    "generate": ("hivekeeper.core.cli.generate", "generate text once, for scripts and benchmarks (raw completion: no "
                                                 "chat template)"),
    "chat": ("hivekeeper.core.cli.chat", "chat in the terminal with a local or swarm model"),
    "api": ("hivekeeper.core.cli.api", "serve a model over a local OpenAI-compatible HTTP API"),
    "finetune": ("hivekeeper.core.cli.finetune", "train soft or deep prompts for a model, locally or in a swarm"),
    "models": ("hivekeeper.core.cli.models", "models on this machine and the hub: list, search, pull, rm"),
    "serve": ("hivekeeper.core.cli.serve", "serve a span of a model's blocks to a swarm"),
    "swarm": ("hivekeeper.core.cli.swarm", "inspect a swarm: who serves a model's blocks (swarm status), the models it "
                                           "serves (swarm models)"),
    "node": ("hivekeeper.core.cli.node", "this machine's node: what it has served (node stats)"),
    "measure": ("hivekeeper.core.cli.measure", "micro-benchmark this machine and save a hardware profile"),
    "profile": ("hivekeeper.core.cli.profile", "profile the runtime and calibrate the planner"),
    "app": ("hivekeeper.core.cli.app", "open the desktop app"),
    "install-desktop": ("hivekeeper.core.cli.install_desktop", "add the app and the node service to your desktop"),
}


class OneLineParser(argparse.ArgumentParser):
    """A parser whose usage errors (a value of the wrong type, a missing required option, an unknown choice) are one
    line on stderr naming the argument, with exit status 2, as every other bad input is (README); `--help` still
    prints the whole usage. Each command's parser, and theirs in turn, is one (add_subparsers takes the parent's
    class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class VersionAction(argparse.Action):
    """`--version`: prints core/version.py's line and exits, reading the package metadata only then."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="show program's version number and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from hivekeeper.core.version import version_line

        print(version_line())
        parser.exit()


def requested_command(argv: list[str]) -> str:
    """The command argv names ('' for none or an unknown one): its first word that is not an option, since the
    top level has only -h and --version."""
    word = next((word for word in argv if not word.startswith("-")), "")
    return word if word in COMMANDS else ""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only` (a command, or '' for none), the other commands are listed by name and help
    without importing their modules, so they have no options here."""
    parser = OneLineParser(prog="hivekeeper", description="Plan, run and serve large language models.")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if only is not None and name != only:
            if importlib.util.find_spec(module_name) is not None:  # a command not written yet is simply absent
                sub.add_parser(name, help=help_text, description=help_text)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # a command not written yet is simply absent
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=requested_command(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except InputError as exc:
        print(f"hivekeeper {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and friends: stop quietly
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"hivekeeper {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
