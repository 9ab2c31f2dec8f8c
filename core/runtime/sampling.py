"""Choosing the next token from logits, and deciding when a sequence is finished.

`Sampler` applies, in Hugging Face's order: repetition penalty, then (unless greedy) temperature, top-k, top-p, and
draws from the result with its own torch.Generator, so a seed reproduces a generation whatever else uses torch's
global generator. `StopChecker` watches one sequence for an end-of-sequence id or a stop string in its text.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from hivekeeper.planner.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. temperature 0 (or top_k 1) means greedy: always the most likely token.

    top_k 0 and top_p 1.0 switch those filters off; repetition_penalty 1.0 switches the penalty off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.seed is not None and self.seed < 0:
            raise InputError(f"seed must be >= 0, got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def apply_repetition_penalty(logits: torch.Tensor, previous_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """Make every token already in previous_ids less likely (CTRL's penalty, as transformers applies it).

    logits [batch, vocab]; previous_ids [batch, t]. A positive logit is divided by the penalty, a negative one
    multiplied, so the token loses probability either way. Returns a new tensor.
    """
    if penalty == 1.0 or previous_ids.numel() == 0:
        return logits
    previous_ids = previous_ids.to(device=logits.device, dtype=torch.long)
    seen = logits.gather(-1, previous_ids)  # [batch, t]
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(-1, previous_ids, seen)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th kept too); the rest become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth_largest = logits.topk(k, dim=-1).values[..., -1:]  # [batch, 1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the most likely tokens of each row until they hold at least p of the probability.

    A token is dropped when the tokens ranked above it already reach p; the most likely token always stays.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked strictly higher
    drop_sorted = mass_above >= p
    drop_sorted[..., 0] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


class Sampler:
    """Picks next tokens for one generation. Make a new Sampler per generation: it owns the random generator."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self._generator: torch.Generator | None = None
        self._device: torch.device | None = None

    def _generator_for(self, device: torch.device) -> torch.Generator:
        """The generation's generator, made on first use on the logits' device (seeded from the OS if no seed)."""
        if self._generator is None:
            seed = self.params.seed
            if seed is None:
                seed = int.from_bytes(os.urandom(8), "little") >> 1
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(seed)
            self._device = device
        elif device != self._device:
            raise ValueError(f"this Sampler draws on {self._device}; logits arrived on {device}")
        return self._generator

    def __call__(self, logits: torch.Tensor, previous_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Next token ids [batch] (int64) from logits [batch, vocab]; previous_ids [batch, t] for the penalty."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        params = self.params
        logits = logits.float()
        if previous_ids is not None:
            logits = apply_repetition_penalty(logits, previous_ids, params.repetition_penalty)
        if params.is_greedy:
            return logits.argmax(dim=-1)
        logits = logits / params.temperature
        logits = apply_top_k(logits, params.top_k)
        logits = apply_top_p(logits, params.top_p)
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self._generator_for(logits.device)).squeeze(-1)


def sample(logits: torch.Tensor, params: SamplingParams, previous_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One-off sampling with a fresh generator; a generation loop should keep one Sampler instead."""
    return Sampler(params)(logits, previous_ids)


class StopChecker:
    """Watches one sequence: stops at an end-of-sequence id or when a stop string appears in the decoded text.

    Feed each new token id with the text the stream decoder released for it; `push` returns the text that is safe
    to show. Text that could be the start of a stop string is held back until it is clearly not one; a stop string
    found is cut off together with everything after it. Call `finish` at the end for any text still held.
    """

    def __init__(self, eos_ids: Iterable[int] = (), stop_strings: Iterable[str] = ()):
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.stop_strings = tuple(dict.fromkeys(s for s in stop_strings if s))
        self.stopped = False
        self.reason: str | None = None  # "eos" or "stop_string"
        self.matched: str | None = None  # the stop string that ended the sequence
        self._held = ""

    def push(self, token_id: int, text: str = "") -> str:
        """Record one generated token and its text; returns the text to emit now (after a stop: always "")."""
        if self.stopped:
            return ""
        buffer = self._held + text
        self._held = ""
        cut = self._first_stop(buffer)
        if cut is not None:
            self.stopped, self.reason = True, "stop_string"
            return buffer[:cut]
        if int(token_id) in self.eos_ids:
            self.stopped, self.reason = True, "eos"
            return buffer
        hold = self._longest_partial_stop(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def finish(self) -> str:
        """The text still held back (a prefix of a stop string that never completed)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def trim(self, text: str) -> str:
        """A whole text cut at its first stop string (for callers that do not stream)."""
        cut = self._first_stop(text)
        return text if cut is None else text[:cut]

    def _first_stop(self, text: str) -> int | None:
        best = None
        for stop in self.stop_strings:
            index = text.find(stop)
            if index != -1 and (best is None or index < best):
                best, self.matched = index, stop
        return best

    def _longest_partial_stop(self, text: str) -> int:
        """Length of the longest end of `text` that is the beginning of some stop string."""
        longest = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
