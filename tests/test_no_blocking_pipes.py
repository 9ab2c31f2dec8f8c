"""No test blocks on a live pipe of a child process: a hung child must fail its test within the test's own deadline,
with the output so far, instead of hanging the suite until pytest's timeout.

The tests' code is searched (by its syntax tree, so strings and comments do not count) for what waits on a pipe
without a deadline: `.read()`, `.readline()`, `.readlines()` on a `stdout`/`stderr`, iterating over one,
`.communicate()` without a timeout, and `subprocess.run`/`check_output`/`check_call`/`call` without a timeout.
Reading pipes is tests/child_output.py's job (reader threads, deadlines, the child killed before its output is
reported); it is the one file not searched.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
HELPER = TESTS / "child_output.py"
READS = {"read", "readline", "readlines"}
PIPES = ("stdout", "stderr")
RUNS = {"run", "check_output", "check_call", "call"}


def on_a_pipe(node: ast.AST) -> bool:
    """`x.stdout`, `self.proc.stderr`: an attribute named like a child's pipe."""
    return isinstance(node, ast.Attribute) and node.attr in PIPES


def has_timeout(call: ast.Call, position: int) -> bool:
    """A timeout given by keyword, or positionally at `position` (communicate(input, timeout))."""
    return any(keyword.arg == "timeout" for keyword in call.keywords) or len(call.args) > position


def blocking_call(call: ast.Call) -> str | None:
    """Why this call may wait on a pipe without a deadline, or None."""
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr in READS and on_a_pipe(func.value):
        return f".{func.value.attr}.{func.attr}() on a live pipe"
    if func.attr == "communicate" and not has_timeout(call, 1):
        return "communicate() without a timeout"
    if (func.attr in RUNS and isinstance(func.value, ast.Name) and func.value.id == "subprocess"
            and not has_timeout(call, 99)):
        return f"subprocess.{func.attr}() without a timeout"
    return None


def blocking_reads(source: str, filename: str = "<test>") -> list[str]:
    """'file:line: why' for each blocking read of a pipe in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        why = None
        if isinstance(node, ast.Call):
            why = blocking_call(node)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and on_a_pipe(node.iter):
            why = f"iterating over .{node.iter.attr}"
        if why:
            found.append(((node.iter if isinstance(node, ast.comprehension) else node).lineno, why))
    return [f"{filename}:{line}: {why}" for line, why in sorted(found)]


def test_the_search_finds_each_kind_of_blocking_read():
    offending = '''
line = proc.stdout.readline()
rest = self.proc.stderr.read()
out, err = proc.communicate()
subprocess.run(["x"], capture_output=True)
for line in proc.stdout:
    pass
'''
    found = blocking_reads(offending)
    assert [entry.split(":")[1] for entry in found] == ["2", "3", "4", "5", "6"], found
    bounded = '''
out, err = proc.communicate(timeout=5)
out, err = proc.communicate(None, 5)
subprocess.run(["x"], capture_output=True, timeout=60)
data = handle.read()
text = "proc.stdout.readline()"
'''
    assert blocking_reads(bounded) == []


def test_no_test_reads_a_live_pipe_outside_the_helper():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path != HELPER:
            found += blocking_reads(path.read_text(encoding="utf-8"), str(path.relative_to(TESTS.parent)))
    assert not found, "read pipes through tests/child_output.py (deadlines, output so far):\n" + "\n".join(found)
