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


PULL_PROBE = """
import json, sys
from hivekeeper.core.runtime.hub_library import pull_files
checkpoint = pull_files("org/llama", {"config.json": 1, "model.safetensors": 2, "tokenizer.json": 3}, None)
single = pull_files("org/gguf", {"a-Q8_0.gguf": 1, "README.md": 2}, None)
print(json.dumps({"checkpoint": checkpoint, "single": single, "torch": "torch" in sys.modules}))
"""


def test_models_pull_chooses_a_repos_files_without_importing_torch():
    """`models pull` picks the files as a checkpoint load would read them (the side files, the weights, config.json
    last) without importing torch: it cost each pull seconds of start-up on a loaded machine."""
    found = json.loads(run([sys.executable, "-c", PULL_PROBE], timeout=120).stdout)
    assert found["checkpoint"] == [["tokenizer.json", "model.safetensors", "config.json"], None]
    assert found["single"] == [["a-Q8_0.gguf"], "a-Q8_0.gguf"]
    assert found["torch"] is False
