"""The fixed cost of a decode step outside the blocks and the LM head, measured with the engine's own decode loop.

A decode step is the span (every block), the LM head, and the rest: embedding the new token, sampling it, and the
generation loop's bookkeeping (`generation.generate`). The cost model prices the rest as
`Efficiency.step_overhead_s`, until issue 23 (session 16) a default 1 ms nobody measured; a packed SmolLM2-135M step
takes 5.5-8 ms, so the default alone was 12-18% of it.

`measure.measure_step_overhead` runs `generate` (greedy, ignore_eos) on a tiny decoder held in memory, shaped to pay
what a small model's step pays outside its blocks: one block 64 wide (laid out as `measure.span_of_config` lays out a
loaded model, so its one-token steps take the native kernels' path), an LM head over `LOOP_VOCAB` tokens (SmolLM2's:
the sampler reads a row of that many logits) and a token embedding packed as a GGUF's (Q8_0 rows dequantized per
lookup, as the default model's: a checkpoint's fp32 embedding costs ~0.04 ms less). After its block the tiny span
reads a buffer of twice the last-level cache, as a real step's weights stream through it, so the loop's code and data
are as cold as after a real model's blocks (issue 23, session 16, a 2-core EPYC at load ~2: 0.12 ms with warm caches,
a 32000-token vocabulary and an fp32 embedding; 0.30-0.37 ms so shaped; SmolLM2-135M Q4_1's own steps 0.26-0.31 ms).
It times every span and head call and takes each step's time (between the loop's stop-flag checks: StepClock, which
profiling.measure_grid times its steps with too) less its span and head calls: the median of those rests over
`LOOP_RUNS` x `LOOP_STEPS` steps. About 0.2 s with a 32 MiB cache (2 x 16 steps of ~3 ms: the buffer read is most of
it).

This module holds the loop's parts (the tiny runner, the timed calls, the rests); measure.py builds the decoder and
makes the Measurement, so that this module imports neither it nor profiling (both import it). The text `generate`
streams through the tokenizer is not in it (~0.05-0.1 ms a step more for SmolLM2; the
measurement has no tokenizer to run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

LOOP_HIDDEN = 64  # the tiny decoder's width: one head of 64
LOOP_VOCAB = 49152  # its vocabulary (SmolLM2's): the sampler's argmax reads a model-sized row of logits
LOOP_EMBEDDING = "q8_0"  # its embedding's packed format (a GGUF's, as the runtime keeps it)
LOOP_STEPS = 16  # decode steps per run
LOOP_RUNS = 2  # runs of generate(); the rests of all their steps are pooled
LOOP_PROMPT = 4  # prompt tokens of each run


class StepClock:
    """Passed to generate() as its stop flag, which it checks once between decode steps: the time of each check
    gives the duration of every step, so a burst of load from another process spoils a few steps, not the run."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def is_set(self) -> bool:
        self.times.append(time.perf_counter())
        return False

    def step_durations(self, last_token_at: float) -> list[float]:
        """Each decode step's seconds: between checks, and from the last check to the last token."""
        marks = self.times + [last_token_at]
        return [b - a for a, b in zip(marks[:-1], marks[1:])]


@dataclass
class TimedCall:
    """A callable (the span or the head) whose calls' seconds are appended to `seconds`; other attributes pass
    through (the span's allocate_cache)."""

    part: object
    seconds: list

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        out = self.part(*args, **kwargs)
        self.seconds.append(time.perf_counter() - started)
        return out

    def __getattr__(self, name):
        return getattr(self.part, name)


class LoopSpan:
    """A span of decoder blocks with the cache generate() asks for (`allocate_cache`), as the engine's spans have;
    each call reads `flush` after the blocks (a buffer beyond the last-level cache, or an empty one), so that what
    runs next finds the caches as cold as after a real model's blocks."""

    def __init__(self, config, span, flush: torch.Tensor):
        self.config, self.span, self.flush = config, span, flush

    def allocate_cache(self, batch: int, max_length: int):
        from hivekeeper.core.runtime.model import KVCache

        return KVCache.allocate(self.config, self.config.num_layers, batch, max_length, torch.float32)

    def __call__(self, hidden, cache):
        out = self.span(hidden, cache)
        self.flush.sum()
        return out


@dataclass
class LoopModel:
    """The runner shape generation.generate takes (config, embedding, span, head), with the span's and the head's
    calls timed (`span_s`, `head_s`: seconds of each call, the prefill's first)."""

    config: object
    embedding: object
    span: TimedCall
    head: TimedCall

    @property
    def span_s(self) -> list[float]:
        return self.span.seconds

    @property
    def head_s(self) -> list[float]:
        return self.head.seconds


def loop_config(vocab: int = LOOP_VOCAB, hidden: int = LOOP_HIDDEN):
    """The tiny decoder's ModelConfig: one block `hidden` wide (heads of 64), room for a run's tokens."""
    from hivekeeper.core.runtime.model import ModelConfig

    return ModelConfig("llama", vocab, hidden, 2 * hidden, 1, max(1, hidden // 64), 1, 64,
                       max_position_embeddings=LOOP_PROMPT + LOOP_STEPS + 8, tie_word_embeddings=True)


def loop_model(config, span, embedding, cache_bytes: int = 0) -> LoopModel:
    """The tiny decoder (`config`, its span of blocks laid out as a loaded model's, its embedding) as generate() runs
    it, with an fp32 head over its vocabulary, its span and head timed; its span reads twice `cache_bytes` after its
    block (0: nothing)."""
    from hivekeeper.core.runtime.model import Head

    head = Head(config).requires_grad_(False)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02)
        head.norm.weight.fill_(1.0)
    flush = torch.ones(2 * cache_bytes // 4)
    return LoopModel(config, embedding, TimedCall(LoopSpan(config, span, flush), []), TimedCall(head, []))


def step_rests(steps_s: list[float], span_s: list[float], head_s: list[float]) -> list[float]:
    """Each decode step's seconds less its span and head calls. `span_s` and `head_s` hold the prefill's call first,
    then one per step: the step between two stop-flag checks runs the span and head calls after the first check."""
    return [step - span - head for step, span, head in zip(steps_s, span_s[1:], head_s[1:])]


def loop_rests(model: LoopModel, steps: int = LOOP_STEPS) -> list[float]:
    """One generate() run of `steps` new tokens on `model`: every decode step's rest (step_rests)."""
    from hivekeeper.core.runtime.generation import generate

    model.span_s.clear()
    model.head_s.clear()
    clock = StepClock()
    called = time.perf_counter()
    with torch.inference_mode():
        result = generate(model, list(range(1, LOOP_PROMPT + 1)), max_new_tokens=steps, ignore_eos=True, stop=clock)
    durations = clock.step_durations(called + result.time_to_first_token_s + result.decode_s)
    return step_rests(durations, model.span_s, model.head_s)
