"""Engines that take generation requests as they come, for a server (the OpenAI-compatible API).

ContinuousBatcher decodes concurrent requests together: between two decode steps, waiting requests join the running
batch (each prefilled alone into its row of a shared K/V pool) and finished or cancelled ones leave it; each step
then runs one token of every running sequence through the model at once (runtime/ragged.decode_rows), so the
weights are read once per step for all of them. On a CPU, where decode is bound by memory bandwidth, that is nearly free throughput.
A step with a single sequence takes the ordinary path (Span.forward, the native decode kernels), so one client alone
decodes as fast as `hivekeeper generate`. It needs the model's blocks in memory (a Span); a model that streams its
blocks from disk, or runs them in a swarm, gets SerialEngine: the same interface, one request after another through
generation.generate.

Both run on their own thread; `submit` returns at once, text comes through the request's `on_text`, and `on_done`
gets the Completion (or the exception). Setting the request's `cancelled` event (a client that left) frees its
row of the pool at the next step; an idle batcher holds no K/V memory.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hivekeeper.core.runtime.generation import (SequenceOutput, context_limit, generate, stop_rules)
from hivekeeper.core.runtime.model import KVCache, Span
from hivekeeper.core.runtime.ragged import decode_rows, row_view
from hivekeeper.core.runtime.sampling import Sampler, SamplingParams

PREFILL_CHUNK = 256  # prompt tokens per prefill call (as generation.generate)
FIRST_CACHE_TOKENS = 256
HOLD_YIELD_S = 0.001  # the engine's pause between steps while someone waits to hold it  # a cache starts with room for the prompt and this many tokens, then doubles as needed


@dataclass
class Completion:
    """What a finished request produced."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop_string", "length" or "stopped"
    prompt_tokens: int


@dataclass
class Request:
    """One generation asked of an engine."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_strings: tuple[str, ...] = ()  # besides the tokenizer's own
    on_text: Callable[[str], None] = lambda text: None
    on_done: Callable[[Completion | BaseException], None] = lambda outcome: None
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class BatchStats:
    """What the batcher did: steps, and the most sequences one step advanced."""

    steps: int = 0
    largest_batch: int = 0
    requests: int = 0


class _Row:
    """A running request: its row of the pool, sampler, output, the tokens its row holds and the token to feed
    next."""

    def __init__(self, request: Request, output: SequenceOutput, limit: int):
        self.request, self.output, self.limit = request, output, limit
        self.sampler = Sampler(request.sampling)
        self.length = 0  # tokens its row of the pool holds
        self.next_token = 0

    def take(self, logits: torch.Tensor) -> None:
        """Sample this row's next token from its logits [1, vocab] and record it."""
        self.next_token = int(self.sampler(logits)[0])
        self.output.push(self.next_token)

    @property
    def done(self) -> bool:
        return self.output.finished or len(self.request.prompt_ids) + len(self.output.tokens) >= self.limit

    def completion(self) -> Completion:
        self.output.close()
        return Completion(self.output.text, self.output.tokens, self.output.reason, len(self.request.prompt_ids))


class _EngineThread:
    """A queue of requests served by one thread; subclasses say how."""

    def __init__(self, name: str):
        self.queue: queue.Queue[Request | None] = queue.Queue()
        self.stats = BatchStats()
        self._closed = False
        self._held = threading.Lock()  # taken around each round of admitting and stepping (see hold)
        self._hold_wanted = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed")
        self.queue.put(request)

    @contextlib.contextmanager
    def hold(self):
        """No request starts and no step runs while this is held (the current step finishes first): requests sent
        meanwhile queue up, and start together when it is released."""
        self._hold_wanted += 1
        try:
            with self._held:
                yield
        finally:
            self._hold_wanted -= 1

    @property
    def waiting(self) -> int:
        """Requests queued, not yet started."""
        return self.queue.qsize() + (getattr(self, "_first", None) is not None)

    def close(self, timeout: float = 30.0) -> None:
        """Stop after the current step; requests still waiting or running end as "stopped"."""
        self._closed = True
        self.queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        raise NotImplementedError

    def _drain(self) -> None:
        """Requests that never started end as "stopped" with no text."""
        while True:
            try:
                request = self.queue.get_nowait()
            except queue.Empty:
                return
            if request is not None:
                request.on_done(Completion("", [], "stopped", len(request.prompt_ids)))


class ContinuousBatcher(_EngineThread):
    """Continuous batching over a model held in memory: embedding, a Span of all blocks, head.

    The running sequences' K/V live in one pool (a KVCache whose batch rows are the sequences, runtime/ragged.py),
    in rows 0..n-1 in the order of `rows`: a sequence that leaves hands its row to the last one (moved once), so
    each step attends over a contiguous block of rows. The pool's length grows (doubling, up to the context) as the
    longest sequence needs, and it is dropped when no sequence runs."""

    def __init__(self, embedding, span: Span, head, tokenizer, *, max_rows: int):
        """max_rows: sequences decoded together at most; more requests wait for a row to free."""
        self.embedding, self.span, self.head, self.tokenizer = embedding, span, head, tokenizer
        self.config = span.config
        self.max_rows = max_rows
        self.rows: list[_Row] = []
        self.pool: KVCache | None = None
        self._first: Request | None = None  # taken off the queue while waiting for work, admitted next
        super().__init__("continuous-batcher")

    def _run(self) -> None:
        with torch.inference_mode():
            while self._wait_for_work():
                with self._held:
                    if not self._admit():
                        break
                    if self.rows:
                        self._step()
        for row in list(self.rows):
            row.output.stop()
            self._finish(row)
        self._drain()

    @property
    def active(self) -> int:
        """Sequences in the running batch (each holding a row of the KV pool)."""
        return len(self.rows)

    def _wait_for_work(self) -> bool:
        """Let a hold() in; with nothing running, wait until a request (or the close) is queued."""
        if self._hold_wanted:
            time.sleep(HOLD_YIELD_S)
        if not self.rows and self._first is None:
            self.pool = None  # idle: no K/V memory held
            self._first = self.queue.get()
            if self._first is None:  # closed
                return False
        return True

    def _next_request(self) -> Request | None:
        """The next queued request (the one _wait_for_work took first); queue.Empty when none."""
        if self._first is not None:
            request, self._first = self._first, None
            return request
        return self.queue.get_nowait()

    def _admit(self) -> bool:
        """Start queued requests while rows are free; False once closed."""
        while len(self.rows) < self.max_rows:
            try:
                request = self._next_request()
            except queue.Empty:
                return True
            if request is None:
                return False
            self._start(request)
        return not self._closed

    def _start(self, request: Request) -> None:
        """Prefill a request alone into the next free row and sample its first token; it joins the batch unless
        that already finished it."""
        self.stats.requests += 1
        try:
            row = self._prefilled(request)
        except Exception as exc:  # noqa: BLE001 - this request fails; the engine and the others go on
            request.on_done(exc)
            return
        self.rows.append(row)
        if request.cancelled.is_set():
            row.output.stop()
        if row.done:
            self._finish(row)

    def _prefilled(self, request: Request) -> _Row:
        ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.embedding.weight.device)
        limit = min(len(request.prompt_ids) + request.max_new_tokens, context_limit(self.config))
        eos, strings = stop_rules(self.config, self.tokenizer, None, self._stop_strings(request), False)
        row = _Row(request, SequenceOutput.open(self.tokenizer, eos, strings, request.on_text), limit)
        self._make_room(len(request.prompt_ids) + 1)
        cache = row_view(self.pool, len(self.rows), 0)
        hidden = None
        for start in range(0, ids.shape[1], PREFILL_CHUNK):
            hidden = self.span(self.embedding(ids[:, start : start + PREFILL_CHUNK]), cache)
        row.length = cache.length
        row.take(self.head(hidden[:, -1:])[:, -1])
        return row

    def _stop_strings(self, request: Request) -> tuple[str, ...]:
        return tuple(getattr(self.tokenizer, "stop_strings", ())) + request.stop_strings

    def _make_room(self, length: int) -> None:
        """A pool with room for `length` tokens per row: grown (doubling, up to the context), keeping what the
        running rows hold."""
        old = self.pool
        if old is not None and old.max_length >= length:
            return
        context = context_limit(self.config)
        size = max(length, FIRST_CACHE_TOKENS, 2 * old.max_length if old is not None else 0)
        self.pool = KVCache.allocate(self.config, len(self.span.blocks), self.max_rows, min(size, context),
                                     self.span.dtype, self.embedding.weight.device)
        # decode_rows reads every row up to the longest one, masked: a NaN left in uninitialised memory past a short
        # row's length would still poison its attention (0 x NaN), so the pool starts as zeros
        self.pool.k.zero_()
        self.pool.v.zero_()
        if old is not None:
            self.pool.k[:, :, :, : old.max_length].copy_(old.k)
            self.pool.v[:, :, :, : old.max_length].copy_(old.v)

    def _step(self) -> None:
        """One token of every running sequence, together; rows that finished or were cancelled leave."""
        for row in [r for r in self.rows if r.request.cancelled.is_set()]:
            row.output.stop()
            self._finish(row)
        if not self.rows:
            return
        self._make_room(max(row.length for row in self.rows) + 1)
        tokens = torch.tensor([[row.next_token] for row in self.rows], device=self.embedding.weight.device)
        hidden = self.embedding(tokens)
        if len(self.rows) == 1:  # alone: the ordinary decode path (the native kernels' one call per step)
            hidden = self.span(hidden, row_view(self.pool, 0, self.rows[0].length))
        else:
            hidden = decode_rows(self.span, hidden, self.pool, [row.length for row in self.rows])
        logits = self.head(hidden)[:, -1]
        self.stats.steps += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(self.rows))
        for i, row in enumerate(list(self.rows)):
            row.length += 1
            row.take(logits[i : i + 1])
        for row in [r for r in self.rows if r.done]:
            self._finish(row)

    def _finish(self, row: _Row) -> None:
        """The row leaves: the last running row moves into its place in the pool, and its request is answered."""
        index, last = self.rows.index(row), len(self.rows) - 1
        if index != last:
            moving = self.rows[last]
            for pool in (self.pool.k, self.pool.v):
                pool[:, index, :, : moving.length].copy_(pool[:, last, :, : moving.length])
            self.rows[index] = moving
        self.rows.pop()
        row.request.on_done(row.completion())


class SerialEngine(_EngineThread):
    """One request after another through generation.generate: for runners that do not hold every block in memory
    (a model streamed from disk, a swarm client)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        super().__init__("serial-engine")

    def _run(self) -> None:
        while True:
            request = self.queue.get()
            if request is None or self._closed:
                break
            with self._held:
                self.stats.requests += 1
                try:
                    request.on_done(self._generate(request))
                except Exception as exc:  # noqa: BLE001 - this request fails; the engine goes on
                    request.on_done(exc)
        self._drain()

    def _generate(self, request: Request) -> Completion:
        stops = tuple(getattr(self.tokenizer, "stop_strings", ())) + tuple(request.stop_strings)
        result = generate(self.model, request.prompt_ids, max_new_tokens=request.max_new_tokens,
                          sampling=request.sampling, tokenizer=self.tokenizer, stop_strings=stops,
                          on_text=lambda row, piece: request.on_text(piece), stop=request.cancelled)
        self.stats.steps += result.steps
        self.stats.largest_batch = max(self.stats.largest_batch, 1)
        return Completion(result.texts[0], result.token_ids[0], result.finish_reasons[0], result.prompt_tokens)
