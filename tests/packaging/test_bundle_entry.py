"""packaging/pyinstaller_entry.py, the frozen bundle's entry point: it answers the `-m MODULE` and `-c CODE` command
lines the app starts its children with (core/child_argv.py) as python would, and anything else as `hivekeeper`.
Run here with this venv's Python, the same code a bundle runs as its executable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "packaging" / "pyinstaller_entry.py"


def entry(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ENTRY), *words], capture_output=True, text=True, timeout=120)


def test_dash_c_runs_the_code_with_python_argv():
    done = entry("-c", "import sys; print(sys.argv, __name__); sys.exit(3)", "a", "b")
    assert done.returncode == 3 and done.stdout.strip() == "['-c', 'a', 'b'] __main__"


def test_dash_m_runs_the_module_as_main():
    done = entry("-m", "hivekeeper.core.cli.main", "plan", "--model", "meta-llama/Llama-2-7b-hf", "--json")
    assert done.returncode == 0, done.stderr
    assert '"model"' in done.stdout


def test_other_words_are_the_hivekeeper_command_line():
    done = entry("serve", "--new-swarm")
    assert done.returncode == 2 and "--model is required" in done.stderr
