"""`hivekeeper chat`: a terminal chat with a local (offloaded) or swarm model.

Lines typed are user turns; replies stream token by token, then a line with the reply's tokens/s. Ctrl-C stops a
reply (the chat goes on; at the prompt it only reminds how to leave). /reset forgets the conversation (the system
prompt stays), /exit or end of input quits. --history FILE keeps the conversation in a JSON file across runs.

The conversation's KV cache is kept between turns (generation.PromptCache): a turn prefills only the tokens after
what the cache already holds, so the first token comes as fast in a long conversation as in a short one.
"""

from __future__ import annotations

import argparse
import sys

from hivekeeper.core.cli.generate import add_model_arguments, add_sampling_arguments

HELP = "/reset clears the conversation, /exit quits, Ctrl-C stops a reply"
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
    import signal
    import threading
    from pathlib import Path

    from hivekeeper.planner.errors import InputError

    from hivekeeper.core.runtime.chat_history import ChatHistory
    from hivekeeper.core.cli.generate import check_budget, open_runner, resolve_model, sampling_params, set_threads
    from hivekeeper.core.runtime.generation import context_limit, conversation_cache, generate

    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    ram_budget = check_budget(args)
    sampling = sampling_params(args)
    history = ChatHistory(system_prompt=args.system)
    if args.history and Path(args.history).exists():
        history = ChatHistory.load(args.history)
        if args.system:
            history.system_prompt = args.system

    set_threads()
    path, tokenizer, config = resolve_model(args)
    context = context_limit(config)
    if args.max_new_tokens >= context:
        raise InputError(f"--max-new-tokens {args.max_new_tokens} leaves no room for the prompt in the model's "
                         f"context of {context} tokens")
    tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])  # no chat template: fail before loading
    # the plan (and a RAM budget) counts a KV cache of the full context: the one the conversation keeps
    runner = open_runner(args, path, tokenizer, config, batch=1, prompt_len=context - args.max_new_tokens,
                         max_length=context, ram_budget=ram_budget)
    prompt_cache = conversation_cache(context, swarm=args.swarm)
    stop = threading.Event()
    waiting_for_input = False

    def on_interrupt(signum, frame) -> None:
        # Ctrl-C: at the prompt, interrupt the read (a reminder is shown); otherwise stop the reply, if one is
        # running — never end the chat, however fast the presses come
        stop.set()
        if waiting_for_input:
            raise KeyboardInterrupt

    previous_handler = signal.signal(signal.SIGINT, on_interrupt)
    try:
        _say(f"Chatting with {args.model} ({runner.description}). {HELP}.")
        if runner.is_demo:
            _say("Note: this is a demo checkpoint with RANDOM weights: its replies are gibberish.")
        while True:
            _say(USER_PROMPT, end="")
            try:
                waiting_for_input = True
                line = sys.stdin.readline()
            except KeyboardInterrupt:
                line = None
            finally:
                waiting_for_input = False
            if line is None:
                _say(f"\n({HELP}; Ctrl-D also quits)")
                continue
            if not line:  # end of input
                _say("")
                return 0
            text = line.rstrip("\n")
            command = text.strip()
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                history.reset()
                prompt_cache.reset()
                _say("(conversation cleared)")
                continue
            if command.startswith("/") or not command:
                if command:
                    _say(f"(unknown command {command}; {HELP})")
                continue
            history.add_user(text)
            try:
                prompt_ids, dropped = history.prompt_ids(tokenizer, context - args.max_new_tokens)
            except InputError as exc:
                history.messages.pop()
                _say(f"(error: {exc})")
                continue
            if dropped:
                _say(f"(the {dropped} oldest messages no longer fit in the context and are left out)")
            stop.clear()
            _say(ASSISTANT_PROMPT, end="")
            result = generate(runner.model, prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                              tokenizer=tokenizer, on_text=lambda row, piece: _say(piece, end=""), stop=stop,
                              prompt_cache=prompt_cache)
            history.add_assistant(result.texts[0])
            if args.history:
                history.save(args.history)
            tps = result.decode_tokens_per_s
            stopped = ", stopped" if result.finish_reasons[0] == "stopped" else ""
            _say(f"\n[{result.new_tokens} tokens, {'n/a' if tps is None else f'{tps:.1f}'} tokens/s, "
                 f"first token {result.time_to_first_token_s:.2f} s{stopped}] "
                 f"(prompt {result.prompt_tokens} tokens: {result.prefilled_tokens} prefilled, "
                 f"{result.cached_prompt_tokens} from the cache)")
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        try:
            prompt_cache.close()
        finally:
            runner.close()

