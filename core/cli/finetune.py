"""`hivekeeper finetune`: train soft prompts (ptune) or deep prompts (deep_ptune) for a frozen model.

    hivekeeper finetune --data facts.jsonl --method deep_ptune --prompt-tokens 8 --steps 30 --out facts.prompts

The blocks run here, or with --swarm through the swarm's rpc_forward / rpc_backward (the embeddings, head and the
prompts stay here). A progress line shows the step, the loss and training tokens/s. The prompts are saved as a
small safetensors file with the model id and method in its metadata; when --out exists the run resumes from it
(its optimizer state included) up to --steps in all. Use the result with `chat` / `generate` / `api --prompts FILE`.

The data file is checked before any weight is loaded: a bad line is one error naming the file and line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time

from hivekeeper.planner.errors import InputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID

    parser.add_argument("--model", default=DEFAULT_MODEL_ID, help=f"checkpoint folder, GGUF file, hub id, or "
                                                                   f"{DEFAULT_MODEL_ID} (the default)")
    parser.add_argument("--data", required=True, metavar="FILE.jsonl",
                        help="JSON lines: {\"messages\": [...]} chats (the last message, the assistant's, is "
                             "learned) or {\"prompt\": ..., \"completion\": ...} pairs")
    parser.add_argument("--eval", metavar="FILE.jsonl", help="held-out examples: their loss before and after")
    parser.add_argument("--method", choices=("ptune", "deep_ptune"), default="deep_ptune",
                        help="ptune: soft prompt tokens before the input; deep_ptune: also a prompt per block")
    parser.add_argument("--prompt-tokens", type=int, default=8, metavar="N", help="trained prompt tokens (8)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps in all, resumed ones included (30)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate (0.01)")
    parser.add_argument("--batch", type=int, default=4, help="examples per step (4)")
    parser.add_argument("--seed", type=int, default=0, help="order of the examples and the prompts' start")
    parser.add_argument("--out", required=True, metavar="FILE", help="the prompts file (resumed from if it exists)")
    swarm = parser.add_argument_group("swarm")
    swarm.add_argument("--swarm", action="store_true", help="run the blocks through the swarm")
    swarm.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="multiaddrs to join the swarm")
    swarm.add_argument("--dht-prefix", help="the model's name in the swarm (default: derived from --model)")


def _check(args: argparse.Namespace) -> None:
    for name in ("steps", "batch", "prompt_tokens"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.lr < 10:
        raise InputError(f"--lr must be a positive number below 10, got {args.lr}")
    if args.swarm and not args.initial_peers:
        raise InputError("--swarm needs --initial-peers (the multiaddrs a `hivekeeper serve` printed)")


def run(args: argparse.Namespace) -> int:
    from hivekeeper.core.cli.generate import set_threads
    from hivekeeper.core.runtime.checkpoint import load_config, resolve_checkpoint
    from hivekeeper.core.runtime.tokenizer import load_tokenizer
    from hivekeeper.core.finetune.data import read_examples

    _check(args)
    path = resolve_checkpoint(args.model, blocks=(0, 0), embeddings=True) if args.swarm else \
        resolve_checkpoint(args.model)
    tokenizer, config = load_tokenizer(path), load_config(path)
    room = config.max_position_embeddings - args.prompt_tokens
    examples = read_examples(args.data, tokenizer, room)
    held_out = read_examples(args.eval, tokenizer, room) if args.eval else []
    prompts, info, moments = _start_or_resume(args, config)
    set_threads()
    trainer = _open_trainer(args, path, config, prompts, info, moments, examples)
    try:
        return _train(args, trainer, held_out)
    finally:
        client = getattr(trainer.blocks, "client", None)
        if client is not None:
            client.close()


def _start_or_resume(args: argparse.Namespace, config):
    """(prompts, info, Adam's moments): from --out when it exists (same method and shape), else new ones."""
    from pathlib import Path

    from hivekeeper.core.finetune.prompts import PromptsInfo, TrainablePrompts, check_fits, load_prompts

    if Path(args.out).exists():
        prompts, info, moments = load_prompts(args.out)
        check_fits(args.out, info, config)
        if (info.method, info.tokens) != (args.method, args.prompt_tokens):
            raise InputError(f"{args.out}: holds {info.method} prompts of {info.tokens} tokens; this run asks for "
                             f"{args.method} with {args.prompt_tokens} (use another --out to start anew)")
        print(f"resuming {args.out} at step {info.step}", file=sys.stderr)
        return prompts, PromptsInfo(**{**info.__dict__, "lr": args.lr}), moments
    prompts = TrainablePrompts(args.method, args.prompt_tokens, config.hidden_size, config.num_layers)
    info = PromptsInfo(args.model, args.method, args.prompt_tokens, config.hidden_size, config.num_layers, 0, args.lr)
    return prompts, info, {}


def _open_trainer(args, path, config, prompts, info, moments, examples):
    from hivekeeper.core.finetune.blocks import local_blocks, swarm_blocks
    from hivekeeper.core.finetune.trainer import TrainConfig, Trainer, load_frozen_parts

    parts = load_frozen_parts(path)
    if info.step == 0:
        prompts.start_from_vocabulary(parts.embedding.weight, args.seed)
    blocks = swarm_blocks(args.model, config.num_layers, args.initial_peers, args.dht_prefix) if args.swarm \
        else local_blocks(path)
    train = TrainConfig(steps=args.steps, lr=args.lr, batch=args.batch, seed=args.seed)
    return Trainer(parts, blocks, prompts, info, examples, train, moments)


def _train(args: argparse.Namespace, trainer, held_out) -> int:
    from hivekeeper.core.finetune.trainer import mean_loss

    if held_out:
        before = mean_loss(trainer.parts, trainer.blocks, trainer.prompts, held_out)
        print(f"held-out loss before: {before:.4f}", file=sys.stderr)
    progress = _Progress(trainer.info.step, args.steps)
    reports = trainer.run(args.out, on_step=progress.show)
    progress.close()
    for failover in trainer.failovers:
        print(f"step {failover['step']} redone: {failover['error']}", file=sys.stderr)
    if held_out:
        after = mean_loss(trainer.parts, trainer.blocks, trainer.prompts, held_out)
        print(f"held-out loss after: {after:.4f}", file=sys.stderr)
    what = f"{len(reports)} steps trained" if reports else "nothing to train (already at --steps)"
    print(f"{what}; prompts at step {trainer.info.step} in {args.out}")
    return 0


class _Progress:
    """A progress bar with the step, loss and tokens/s: redrawn in place on a terminal, a line per step if not."""

    WIDTH = 20

    def __init__(self, done: int, total: int):
        self.total, self.tty = total, sys.stderr.isatty()
        self.tokens, self.seconds, self.started = 0, 0.0, time.perf_counter()

    def show(self, report) -> None:
        self.tokens += report.tokens
        self.seconds += report.seconds
        filled = self.WIDTH * report.step // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        redone = f"  (redone {report.redone}x)" if report.redone else ""
        line = (f"[{bar}] step {report.step}/{self.total}  loss {report.loss:.4f}  "
                f"{self.tokens / max(self.seconds, 1e-9):.0f} tokens/s{redone}")
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
