"""Issue 14 (session 11, a new user's first hour): `hivekeeper generate --prompt "What is the capital of France?
Answer in one sentence."` with the built-in chat model printed nothing but "1 new tokens (eos)": the model ends a bare
question at once. The command now says why and where the answer is (chat). The real command, the real model."""

from __future__ import annotations

import subprocess
import sys

from hivekeeper.core.cli.generate import ENDED_AT_ONCE


def test_a_text_that_ends_at_once_says_why():
    done = subprocess.run([sys.executable, "-m", "hivekeeper.core.cli.main", "generate", "--prompt",
                           "What is the capital of France? Answer in one sentence.", "--max-new-tokens", "4"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    text, _, summary = done.stdout.partition("---")
    assert text.strip() == "" and "(eos)" in summary  # greedy (the default): the model's own end of sequence
    assert ENDED_AT_ONCE in done.stderr and "hivekeeper chat" in ENDED_AT_ONCE
