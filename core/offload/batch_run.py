"""A batch generation over a prompts file with a given policy, reporting each step as it runs.

This is what `hivekeeper generate --prompts-file` runs (the same prompts file rules, plan_local_run's pieces, the
OffloadedModel and core.generation.generate), for a caller that draws the measured throughput beside the predicted
one while it runs and may stop it: the app's Plan page ("Run this plan"). Each step (the first token after the
prefill, then each decode step) is reported as a StepReport; `stop` ends the run after the step in progress.

    run = BatchRun(model="smollm2-135m-instruct", prompts_file="prompts.txt", policy=policy, predicted=figures)
    report = run_batch(run, on_step=print, stop=threading.Event())
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hivekeeper.planner.costmodel import Policy
from hivekeeper.planner.errors import InputError

MAX_PROMPTS = 65536


@dataclass(frozen=True)
class BatchRun:
    """What to run: the model (checkpoint folder, GGUF, default model id or hub id), the prompts (one a line, the
    same number of tokens each: one batch), the policy (None: the planner's for this machine) and its predicted
    figures (local_plan.PREDICTED_KEYS), under an optional RAM budget. `predict(batch, prompt_len, new_tokens)`,
    when given, predicts them for the run's own shape instead (called once the prompts are read)."""

    model: str
    prompts_file: str
    policy: Policy | None = None
    predicted: dict | None = None
    max_new_tokens: int = 32
    ram_budget_bytes: float | None = None
    source: str = "the plan shown"  # where the policy came from, in words
    predict: Callable[[int, int, int], dict | None] | None = None


@dataclass(frozen=True)
class StepReport:
    """One step of a running batch: `tokens` generated so far over all sequences, `elapsed_s` since the run
    started (prefill included), and the throughput that makes (FlexGen's metric: tokens / wall time)."""

    step: int
    tokens: int
    elapsed_s: float

    @property
    def throughput_tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def read_prompts_file(path: str | Path) -> list[str]:
    """The non-empty lines of a prompts file (one prompt each); errors name the file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the prompts file ({exc})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise InputError(f"{path}: needs 1 to {MAX_PROMPTS} prompts, one per line (found {len(prompts)})")
    return prompts


def tokenize_batch(tokenizer, prompts: list[str], source: str | Path) -> list[list[int]]:
    """The prompts' token ids, one equally long list each (one batch, no padding); errors name the file and lines."""
    ids = [tokenizer.encode(prompt) for prompt in prompts]
    lengths = sorted({len(row) for row in ids})
    if len(lengths) > 1:
        rows = {length: next(i + 1 for i, row in enumerate(ids) if len(row) == length) for length in lengths}
        raise InputError(f"{source}: the prompts of one batch must have the same number of tokens; they "
                         f"have {', '.join(f'{n} (line {line})' for n, line in rows.items())} (padding is not "
                         "supported yet)")
    return ids


class StepClock:
    """A runner (`config`, `embedding`, `span`, `head`) whose head reports each step: generate() calls the head
    once per sampled token row (after the prefill, then after each decode step)."""

    def __init__(self, model, batch: int, on_step: Callable[[StepReport], None], started: float):
        self.config, self.embedding, self.span = model.config, model.embedding, model.span
        self._head, self._batch, self._on_step, self._started = model.head, batch, on_step, started
        self.steps = 0

    def head(self, hidden):
        logits = self._head(hidden)
        self.steps += 1
        self._on_step(StepReport(self.steps, self.steps * self._batch, time.perf_counter() - self._started))
        return logits


def choose(run: BatchRun, path, config, *, batch: int, prompt_len: int, max_length: int):
    """(PolicyChoice, EnginePlan) for the run: its policy as given, or the planner's (local_plan.plan_local_run)."""
    from hivekeeper.core.offload.local_plan import PolicyChoice, engine_plan, plan_local_run

    if run.policy is None:
        return plan_local_run("auto", path, config, batch=batch, prompt_len=prompt_len,
                              max_new_tokens=max(1, max_length - prompt_len), max_length=max_length,
                              ram_budget_bytes=run.ram_budget_bytes)
    predicted = run.predict(batch, prompt_len, max(1, max_length - prompt_len)) if run.predict else run.predicted
    choice = PolicyChoice(run.policy, run.source, f"policy of {run.source}", predicted=predicted)
    plan = engine_plan(config, choice, batch=batch, max_length=max_length, ram_budget_bytes=run.ram_budget_bytes,
                       prefill_tokens=min(256, max(1, prompt_len)), model_path=path)
    return choice, plan


def run_batch(run: BatchRun, on_step: Callable[[StepReport], None], stop: threading.Event | None = None,
              on_start: Callable[[dict], None] | None = None) -> dict:
    """Generate run.max_new_tokens greedy tokens for every prompt together (EOS ignored, as a benchmark does);
    returns the texts, the measured and predicted tokens/s, the plan used and the bytes streamed from disk.
    on_start(info) is called once the plan is made, before the model loads: {"batch", "prompt_tokens",
    "new_tokens", "predicted", "plan"}."""
    from hivekeeper.core.offload.offloaded_model import OffloadedModel
    from hivekeeper.core.runtime.checkpoint import load_config, resolve_checkpoint
    from hivekeeper.core.runtime.generation import check_prompt_fits, context_limit, generate
    from hivekeeper.core.runtime.tokenizer import load_tokenizer

    if not 1 <= run.max_new_tokens <= 1_000_000:
        raise InputError(f"max new tokens must be from 1 to 1000000, got {run.max_new_tokens}")
    prompts = read_prompts_file(run.prompts_file)
    path = resolve_checkpoint(run.model)
    tokenizer, config = load_tokenizer(path), load_config(path)
    ids = tokenize_batch(tokenizer, prompts, run.prompts_file)
    check_prompt_fits(len(ids[0]), config, what=str(run.prompts_file))
    max_length = min(len(ids[0]) + run.max_new_tokens, context_limit(config))
    choice, plan = choose(run, path, config, batch=len(ids), prompt_len=len(ids[0]), max_length=max_length)
    if on_start is not None:
        on_start({"batch": len(ids), "prompt_tokens": len(ids[0]), "new_tokens": max_length - len(ids[0]),
                  "predicted": choice.predicted, "plan": plan.describe()})
    started = time.perf_counter()
    with OffloadedModel(path, plan) as model:
        clock = StepClock(model, len(ids), on_step, started)
        result = generate(clock, ids, max_new_tokens=run.max_new_tokens, batch=len(ids), tokenizer=tokenizer,
                          ignore_eos=True, stop=stop)
        streamed = model.bytes_streamed
    return {
        "texts": result.texts, "new_tokens": result.new_tokens, "steps": result.steps, "batch": len(ids),
        "stopped": "stopped" in result.finish_reasons, "total_s": round(result.total_s, 4),
        "throughput_tokens_per_s": round(result.new_tokens / result.total_s, 4) if result.total_s > 0 else None,
        "decode_tokens_per_s": result.decode_tokens_per_s, "predicted": choice.predicted,
        "plan": plan.describe(), "warnings": list(choice.warnings), "bytes_streamed": streamed,
        "bytes_streamed_per_token": round(streamed / result.new_tokens) if result.new_tokens else 0,
    }
