"""`hivekeeper finetune`: train soft prompts (ptune) or deep prompts (deep_ptune) for a frozen model.

    hivekeeper finetune --data facts.jsonl --method deep_ptune --prompt-tokens 8 --steps 30 --out facts.prompts

The blocks run here, or with --swarm through the swarm's rpc_forward / rpc_backward (the embeddings, head and the
prompts stay here). A progress line shows the step, the loss and training tokens/s. The prompts are saved as a
small safetensors file with the model id and method in its metadata; when --out exists the run resumes from it
(its optimizer state included) up to --steps in all, with the file's method and prompt tokens unless others are
given (which is refused). Use the result with `chat` / `generate` / `api --prompts FILE`.

The data file is checked before any weight is loaded: a bad line is one error naming the file and line, exit 2;
so are --prompt-tokens (below the model's context) and --out (a file, not a folder).
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
    # no defaults here: left out, a resumed --out file's are taken, else the trainer's (deep_ptune, 8)
    parser.add_argument("--method", choices=("ptune", "deep_ptune"),
                        help="ptune: soft prompt tokens before the input; deep_ptune (the default): also a prompt per "
                             "block; resuming --out, its method")
    parser.add_argument("--prompt-tokens", type=int, metavar="N",
                        help="trained prompt tokens (8; resuming --out, its number)")
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
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.lr < 10:
        raise InputError(f"--lr must be a positive number below 10, got {args.lr}")
    if args.swarm and not args.initial_peers:
        raise InputError("--swarm needs --initial-peers (the multiaddrs a `hivekeeper serve` printed)")


def run(args: argparse.Namespace) -> int:
    from hivekeeper.core.cli.generate import set_threads
    from hivekeeper.core.finetune.trainer import RunSpec, close_trainer, open_trainer

    _check(args)
    spec = RunSpec(data=args.data, out=args.out, model=args.model, method=args.method,
                   prompt_tokens=args.prompt_tokens, steps=args.steps, lr=args.lr, batch=args.batch, seed=args.seed,
                   eval_data=args.eval, swarm=args.swarm, initial_peers=tuple(args.initial_peers),
                   dht_prefix=args.dht_prefix)
    set_threads()
    trainer, held_out = open_trainer(spec, say=lambda line: print(line, file=sys.stderr))
    try:
        return _train(args, trainer, held_out)
    finally:
        close_trainer(trainer)


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
