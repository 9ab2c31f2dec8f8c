"""The `hivekeeper` command line: a thin dispatcher over one module per subcommand.

Each command module has `add_arguments(parser)` and `run(args) -> int`, and keeps its top-level imports light
(argparse, the planner): torch and hivemind are imported inside `run`, so `hivekeeper plan` and `--help` start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hivekeeper.planner.errors import InputError

from hivekeeper.core.version import version_line

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("hivekeeper.core.cli.plan", "recommend how to run a model on this machine or in the swarm"),
    "detect": ("hivekeeper.core.cli.detect", "show the detected hardware (text; --json for a hardware JSON document)"),
    "demo-model": ("hivekeeper.core.cli.demo_model", "write a random-weight Llama checkpoint for offline use"),
    "generate": ("hivekeeper.core.cli.generate", "generate text once, for scripts and benchmarks"),
    "chat": ("hivekeeper.core.cli.chat", "chat in the terminal with a local or swarm model"),
    "api": ("hivekeeper.core.cli.api", "serve a model over a local OpenAI-compatible HTTP API"),
    "finetune": ("hivekeeper.core.cli.finetune", "train soft or deep prompts for a model, locally or in a swarm"),
    "models": ("hivekeeper.core.cli.models", "models on this machine and the hub: list, search, pull, rm"),
    "serve": ("hivekeeper.core.cli.serve", "serve a span of a model's blocks to a swarm"),
    "swarm": ("hivekeeper.core.cli.swarm", "inspect a swarm (swarm status)"),
    "node": ("hivekeeper.core.cli.node", "this machine's node: what it has served (node stats)"),
    "measure": ("hivekeeper.core.cli.measure", "micro-benchmark this machine and save a hardware profile"),
    "profile": ("hivekeeper.core.cli.profile", "profile the runtime and calibrate the planner"),
    "app": ("hivekeeper.core.cli.app", "open the desktop app"),
    "install-desktop": ("hivekeeper.core.cli.install_desktop", "add the app and the node service to your desktop"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivekeeper", description="Plan, run and serve large language models.")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
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
    parser = build_parser()
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
