"""Two other ways to run a decoder Block, for the offloading engine's policy knobs. Same math as Block.forward.

- `forward_with_attention_at_cache` (`attention_on_cpu`): the projections and the MLP run on the compute device,
  the attention itself where the KV cache lives (FlexGen's CPU attention: only q, the new K/V and the attention
  output cross the host link, never the cache).
- `forward_recomputing_kv` (`kv_cache_mode: recompute`): the cache holds each block's input hidden states; every
  step recomputes K and V of the stored prefix (input norm, the k/v rows of the fused projection, rotary) and then
  runs the block as usual.

Both take the devices from their tensors (hidden states on the compute device, caches wherever they are), so on a
CPU-only machine they run with both devices "cpu" and must give Block.forward's results.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hivekeeper.core.runtime.kernels.cpu_matmul import Linear, linear
from hivekeeper.core.runtime.model import Block, apply_rotary


def forward_with_attention_at_cache(block: Block, hidden: Tensor, k_cache: Tensor, v_cache: Tensor, position: int,
                                    rope: tuple[Tensor, Tensor],
                                    attention_dtype: torch.dtype | None = None) -> Tensor:
    """Block.forward with the attention run on the cache's device.

    hidden [b, t, hidden] on the compute device, at positions [position, position + t); k_cache, v_cache
    [b, kv_heads, max_length, head_dim] on the cache's device (pinned RAM or a memory-mapped file when a GPU
    computes). The new K, V are written into the cache where it is, q goes there and the attention output comes
    back. With nothing cached yet (position 0) the new tokens attend among themselves on the compute device: there
    is no prefix to read. attention_dtype: run the attention in this dtype (fp32 for a 16-bit cache on a CPU
    without 16-bit math, as FlexGen does); None keeps the cache's dtype.
    """
    attn = block.self_attn
    b, t, _ = hidden.shape
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    cos, sin = rope
    qkv = attn.qkv_proj(block.input_layernorm(hidden)).view(b, t, nh + 2 * nkv, d)
    qk = apply_rotary(qkv[:, :, : nh + nkv], cos, sin)
    q = qk[:, :, :nh].transpose(1, 2)  # [b, nh, t, d]
    k = qk[:, :, nh:].transpose(1, 2)  # [b, nkv, t, d]
    v = qkv[:, :, nh + nkv :].transpose(1, 2)
    end = position + t
    k_cache[:, :, position:end].copy_(k)
    v_cache[:, :, position:end].copy_(v)
    if position == 0:
        out = attn.attend(q, k, v, 0, 0)
    else:
        first_key = 0
        if attn.window is not None and t == 1 and end > attn.window:
            first_key = end - attn.window  # decode: keys older than the window are not read (as Attention does)
        dtype = attention_dtype or k_cache.dtype
        keys = k_cache[:, :, first_key:end].to(dtype)
        values = v_cache[:, :, first_key:end].to(dtype)
        out = attn.attend(q.to(k_cache.device, dtype), keys, values, position, first_key)
        out = out.to(hidden.device, hidden.dtype)
    hidden = attn.o_proj(out.transpose(1, 2).reshape(b, t, nh * d)).add_(hidden)
    return block.mlp(block.post_attention_layernorm(hidden)).add_(hidden)


def project_kv(block: Block, inputs: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """K (rotated) and V [b, kv_heads, L, head_dim] of a block's inputs [b, L, hidden], with cos/sin of their
    positions: the input norm, then only the k/v rows of the fused q/k/v projection."""
    attn = block.self_attn
    b, length, _ = inputs.shape
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    proj = attn.qkv_proj
    if isinstance(proj, Linear):
        q_dim = nh * d
        bias = None if proj.bias is None else proj.bias[q_dim:]
        kv = linear(block.input_layernorm(inputs), proj.weight[q_dim:], bias).view(b, length, 2 * nkv, d)
    else:  # quantized layers cannot be sliced by rows: project q too and drop it
        kv = proj(block.input_layernorm(inputs)).view(b, length, nh + 2 * nkv, d)[:, :, nh:]
    k = apply_rotary(kv[:, :, :nkv], cos, sin).transpose(1, 2)
    v = kv[:, :, nkv:].transpose(1, 2)
    return k, v


def forward_recomputing_kv(block: Block, hidden: Tensor, prefix: Tensor, position: int,
                           rope: tuple[Tensor, Tensor], keys: Tensor, values: Tensor) -> Tensor:
    """Block.forward for new tokens hidden [b, t, hidden] at `position`, whose earlier positions are known only
    by the block's stored inputs prefix [b, position, hidden] (on the compute device).

    keys, values [b, kv_heads, >= position + t, head_dim] are scratch buffers on the compute device: the
    recomputed K, V of the prefix go to [0, position), the block writes the new tokens' after them and attends.
    """
    if position:
        cos, sin = block.rotary.get(0, position, hidden.device, hidden.dtype)
        k, v = project_kv(block, prefix, cos, sin)
        keys[:, :, :position].copy_(k)
        values[:, :, :position].copy_(v)
    return block(hidden, keys, values, position, rope)
