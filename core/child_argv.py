"""Command lines for Hivekeeper's own child processes (serving nodes, probes), shared by the CLI's local swarms and
the app."""

from __future__ import annotations

import os
import sys

# On Linux a child is asked to die with its parent (SIGTERM when the parent process ends, even by a crash or
# SIGKILL): a tiny Python shim sets PR_SET_PDEATHSIG, which survives exec, then becomes the real command. SIGTERM
# lets a node announce OFFLINE and stop its p2pd on the way out. The signal follows the parent *thread* that
# started the child, so start children from a thread that lives as long as they should (the main thread).
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):  # the parent died before prctl took effect\n"
    "    sys.exit(143)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(argv: list[str]) -> list[str]:
    """argv wrapped so that the child gets SIGTERM when this process ends (Linux only; unchanged elsewhere)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def hivekeeper_command(*args: str) -> list[str]:
    """argv of `hivekeeper ARGS` run with this Python (works in a venv without the console script on PATH)."""
    return [sys.executable, "-m", "hivekeeper.core.cli.main", *args]
