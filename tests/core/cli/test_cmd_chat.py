"""`hivekeeper chat` driven as a real subprocess over stdin/stdout: turns with streamed replies and tokens/s,
/reset, /exit, a saved history, and Ctrl-C (SIGINT) stopping a reply without ending the chat; in the test process,
a Ctrl-C at the prompt that only raises Python's signal flag still ends the wait for a line."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

from ...child_output import ChildOutput

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
STATS = re.compile(r"\[(\d+) tokens, ([\d.]+|n/a) tokens/s, first token [\d.]+ s(, stopped)?\]")


class Chat:
    """A chat subprocess whose output tests/child_output.py collects, so the test can wait for text to appear."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "hivekeeper.core.cli.main", "chat", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=ENV, bufsize=1)
        self.child = ChildOutput(self.proc)

    @property
    def output(self) -> str:
        return self.child.stdout

    def wait_for(self, pattern: str, start: int = 0, timeout: float = 120.0) -> re.Match:
        """The first match in stdout from `start`; past the deadline the chat is killed and its output shown."""
        return self.child.wait_for(pattern, start, timeout)

    def send(self, line: str) -> int:
        """Type a line; returns the output position before it (to wait for what follows)."""
        position = len(self.output)
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return position

    def close(self, timeout: float = 60.0) -> int:
        """End of input, then the exit code (killed, output shown, when it does not exit in time)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.child.wait(timeout)
        finally:
            self.child.close()


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """Tiny, but with room for long replies (8192 positions) and a vocabulary where EOS is rarely greedy."""
    return make_demo_checkpoint(tmp_path_factory.mktemp("chat") / "long", max_position=8192, vocab=2048, seed=11)


def test_a_conversation_with_reset_exit_and_a_saved_history(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    history = tmp_path / "chat.json"
    chat = Chat("--model", str(tiny_checkpoint), "--max-new-tokens", "8", "--system", "Be brief.",
                "--history", str(history), "--seed", "3")
    try:
        chat.wait_for(r"Chatting with .*float32 blocks: 2 RAM.*/reset.*/exit")
        chat.wait_for("RANDOM weights")
        chat.wait_for("you> ")
        mark = chat.send("Hello there")
        reply = chat.wait_for(r"assistant> (.*?)\n" + STATS.pattern, mark)
        assert int(reply.group(2)) >= 1
        saved = json.loads(history.read_text())
        assert saved["system_prompt"] == "Be brief."
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
        assert saved["messages"][0]["content"] == "Hello there"
        assert saved["messages"][1]["content"] == reply.group(1)  # the streamed text is the reply kept

        mark = chat.send("/nonsense")
        chat.wait_for(r"unknown command /nonsense", mark)
        mark = chat.send("/reset")
        chat.wait_for(r"conversation cleared", mark)
        mark = chat.send("Second try")
        chat.wait_for(STATS.pattern, mark)
        assert [m["content"] for m in json.loads(history.read_text())["messages"]][0] == "Second try"
        chat.send("/exit")
        assert chat.close() == 0
    finally:
        chat.close()

    # a new chat continues the saved conversation (the same main() in this process: a second child only repeated
    # the start-up the first one tests)
    from hivekeeper.core.cli.main import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(sys, "stdin", io.StringIO("Third\n"))
    capsys.readouterr()
    assert main(["chat", "--model", str(tiny_checkpoint), "--max-new-tokens", "4", "--history", str(history)]) == 0
    assert STATS.search(capsys.readouterr().out)  # end of input quits, after the reply
    messages = json.loads(history.read_text())["messages"]
    assert [m["content"] for m in messages[::2]] == ["Second try", "Third"]


def test_ctrl_c_stops_a_reply_but_not_the_chat(long_context_model):
    chat = Chat("--model", str(long_context_model), "--max-new-tokens", "6000", "--temperature", "0")
    try:
        chat.wait_for("you> ")
        mark = chat.send("Tell me a very long story")
        chat.wait_for(r"assistant> .{5}", mark)  # the reply is streaming
        chat.proc.send_signal(signal.SIGINT)
        stopped = chat.wait_for(STATS.pattern, mark)
        assert stopped.group(3) == ", stopped" and int(stopped.group(1)) < 6000
        assert chat.proc.poll() is None  # still chatting
        chat.wait_for("you> ", stopped.end())
        chat.proc.send_signal(signal.SIGINT)  # at the prompt: a reminder, not an exit
        chat.wait_for(r"Ctrl-D also quits", stopped.end())
        for _ in range(3):  # however fast the presses come
            chat.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert chat.proc.poll() is None
        mark = chat.send("/reset")
        chat.wait_for("conversation cleared", mark)
        chat.send("/exit")
        assert chat.close() == 0
    finally:
        chat.close()


class Terminal(io.StringIO):
    """The chat's stdout in the test process: what was written, and an event per text awaited."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.awaited: dict[str, threading.Event] = {}

    def write(self, text: str) -> int:
        with self.lock:
            written = super().write(text)
            for pattern, shown in self.awaited.items():
                if pattern in self.getvalue():
                    shown.set()
            return written

    def shown(self, pattern: str) -> threading.Event:
        with self.lock:
            event = self.awaited.setdefault(pattern, threading.Event())
            if pattern in self.getvalue():
                event.set()
            return event


def test_ctrl_c_at_the_prompt_ends_the_wait_even_when_only_its_flag_was_raised(tiny_checkpoint, monkeypatch):
    """A Ctrl-C that only raises Python's signal flag, without interrupting the read (one landing just before the read
    began, or one another thread takes: here sent to another thread), still ends the wait for a line at once: the
    reminder shows with nothing typed, and what is typed next is not lost. sys.stdin.readline() waited for a line."""
    from hivekeeper.core.cli.main import main

    handler, wakeup = signal.getsignal(signal.SIGINT), signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    read_end, write_end = os.pipe()
    terminal = Terminal()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(sys, "stdin", os.fdopen(read_end, "r"))
    monkeypatch.setattr(sys, "stdout", terminal)
    seen = {}

    def user() -> None:
        with os.fdopen(write_end, "w") as keys:
            seen["prompt"] = terminal.shown("you> ").wait(120)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # Python's C handler runs on this thread
            seen["reminder"] = terminal.shown("Ctrl-D also quits").wait(60)  # nothing typed yet
            keys.write("/nonsense\n")
            keys.flush()
            seen["line"] = terminal.shown("unknown command /nonsense").wait(60)

    typing = threading.Thread(target=user)
    typing.start()
    try:
        assert main(["chat", "--model", str(tiny_checkpoint), "--max-new-tokens", "4"]) == 0  # end of input quits
    finally:
        typing.join(200)
        sys.stdin.close()
    assert seen == {"prompt": True, "reminder": True, "line": True}, terminal.getvalue()
    assert signal.getsignal(signal.SIGINT) is handler  # the chat's handler was taken off
    assert signal.set_wakeup_fd(wakeup) == wakeup  # and its wakeup pipe


def test_piped_input_reads_as_a_transcript(tiny_checkpoint, capsys, monkeypatch):
    """`printf 'What is 2+2?\\n/reset\\nName a colour.\\n' | hivekeeper chat` printed `you> assistant> ...` on one
    line: a pipe does not echo what it feeds, so the chat writes each line after its prompt."""
    from hivekeeper.core.cli.main import main

    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as keys:
        keys.write("What is 2+2?\n/reset\nName a colour.\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(sys, "stdin", os.fdopen(read_end, "r"))
    capsys.readouterr()
    try:
        assert main(["chat", "--model", str(tiny_checkpoint), "--max-new-tokens", "4", "--temperature", "0"]) == 0
    finally:
        sys.stdin.close()
    out = capsys.readouterr().out
    assert "you> What is 2+2?\nassistant> " in out and "you> /reset\n(conversation cleared)\n" in out, out
    assert "you> Name a colour.\nassistant> " in out and "you> assistant>" not in out, out
    assert len(STATS.findall(out)) == 2


def test_missing_chat_template_fails_before_loading(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    import shutil

    from hivekeeper.core.cli.main import main

    folder = tmp_path / "no-template"
    shutil.copytree(tiny_checkpoint, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["chat", "--model", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert "no chat template" in err and len(err.strip().splitlines()) == 1 and out == ""


@pytest.mark.slow
def test_a_swarm_chat_keeps_the_conversation_when_blocks_lose_their_server_and_retries(tiny_checkpoint, tmp_path):
    """A server dies and no other serves its block: the reply fails with the blocks named, the chat goes on with the
    conversation as it was, and /retry sends the message again once a server is back (Petals' chat ends there); after
    /reset nothing is left to retry."""
    from hivekeeper.core.swarm.local import LocalSwarm

    history = tmp_path / "chat.json"

    def said() -> list[str]:
        return [m["content"] for m in json.loads(history.read_text())["messages"]]

    with LocalSwarm(tiny_checkpoint) as swarm:
        swarm.start("--block-indices", "0:1")
        holder = swarm.start("--block-indices", "1:2")
        chat = Chat("--model", str(tiny_checkpoint), "--swarm", "--initial-peers", *swarm.initial_peers,
                    "--max-new-tokens", "4", "--history", str(history), "--seed", "3")
        try:
            mark = chat.send("Hello")
            chat.wait_for(STATS.pattern, mark)
            holder.kill()
            mark = chat.send("Are you there?")
            chat.wait_for(r"the reply failed: no server covers block 1.*\n.*/retry sends it again\)\nyou> ", mark)
            assert chat.proc.poll() is None
            assert said()[::2] == ["Hello"]

            replacement = swarm.start("--block-indices", "1:2")
            mark = chat.send("/retry")
            chat.wait_for(STATS.pattern, mark)
            assert said()[::2] == ["Hello", "Are you there?"] and len(said()) == 4
            mark = chat.send("/retry")
            chat.wait_for(r"no failed reply to retry", mark)

            replacement.kill()  # a failed reply, then /reset: nothing is left to retry
            mark = chat.send("Still there?")
            chat.wait_for(r"the reply failed: no server covers block 1", mark)
            mark = chat.send("/reset")
            chat.wait_for(r"conversation cleared", mark)
            mark = chat.send("/retry")
            chat.wait_for(r"no failed reply to retry", mark)
            chat.send("/exit")
            assert chat.close() == 0
        finally:
            chat.close()


def test_the_left_out_note_is_said_when_more_messages_are_left_out(tmp_path, capsys, monkeypatch):
    """A newcomer (session 26) read "(the 2 oldest messages no longer fit ...)" again on a turn that left nothing
    more out (its prompt came from the cache), as a new loss: the note comes only when more messages are left out."""
    from hivekeeper.core.cli.main import main

    model = make_demo_checkpoint(tmp_path / "short", max_position=96)  # a prompt holds ~92 tokens: turns drop out
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as keys:
        keys.write("one two three four five six seven eight nine ten\n" * 4 + "hi\nhi\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(sys, "stdin", os.fdopen(read_end, "r"))
    capsys.readouterr()
    try:
        assert main(["chat", "--model", str(model), "--max-new-tokens", "4", "--temperature", "0",
                     "--no-measure"]) == 0
    finally:
        sys.stdin.close()
    out = capsys.readouterr().out
    said = [int(n) for n in re.findall(r"\(the (\d+) oldest messages no longer fit", out)]
    assert len(said) >= 2 and said == sorted(set(said)), out  # each note names more than the one before
    assert len(STATS.findall(out)) == 6
