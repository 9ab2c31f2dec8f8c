"""`hivekeeper COMMAND` imports only the module of the command it runs, and `--help` none of them: each command module
pulls its own dependencies (the planner, huggingface_hub, ...), and a process that imported them all took seconds to
start on a loaded machine (core/cli/main.py). The other commands are still listed, and an unknown one is refused."""

from __future__ import annotations

import json
import sys

from ...child_output import run

PROBE = """
import json, sys
from hivekeeper.core.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(m for m in sys.modules if m.startswith("hivekeeper.core.cli."))}))
"""


def probe(*args: str) -> tuple[int, list[str], str]:
    """(exit code, the hivekeeper.core.cli modules imported, stdout before the report) of main(args) in a child."""
    done = run([sys.executable, "-c", PROBE, *args], timeout=120)
    printed, _, report = done.stdout.rstrip("\n").rpartition("\n")
    found = json.loads(report)
    return found["code"], found["modules"], printed


def test_a_command_imports_its_module_only_and_help_lists_them_all():
    code, modules, printed = probe("demo-model", "--help")
    assert code == 0 and "usage: hivekeeper demo-model" in printed
    assert modules == ["hivekeeper.core.cli.demo_model", "hivekeeper.core.cli.main"]
    code, modules, printed = probe("--help")
    assert code == 0 and modules == ["hivekeeper.core.cli.main"]
    for command in ("plan", "generate", "serve", "models", "install-desktop"):
        assert f"\n    {command} " in printed or f"\n    {command}\n" in printed, printed
    code, modules, _ = probe("no-such-command")
    assert code == 2 and modules == ["hivekeeper.core.cli.main"]
