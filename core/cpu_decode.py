"""A decode step of one Block (one new token per row, fp32, on the CPU) in numpy.

Why: at batch 1 a decoder layer is four matrix-vector products and about thirty small vector ops. torch spends
10-40 us of dispatch on each small op (RMSNorm alone ~37 us, attention ~40 us for one query), numpy 1-2 us. Between
matmuls that stream megabytes of weights the caches are cold, and every Python-level step costs several times its
warm price, so the step also avoids per-call work: the block's weights are looked up as numpy views once
(`BlockArrays`) and reused while they are still the block's. In a decode step of a 12-layer ~125M model the small
ops took ~10 ms per token in torch and take ~5 ms here (~1.5 ms when the caches are warm); the model decodes ~25%
faster (bench/decode_resident.py).

The arithmetic is Block.forward's, in the same order; tests/core/test_model.py checks both paths against
transformers. The path is taken only when `prepare` says so: torch on one thread (cpu_matmul's layout), no autograd,
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


class BlockArrays:
    """numpy views of one block's weights (shared memory, not copies) and its shapes, made once per block.

    `current()` checks that they are still the block's: the same submodules holding the same parameters at the same
    addresses (weights filled in place, as the engine's streamed slots are, stay valid; replaced or moved ones do
    not). `usable` is False for a block this path cannot run (not fp32 on the CPU, quantized layers)."""

    def __init__(self, block):
        attn, mlp = block.self_attn, block.mlp
        norms = (block.input_layernorm, block.post_attention_layernorm)
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self._children = [(block, "self_attn", attn), (block, "mlp", mlp),
                         (block, "input_layernorm", norms[0]), (block, "post_attention_layernorm", norms[1])]
        self._children += [(attn, "qkv_proj", linears[0]), (attn, "o_proj", linears[1]),
                          (mlp, "gate_up_proj", linears[2]), (mlp, "down_proj", linears[3])]
        tensors = [(module, name, module._parameters.get(name))
                   for module in (*norms, *linears) for name in ("weight", "bias")]
        self._tensors = [(module, name, tensor, tensor.data_ptr() if tensor is not None else 0)
                         for module, name, tensor in tensors]
        self.usable = all(isinstance(layer, Linear) for layer in linears) and all(
            tensor.dtype is torch.float32 and tensor.device.type == "cpu"
            for _, _, tensor, _ in self._tensors if tensor is not None)
        if not self.usable:
            return

        def array(tensor: Tensor | None) -> np.ndarray | None:
            return None if tensor is None else tensor.detach().numpy()

        self.norm_weights = tuple(array(norm.weight) for norm in norms)
        self.norm_eps = tuple(norm.eps for norm in norms)
        self.weights = tuple((array(layer.weight), array(layer.bias)) for layer in linears)
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate_size = mlp.intermediate_size

    def current(self) -> bool:
        return all(parent._modules.get(name) is child for parent, name, child in self._children) and all(
            module._parameters.get(name) is tensor and (tensor is None or tensor.data_ptr() == address)
            for module, name, tensor, address in self._tensors)


def block_arrays(block) -> BlockArrays:
    """The block's BlockArrays, made again when its weights changed since the last step."""
    arrays = block.__dict__.get("_numpy_arrays")
    if arrays is None or not arrays.current():
        arrays = BlockArrays(block)
        block.__dict__["_numpy_arrays"] = arrays  # a plain attribute: not a parameter, buffer or state_dict entry
    return arrays


def prepare(block, hidden: Tensor, k_cache: Tensor | None) -> BlockArrays | None:
    """The block's arrays when this step can run in numpy (`decode_step`), else None (Block.forward's torch code)."""
    if not ENABLED or k_cache is None or hidden.dim() != 3 or hidden.shape[1] != 1:
        return None
    if hidden.dtype is not torch.float32 or hidden.device.type != "cpu" or k_cache.dtype is not torch.float32:
        return None
    if torch.is_grad_enabled() or not blas_active() or k_cache.device.type != "cpu":
        return None
    arrays = block_arrays(block)
    return arrays if arrays.usable else None


def _matmul(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """x [rows, in] @ weight[out, in].T (+ bias) -> [rows, out]; one row as a matrix-vector product."""
    out = np.dot(weight, x[0])[None] if x.shape[0] == 1 else np.matmul(x, weight.T)
    if bias is not None:
        out += bias
    return out


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [rows, hidden] / rms(x) * weight."""
    if x.shape[0] == 1:
        inv_rms = np.float32(1.0 / math.sqrt(float(np.dot(x[0], x[0])) / x.shape[1] + eps))
    else:
        inv_rms = 1.0 / np.sqrt(np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[1]) + np.float32(eps))
    out = x * weight
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


def decode_step(block, w: BlockArrays, hidden: Tensor, k_cache: Tensor, v_cache: Tensor, position: int,
                rope: tuple[Tensor, Tensor]) -> Tensor:
    """Block.forward for hidden [batch, 1, hidden_size] at `position` with the block's arrays `w` (from `prepare`),
    writing K/V into the caches [batch, kv_heads, max_length, head_dim]. Returns a new [batch, 1, hidden] tensor."""
    (qkv_w, qkv_b), (o_w, o_b), (gate_up_w, gate_up_b), (down_w, down_b) = w.weights
    nh, nkv, d = w.num_heads, w.num_kv_heads, w.head_dim
    batch, _, width = hidden.shape
    x = hidden.detach().numpy().reshape(batch, width)  # [b, hidden]
    cos, signed_sin = rope[0].numpy().reshape(d), rope[1].numpy().reshape(d)
    half = d // 2

    # attention: q, k, v in one matmul; rotate q and k together
    y = _rms_norm(x, w.norm_weights[0], w.norm_eps[0])
    qkv = _matmul(y, qkv_w, qkv_b).reshape(batch, nh + 2 * nkv, d)
    qk = qkv[:, : nh + nkv]
    rotated = qk * cos  # x * cos + rotate_half(x) * sin, rotate_half's sign folded into signed_sin
    rotated[..., :half] += qk[..., half:] * signed_sin[:half]
    rotated[..., half:] += qk[..., :half] * signed_sin[half:]
    keys_all, values_all = k_cache.numpy(), v_cache.numpy()  # views: writes land in the cache
    keys_all[:, :, position] = rotated[:, nh:]
    values_all[:, :, position] = qkv[:, nh + nkv :]
    end = position + 1
    window = block.self_attn.window  # per call: the engine's streamed slots change it with the layer
    first_key = end - window if window is not None and end > window else 0
    keys, values = keys_all[:, :, first_key:end], values_all[:, :, first_key:end]  # [b, nkv, n, d]
    q = rotated[:, :nh].reshape(batch, nkv, nh // nkv, d)  # each kv head's query group
    scores = np.matmul(q, keys.transpose(0, 1, 3, 2))  # [b, nkv, groups, n]
    scores *= np.float32(1.0 / math.sqrt(d))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    context = np.matmul(scores, values).reshape(batch, nh * d)
    x = x + _matmul(context, o_w, o_b)

    # MLP: gate and up in one matmul
    y = _rms_norm(x, w.norm_weights[1], w.norm_eps[1])
    gate_up = _matmul(y, gate_up_w, gate_up_b)
    size = w.intermediate_size
    x += _matmul(_silu_times(gate_up[:, :size], gate_up[:, size:]), down_w, down_b)
    return torch.from_numpy(x).view(batch, 1, width)
