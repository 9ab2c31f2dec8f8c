"""How a count reads in a sentence: one definition for the planner's words, the commands' and the app's."""

from __future__ import annotations


def counted(count: int, noun: str) -> str:
    """"1 server", "2 servers", "1,024 rows": a count with its noun, plural but for one."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"
