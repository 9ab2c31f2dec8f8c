"""Engines that take generation requests as they come, for a server (the OpenAI-compatible API).

ContinuousBatcher decodes concurrent requests together: waiting requests are admitted together into rows of a
shared K/V pool, their prompts prefilled as one padded batch a chunk at a time between decode steps (so running
streams do not stall while a long prompt is read), and finished or cancelled ones leave; each step runs one token of
every running sequence through the model at once (runtime/ragged.decode_rows: one call of the native kernels on a
CPU), so the weights are read once per step for all of them. On a CPU, where a lone sequence's decode leaves the
cores waiting on memory, that is nearly free throughput.
A step with a single sequence takes the ordinary path (Span.forward, the native decode kernels), so one client alone
decodes as fast as `hivekeeper generate`. It needs the model's blocks in memory (a Span); a model that streams its
blocks from disk, or runs them in a swarm, gets SerialEngine: the same interface, one request after another through
generation.generate.

Both run on their own thread; `submit` returns at once, text comes through the request's `on_text`, and `on_done`
gets the Completion (or the exception). Setting the request's `cancelled` event (a client that left) frees its
row of the pool at the next step; an idle batcher holds no K/V memory.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hivekeeper.planner.errors import InputError

from hivekeeper.core.runtime.generation import (SequenceOutput, context_limit, generate, stop_rules)
from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.model import KVCache, Span
from hivekeeper.core.runtime.ragged import allocate_pool, decode_rows, row_view
from hivekeeper.core.runtime.sampling import Sampler, SamplingParams

# prompt positions per prefill call, for a group as for a lone prompt (generation.generate's chunks): a packed
# model's call costs mostly the weights' dequantization, whatever its tokens, so a group's chat prompts take one call
PREFILL_CHUNK = 256
GATHER_S = 0.05  # an idle batcher's first request waits this long after each arrival (up to GATHER_MAX_S) for others
GATHER_MAX_S = 0.25  # to be prefilled with it: clients that start together share one prefill instead of queueing
PAD_FACTOR = 2  # a prefill group's padded tokens stay within this many times its real ones (plus one chunk)
# A prompt this short is prefilled alone, as `generate` prefills it: so few tokens go through the packed decode
# kernels (int8 activations), while a padded group multiplies dequantized weights, and the greedy text could part.
SHORT_PROMPT_TOKENS = native_kernels.MAX_ROWS
SHARED_MIN_TOKENS = 8  # a prefill group's prompts that begin alike for this many tokens prefill that part once
FIRST_CACHE_TOKENS = 256  # a cache starts with room for the prompt and this many tokens, then doubles as needed
HOLD_YIELD_S = 0.001  # the engine's pause between steps while someone waits to hold it


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
    """What the batcher did: steps, the most sequences one step advanced, and how prompts were prefilled."""

    steps: int = 0
    largest_batch: int = 0
    requests: int = 0
    prefills: int = 0  # prefill calls (chunks)
    prefill_groups: int = 0  # requests admitted together, prefilled as one padded batch
    largest_prefill: int = 0  # the most requests one prefill group held
    shared_tokens: int = 0  # prompt tokens not prefilled because another prompt of the group began alike


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
        return self.queue.qsize()

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


class _Filling:
    """Requests prefilled together: their prompts right-padded to the longest, in the pool's rows base..base+k-1 (a
    KVCache view of those rows, all at one position), a chunk of positions per round between decode steps. A row's
    pads only write K/V past its own length, which its decode steps overwrite (causal attention never reads them
    earlier). A row's products then run in matrices of another size than its prompt's alone: on a packed model
    numpy's BLAS rounds them differently (~1e-6 relative), and a greedy text can part from `generate`'s at a
    near-tie some tokens later. The prompts' common beginning (`shared` tokens: a chat template's system prompt) is
    prefilled once, in the first row, and its K/V copied to the others. `last` keeps each row's hidden state at its
    prompt's last token until the group's first tokens are sampled together."""

    def __init__(self, rows: list[_Row], ids: torch.Tensor, base: int):
        self.rows, self.ids, self.base = rows, ids, base
        self.done = 0  # positions prefilled
        self.last: list[torch.Tensor | None] = [None] * len(rows)
        self.shared = shared_beginning([row.request.prompt_ids for row in rows])

    @property
    def longest(self) -> int:
        return self.ids.shape[1]


class ContinuousBatcher(_EngineThread):
    """Continuous batching over a model held in memory: embedding, a Span of all blocks, head.

    The running sequences' K/V live in one pool (a KVCache whose batch rows are the sequences, runtime/ragged.py),
    in rows 0..n-1 in the order of `rows`: a sequence that leaves hands its row to the last one (moved once), so
    each step attends over a contiguous block of rows. Waiting requests are admitted together, as many as rows are
    free: their prompts are prefilled as one padded batch in the rows after the running ones (_Filling), one chunk
    per round, each round ending with a decode step of the running rows, so their streams go on while a prompt is
    read; the group joins the batch when its last chunk is done. The pool's length grows (doubling, up to the
    context) as the longest sequence needs, and it is dropped when no sequence runs."""

    def __init__(self, embedding, span: Span, head, tokenizer, *, max_rows: int, prefix=None):
        """max_rows: sequences decoded together at most; more requests wait for a row to free. prefix: trained
        prompts whose K/V start every row (core/finetune/prompted.RowPrefix: .tokens, .fill(rows)), or None."""
        self.prefix, self.prefix_tokens = prefix, prefix.tokens if prefix is not None else 0
        self.embedding, self.span, self.head, self.tokenizer = embedding, span, head, tokenizer
        self.config = span.config
        self.max_rows = max_rows
        self.rows: list[_Row] = []
        self.filling: _Filling | None = None
        self.pool: KVCache | None = None
        self._waiting: collections.deque[Request] = collections.deque()  # off the queue, not yet admitted
        super().__init__("continuous-batcher")

    def _run(self) -> None:
        with torch.inference_mode():
            while self._wait_for_work():
                with self._held:
                    if not self._admit():
                        break
                    if self.filling is not None:
                        self._fill()
                    if self.rows:
                        self._step()
            # still in inference mode: _finish moves pool rows (session 23: closed with two rows running, the copy
            # into an inference tensor outside it raised "Inplace update to inference tensor outside InferenceMode")
            if self.filling is not None:
                self.rows += self.filling.rows  # their requests end as "stopped" with the others
            for row in list(self.rows):
                row.output.stop()
                self._finish(row)
        for request in self._waiting:  # taken off the queue, never started
            request.on_done(Completion("", [], "stopped", len(request.prompt_ids)))
        self._drain()

    @property
    def active(self) -> int:
        """Sequences in the running batch or being prefilled (each holding a row of the KV pool)."""
        return len(self.rows) + (len(self.filling.rows) if self.filling is not None else 0)

    @property
    def waiting(self) -> int:
        """Requests queued, not yet started."""
        return self.queue.qsize() + len(self._waiting)

    def _wait_for_work(self) -> bool:
        """Let a hold() in; with nothing running, wait until a request (or the close) is queued."""
        if self._hold_wanted:
            time.sleep(HOLD_YIELD_S)
        if not self.rows and self.filling is None and not self._waiting:
            self.pool = None  # idle: no K/V memory held
            request = self.queue.get()
            if request is None:  # closed
                return False
            self._waiting.append(request)
        return True

    def _admit(self) -> bool:
        """Take what was queued; start a group of waiting requests on the free rows unless one is being prefilled.
        False once closed."""
        while True:
            try:
                request = self.queue.get_nowait()
            except queue.Empty:
                break
            if request is None:
                return False
            self._waiting.append(request)
        if self._closed:
            return False
        if self.filling is None and self._waiting and self.active < self.max_rows:
            if not self.rows:
                self._gather()
            if not self._closed:
                self._start_group()
        return not self._closed

    def _gather(self) -> None:
        """Nothing runs: wait briefly for more requests to arrive (GATHER_S after each, GATHER_MAX_S in all, until
        the rows are full), so that clients starting together are prefilled as one group."""
        deadline = time.monotonic() + GATHER_MAX_S
        while len(self._waiting) < self.max_rows and not self._closed:
            wait = min(GATHER_S, deadline - time.monotonic())
            if wait <= 0:
                return
            try:
                request = self.queue.get(timeout=wait)
            except queue.Empty:
                return
            if request is None:
                self._closed = True
                return
            self._waiting.append(request)

    def _start_group(self) -> None:
        """Admit waiting requests as one prefill group: the first, and those after it that may join it (_may_join),
        while rows are free; the others keep their place in the line."""
        rows: list[_Row] = []
        for request in list(self._waiting):
            if self.active + len(rows) >= self.max_rows:
                break
            if rows and not _may_join([r.request for r in rows], request):
                continue
            self._waiting.remove(request)
            self.stats.requests += 1
            try:
                rows.append(self._new_row(request))
            except Exception as exc:  # noqa: BLE001 - this request fails; the engine and the others go on
                request.on_done(exc)
        if not rows:
            return
        longest = max(len(row.request.prompt_ids) for row in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long, device=self.embedding.weight.device)
        for j, row in enumerate(rows):
            ids[j, : len(row.request.prompt_ids)] = torch.tensor(row.request.prompt_ids, dtype=torch.long)
        try:
            self._make_room(self.prefix_tokens + longest + 1)
        except Exception as exc:  # noqa: BLE001 - no room for these prompts: they fail, the running rows go on
            for row in rows:
                row.request.on_done(exc)
            return
        self.filling = _Filling(rows, ids, len(self.rows))
        if self.prefix is not None:  # the prompts' K/V first in each of the group's rows
            base = len(self.rows)
            self.prefix.fill(KVCache(self.pool.k[:, base : base + len(rows)], self.pool.v[:, base : base + len(rows)]))
        self.stats.prefill_groups += 1
        self.stats.largest_prefill = max(self.stats.largest_prefill, len(rows))

    def _new_row(self, request: Request) -> _Row:
        """A request's row, its prompt checked (token ids the embedding has)."""
        ids, vocab = request.prompt_ids, self.config.vocab_size
        if not ids:
            raise InputError("the prompt has no tokens")
        bad = next((token for token in ids if not 0 <= token < vocab), None)
        if bad is not None:
            raise InputError(f"the prompt holds token id {bad}, outside the model's vocabulary of {vocab}")
        limit = min(len(ids) + request.max_new_tokens, context_limit(self.config) - self.prefix_tokens)
        eos, strings = stop_rules(self.config, self.tokenizer, None, self._stop_strings(request), False)
        return _Row(request, SequenceOutput.open(self.tokenizer, eos, strings, request.on_text), limit)

    def _fill(self) -> None:
        """One chunk of the group's prompts; at the last, their first tokens are sampled and they join the batch."""
        group = self.filling
        start, base, offset = group.done, group.base, self.prefix_tokens
        in_shared = start < group.shared  # the common beginning, once, in the group's first row
        k = 1 if in_shared else len(group.rows)
        end = min(start + PREFILL_CHUNK, group.shared if in_shared else group.longest)
        view = KVCache(self.pool.k[:, base : base + k], self.pool.v[:, base : base + k], offset + start)
        try:
            hidden = self.span(self.embedding(group.ids[:k, start:end]), view)
        except Exception as exc:  # noqa: BLE001 - the group fails; the running rows go on
            self.filling = None
            for row in group.rows:
                row.request.on_done(exc)
            return
        if in_shared and end == group.shared:
            for pool in (self.pool.k, self.pool.v):
                shared = pool[:, base : base + 1, :, offset : offset + end]
                pool[:, base + 1 : base + len(group.rows), :, offset : offset + end].copy_(shared)
            self.stats.shared_tokens += end * (len(group.rows) - 1)
        for j, row in enumerate(group.rows[:k]):
            length = len(row.request.prompt_ids)
            if start < length <= end:
                group.last[j] = hidden[j : j + 1, length - 1 - start]
        group.done = end
        self.stats.prefills += 1
        if end == group.longest:
            self._join(group)

    def _join(self, group: _Filling) -> None:
        """The group's first tokens, from each row's last prompt position; its rows move next to the running ones."""
        self.filling = None
        logits = self.head(torch.stack(group.last))[:, -1]  # [k, vocab]
        for j, row in enumerate(group.rows):
            row.length = self.prefix_tokens + len(row.request.prompt_ids)
            source, target = group.base + j, len(self.rows)
            if source != target:
                for pool in (self.pool.k, self.pool.v):
                    pool[:, target, :, : row.length].copy_(pool[:, source, :, : row.length])
            self.rows.append(row)
            row.take(logits[j : j + 1])
            if row.request.cancelled.is_set():
                row.output.stop()
        for row in [r for r in group.rows if r.done]:
            self._finish(row)

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
        self.pool = allocate_pool(self.config, len(self.span.blocks), self.max_rows, min(size, context),
                                  self.span.dtype, self.embedding.weight.device)  # zeros (ragged.allocate_pool)
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


def shared_beginning(prompts: list[list[int]]) -> int:
    """The tokens that several prompts begin with alike, when at least SHARED_MIN_TOKENS, else 0; never a whole
    prompt (each keeps a token of its own, whose hidden state gives its first token)."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(prompt) for prompt in prompts)
    common = 0
    while common < shortest - 1 and all(prompt[common] == prompts[0][common] for prompt in prompts):
        common += 1
    return common if common >= SHARED_MIN_TOKENS else 0


def _may_join(group: list[Request], request: Request) -> bool:
    """Whether `request` may join a prefill group: the padded batch stays within PAD_FACTOR times its real tokens
    (plus one chunk), so a long prompt does not make short ones compute its length in pads, nor the reverse; and
    neither it nor the group holds a prompt of SHORT_PROMPT_TOKENS or fewer (prefilled alone, see there)."""
    lengths = [len(r.prompt_ids) for r in group] + [len(request.prompt_ids)]
    return min(lengths) > SHORT_PROMPT_TOKENS and \
        len(lengths) * max(lengths) <= PAD_FACTOR * sum(lengths) + PREFILL_CHUNK


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
