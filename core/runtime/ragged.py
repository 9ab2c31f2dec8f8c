"""One decode step for several sequences that stand at different positions: continuous batching's step.

`Span.forward` runs a batch whose rows share one position (one KVCache, one length). A server that takes requests
as they come (the OpenAI-compatible API) holds sequences of different lengths, each in its own batch-1 KVCache, and
wants one step to advance all of them: the weights are read once per step for every sequence, which is where
batching's speed comes from on a machine whose decode is bound by memory bandwidth.

`decode_rows` does that with the span's own modules: norms, the fused q/k/v projection, the output projection and
the MLP run on all rows together ([n, 1, hidden]); rotary angles, the K/V writes and attention are per row, each
against its own cache at its own position (sliding windows included). Its results equal `Span.forward` run on each
row alone, up to float rounding (the tests compare them).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from hivekeeper.planner.errors import InputError

from hivekeeper.core.runtime.model import Block, KVCache, Span, apply_rotary


def decode_rows(span: Span, hidden: Tensor, caches: Sequence[KVCache]) -> Tensor:
    """hidden [n, 1, hidden]: the next token of n sequences, row r at position caches[r].length in its own batch-1
    cache. Returns [n, 1, hidden]; each cache's length advances by one."""
    _check_rows(span, hidden, caches)
    positions = [cache.length for cache in caches]
    hidden = hidden.to(span.dtype)
    rope = _rows_rope(span, positions, hidden)
    for i, block in enumerate(span.blocks):
        hidden = _block_rows(block, hidden, [cache.block(i) for cache in caches], positions, rope)
    for cache, position in zip(caches, positions):
        cache.length = position + 1
    return hidden


def _check_rows(span: Span, hidden: Tensor, caches: Sequence[KVCache]) -> None:
    n = len(caches)
    if hidden.dim() != 3 or hidden.shape[0] != n or hidden.shape[1] != 1 or \
            hidden.shape[2] != span.config.hidden_size:
        raise InputError(f"decode_rows: hidden must be [{n}, 1, {span.config.hidden_size}] for {n} caches, "
                         f"got {tuple(hidden.shape)}")
    for cache in caches:
        if cache.batch != 1 or cache.num_blocks != len(span.blocks):
            raise InputError(f"decode_rows: each cache holds one sequence of {len(span.blocks)} blocks, got batch "
                             f"{cache.batch} of {cache.num_blocks} blocks")
        if cache.length + 1 > cache.max_length:
            raise InputError(f"decode_rows: a cache holds {cache.length} of {cache.max_length} tokens: no room")


def _rows_rope(span: Span, positions: list[int], hidden: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, signed sin) of each row's position: [n, 1, 1, head_dim], broadcast over a row's heads."""
    pairs = [span.rotary.get(p, 1, hidden.device, hidden.dtype) for p in positions]
    return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])


def _block_rows(block: Block, hidden: Tensor, views: list[tuple[Tensor, Tensor]], positions: list[int],
                rope: tuple[Tensor, Tensor]) -> Tensor:
    """One block on n rows: projections and MLP batched, attention per row against its cache."""
    attn = block.self_attn
    n = hidden.shape[0]
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = attn.qkv_proj(block.input_layernorm(hidden)).view(n, 1, nh + 2 * nkv, d)
    qk = apply_rotary(qkv[:, :, : nh + nkv], *rope)
    q = qk[:, :, :nh].transpose(1, 2)  # [n, nh, 1, d]
    k = qk[:, :, nh:].transpose(1, 2)  # [n, nkv, 1, d]
    v = qkv[:, :, nh + nkv :].transpose(1, 2)
    out = torch.empty_like(q)
    for row, ((k_cache, v_cache), position) in enumerate(zip(views, positions)):
        end = position + 1
        k_cache[:, :, position:end].copy_(k[row : row + 1])
        v_cache[:, :, position:end].copy_(v[row : row + 1])
        first = end - attn.window if attn.window is not None and end > attn.window else 0
        out[row : row + 1] = attn.attend(q[row : row + 1], k_cache[:, :, first:end], v_cache[:, :, first:end],
                                         position, first)
    hidden = attn.o_proj(out.transpose(1, 2).reshape(n, 1, nh * d)).add_(hidden)
    return block.mlp(block.post_attention_layernorm(hidden)).add_(hidden)
