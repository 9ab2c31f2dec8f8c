"""Generating with trained prompts (`chat`, `generate`, `api` with `--prompts FILE`).

A runner (generation.py's shape: config, embedding, span, head) whose every new cache starts with the trained
prompts: allocate_cache runs them through the blocks first, as positions 0..tokens-1 (with each block's deep prompt
added there, for deep_ptune), exactly where training put them. The cache it hands out counts only what follows
(length, truncate), so the generation loop, the chat's kept cache and the API's engine see an ordinary cache; the
context is the model's less the prompt tokens.

Locally the runner wraps the OffloadedModel a plain run would use, planned as usual with the prompts' positions
counted in its cache (`prompt_tokens`): the prefix runs through the engine's placement (blocks resident, in RAM or
streamed from disk), deep prompts added to each block's input there (OffloadedModel.forward_blocks). Through a
swarm the prompts run as the first step of the session; deep_ptune's per-block prompts go with that step, each
server getting its blocks' slice (Petals' inference `prompts` tensor), and with every replay of those positions
(a failover's replacement, a spot check's referee).

The API's continuous batcher runs the resident blocks itself: `RowPrefix` gives it the prompts' K/V, computed once
and copied into the start of each new row of its pool.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from hivekeeper.planner.errors import InputError

from hivekeeper.core.finetune.prompts import TrainablePrompts, check_fits, load_prompts


class _PromptedCache:
    """A cache whose first `offset` positions hold the prompts: it shows only what follows them."""

    def __init__(self, inner, offset: int):
        self.inner, self.offset = inner, offset

    @property
    def length(self) -> int:
        return self.inner.length - self.offset

    def truncate(self, length: int) -> None:
        self.inner.truncate(length + self.offset)

    def reorder(self, hypo_ids: Tensor) -> None:
        self.inner.reorder(hypo_ids)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


class _PromptedSpan:
    """span(hidden, cache) of the model, with caches that start with the prompts (see the module docstring)."""

    def __init__(self, inner, prompts: TrainablePrompts, run_prefix, context: int):
        self.inner, self.prompts, self.run_prefix, self.context = inner, prompts, run_prefix, context
        self.start, self.end = inner.start, inner.end

    def allocate_cache(self, batch: int, max_length: int) -> _PromptedCache:
        # a caller sizing its cache by the model's whole context (a chat) gets it: generation stops at the
        # context less the prompts (PromptedModel.config)
        tokens = min(max_length + self.prompts.tokens, self.context)
        cache = self.inner.allocate_cache(batch, tokens)
        with torch.inference_mode():
            first, deep = self.prompts.for_batch(batch)
            self.run_prefix(first, deep, cache)
        return _PromptedCache(cache, self.prompts.tokens)

    def __call__(self, hidden: Tensor, cache: _PromptedCache | None = None) -> Tensor:
        if cache is None:
            raise InputError("a model with trained prompts runs with a cache (the prompts live in it)")
        return self.inner(hidden, cache.inner)


class PromptedModel:
    """A runner that generates after trained prompts; closes the model it wraps (if it has close)."""

    def __init__(self, config, embedding, head, span: _PromptedSpan, closes=None):
        self.config = dataclasses.replace(config, max_position_embeddings=config.max_position_embeddings
                                          - span.prompts.tokens)
        self.embedding, self.head, self.span, self._closes = embedding, head, span, closes

    @property
    def offloaded(self):
        """The OffloadedModel it wraps (local runs), for an engine that runs its resident blocks itself; else None."""
        from hivekeeper.core.offload.offloaded_model import OffloadedModel

        return self._closes if isinstance(self._closes, OffloadedModel) else None

    def row_prefix(self, span) -> RowPrefix:
        """The prompts' K/V over `span` (the wrapped model's resident blocks), for the continuous batcher."""
        return RowPrefix(span, self.span.prompts)

    @property
    def bytes_streamed(self) -> int:
        """Weight bytes the model it wraps read from disk (an OffloadedModel's streamed blocks), else 0."""
        return getattr(self._closes, "bytes_streamed", 0)

    def close(self) -> None:
        if self._closes is not None:
            self._closes.close()


class RowPrefix:
    """The prompts' keys and values for the continuous batcher (core/runtime/continuous.py, the API): computed once
    over the resident blocks (with the deep prompts, for deep_ptune), then copied into positions 0..tokens-1 of each
    new row of its pool, so every request starts after the prompts as in a cache of PromptedModel's."""

    def __init__(self, span, prompts: TrainablePrompts):
        from hivekeeper.core.runtime.model import KVCache
        from hivekeeper.core.swarm.server.handler import run_blocks

        self.tokens = prompts.tokens
        device = span.blocks[0].input_layernorm.weight.device
        cache = KVCache.allocate(span.config, len(span.blocks), 1, self.tokens, span.dtype, device)
        with torch.inference_mode():
            first, deep = prompts.for_batch(1)
            run_blocks(span, first, cache, deep)
        self.k, self.v = cache.k, cache.v

    def fill(self, rows) -> None:
        """Write the prompts' K/V at the start of every row of `rows` (a KVCache view of the pool's rows)."""
        rows.k[:, :, :, : self.tokens].copy_(self.k.expand(-1, rows.k.shape[1], -1, -1, -1))
        rows.v[:, :, :, : self.tokens].copy_(self.v.expand(-1, rows.v.shape[1], -1, -1, -1))


def read_prompts_for(prompts_file, config) -> tuple[TrainablePrompts, object]:
    """(prompts, info) of a file, checked to fit this model."""
    prompts, info, _ = load_prompts(prompts_file)
    check_fits(prompts_file, info, config)
    return prompts.requires_grad_(False), info


def prompt_tokens(prompts_file, config) -> int:
    """The positions a prompts file takes at the start of every cache (checked to fit the model): what a local plan
    adds to its prompt and cache lengths."""
    return read_prompts_for(prompts_file, config)[1].tokens


def check_room_after_prompts(prompts_file, prompt_len: int, config, what: str) -> None:
    """A prompt after the trained prompts must leave room for one new token in the model's context: else one error
    naming the prompts file and its trained prompt tokens (they, not max_position_embeddings, took the room)."""
    trained = prompt_tokens(prompts_file, config)
    context = config.max_position_embeddings
    if prompt_len + trained < context:
        return
    room = context - trained - 1
    fix = f"shorten {what} to {room} tokens or fewer" if room > 0 else "train prompts with fewer --prompt-tokens"
    raise InputError(f"{prompts_file}: its {trained} trained prompt tokens and the {prompt_len} tokens of {what} "
                     f"fill the model's context of {context} tokens, which leaves no room to generate: {fix}")


def local_prompted_model(model, prompts_file, describe_plan: str = "") -> tuple[PromptedModel, str]:
    """(runner, description): an OffloadedModel (placed by its plan; closed with the runner) whose caches start with
    the prompts."""
    try:
        prompts, info = read_prompts_for(prompts_file, model.config)
    except BaseException:
        model.close()
        raise

    def run_prefix(first: Tensor, deep: Tensor | None, cache) -> None:
        model.forward_blocks(first, cache, deep)

    prompted = _PromptedSpan(model.span, prompts, run_prefix, model.config.max_position_embeddings)
    runner = PromptedModel(model.config, model.embedding, model.head, prompted, closes=model)
    return runner, _describe(prompts_file, info) + (f"; {describe_plan}" if describe_plan else "")


def swarm_prompted_model(swarm_model, prompts_file) -> tuple[PromptedModel, str]:
    """(runner, description): a SwarmModel whose sessions start with the trained prompts (ptune or deep_ptune)."""
    try:
        prompts, info = read_prompts_for(prompts_file, swarm_model.config)
    except BaseException:
        swarm_model.close()
        raise

    def run_prefix(first: Tensor, deep: Tensor | None, cache) -> None:
        # the session's first step; deep prompts ride with it, each server getting its blocks' slice (and again with
        # any replay from position 0 on a replacement server or a spot check's referee: client.inference.DeepPrompts)
        cache.step(first.to(swarm_model.dtype), deep)

    prompted = _PromptedSpan(swarm_model.span, prompts, run_prefix,
                             swarm_model.config.max_position_embeddings)
    model = PromptedModel(swarm_model.config, swarm_model.embedding, swarm_model.head, prompted, closes=swarm_model)
    return model, _describe(prompts_file, info) + "; blocks in the swarm"


def _describe(prompts_file, info) -> str:
    return f"trained prompts {prompts_file} ({info.method}, {info.tokens} tokens, {info.step} steps)"
