"""The frozen bundle's entry point (packaging/pyinstaller.spec): `hivekeeper ARGS`, and the two Python command lines
Hivekeeper starts its own children with.

The app and the CLI start child processes as `sys.executable -m MODULE ...` and `sys.executable -c CODE ...`
(core/child_argv.py, gui/services). In a frozen bundle sys.executable is this program, not a Python, so it answers
those two forms itself, as python would: `-m` runs the module as __main__, `-c` runs the code with sys.argv[0] "-c".
Anything else is the `hivekeeper` command line.
"""

from __future__ import annotations

import multiprocessing
import runpy
import sys


def main() -> int:
    multiprocessing.freeze_support()
    if len(sys.argv) >= 3 and sys.argv[1] == "-m":
        module = sys.argv[2]
        sys.argv = [module, *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    if len(sys.argv) >= 3 and sys.argv[1] == "-c":
        code = sys.argv[2]
        sys.argv = ["-c", *sys.argv[3:]]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        return 0
    from hivekeeper.core.cli.main import main as hivekeeper_main

    return hivekeeper_main()


if __name__ == "__main__":
    sys.exit(main())
