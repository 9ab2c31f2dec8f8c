"""A decode step of one Block (one new token per row, fp32, on the CPU) in numpy.

Why: at batch 1 a decoder layer is four matrix-vector products and about thirty small vector ops. torch spends
10-40 us of dispatch on each small op (RMSNorm alone ~37 us, attention ~40 us for one query), numpy 1-2 us, so the
small ops of a 12-layer ~125M model cost ~6 ms per token in torch against ~1.5 ms here, next to ~15 ms of weight
streaming (bench/decode_resident.py). The matmuls go to numpy's BLAS as in cpu_matmul.

The arithmetic is Block.forward's, in the same order; tests/core/test_model.py checks both paths against
transformers. The path is taken only when `eligible` says so: torch on one thread (cpu_matmul's layout), no autograd,
fp32 weights of our own Linear on the CPU, one token per row, a KV cache. Everything else (prefill, GPUs, bf16,
quantized blocks, backward) runs Block.forward's torch code.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .cpu_matmul import Linear, blas_active

ENABLED = True  # tests switch it off to run the torch path through the same checks


def eligible(block, hidden: Tensor, k_cache: Tensor | None) -> bool:
    """Whether Block.forward may hand this step to `decode_step`."""
    if not ENABLED or k_cache is None or hidden.dim() != 3 or hidden.shape[1] != 1:
        return False
    if hidden.dtype is not torch.float32 or hidden.device.type != "cpu" or k_cache.dtype is not torch.float32:
        return False
    if torch.is_grad_enabled() or not blas_active():
        return False
    attn, mlp = block.self_attn, block.mlp
    for layer in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        if not isinstance(layer, Linear) or layer.weight.dtype is not torch.float32 or layer.weight.device.type != "cpu":
            return False
    return block.input_layernorm.weight.dtype is torch.float32 and k_cache.device.type == "cpu"


def _matmul(x: np.ndarray, weight: Tensor, bias: Tensor | None) -> np.ndarray:
    """x [rows, in] @ weight[out, in].T (+ bias) -> [rows, out]; one row as a matrix-vector product."""
    w = weight.detach().numpy()
    out = np.dot(w, x[0])[None] if x.shape[0] == 1 else np.matmul(x, w.T)
    if bias is not None:
        out += bias.detach().numpy()
    return out


def _rms_norm(x: np.ndarray, weight: Tensor, eps: float) -> np.ndarray:
    """x [rows, hidden] / rms(x) * weight."""
    if x.shape[0] == 1:
        inv_rms = np.float32(1.0 / math.sqrt(float(np.dot(x[0], x[0])) / x.shape[1] + eps))
    else:
        inv_rms = 1.0 / np.sqrt(np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[1]) + np.float32(eps))
    out = x * weight.detach().numpy()
    out *= inv_rms
    return out


def _silu_times(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, with sigmoid(g) = (1 + tanh(g / 2)) / 2 (no overflow for large negative g)."""
    half = gate * np.float32(0.5)
    out = np.tanh(half)
    out += 1
    out *= half
    out *= up
    return out


def decode_step(block, hidden: Tensor, k_cache: Tensor, v_cache: Tensor, position: int,
                rope: tuple[Tensor, Tensor]) -> Tensor:
    """Block.forward for hidden [batch, 1, hidden_size] at `position`, writing K/V into the caches
    [batch, kv_heads, max_length, head_dim]. Returns a new [batch, 1, hidden_size] tensor."""
    attn, mlp = block.self_attn, block.mlp
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    batch, _, width = hidden.shape
    x = hidden.detach().reshape(batch, width).numpy()  # [b, hidden]
    cos, signed_sin = (t.reshape(d).numpy() for t in rope)
    half = d // 2

    # attention: q, k, v in one matmul; rotate q and k together
    y = _rms_norm(x, block.input_layernorm.weight, block.input_layernorm.eps)
    qkv = _matmul(y, attn.qkv_proj.weight, attn.qkv_proj.bias).reshape(batch, nh + 2 * nkv, d)
    qk = qkv[:, : nh + nkv]
    rotated = qk * cos  # x * cos + rotate_half(x) * sin, rotate_half's sign folded into signed_sin
    rotated[..., :half] += qk[..., half:] * signed_sin[:half]
    rotated[..., half:] += qk[..., :half] * signed_sin[half:]
    keys_all, values_all = k_cache.detach().numpy(), v_cache.detach().numpy()  # views: writes land in the cache
    keys_all[:, :, position] = rotated[:, nh:]
    values_all[:, :, position] = qkv[:, nh + nkv :]
    end = position + 1
    first_key = end - attn.window if attn.window is not None and end > attn.window else 0
    keys, values = keys_all[:, :, first_key:end], values_all[:, :, first_key:end]  # [b, nkv, n, d]
    q = rotated[:, :nh].reshape(batch, nkv, nh // nkv, d)  # each kv head's query group
    scores = np.matmul(q, keys.transpose(0, 1, 3, 2))  # [b, nkv, groups, n]
    scores *= np.float32(1.0 / math.sqrt(d))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    context = np.matmul(scores, values).reshape(batch, nh * d)
    x = x + _matmul(context, attn.o_proj.weight, attn.o_proj.bias)

    # MLP: gate and up in one matmul
    y = _rms_norm(x, block.post_attention_layernorm.weight, block.post_attention_layernorm.eps)
    gate_up = _matmul(y, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
    size = mlp.intermediate_size
    x += _matmul(_silu_times(gate_up[:, :size], gate_up[:, size:]), mlp.down_proj.weight, mlp.down_proj.bias)
    return torch.from_numpy(x).view(batch, 1, width)
