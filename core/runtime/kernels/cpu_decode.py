"""A decode step of one Block (one new token per row, fp32, on the CPU) in numpy.

Why: at batch 1 a decoder layer is four matrix-vector products and about thirty small vector ops. torch spends
10-40 us of dispatch on each small op (RMSNorm alone ~37 us, attention ~40 us for one query), numpy 1-2 us. Between
matmuls that stream megabytes of weights the caches are cold, and every Python-level step costs several times its
warm price, so the step also avoids per-call work: the block's weights are looked up as numpy views once
(`BlockArrays`) and reused while they are still the block's. In a decode step of a 12-layer ~125M model the small
ops took ~10 ms per token in torch and take ~5 ms here (~1.5 ms when the caches are warm); the model decodes ~25%
faster (bench/decode_resident.py).

The arithmetic is Block.forward's, in the same order; tests/core/runtime/test_model.py checks both paths against
transformers. The path is taken only when `prepare` says so: torch on one thread (cpu_matmul's layout), no autograd,
fp32 weights of our own Linear on the CPU, one token per row, a KV cache. Everything else (prefill, GPUs, bf16,
bitsandbytes blocks, backward) runs Block.forward's torch code. Blocks whose layers are block-quantized
(QuantizedLinear: GGUF's Q8_0, Q4_0, Q4_1, core/runtime/kernels/quant_kernels.py) take the C kernels' step only
(up to MAX_ROWS rows); without the kernels they run torch's code too.

One row (batch 1, the chat and serving case) goes further, into the C kernels of core/runtime/kernels/native_kernels.py when they
are built: `decode_blocks` runs a whole span's step in one call (a Span's, or an engine's through `PreparedSpan`),
`head_step` the final norm and LM head, and a lone block's step (`decode_step`) takes one call too. Several rows
stay in numpy, whose BLAS multiplies a batch faster than row-by-row products would.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch
from torch import Tensor

from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.kernels.cpu_matmul import Linear, blas_active, column_major
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear

ENABLED = True  # tests switch it off to run the torch path through the same checks


class BlockArrays:
    """numpy views of one block's weights (shared memory, not copies) and its shapes, made once per block.

    `current()` checks that they are still the block's: the same submodules holding the same parameters at the same
    addresses (weights filled in place, as the engine's streamed slots are, stay valid; replaced or moved ones do
    not). `usable` says whether the numpy step runs the block (fp32 on the CPU, plain Linear layers); `native` is the
    C kernels' table of the block when they run it: fp32 layers, or block-quantized ones (QuantizedLinear: Q8_0,
    Q4_0, Q4_1), which only the kernels run."""

    def __init__(self, block):
        attn, mlp = block.self_attn, block.mlp
        norms = (block.input_layernorm, block.post_attention_layernorm)
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self._children = [(block, "self_attn", attn), (block, "mlp", mlp),
                         (block, "input_layernorm", norms[0]), (block, "post_attention_layernorm", norms[1])]
        self._children += [(attn, "qkv_proj", linears[0]), (attn, "o_proj", linears[1]),
                          (mlp, "gate_up_proj", linears[2]), (mlp, "down_proj", linears[3])]
        tensors = [(module, name, _tensor(module, name))
                   for module in (*norms, *linears) for name in (_weight_name(module), "bias")]
        self._tensors = [(module, name, tensor, tensor.data_ptr() if tensor is not None else 0)
                         for module, name, tensor in tensors]
        self.usable = all(isinstance(layer, Linear) for layer in linears) and _fp32_on_cpu(self._tensors)
        self.native = None  # the C kernels' table of this block, when they can run it
        if not (all(isinstance(layer, (Linear, QuantizedLinear)) for layer in linears)
                and _fp32_on_cpu(self._tensors)):
            return

        def array(tensor: Tensor | None) -> np.ndarray | None:
            return None if tensor is None else tensor.detach().numpy()

        self.norm_weights = tuple(array(norm.weight) for norm in norms)
        self.norm_eps = tuple(norm.eps for norm in norms)
        self.weights = tuple((array(_tensor(layer, _weight_name(layer))), array(layer.bias)) for layer in linears)
        self.formats = tuple(layer.fmt.ggml_type if isinstance(layer, QuantizedLinear) else 0 for layer in linears)
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate_size = mlp.intermediate_size
        self.native = self._native_block(attn) if native_kernels.library() is not None else None

    def _native_block(self, attn) -> native_kernels.Block | None:
        """The C kernels' view of this block (weights row- or column-major, block-quantized ones row by row, the
        rest contiguous), or None."""
        vectors = [*self.norm_weights, *(bias for _, bias in self.weights if bias is not None)]
        if not all(a.flags.c_contiguous for a in vectors):
            return None
        layout = formats = 0
        for bit, ((weight, _), fmt) in enumerate(zip(self.weights, self.formats)):
            formats |= fmt << (8 * bit)
            if not weight.flags.c_contiguous:
                if fmt or not weight.flags.f_contiguous:
                    return None
                layout |= 1 << bit

        def address(a: np.ndarray | None) -> int | None:
            return None if a is None else a.ctypes.data

        (qkv_w, qkv_b), (o_w, o_b), (gate_up_w, gate_up_b), (down_w, down_b) = self.weights
        return native_kernels.Block(
            self.norm_weights[0].shape[0], self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size,
            address(self.norm_weights[0]), address(self.norm_weights[1]), self.norm_eps[0], self.norm_eps[1],
            address(qkv_w), address(qkv_b), address(o_w), address(o_b), address(gate_up_w), address(gate_up_b),
            address(down_w), address(down_b), layout, formats)

    def current(self) -> bool:
        return all(parent._modules.get(name) is child for parent, name, child in self._children) and all(
            _tensor(module, name) is tensor and (tensor is None or tensor.data_ptr() == address)
            for module, name, tensor, address in self._tensors)


def _weight_name(module) -> str:
    """Where a layer keeps its weight: `packed` (a buffer of block bytes) for QuantizedLinear, else `weight`."""
    return "packed" if isinstance(module, QuantizedLinear) else "weight"


def _tensor(module, name: str) -> Tensor | None:
    """A module's own parameter or buffer `name` (None when it has none)."""
    return module._parameters.get(name) if name in module._parameters else module._buffers.get(name)


def _fp32_on_cpu(tensors) -> bool:
    """Every floating-point tensor fp32 and every tensor on the CPU (block bytes are uint8)."""
    return all((tensor.dtype is torch.float32 or not tensor.is_floating_point()) and tensor.device.type == "cpu"
               for _, _, tensor, _ in tensors if tensor is not None)


def block_arrays(block) -> BlockArrays:
    """The block's BlockArrays, made again when its weights changed since the last step."""
    arrays = block.__dict__.get("_numpy_arrays")
    if arrays is None or not arrays.current():
        arrays = BlockArrays(block)
        block.__dict__["_numpy_arrays"] = arrays  # a plain attribute: not a parameter, buffer or state_dict entry
    return arrays


def forget_arrays(module) -> None:
    """Drop the cached BlockArrays of every block under `module` (their views would keep freed weights alive)."""
    for child in module.modules():
        child.__dict__.pop("_numpy_arrays", None)


def _step_allowed(hidden: Tensor, k_cache: Tensor | None) -> bool:
    """Whether a decode step of these hidden states and cache can leave torch (see the module docstring)."""
    if not ENABLED or k_cache is None or hidden.dim() != 3 or hidden.shape[1] != 1:
        return False
    if hidden.dtype is not torch.float32 or hidden.device.type != "cpu" or k_cache.dtype is not torch.float32:
        return False
    return not torch.is_grad_enabled() and blas_active() and k_cache.device.type == "cpu"


def prepare(block, hidden: Tensor, k_cache: Tensor | None) -> BlockArrays | None:
    """The block's arrays when this step can run in numpy or the C kernels (`decode_step`), else None (Block.forward's
    torch code). A block-quantized block runs only in the kernels: a batch they take, caches they read."""
    if not _step_allowed(hidden, k_cache):
        return None
    arrays = block_arrays(block)
    if arrays.usable:
        return arrays
    native_ready = (arrays.native is not None and native_kernels.library() is not None
                    and hidden.shape[0] <= native_kernels.MAX_ROWS and k_cache.stride(-1) == 1)
    return arrays if native_ready else None


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
    batch, _, width = hidden.shape
    if w.native is not None and batch <= native_kernels.MAX_ROWS and native_kernels.ENABLED:
        out = _native_step(block, w.native, hidden, k_cache, v_cache, position, rope)
        if out is not None:
            return out
    if not w.usable:  # `prepare` checked what the kernels need; caches unlike KVCache's would end here
        raise RuntimeError("decode: a block-quantized block's caches do not suit the native kernels")
    (qkv_w, qkv_b), (o_w, o_b), (gate_up_w, gate_up_b), (down_w, down_b) = w.weights
    nh, nkv, d = w.num_heads, w.num_kv_heads, w.head_dim
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
    first_key = _first_key(block, position)
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


def _first_key(block, position: int) -> int:
    window = block.self_attn.window  # per call: the engine's streamed slots change it with the layer
    end = position + 1
    return end - window if window is not None and end > window else 0


def _native_cache(block, k_cache: Tensor, v_cache: Tensor) -> native_kernels.Cache | None:
    """The C kernels' hk_cache for a block's caches [batch, kv_heads, max_length, head_dim], or None when they
    cannot take them."""
    if (k_cache.dtype is not torch.float32 or k_cache.device.type != "cpu" or v_cache.dtype is not torch.float32
            or v_cache.device.type != "cpu" or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride()
            or k_cache.stride(-1) != 1):
        return None
    return native_kernels.Cache(k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                                k_cache.stride(2), block.self_attn.window or 0)


def _native_rows(hidden: Tensor, caches) -> bool:
    """hidden [batch, 1, hidden_size] of a batch the kernels take, with caches of that batch."""
    return (hidden.dim() == 3 and hidden.shape[1] == 1 and 1 <= hidden.shape[0] <= native_kernels.MAX_ROWS
            and caches[0][0].shape[0] == hidden.shape[0])


def _native_token(position: int, rope: tuple[Tensor, Tensor]) -> tuple[native_kernels.Token, tuple[Tensor, Tensor]]:
    """The C kernels' hk_token, and the rope tables it points into (keep them until the call returns)."""
    cos, signed_sin = (table if table.is_contiguous() else table.contiguous() for table in rope)
    return native_kernels.Token(position, cos.data_ptr(), signed_sin.data_ptr()), (cos, signed_sin)


def _run_native(library, blocks, caches, count: int, hidden: Tensor, position: int,
                rope: tuple[Tensor, Tensor]) -> Tensor:
    """`count` blocks' step in one call: blocks and caches are tables of that many entries (or one, by reference)."""
    token, _tables = _native_token(position, rope)
    out = hidden.detach().clone(memory_format=torch.contiguous_format)  # [batch, 1, hidden]: updated in place
    if library.hk_span_decode(blocks, caches, count, ctypes.byref(token), out.data_ptr(), out.shape[0]) != 0:
        raise MemoryError("decode: the native kernels could not allocate their scratch memory")
    return out


def _native_tables(blocks, caches) -> tuple[ctypes.Array, ctypes.Array, list[BlockArrays]] | None:
    """(block table, cache table, the blocks' arrays) for the C kernels, or None when they cannot run every block."""
    arrays, entries = [], []
    for block, (k_cache, v_cache) in zip(blocks, caches, strict=True):
        block_weights = block_arrays(block)
        entry = _native_cache(block, k_cache, v_cache) if block_weights.native is not None else None
        if entry is None:
            return None
        arrays.append(block_weights)
        entries.append(entry)
    count = len(arrays)
    return ((native_kernels.Block * count)(*(a.native for a in arrays)), (native_kernels.Cache * count)(*entries),
            arrays)


def decode_blocks(blocks, caches, hidden: Tensor, position: int, rope: tuple[Tensor, Tensor]) -> Tensor | None:
    """One token per row (hidden [batch, 1, hidden_size], batch <= MAX_ROWS) through consecutive `blocks` with their
    (k, v) `caches` [batch, ...] in one call of the C kernels, or None when the native path cannot take all of them
    (the caller runs them one by one). Every call checks that each block's weights are still those its table points
    to (`block_arrays`)."""
    prepared = PreparedSpan.prepare(blocks, caches, hidden)
    return prepared.run(hidden, position, rope) if prepared is not None else None


class PreparedSpan:
    """decode_blocks for blocks whose weights stay put (an engine's resident blocks: nothing replaces or moves
    them after loading) and one set of caches. The tables are built once, so a step costs one call and no Python
    per block (~40 us a block otherwise, cache-cold between matmuls). Each step checks that the caches are still
    the same tensors."""

    def __init__(self, caches, tables):
        self.block_table, self.cache_table, self._arrays = tables
        self._caches = [tensor for pair in caches for tensor in pair]  # also keeps them alive for the table

    @classmethod
    def prepare(cls, blocks, caches, hidden: Tensor) -> "PreparedSpan | None":
        if (native_kernels.library() is None or not blocks or not _native_rows(hidden, caches)
                or not _step_allowed(hidden, caches[0][0])):
            return None
        tables = _native_tables(blocks, caches)
        return cls(caches, tables) if tables is not None else None

    def run(self, hidden: Tensor, position: int, rope: tuple[Tensor, Tensor]) -> Tensor:
        """The step, with the conditions `prepare` checked holding."""
        return _run_native(native_kernels.library(), self.block_table, self.cache_table, len(self.block_table),
                           hidden, position, rope)

    def __call__(self, caches, hidden: Tensor, position: int, rope: tuple[Tensor, Tensor]) -> Tensor | None:
        """The step, or None when it cannot run natively now (autograd on, threads changed, other caches)."""
        if native_kernels.library() is None or not _native_rows(hidden, caches) or not _step_allowed(
                hidden, self._caches[0]):
            return None
        if any(a is not b for a, b in zip((t for pair in caches for t in pair), self._caches, strict=True)):
            return None
        return self.run(hidden, position, rope)


def head_step(head, hidden: Tensor) -> Tensor | None:
    """Head.forward (final norm, LM head) of up to MAX_ROWS rows in one call of the C kernels, or None when it cannot
    run there (then torch and cpu_matmul.linear do)."""
    library = native_kernels.library()
    norm, weight = head.norm, head.weight
    rows = hidden.numel() // max(hidden.shape[-1], 1)
    if (library is None or not 1 <= rows <= native_kernels.MAX_ROWS or hidden.dtype is not torch.float32
            or hidden.device.type != "cpu" or weight.dtype is not torch.float32 or weight.device.type != "cpu"
            or norm.weight.dtype is not torch.float32 or torch.is_grad_enabled() or not blas_active()):
        return None
    layout = column_major(weight)
    if layout is None:
        return None
    row = hidden.detach().reshape(-1).contiguous()
    logits = torch.empty(*hidden.shape[:-1], weight.shape[0])
    if library.hk_norm_gemv(norm.weight.data_ptr(), norm.eps, weight.data_ptr(), layout, row.data_ptr(),
                            logits.data_ptr(), weight.shape[0], weight.shape[1], rows) != 0:
        raise MemoryError("head_step: the native kernels could not allocate their scratch memory")
    return logits


def _native_step(block, native: native_kernels.Block, hidden: Tensor, k_cache: Tensor, v_cache: Tensor,
                 position: int, rope: tuple[Tensor, Tensor]) -> Tensor | None:
    """decode_step in one call of the C kernels (core/runtime/kernels/native/decode_kernels.c); None when the caches' layout does
    not suit them."""
    cache = _native_cache(block, k_cache, v_cache)
    if cache is None or k_cache.shape[0] != hidden.shape[0]:
        return None
    return _run_native(native_kernels.library(), ctypes.byref(native), ctypes.byref(cache), 1, hidden, position,
                       rope)
