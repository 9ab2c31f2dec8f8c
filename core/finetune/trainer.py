"""The training loop: trainable prompts before frozen blocks, next-token loss on the completions, Adam.

One step: the batch's sequences (padded on the right: attention is causal, so padding never reaches a real token)
go through the embedding here, get the soft prompts put before them, run through the blocks (here or through the
swarm, blocks.py) with the deep prompts, and the head here gives logits; the loss is the mean cross-entropy over
the completion tokens. Backward goes the same way back, and Adam updates only the prompts.

When a swarm server fails mid-step (HopFailed) or no route exists for a moment (SwarmError), the step is redone
from the start on a new route: gradients are cleared, so the step counts once and its update is the one an
uninterrupted run makes. Each redo is recorded in `failovers`.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from hivekeeper.core.finetune.blocks import HopFailed
from hivekeeper.core.finetune.data import Example, batches
from hivekeeper.core.finetune.prompts import PromptsInfo, TrainablePrompts, check_prompt_tokens, save_prompts
from hivekeeper.core.swarm.client.inference import SwarmError
from hivekeeper.planner.errors import InputError


@dataclass
class TrainConfig:
    steps: int = 30  # optimizer steps in all (a resumed run goes on up to this many)
    lr: float = 1e-2
    batch: int = 4
    seed: int = 0
    retry_seconds: float = 60.0  # a step failing on the swarm is redone for this long, then the error stands
    save_every: int = 0  # also save every N steps (0: only at the end, or when stopped)


@dataclass
class StepReport:
    step: int  # 1-based, counting steps of earlier runs
    loss: float
    tokens: int  # tokens through the blocks (prompts and padding included): the training throughput's unit
    seconds: float
    redone: int = 0  # times this step was redone after a server failed

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class FrozenParts:
    """What runs here besides the blocks: the embedding, the head (final norm + LM head) and the config."""

    config: object
    embedding: torch.nn.Module
    head: torch.nn.Module


def padded(examples: list[Example]) -> tuple[Tensor, Tensor]:
    """(ids [batch, longest], target mask [batch, longest]: True where the loss counts the token)."""
    longest = max(len(e.ids) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros(len(examples), longest, dtype=torch.bool)
    for row, example in enumerate(examples):
        ids[row, : len(example.ids)] = torch.tensor(example.ids)
        mask[row, example.target_start : len(example.ids)] = True
    return ids, mask


def batch_loss(parts: FrozenParts, blocks, prompts: TrainablePrompts, examples: list[Example]) -> tuple[Tensor, int]:
    """(mean cross-entropy over the completion tokens, tokens run through the blocks)."""
    ids, mask = padded(examples)
    first, deep = prompts.for_batch(ids.shape[0])
    hidden = torch.cat([first, parts.embedding(ids).float()], dim=1)
    out = blocks(hidden, deep)
    p = prompts.tokens
    # the output at position p + t - 1 predicts token t; the head runs on the counted positions only (its
    # vocabulary-wide product is a tenth of the model's work per position)
    predicting = out[:, p - 1 : p - 1 + ids.shape[1]][mask]
    logits = parts.head(predicting[None])[0].float()
    loss = F.cross_entropy(logits, ids[mask])
    return loss, hidden.shape[0] * hidden.shape[1]


@torch.no_grad()
def mean_loss(parts: FrozenParts, blocks, prompts: TrainablePrompts, examples: list[Example], batch: int = 8) -> float:
    """The loss over examples (weighted by their completion tokens): held-out evaluation."""
    total, count = 0.0, 0
    for first in range(0, len(examples), batch):
        chunk = examples[first : first + batch]
        loss, _ = batch_loss(parts, blocks, prompts, chunk)
        n = sum(len(e.ids) - e.target_start for e in chunk)
        total, count = total + float(loss) * n, count + n
    return total / max(count, 1)


@dataclass
class Trainer:
    parts: FrozenParts
    blocks: object  # LocalBlocks or SwarmBlocks
    prompts: TrainablePrompts
    info: PromptsInfo  # what the prompts file says; info.step: steps trained so far
    examples: list[Example]
    config: TrainConfig
    moments: dict[str, Tensor] = field(default_factory=dict)  # Adam's moments from a resumed file
    failovers: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.optimizer = torch.optim.Adam(self.prompts.parameters(), lr=self.config.lr)
        for name, param in self.prompts.named_parameters():
            keys = (f"adam.{name}.exp_avg", f"adam.{name}.exp_avg_sq")
            if all(k in self.moments for k in keys) and self.info.step > 0:
                self.optimizer.state[param] = {"step": torch.tensor(float(self.info.step)),
                                               "exp_avg": self.moments[keys[0]], "exp_avg_sq": self.moments[keys[1]]}

    def step(self) -> StepReport:
        """One optimizer step (redone from the start on a new route when a swarm server fails)."""
        index = self.info.step
        examples = batches(self.examples, self.config.batch, index, self.config.seed)
        started, redone = time.perf_counter(), 0
        deadline = time.monotonic() + self.config.retry_seconds
        while True:
            self.optimizer.zero_grad(set_to_none=True)
            try:
                loss, tokens = batch_loss(self.parts, self.blocks, self.prompts, examples)
                loss.backward()
                break
            except (HopFailed, SwarmError) as exc:
                if time.monotonic() > deadline:
                    raise
                self._record_failover(index + 1, exc)
                redone += 1
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"step {index + 1}: the loss is {loss.item()}; lower --lr")
        self.optimizer.step()
        self.info = PromptsInfo(**{**self.info.__dict__, "step": index + 1})
        return StepReport(index + 1, loss.item(), tokens, time.perf_counter() - started, redone)

    def _record_failover(self, step: int, exc: Exception) -> None:
        self.failovers.append({"step": step, "peer": getattr(exc, "peer_id", None),
                               "blocks": getattr(exc, "blocks", None), "error": str(exc), "at": time.time()})
        time.sleep(0.2 if isinstance(exc, HopFailed) else 1.0)  # no route: the swarm view is read again
        refresh = getattr(self.blocks, "refresh", None)
        if refresh is not None:
            refresh()

    def run(self, out_path, on_step: Callable[[StepReport], None] | None = None,
            stop: threading.Event | None = None) -> list[StepReport]:
        """Steps until config.steps in all (or the stop flag), saving to out_path at the end (and every save_every
        steps): the reports of this run's steps."""
        reports = []
        try:
            while self.info.step < self.config.steps and not (stop is not None and stop.is_set()):
                reports.append(self.step())
                if on_step is not None:
                    on_step(reports[-1])
                if self.config.save_every and self.info.step % self.config.save_every == 0:
                    self.save(out_path)
        finally:
            if reports:
                self.save(out_path)
        return reports

    def save(self, path) -> None:
        save_prompts(path, self.prompts, self.info, self.optimizer)


def load_frozen_parts(path) -> FrozenParts:
    """The embedding and head of a checkpoint, fp32, not trained (a tied head shares the embedding)."""
    from hivekeeper.core.runtime.checkpoint import load_config, load_embedding, load_head

    config = load_config(path)
    embedding = load_embedding(path, dtype=torch.float32)
    head = load_head(path, dtype=torch.float32, embedding=embedding if config.tie_word_embeddings else None,
                     packed=False)
    return FrozenParts(config, embedding, head)


DEFAULT_METHOD = "deep_ptune"
DEFAULT_PROMPT_TOKENS = 8


@dataclass(frozen=True)
class RunSpec:
    """One training run as the CLI and the app describe it."""

    data: str
    out: str
    model: str = "smollm2-135m-instruct"
    method: str | None = None  # None: the resumed file's, else DEFAULT_METHOD
    prompt_tokens: int | None = None  # None: the resumed file's, else DEFAULT_PROMPT_TOKENS
    steps: int = 30
    lr: float = 1e-2
    batch: int = 4
    seed: int = 0
    eval_data: str | None = None
    swarm: bool = False
    initial_peers: tuple[str, ...] = ()
    dht_prefix: str | None = None


def open_trainer(spec: RunSpec, say: Callable[[str], None] = lambda line: None) -> tuple[Trainer, list[Example]]:
    """(trainer, held-out examples): the prompts resumed from spec.out when it exists (same method, size and model
    shape) or started anew, their size checked against the model's context, then the data read and checked, all
    before any weight is loaded; the blocks here or in the swarm. Close the swarm client with close_trainer."""
    from hivekeeper.core.finetune.blocks import local_blocks, swarm_blocks
    from hivekeeper.core.finetune.data import read_examples
    from hivekeeper.core.runtime.checkpoint import load_config, resolve_checkpoint
    from hivekeeper.core.runtime.generation import context_limit
    from hivekeeper.core.runtime.tokenizer import load_tokenizer

    _check_out(spec.out)
    path = resolve_checkpoint(spec.model, blocks=(0, 0), embeddings=True) if spec.swarm else \
        resolve_checkpoint(spec.model)
    tokenizer, config = load_tokenizer(path), load_config(path)
    prompts, info, moments = _start_or_resume(spec, config)
    room = context_limit(config) - prompts.tokens
    examples = read_examples(spec.data, tokenizer, room)
    held_out = read_examples(spec.eval_data, tokenizer, room) if spec.eval_data else []
    if Path(spec.out).exists():
        say(f"resuming {spec.out} at step {info.step}")
    parts = load_frozen_parts(path)
    if info.step == 0:
        prompts.start_from_vocabulary(parts.embedding.weight, spec.seed)
    blocks = swarm_blocks(spec.model, config.num_layers, spec.initial_peers, spec.dht_prefix) if spec.swarm \
        else local_blocks(path)
    train = TrainConfig(steps=spec.steps, lr=spec.lr, batch=spec.batch, seed=spec.seed)
    return Trainer(parts, blocks, prompts, info, examples, train, moments), held_out


def _check_out(out: str) -> None:
    """--out is a prompts file to write or resume: a folder there is refused before anything is loaded."""
    if Path(out).is_dir():
        raise InputError(f"--out {out}: a folder, not a prompts file")


def close_trainer(trainer: Trainer) -> None:
    client = getattr(trainer.blocks, "client", None)
    if client is not None:
        client.close()


def _start_or_resume(spec: RunSpec, config):
    """(prompts, info, Adam's moments): from spec.out when it exists (its method and size unless the run names
    others, which is refused), else new ones of the run's method and size (or the defaults)."""
    from hivekeeper.core.finetune.prompts import check_fits, load_prompts
    from hivekeeper.core.runtime.generation import context_limit

    if Path(spec.out).exists():
        prompts, info, moments = load_prompts(spec.out)
        check_fits(spec.out, info, config)
        _check_same_prompts(spec, info)
        check_prompt_tokens(info.tokens, context_limit(config), f"{spec.out}: its {info.tokens} prompt tokens")
        return prompts, PromptsInfo(**{**info.__dict__, "lr": spec.lr}), moments
    method = DEFAULT_METHOD if spec.method is None else spec.method
    tokens = DEFAULT_PROMPT_TOKENS if spec.prompt_tokens is None else spec.prompt_tokens
    check_prompt_tokens(tokens, context_limit(config), f"--prompt-tokens {tokens}")
    prompts = TrainablePrompts(method, tokens, config.hidden_size, config.num_layers)
    info = PromptsInfo(spec.model, method, tokens, config.hidden_size, config.num_layers, 0, spec.lr)
    return prompts, info, {}


def _check_same_prompts(spec: RunSpec, info: PromptsInfo) -> None:
    """A run resuming a file may leave out --method and --prompt-tokens (the file's are taken); a different value
    given is refused, saying the file's."""
    flags = (("--method", spec.method, info.method), ("--prompt-tokens", spec.prompt_tokens, info.tokens))
    differ = [(flag, asked, held) for flag, asked, held in flags if asked is not None and asked != held]
    if differ:
        asked = " ".join(f"{flag} {value}" for flag, value, _ in differ)
        held = " ".join(f"{flag} {value}" for flag, _, value in differ)
        them = "them" if len(differ) > 1 else "it"
        raise InputError(f"{spec.out}: holds {info.method} prompts of {info.tokens} tokens, not {asked}: pass "
                         f"{held} (or leave {them} out) to resume, or use another --out to start anew")
