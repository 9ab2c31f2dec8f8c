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
from hivekeeper.planner.models import CONTEXT_FIELDS

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
                         f"({CONTEXT_FIELDS}), which leaves no room to generate: "
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
    ids, max_length = _checked_prompt(model, prompt_ids, batch, max_new_tokens, prompt_cache)
    eos, strings = stop_rules(model.config, tokenizer, eos_ids, stop_strings, ignore_eos)
    rows = _Rows.open(ids.shape[0], tokenizer, eos, strings, on_text)
    ids = ids.to(model.embedding.weight.device)
    steps = _Steps.open(sampling, ids, max_length, stop)
    with _cache_in_use(model.span, prompt_cache, ids, max_length) as use:
        _decode(model, _prefill(model, ids, use, prefill_chunk), steps, rows, use)
    rows.close()
    return GenerationResult(
        texts=rows.texts, token_ids=rows.generated, finish_reasons=list(rows.reasons), prompt_tokens=steps.prompt_len,
        steps=steps.count, time_to_first_token_s=steps.first_at - started, decode_s=steps.last_at - steps.first_at,
        total_s=time.perf_counter() - started, cached_prompt_tokens=use.reused,
    )


def _checked_prompt(model, prompt_ids, batch: int, max_new_tokens: int,
                    prompt_cache: PromptCache | None) -> tuple[torch.Tensor, int]:
    """The prompt as a [batch, tokens] tensor, and the length the generation may reach (the context caps it)."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    ids = _prompt_tensor(prompt_ids, batch)
    batch, prompt_len = ids.shape
    if prompt_cache is not None and batch != 1:
        raise InputError(f"a prompt cache holds one sequence; this generation has a batch of {batch}")
    config = model.config
    check_prompt_fits(prompt_len, config)
    return ids, min(prompt_len + max_new_tokens, context_limit(config))


def stop_rules(config, tokenizer, eos_ids, stop_strings, ignore_eos: bool) -> tuple[tuple, tuple]:
    """(EOS ids, stop strings) a sequence stops at: by default the tokenizer's and the config's EOS ids, and the
    tokenizer's stop strings; no EOS with ignore_eos, no stop strings without a tokenizer."""
    if eos_ids is None:
        eos_ids = tuple(getattr(tokenizer, "eos_token_ids", ())) + tuple(config.eos_token_ids)
    if stop_strings is None:
        stop_strings = tuple(getattr(tokenizer, "stop_strings", ()))
    return (() if ignore_eos else eos_ids), (stop_strings if tokenizer is not None else ())


class SequenceOutput:
    """One sequence's output as it is generated: its tokens, the text shown so far (streamed to `on_text` once it is
    final: a stop string is cut off, an unfinished character or a possible stop string's start is held back), and
    why it finished. generate() keeps one per row; the API's continuous batcher keeps one per request."""

    def __init__(self, checker: StopChecker, decoder, on_text: Callable[[str], None] | None = None):
        self.checker, self.decoder, self.on_text = checker, decoder, on_text
        self.text = ""
        self.tokens: list[int] = []
        self.reason: str | None = None  # "eos", "stop_string", "length" or "stopped" once finished

    @classmethod
    def open(cls, tokenizer, eos_ids, stop_strings, on_text: Callable[[str], None] | None = None) -> SequenceOutput:
        decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        return cls(StopChecker(eos_ids, stop_strings), decoder, on_text)

    @property
    def finished(self) -> bool:
        return self.reason is not None

    def push(self, token: int) -> None:
        """One sampled token; after the sequence finished, ignored."""
        if self.reason is not None:
            return
        self.tokens.append(token)
        piece = self.decoder.feed(token) if self.decoder is not None else ""
        self._show(self.checker.push(token, piece))
        if self.checker.stopped:
            self.reason = self.checker.reason

    def _show(self, text: str) -> None:
        if text:
            self.text += text
            if self.on_text is not None:
                self.on_text(text)

    def stop(self) -> None:
        self.reason = self.reason or "stopped"

    def close(self) -> None:
        """Text held back (an unfinished character, a partial stop string) is released; if it was still going, it ran
        to its length."""
        if self.reason in (None, "stopped") and self.decoder is not None:
            self._show(self.checker.push(-1, self.decoder.flush()) + self.checker.finish())
        self.reason = self.reason or "length"


class _Rows:
    """The sequences of one generation, each a SequenceOutput."""

    def __init__(self, sequences: list[SequenceOutput]):
        self.sequences = sequences

    @classmethod
    def open(cls, batch: int, tokenizer, eos_ids, stop_strings, on_text: TextCallback | None) -> _Rows:
        def row_callback(row: int):
            return None if on_text is None else (lambda text: on_text(row, text))

        return cls([SequenceOutput.open(tokenizer, eos_ids, stop_strings, row_callback(row)) for row in range(batch)])

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.sequences]

    @property
    def generated(self) -> list[list[int]]:
        return [s.tokens for s in self.sequences]

    @property
    def reasons(self) -> list[str | None]:
        return [s.reason for s in self.sequences]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def push(self, tokens: list[int]) -> None:
        """One sampled token per sequence; a sequence that finished ignores the rest."""
        for sequence, token in zip(self.sequences, tokens):
            sequence.push(token)

    def stop(self) -> None:
        for sequence in self.sequences:
            sequence.stop()

    def close(self) -> None:
        for sequence in self.sequences:
            sequence.close()


@dataclass
class _Steps:
    """The decode steps: one sampled token per sequence each (with the history a repetition penalty reads), timed,
    up to max_new_tokens or until the stop flag is set."""

    sampler: Sampler
    history: torch.Tensor | None  # [batch, max_length]: prompt and sampled tokens, for a repetition penalty
    prompt_len: int
    max_new_tokens: int
    stop: threading.Event | None
    count: int = 0
    first_at: float | None = None
    last_at: float | None = None

    @classmethod
    def open(cls, sampling: SamplingParams | None, ids: torch.Tensor, max_length: int,
             stop: threading.Event | None) -> _Steps:
        sampler = Sampler(sampling or SamplingParams(temperature=0.0))
        batch, prompt_len = ids.shape
        history = None
        if sampler.params.repetition_penalty != 1.0:
            history = torch.empty(batch, max_length, dtype=torch.long, device=ids.device)
            history[:, :prompt_len] = ids
        return cls(sampler, history, prompt_len, max_length - prompt_len, stop)

    @property
    def at_limit(self) -> bool:
        return self.count >= self.max_new_tokens

    @property
    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of every sequence: [batch]."""
        previous = self.history[:, : self.prompt_len + self.count] if self.history is not None else None
        next_ids = self.sampler(logits, previous)
        self.count += 1
        self.last_at = time.perf_counter()
        if self.first_at is None:
            self.first_at = self.last_at
        if self.history is not None:
            self.history[:, self.prompt_len + self.count - 1] = next_ids
        return next_ids


@dataclass
class _CacheUse:
    """The cache one generation runs on."""

    cache: object
    reused: int  # prompt tokens whose K/V it held already
    kept: bool  # the prompt cache's: not closed here
    fed: list[int] = field(default_factory=list)  # sampled tokens run through the model (batch 1: kept with it)


@contextlib.contextmanager
def _cache_in_use(span, prompt_cache: PromptCache | None, ids: torch.Tensor, max_length: int):
    """The prompt cache's (rewound to what it shares with the prompt, and recording what it holds after), or one
    for this call (closed after it). An error empties the prompt cache; a call that does not fit in it, too."""
    use = _open_cache(span, prompt_cache, ids, max_length)
    try:
        yield use
    except BaseException:
        if use.kept:
            with contextlib.suppress(Exception):  # the error that matters is the one being raised
                prompt_cache.reset()  # what it holds is unknown now
        raise
    finally:
        close = getattr(use.cache, "close", None)
        if not use.kept and close is not None:
            close()
    if use.kept:
        prompt_cache._record(ids[0].tolist() + use.fed)
    elif prompt_cache is not None:
        prompt_cache.reset()  # it did not fit: start over next time


def _open_cache(span, prompt_cache: PromptCache | None, ids: torch.Tensor, max_length: int) -> _CacheUse:
    if prompt_cache is not None:
        cache, reused = prompt_cache._attach(span, ids[0].tolist(), max_length)
        if cache is not None:
            return _CacheUse(cache, reused, kept=True)
    return _CacheUse(span.allocate_cache(ids.shape[0], max_length), 0, kept=False)


def _prefill(model, ids: torch.Tensor, use: _CacheUse, chunk: int) -> torch.Tensor:
    """Run the prompt after what the cache holds, in chunks of `chunk` tokens: the logits at its last position."""
    hidden = None
    for start in range(use.reused, ids.shape[1], chunk):
        hidden = model.span(model.embedding(ids[:, start : start + chunk]), use.cache)
    return model.head(hidden[:, -1:])[:, -1]


def _decode(model, logits: torch.Tensor, steps: _Steps, rows: _Rows, use: _CacheUse) -> None:
    """Sample a token per sequence and run it through the model, until every sequence finished, max_new_tokens
    or the stop flag (checked between steps)."""
    while True:
        next_ids = steps.sample(logits)
        rows.push(next_ids.tolist())
        if rows.finished or steps.at_limit:
            return
        if steps.stopped:
            rows.stop()
            return
        hidden = model.span(model.embedding(next_ids[:, None]), use.cache)
        use.fed.append(int(next_ids[0]))
        logits = model.head(hidden)[:, -1]
