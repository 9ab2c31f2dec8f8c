"""One generation loop for every runner: a local OffloadedModel or a SwarmModel (embeddings and head here, blocks
in the swarm). A runner has `config`, `embedding(ids)`, `head(hidden)` and `span` with `allocate_cache(batch,
max_length)` and `span(hidden, cache)`.

The loop prefills the prompt in chunks, then decodes one token per sequence per step: sampling (core.sampling),
streaming text through a callback as it becomes final, stopping at EOS or a stop string, at max_new_tokens or the
end of the context, or when a stop flag is set (checked between steps). It times the first token and the decode
rate and returns a GenerationResult.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hivekeeper.planner.errors import InputError

from .sampling import Sampler, SamplingParams, StopChecker

# on_text(row, text): text of sequence `row` that is final (never retracted), in order
TextCallback = Callable[[int, str], None]


@dataclass
class GenerationResult:
    """What one generation produced, and how fast.

    token_ids: new tokens per sequence, up to and including the one that finished it (EOS, stop string).
    finish_reasons: per sequence, "eos", "stop_string", "length" (max_new_tokens or the context) or "stopped".
    time_to_first_token_s: from the call to the first sampled token (tokenized prompt in, prefill included).
    decode_s: from the first token to the last; decode_tokens_per_s counts every sequence's tokens after the first.
    """

    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    prompt_tokens: int
    steps: int
    time_to_first_token_s: float
    decode_s: float
    total_s: float

    @property
    def batch(self) -> int:
        return len(self.texts)

    @property
    def new_tokens(self) -> int:
        """Tokens generated over all sequences (each up to its finish)."""
        return sum(len(ids) for ids in self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode throughput: tokens computed per second after the first step, all sequences together."""
        if self.steps < 2 or self.decode_s <= 0:
            return None
        return self.batch * (self.steps - 1) / self.decode_s

    def as_dict(self) -> dict:
        return {
            "text": self.texts[0], "texts": self.texts, "finish_reasons": self.finish_reasons,
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "steps": self.steps,
            "batch": self.batch, "tokens_per_s": _round(self.decode_tokens_per_s),
            "time_to_first_token_s": _round(self.time_to_first_token_s), "decode_s": _round(self.decode_s),
            "total_s": _round(self.total_s),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.5g}")


def context_limit(config) -> int:
    return config.max_position_embeddings


def check_prompt_fits(prompt_tokens: int, config, what: str = "the prompt") -> None:
    """A prompt must leave room for at least one new token in the model's context."""
    limit = context_limit(config)
    if prompt_tokens >= limit:
        raise InputError(f"{what} has {prompt_tokens} tokens; the model's context is {limit} tokens "
                         f"(max_position_embeddings in config.json), which leaves no room to generate: "
                         f"shorten it below {limit} tokens")


def _prompt_tensor(prompt_ids: Sequence[int] | Sequence[Sequence[int]], batch: int) -> torch.Tensor:
    if prompt_ids and isinstance(prompt_ids[0], (list, tuple)):
        rows = [list(r) for r in prompt_ids]
        if len({len(r) for r in rows}) != 1:
            raise InputError("prompts of one batch must have the same number of tokens")
    else:
        rows = [list(prompt_ids)] * batch
    if not rows or not rows[0]:
        raise InputError("the prompt is empty: give at least one token")
    return torch.tensor(rows, dtype=torch.long)


@torch.inference_mode()
def generate(model, prompt_ids: Sequence[int] | Sequence[Sequence[int]], *, max_new_tokens: int, batch: int = 1,
             sampling: SamplingParams | None = None, tokenizer=None, eos_ids: Sequence[int] | None = None,
             stop_strings: Sequence[str] | None = None, ignore_eos: bool = False, on_text: TextCallback | None = None,
             stop: threading.Event | None = None, prefill_chunk: int = 256) -> GenerationResult:
    """Generate up to max_new_tokens after the prompt (one list of ids, repeated `batch` times, or a list of
    equally long lists). Greedy unless `sampling` says otherwise. With a `tokenizer`, text is decoded, streamed to
    `on_text` and checked for stop strings (default: the tokenizer's); EOS ids default to the tokenizer's and the
    model config's. ignore_eos=True generates exactly max_new_tokens (for benchmarks)."""
    started = time.perf_counter()
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    ids = _prompt_tensor(prompt_ids, batch)
    batch, prompt_len = ids.shape
    config = model.config
    check_prompt_fits(prompt_len, config)
    max_length = min(prompt_len + max_new_tokens, context_limit(config))
    max_new_tokens = max_length - prompt_len

    if eos_ids is None:
        eos_ids = tuple(getattr(tokenizer, "eos_token_ids", ())) + tuple(config.eos_token_ids)
    if stop_strings is None:
        stop_strings = tuple(getattr(tokenizer, "stop_strings", ()))
    checkers = [StopChecker(() if ignore_eos else eos_ids, stop_strings if tokenizer is not None else ())
                for _ in range(batch)]
    decoders = [tokenizer.stream_decoder() for _ in range(batch)] if tokenizer is not None else None
    sampler = Sampler(sampling or SamplingParams(temperature=0.0))
    needs_history = sampler.params.repetition_penalty != 1.0
    device = model.embedding.weight.device
    history = torch.empty(batch, max_length, dtype=torch.long, device=device) if needs_history else None
    ids = ids.to(device)
    if history is not None:
        history[:, :prompt_len] = ids

    texts = [""] * batch
    generated: list[list[int]] = [[] for _ in range(batch)]
    reasons: list[str | None] = [None] * batch
    first_token_at = last_token_at = None
    steps = 0
    cache = model.span.allocate_cache(batch, max_length)
    try:
        hidden = None
        for start in range(0, prompt_len, prefill_chunk):
            hidden = model.span(model.embedding(ids[:, start : start + prefill_chunk]), cache)
        logits = model.head(hidden[:, -1:])[:, -1]
        while True:
            previous = history[:, : prompt_len + steps] if history is not None else None
            next_ids = sampler(logits, previous)  # [batch]
            steps += 1
            last_token_at = time.perf_counter()
            if first_token_at is None:
                first_token_at = last_token_at
            if history is not None:
                history[:, prompt_len + steps - 1] = next_ids
            for row, token in enumerate(next_ids.tolist()):
                if reasons[row] is not None:
                    continue
                generated[row].append(token)
                piece = decoders[row].feed(token) if decoders is not None else ""
                shown = checkers[row].push(token, piece)
                if shown:
                    texts[row] += shown
                    if on_text is not None:
                        on_text(row, shown)
                if checkers[row].stopped:
                    reasons[row] = checkers[row].reason
            if all(r is not None for r in reasons) or steps >= max_new_tokens:
                break
            if stop is not None and stop.is_set():
                reasons = [r or "stopped" for r in reasons]
                break
            hidden = model.span(model.embedding(next_ids[:, None]), cache)
            logits = model.head(hidden)[:, -1]
    finally:
        close = getattr(cache, "close", None)
        if close is not None:
            close()

    for row in range(batch):  # text held back (an unfinished character, a partial stop string) is released
        if reasons[row] in (None, "stopped") and decoders is not None:
            tail = checkers[row].push(-1, decoders[row].flush()) + checkers[row].finish()
            if tail:
                texts[row] += tail
                if on_text is not None:
                    on_text(row, tail)
        reasons[row] = reasons[row] or "length"
    finished = time.perf_counter()
    return GenerationResult(
        texts=texts, token_ids=generated, finish_reasons=list(reasons), prompt_tokens=prompt_len, steps=steps,
        time_to_first_token_s=first_token_at - started, decode_s=last_token_at - first_token_at,
        total_s=finished - started,
    )
