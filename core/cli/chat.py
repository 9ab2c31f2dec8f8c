"""`hivekeeper chat`: a terminal chat with a local (offloaded) or swarm model.

Lines typed are user turns; replies stream token by token, then a line with the reply's tokens/s. Ctrl-C stops a
reply (the chat goes on; at the prompt it only reminds how to leave). /reset forgets the conversation (the system
prompt stays), /exit or end of input quits. --history FILE keeps the conversation in a JSON file across runs.
Lines from a pipe or a file (which nothing echoes) are written after their prompt, so the output reads as a transcript.

Lines are read by _Keyboard, not sys.stdin.readline(): a Ctrl-C that lands after the prompt is written but before the
read begins (or that another thread takes) only flags Python's handler, the read is not interrupted, and the reminder
waited for the next line typed. _Keyboard waits with select() on stdin and on a signal wakeup pipe, so the handler
runs at once wherever the signal landed.

The conversation's KV cache is kept between turns (generation.PromptCache): a turn prefills only the tokens after
what the cache already holds, so the first token comes as fast in a long conversation as in a short one.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from hivekeeper.planner.errors import InputError

from hivekeeper.core.atomic_file import in_existing_folder

from hivekeeper.core.cli.generate import (add_model_arguments, add_sampling_arguments, check_budget, open_runner,
                                          resolve_model, sampling_params, set_threads)

if TYPE_CHECKING:
    from hivekeeper.core.runtime.chat_history import ChatHistory

HELP = "/help lists the commands, /reset clears the conversation, /exit quits, Ctrl-C stops a reply"
COMMANDS = (("/help", "this list, and what the chat runs"), ("/reset", "forget the conversation so far"),
            ("/retry", "send again the message whose reply failed"),
            ("/exit, /quit", "end the chat (Ctrl-D too)"), ("Ctrl-C", "stop the reply being written"))
USER_PROMPT = "you> "
ASSISTANT_PROMPT = "assistant> "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest reply in tokens (default 256)")
    parser.add_argument("--system", default="", metavar="TEXT", help="system prompt (instructions for the model)")
    parser.add_argument("--history", metavar="FILE",
                        help="JSON file of the conversation: continued if it exists, saved after every reply")
    add_sampling_arguments(parser, temperature=0.7, top_p=0.9)


def _say(text: str, end: str = "\n") -> None:
    sys.stdout.write(text + end)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    ram_budget = check_budget(args)
    sampling = sampling_params(args)
    history = _load_history(args)
    set_threads()
    chat = _open_chat(args, ram_budget, sampling, history)
    previous_handler = signal.signal(signal.SIGINT, chat.on_interrupt)
    try:
        with _Keyboard(sys.stdin) as keyboard:
            return chat.converse(keyboard)
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        chat.close()


def _load_history(args: argparse.Namespace) -> ChatHistory:
    """The conversation: continued from --history when the file exists (--system, when given, replaces its system
    prompt)."""
    from hivekeeper.core.runtime.chat_history import ChatHistory

    if args.history:
        args.history = str(in_existing_folder("--history", args.history))
    if not (args.history and Path(args.history).exists()):
        return ChatHistory(system_prompt=args.system)
    history = ChatHistory.load(args.history)
    if args.system:
        history.system_prompt = args.system
    return history


def _open_chat(args: argparse.Namespace, ram_budget: float | None, sampling, history: ChatHistory) -> _Chat:
    """The model loaded for a conversation as long as its context; the reply's length and the chat template are
    checked before loading."""
    from hivekeeper.core.runtime.generation import context_limit

    path, tokenizer, config = resolve_model(args)
    context = context_limit(config)
    if args.max_new_tokens >= context:
        raise InputError(f"--max-new-tokens {args.max_new_tokens} leaves no room for the prompt in the model's "
                         f"context of {context} tokens")
    tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])  # no chat template: fail before loading
    # the plan (and a RAM budget) counts a KV cache of the full context: the one the conversation keeps
    runner = open_runner(args, path, tokenizer, config, batch=1, prompt_len=context - args.max_new_tokens,
                         max_length=context, ram_budget=ram_budget)
    return _Chat(args, runner, tokenizer, history, sampling, context)


class _Keyboard:
    """The lines typed, waited for so that a Ctrl-C always ends the wait at once: select() on stdin and on a signal
    wakeup pipe (signal.set_wakeup_fd: Python's C-level handler writes to it however early the signal came and on
    whichever thread, so select() returns and the Python handler runs next), then stdin's descriptor read raw into
    this buffer (a TextIOWrapper may hold lines select() cannot see). A stdin without a descriptor (a StringIO), and
    any stdin on Windows (where select() takes only sockets), is read with its own readline(): a Ctrl-C there is
    seen once a line comes."""

    def __init__(self, stream):
        self.stream = stream
        try:
            self.fd: int | None = stream.fileno() if os.name != "nt" else None
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
            self.fd = None
        self.buffer = b""
        self.ended = False  # the end of input was read
        try:
            self.is_terminal = stream.isatty()  # a terminal echoes what is typed
        except (AttributeError, OSError, ValueError):
            self.is_terminal = False
        self.wakeup: tuple[int, int] | None = None  # the signal wakeup pipe's (read end, write end)
        self.previous_wakeup = -1

    def __enter__(self) -> _Keyboard:
        if self.fd is not None:
            self.wakeup = os.pipe()
            for end in self.wakeup:
                os.set_blocking(end, False)
            self.previous_wakeup = signal.set_wakeup_fd(self.wakeup[1], warn_on_full_buffer=False)
        return self

    def __exit__(self, *exc) -> None:
        if self.wakeup is not None:
            signal.set_wakeup_fd(self.previous_wakeup)
            for end in self.wakeup:
                os.close(end)
            self.wakeup = None

    def readline(self, interrupted: threading.Event) -> str | None:
        """The next line ("" at the end of input), or None as soon as `interrupted` is set (by a signal handler)."""
        if self.fd is None:
            return self.stream.readline()
        while b"\n" not in self.buffer and not self.ended:
            if interrupted.is_set():
                return None
            self._wait()
        line, newline, self.buffer = self.buffer.partition(b"\n")
        return (line + newline).decode(getattr(self.stream, "encoding", None) or "utf-8",
                                       getattr(self.stream, "errors", None) or "strict")

    def _wait(self) -> None:
        """Until stdin or the wakeup pipe can be read; what stdin holds goes into the buffer."""
        readable, _, _ = select.select([self.fd, self.wakeup[0]], [], [])
        if self.wakeup[0] in readable:
            os.read(self.wakeup[0], 4096)  # the signals' bytes: the handlers run in the caller's loop
        if self.fd in readable:
            data = os.read(self.fd, 65536)
            self.buffer += data
            self.ended = not data


class _Chat:
    """A conversation in the terminal: the model, the history and the KV cache kept between turns, and what Ctrl-C
    means (at the prompt: end the wait for a line; during a reply: stop it)."""

    def __init__(self, args: argparse.Namespace, runner, tokenizer, history: ChatHistory, sampling, context: int):
        from hivekeeper.core.runtime.generation import conversation_cache

        self.args = args
        self.runner = runner
        self.tokenizer = tokenizer
        self.history = history
        self.sampling = sampling
        self.prompt_tokens = context - args.max_new_tokens  # the most a prompt may hold
        self.prompt_cache = conversation_cache(context, swarm=args.swarm)
        self.stop = threading.Event()  # Ctrl-C was pressed: cleared as a reply starts and as the prompt shows
        self.failed_turn: str | None = None  # the last message whose reply failed, for /retry
        self.left_out = 0  # the oldest messages the last prompt left out (said again only when more are)

    def on_interrupt(self, signum, frame) -> None:
        # Ctrl-C: stop the reply being written, or at the prompt end the wait for a line (a reminder is shown); never
        # end the chat. Nothing is raised, so no press, however fast the presses come or wherever one lands, can
        # escape a handler or lose text typed
        self.stop.set()

    def converse(self, keyboard: _Keyboard) -> int:
        """Turns, read from `keyboard`, until /exit or the end of input: the exit status."""
        _say(f"Chatting with {self.args.model} ({self.runner.description}). {HELP}.")
        if self.runner.is_demo:
            _say("Note: this is a demo checkpoint with RANDOM weights: its replies are gibberish.")
        while True:
            line = self._read_line(keyboard)
            if line is None:
                _say(f"\n({HELP}; Ctrl-D also quits)")
            elif not line:  # end of input
                _say("")
                return 0
            elif self._handle(line.rstrip("\n")):
                return 0

    def _read_line(self, keyboard: _Keyboard) -> str | None:
        """The line typed ("" at the end of input), or None when Ctrl-C ended the wait for it. Input that is not a
        terminal (a file or a pipe) is not echoed as it comes: the line is written after the prompt, so the reply
        starts on a line of its own and the transcript shows what was asked."""
        self.stop.clear()  # before the prompt shows: a Ctrl-C right after it must end the wait
        _say(USER_PROMPT, end="")
        line = keyboard.readline(self.stop)
        if line and not keyboard.is_terminal:
            _say(line.rstrip("\n"))
        return line

    def _handle(self, text: str) -> bool:
        """A command or a user turn; True to quit."""
        command = text.strip()
        if command in ("/exit", "/quit"):
            return True
        if command in ("/help", "/?"):
            _say(self._help())
        elif command == "/retry":
            self._retry()
        elif command == "/reset":
            self.history.reset()
            self.prompt_cache.reset()
            self.failed_turn = None
            _say("(conversation cleared)")
        elif command.startswith("/"):
            _say(f"(unknown command {command}; {HELP})")
        elif command:
            self._reply(text)
        return False

    def _help(self) -> str:
        """The commands, and what this chat runs (model, plan, reply length)."""
        lines = [f"  {name:<13} {what}" for name, what in COMMANDS]
        lines.append(f"model {self.args.model} ({self.runner.description}); up to {self.args.max_new_tokens} new "
                     f"tokens per reply (--max-new-tokens)")
        if self.args.history:
            lines.append(f"the conversation is saved to {self.args.history}")
        return "\n".join(lines)

    def _retry(self) -> None:
        if self.failed_turn is None:
            _say("(no failed reply to retry)")
        else:
            self._reply(self.failed_turn)

    def _reply(self, text: str) -> None:
        """The model's reply to a user turn, streamed, kept in the history (saved with --history), then its stats; a
        reply that fails leaves the history as it was (the message kept for /retry)."""
        prompt_ids = self._prompt(text)
        if prompt_ids is None:
            return
        self.stop.clear()
        _say(ASSISTANT_PROMPT, end="")
        try:
            result = self._generate(prompt_ids)
        except InputError as exc:  # a swarm without servers for some blocks (SwarmGap), or a run that cannot go on
            self._failed(text, exc)
            return
        self.failed_turn = None
        self.history.add_assistant(result.texts[0])
        if self.args.history:
            self.history.save(self.args.history)
        _say(_stats(result))

    def _generate(self, prompt_ids: list[int]):
        from hivekeeper.core.runtime.generation import generate

        return generate(self.runner.model, prompt_ids, max_new_tokens=self.args.max_new_tokens,
                        sampling=self.sampling, tokenizer=self.tokenizer,
                        on_text=lambda row, piece: _say(piece, end=""), stop=self.stop,
                        prompt_cache=self.prompt_cache)

    def _failed(self, text: str, exc: InputError) -> None:
        """A reply that could not be finished: the message leaves the history (kept for /retry) and the cache is
        dropped (a swarm session whose server died cannot be continued; the next turn prefills anew)."""
        self.history.messages.pop()
        self.failed_turn = text
        self.prompt_cache.reset()
        _say(f"\n(the reply failed: {exc})\n(the conversation is kept as it was before your message; /retry sends "
             f"it again)")

    def _prompt(self, text: str) -> list[int] | None:
        """The conversation with the new user turn, as prompt ids (the oldest messages left out when they no longer
        fit); None, with the error shown, when it cannot be (the turn is not kept)."""
        self.history.add_user(text)
        try:
            prompt_ids, dropped = self.history.prompt_ids(self.tokenizer, self.prompt_tokens)
        except InputError as exc:
            self.history.messages.pop()
            _say(f"(error: {exc})")
            return None
        if dropped > self.left_out:  # a newcomer read the same note every turn as a new loss
            _say(f"(the {dropped} oldest messages no longer fit in the context and are left out)")
        self.left_out = dropped
        return prompt_ids

    def close(self) -> None:
        try:
            self.prompt_cache.close()
        finally:
            self.runner.close()


def _stats(result) -> str:
    """The line after a reply: tokens, speed, time to first token, and how much of the prompt the cache held."""
    tps = result.decode_tokens_per_s
    stopped = ", stopped" if result.finish_reasons[0] == "stopped" else ""
    return (f"\n[{result.new_tokens} tokens, {'n/a' if tps is None else f'{tps:.1f}'} tokens/s, "
            f"first token {result.time_to_first_token_s:.2f} s{stopped}] "
            f"(prompt {result.prompt_tokens} tokens: {result.prefilled_tokens} prefilled, "
            f"{result.cached_prompt_tokens} from the cache)")
