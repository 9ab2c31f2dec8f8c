"""One decode step for several sequences that stand at different positions: continuous batching's step.

`Span.forward` runs a batch whose rows share one position (one KVCache length). A server that takes requests as
they come (the OpenAI-compatible API) holds sequences of different lengths and wants one step to advance all of
them: the weights are then read once per step for every sequence, which is where batching's speed comes from on a
machine whose decode is bound by memory bandwidth.

The sequences live in the rows of one KVCache (a pool: row r of every block's K/V is sequence r), each with its own
length, which the caller keeps. `decode_rows` runs norms, the fused q/k/v projection, the output projection and the
MLP on all rows together ([n, 1, hidden]); each row's rotary angles and K/V writes are at its own position.
On the CPU with the native kernels (fp32 or block-quantized blocks, up to their MAX_ROWS rows) the whole step is one
call (`hk_span_decode_rows`: each row's position and rotary angles passed with it, each row attending to its own
keys), as a lone sequence's step is: no torch op per block, the weights read once for every row. Elsewhere (a GPU,
bf16, more rows, no compiler) it runs in torch, attention one call per block over the pool's first n rows, masked to
each row's length (and sliding window); the masks are made once per step.
`row_view` is one row as an ordinary batch-1 KVCache (sharing the memory), for prefilling it with `Span.forward`.
`allocate_pool` makes the pool: the torch path needs finite values past each row's length (masked keys still enter
the attention's sums with weight 0, and 0 x NaN is NaN), and KVCache.allocate's memory is uninitialised (freed memory
handed out again can hold NaN: a whole row of NaN results, now and then), so the pool starts as zeros; rows written,
copied or rewound later stay finite.
The results equal `Span.forward` run on each sequence alone, up to float rounding (the tests compare them).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from hivekeeper.planner.errors import InputError

from hivekeeper.core.runtime.kernels import cpu_decode, native_kernels
from hivekeeper.core.runtime.model import Block, KVCache, ModelConfig, Span, apply_rotary


def allocate_pool(config: ModelConfig, num_blocks: int, rows: int, max_length: int,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> KVCache:
    """A pool for decode_rows: KVCache.allocate's rows, zeroed (see the module's docstring)."""
    pool = KVCache.allocate(config, num_blocks, rows, max_length, dtype, device)
    pool.k.zero_()
    pool.v.zero_()
    return pool


def row_view(cache: KVCache, row: int, length: int) -> KVCache:
    """Row `row` of a pool as a batch-1 KVCache holding `length` tokens (the same memory)."""
    return KVCache(cache.k[:, row : row + 1], cache.v[:, row : row + 1], length)


def decode_rows(span: Span, hidden: Tensor, cache: KVCache, lengths: Sequence[int]) -> Tensor:
    """hidden [n, 1, hidden]: the next token of the sequences in the pool's rows 0..n-1, row r holding lengths[r]
    tokens; each token is written at its row's length. Returns [n, 1, hidden]; the caller advances its lengths."""
    _check_rows(span, hidden, cache, lengths)
    n = hidden.shape[0]
    hidden = hidden.to(span.dtype)
    rope = _rows_rope(span, lengths, hidden)
    native = _native_rows(span, hidden, cache, lengths, rope)
    if native is not None:
        return native
    positions = torch.tensor(list(lengths), dtype=torch.long, device=hidden.device)
    rows = torch.arange(n, device=hidden.device)
    keys_seen = max(lengths) + 1
    masks: dict[int | None, Tensor] = {}  # per sliding window (None: none), shared by the blocks that have it
    for i, block in enumerate(span.blocks):
        k_cache, v_cache = cache.block(i)
        window = block.self_attn.window
        if window not in masks:
            masks[window] = _row_mask(positions, keys_seen, window)
        hidden = _block_rows(block, hidden, k_cache, v_cache, rows, positions, keys_seen, masks[window], rope)
    return hidden


def _native_rows(span: Span, hidden: Tensor, cache: KVCache, lengths: Sequence[int],
                 rope: tuple[Tensor, Tensor]) -> Tensor | None:
    """The step in one call of the native kernels (hk_span_decode_rows), or None where they cannot take it (then
    torch runs it). PreparedSpan.prepare checks what a lone sequence's native step needs (kernels built, fp32 on the
    CPU, no autograd, the blocks' weights in a layout they read, at most MAX_ROWS rows) on the pool's first n rows."""
    n = hidden.shape[0]
    caches = [(k[:n], v[:n]) for k, v in (cache.block(i) for i in range(len(span.blocks)))]
    prepared = cpu_decode.PreparedSpan.prepare(span.blocks, caches, hidden)
    if prepared is None:
        return None
    cos, signed_sin = (table.reshape(n, -1).contiguous() for table in rope)  # [n, head_dim]: row r's angles
    tokens = (native_kernels.Token * n)(*(native_kernels.Token(length, cos[r].data_ptr(), signed_sin[r].data_ptr())
                                          for r, length in enumerate(lengths)))
    out = hidden.detach().clone(memory_format=torch.contiguous_format)  # [n, 1, hidden]: updated in place
    if native_kernels.library().hk_span_decode_rows(prepared.block_table, prepared.cache_table, len(span.blocks),
                                                    tokens, out.data_ptr(), n) != 0:
        raise MemoryError("decode_rows: the native kernels could not allocate their scratch memory")
    return out


def _check_rows(span: Span, hidden: Tensor, cache: KVCache, lengths: Sequence[int]) -> None:
    n = len(lengths)
    if hidden.dim() != 3 or hidden.shape[0] != n or hidden.shape[1] != 1 or \
            hidden.shape[2] != span.config.hidden_size:
        raise InputError(f"decode_rows: hidden must be [{n}, 1, {span.config.hidden_size}] for {n} rows, "
                         f"got {tuple(hidden.shape)}")
    if cache.batch < n or cache.num_blocks != len(span.blocks):
        raise InputError(f"decode_rows: the cache holds {cache.batch} rows of {cache.num_blocks} blocks; "
                         f"{n} rows of {len(span.blocks)} blocks are asked")
    if n and max(lengths) + 1 > cache.max_length:
        raise InputError(f"decode_rows: a row holds {max(lengths)} of {cache.max_length} tokens: no room")


def _rows_rope(span: Span, lengths: Sequence[int], hidden: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, signed sin) of each row's position: [n, 1, 1, head_dim], broadcast over a row's heads."""
    cos, sin = span.rotary.get(0, max(lengths) + 1, hidden.device, hidden.dtype)  # [positions, 1, head_dim]
    index = torch.tensor(list(lengths), dtype=torch.long, device=hidden.device)
    return cos[index].unsqueeze(1), sin[index].unsqueeze(1)


def _row_mask(positions: Tensor, keys: int, window: int | None) -> Tensor:
    """[n, 1, 1, keys]: True where row r's query (at positions[r]) may attend: keys up to its own position, and
    within the window."""
    key_positions = torch.arange(keys, device=positions.device)[None, :]
    allowed = key_positions <= positions[:, None]
    if window is not None:
        allowed &= key_positions > positions[:, None] - window
    return allowed[:, None, None, :]


def _block_rows(block: Block, hidden: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor, positions: Tensor,
                keys_seen: int, mask: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """One block on n rows: projections and MLP batched; K/V written at each row's position; one attention call."""
    attn = block.self_attn
    n = hidden.shape[0]
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = attn.qkv_proj(block.input_layernorm(hidden)).view(n, 1, nh + 2 * nkv, d)
    qk = apply_rotary(qkv[:, :, : nh + nkv], *rope)
    k_cache[rows, :, positions] = qk[:, 0, nh:]  # [n, nkv, d] at (row, position)
    v_cache[rows, :, positions] = qkv[:, 0, nh + nkv :]
    # one query per head: each kv head's query group folded into the query axis (as Attention.attend does)
    q = qk[:, 0, :nh].reshape(n, nkv, nh // nkv, d)
    out = F.scaled_dot_product_attention(q, k_cache[:n, :, :keys_seen], v_cache[:n, :, :keys_seen], attn_mask=mask)
    hidden = attn.o_proj(out.reshape(n, 1, nh * d)).add_(hidden)
    return block.mlp(block.post_attention_layernorm(hidden)).add_(hidden)
