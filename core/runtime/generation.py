"""One generation loop for every runner: a local OffloadedModel or a SwarmModel (embeddings and head here, blocks
in the swarm). A runner has `config`, `embedding(ids)`, `head(hidden)` and `span` with `allocate_cache(batch,
max_length)` and `span(hidden, cache)`.

The loop prefills the prompt in chunks, then decodes one token per sequence per step: sampling (core.sampling),
streaming text through a callback as it becomes final, stopping at EOS or a stop string, at max_new_tokens or the
end of the context, or when a stop flag is set (checked between steps). It times the first token and the decode
rate and returns a GenerationResult.

A chat passes a PromptCache: the runner's cache kept from one call to the next with the token ids it holds, so each
turn prefills only what follows the longest common prefix of those ids and the new prompt (the earlier turns are not
computed again, and the time to first token stays flat as the conversation grows).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from hivekeeper.planner.errors import InputError

from hivekeeper.core.runtime.sampling import Sampler, SamplingParams, StopChecker

# on_text(row, text): text of sequence `row` that is final (never retracted), in order
TextCallback = Callable[[int, str], None]


@dataclass
class GenerationResult:
    """What one generation produced, and how fast.

    token_ids: new tokens per sequence, up to and including the one that finished it (EOS, stop string).
    finish_reasons: per sequence, "eos", "stop_string", "length" (max_new_tokens or the context) or "stopped".
    time_to_first_token_s: from the call to the first sampled token (tokenized prompt in, prefill included).
    decode_s: from the first token to the last; decode_tokens_per_s counts every sequence's tokens after the first.
    cached_prompt_tokens: prompt tokens whose K/V came from a PromptCache (not prefilled again).
    """

    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    prompt_tokens: int
    steps: int
    time_to_first_token_s: float
    decode_s: float
    total_s: float
    cached_prompt_tokens: int = 0

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens this call ran through the model (per sequence)."""
        return self.prompt_tokens - self.cached_prompt_tokens

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
            "prompt_tokens": self.prompt_tokens, "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens, "new_tokens": self.new_tokens, "steps": self.steps,
            "batch": self.batch, "tokens_per_s": _round(self.decode_tokens_per_s),
            "time_to_first_token_s": _round(self.time_to_first_token_s), "decode_s": _round(self.decode_s),
            "total_s": _round(self.total_s),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.5g}")


@dataclass
class PromptCache:
    """A runner's cache kept across generate() calls, for one conversation, with the token ids whose K/V it holds.

    max_length: the most tokens it holds (a local chat: the max_length its plan budgets; it is allocated once).
    initial_length: None allocates max_length on first use. A number allocates that many tokens, or what a call
        needs if more (up to max_length); a call that needs more than is allocated starts a larger cache,
        prefilling all again. For a swarm session, whose cache is reserved on the servers (ours cap a session at
        2048 tokens by default, as Petals' do for most models).
    max_idle_s / max_age_s: a cache unused for longer, or older, is dropped rather than reused (our swarm servers
        end a session that waits over 300 s for its next step, or lasts over 1800 s, by default).

    Reuse is exact: the cache is rewound to the longest common prefix of `ids` and the new prompt, so a chat template
    that renders earlier turns differently, a changed system prompt or another conversation only costs more prefill.
    reset() empties it (a new conversation); close() frees it. One sequence (batch 1), one generation at a time.
    """

    max_length: int
    initial_length: int | None = None
    max_idle_s: float | None = None
    max_age_s: float | None = None
    ids: list[int] = field(default_factory=list)  # the tokens whose K/V `cache` holds, in order
    cache: object | None = field(default=None, repr=False)  # the runner's KVCache-like object, or None
    capacity: int = 0  # tokens `cache` was allocated for
    created_at: float = 0.0  # time.monotonic() of the allocation
    used_at: float = 0.0  # ... and of the last generation that used it

    def __post_init__(self):
        if self.max_length < 2:
            raise InputError(f"a prompt cache needs max_length of at least 2 tokens, got {self.max_length}")

    def reset(self) -> None:
        """Forget what it holds and free the runner's cache (a swarm session is closed)."""
        cache, self.cache, self.capacity, self.ids = self.cache, None, 0, []
        close = getattr(cache, "close", None)
        if close is not None:
            close()

    close = reset

    def _stale(self, now: float) -> bool:
        return (self.max_idle_s is not None and now - self.used_at > self.max_idle_s) or \
            (self.max_age_s is not None and now - self.created_at > self.max_age_s)

    def _attach(self, span, prompt: list[int], needed: int):
        """(cache, reused): the cache rewound to the common prefix with `prompt`, ready for the rest of it and
        `needed` tokens in all; (None, 0) when `needed` exceeds max_length (the caller runs without it)."""
        now = time.monotonic()
        if self.cache is not None and (needed > self.capacity or self._stale(now)
                                       or self.cache.length != len(self.ids)):
            self.reset()
        if needed > self.max_length:
            return None, 0
        if self.cache is None:
            capacity = self.max_length if self.initial_length is None else \
                min(self.max_length, max(needed, self.initial_length))
            self.cache = span.allocate_cache(1, capacity)
            self.capacity, self.created_at, self.used_at = capacity, now, now
        # at least the prompt's last token is run again: its logits give the first new token
        reused = min(_common_prefix(self.ids, prompt), len(prompt) - 1)
        if reused < self.cache.length:
            self.cache.truncate(reused)
        self.ids = prompt[:reused]
        return self.cache, reused

    def _record(self, ids: list[int]) -> None:
        """After a generation: the tokens now in the cache (prompt and every generated token that went in)."""
        self.ids = ids
        self.used_at = time.monotonic()
        if self.cache.length != len(ids):  # never guess: an unknown state is dropped
            self.reset()


# a swarm session is reserved on the servers: for the servers' usual per-session limit (more only when a turn needs
# it), and given up before a server would end it (step timeout 300 s, session timeout 1800 s)
SWARM_SESSION_TOKENS = 2048
SWARM_SESSION_MAX_IDLE_S = 240.0
SWARM_SESSION_MAX_AGE_S = 1500.0


def conversation_cache(max_length: int, *, swarm: bool = False) -> PromptCache:
    """The KV cache a chat keeps between turns: locally, the max_length its plan counts, allocated once; through a
    swarm, a session of SWARM_SESSION_TOKENS (or more when a turn needs it), renewed before servers would end it."""
    if not swarm:
        return PromptCache(max_length)
    return PromptCache(max_length, initial_length=SWARM_SESSION_TOKENS, max_idle_s=SWARM_SESSION_MAX_IDLE_S,
                       max_age_s=SWARM_SESSION_MAX_AGE_S)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


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
             stop: threading.Event | None = None, prefill_chunk: int = 256,
             prompt_cache: PromptCache | None = None) -> GenerationResult:
    """Generate up to max_new_tokens after the prompt (one list of ids, repeated `batch` times, or a list of
    equally long lists). Greedy unless `sampling` says otherwise. With a `tokenizer`, text is decoded, streamed to
    `on_text` and checked for stop strings (default: the tokenizer's); EOS ids default to the tokenizer's and the
    model config's. ignore_eos=True generates exactly max_new_tokens (for benchmarks).

    prompt_cache (batch 1): reuse and keep the runner's cache across calls (see PromptCache). A call that does not
    fit in it runs as without one and leaves it empty; an error mid-generation empties it too."""
    started = time.perf_counter()
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    ids = _prompt_tensor(prompt_ids, batch)
    batch, prompt_len = ids.shape
    if prompt_cache is not None and batch != 1:
        raise InputError(f"a prompt cache holds one sequence; this generation has a batch of {batch}")
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
    cache, reused = None, 0
    if prompt_cache is not None:
        cache, reused = prompt_cache._attach(model.span, ids[0].tolist(), max_length)
    keep = cache is not None  # the prompt cache's: not closed here
    if cache is None:
        cache = model.span.allocate_cache(batch, max_length)
    fed: list[int] = []  # sampled tokens run through the model (batch 1: what the prompt cache then holds)
    try:
        hidden = None
        for start in range(reused, prompt_len, prefill_chunk):
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
            fed.append(int(next_ids[0]))
            logits = model.head(hidden)[:, -1]
    except BaseException:
        if keep:
            with contextlib.suppress(Exception):  # the error that matters is the one being raised
                prompt_cache.reset()  # what it holds is unknown now
        raise
    finally:
        close = getattr(cache, "close", None)
        if not keep and close is not None:
            close()
    if keep:
        prompt_cache._record(ids[0].tolist() + fed)
    elif prompt_cache is not None:
        prompt_cache.reset()  # it did not fit: start over next time

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
        total_s=finished - started, cached_prompt_tokens=reused,
    )
