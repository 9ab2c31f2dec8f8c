"""fp32 matmuls on the CPU through numpy's BLAS (OpenBLAS in numpy's wheels) instead of torch's.

Why: torch's CPU wheels multiply through MKL, whose single-row kernel (decode: one token times a weight matrix)
runs on one core and reaches about half of the RAM bandwidth on the AMD CPUs we measured, while OpenBLAS spreads the
same matrix-vector product over the cores and comes close to the bandwidth bound (bench/decode_resident.py); for
many rows (prefill, batches) OpenBLAS was faster as well. The weights are shared, not copied: `Tensor.numpy()`
is a view.

The two libraries keep separate thread pools, and on a machine with few cores torch's OpenMP workers spinning
between ops starve OpenBLAS's (we measured 2.5x slower decode). So the BLAS path is taken only while torch runs one
thread: `use_blas_threads()` sets that layout, and `linear` falls back to torch whenever it does not hold, when
autograd needs the result, for small weights (BLAS_MIN_WEIGHT_ELEMENTS), or for other dtypes and devices (numpy has
no bf16, and its fp16 matmul is slow).
HIVEKEEPER_CPU_MATMUL=torch turns the BLAS path off (to compare the two).

Decode's products (one new token in each of up to 8 rows) go to the native kernels instead when they are built
(core/runtime/kernels/native_kernels.py): their own thread pool, so OpenBLAS's stays idle between prefills.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.kernels.cpu_threads import blas_threads, physical_cores

_DISABLED = os.environ.get("HIVEKEEPER_CPU_MATMUL", "").lower() == "torch"


def blas_active() -> bool:
    """True while fp32 CPU matmuls go through numpy's BLAS (torch single-threaded, not disabled)."""
    return not _DISABLED and torch.get_num_threads() == 1


def use_blas_threads() -> int:
    """The thread layout for CPU inference: torch on one thread (its ops here are small), numpy's BLAS on every
    core for the matmuls. Returns the threads the matmuls use. With HIVEKEEPER_CPU_MATMUL=torch, torch gets the
    physical cores instead."""
    cores = physical_cores()
    if _DISABLED:
        torch.set_num_threads(cores)
        return cores
    torch.set_num_threads(1)
    return blas_threads()


@contextlib.contextmanager
def torch_threads(count: int):
    """Run a block with torch on `count` threads (e.g. a bandwidth measurement on every core), then restore."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# Below about a megabyte of fp32 weights the matrix sits in the CPU caches and torch's kernel is as fast, while the
# hand-over to numpy costs ~15 us a call (measured: equal at 512 x 512, torch 2.5x faster at 192 x 64).
BLAS_MIN_WEIGHT_ELEMENTS = 1 << 18


def _blas_eligible(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    if weight.numel() < BLAS_MIN_WEIGHT_ELEMENTS or weight.dtype is not torch.float32 or x.dtype is not torch.float32:
        return False
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return (
        weight.device.type == "cpu" and x.device.type == "cpu"
        and x.numel() > 0 and weight.layout is torch.strided
        and not (needs_grad and torch.is_grad_enabled())
        and blas_active()
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear (x [..., in] @ weight[out, in].T + bias), through numpy's BLAS where that is faster."""
    if not _blas_eligible(x, weight, bias):
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    rows = x.numel() // k
    if (rows <= native_kernels.MAX_ROWS and (x.dim() == 1 or x.shape[-2] == 1)
            and (native := native_kernels.library()) is not None):
        # one new token in each of a few rows (decode): the native kernels' product, on their pool rather than
        # OpenBLAS's; prefills stay with OpenBLAS, whose threads they would keep spinning
        layout = column_major(weight)
        if layout is not None:
            inputs = x.detach().reshape(rows, k).contiguous()
            result = torch.empty(*x.shape[:-1], weight.shape[0])
            if native.hk_gemv(weight.data_ptr(), layout, inputs.data_ptr(),
                              bias.data_ptr() if bias is not None else None, result.data_ptr(), weight.shape[0], k,
                              rows) != 0:
                raise MemoryError("linear: the native kernels could not allocate their partial sums")
            return result
    w = weight.detach().numpy()  # [out, in], a view
    if x.numel() == k:  # one row: matrix-vector (gemv), the decode case
        out = np.dot(w, x.detach().reshape(k).numpy())
    else:
        out = np.matmul(x.detach().reshape(-1, k).numpy(), w.T)
    result = torch.from_numpy(out).view(*x.shape[:-1], weight.shape[0])
    return result.add_(bias) if bias is not None else result


# OpenBLAS streams the weights of a matrix-vector product faster column by column (its gemv "N" kernel, output
# accumulated in the cache) than row by row (a dot product per output, "T") when the matrix has several times more
# rows than columns: a 4096 x 768 fp32 weight (a 125M model's fused gate/up) read at 19-22 GB/s column-major
# against 13-18 GB/s row-major, and a 125M model decoded ~20% faster with its gate/up and LM head stored so. Square
# and wide matrices (o, down) read faster row by row. Only the storage changes: the tensor keeps its [out, in] shape,
# and torch's own matmuls accept either layout. The re-store holds the matrix twice for a moment, so the engine skips
# it when it streams blocks under a RAM budget (there disk reads set the speed anyway).
#
# That is numpy's decode path. Where the native kernels are built, decode runs on them, and they read tall matrices
# faster row-major (issue 23, session 15, after their few-row products were rewritten; 2-core AVX512 host, load ~1-2):
# a 2 x 2048 model decoded at 164-168 tokens/s at batch 4 with tall matrices row-major against 107-114 column-major
# and 51-61 against 39-56 at batch 1, SmolLM2 fp32 121 against 58-94 at batch 4, the AVX2 build's wide batch 4 164
# against 94; one row was faster row-major on 5 of 6 tall shapes (6 of 6 with the AVX2 build). Prefill, still
# OpenBLAS's, loses less: 1.06-1.19x slower on this host's kernels (mixed with Haswell's), the wide model's 128-token
# prefill 0.19-0.26 s against 0.17-0.21. So the runtime stores tall matrices column-major only where decode takes
# numpy's path (store_for_decode); store_by_column re-stores one unconditionally (the kernels' tests of that layout).
COLUMN_MAJOR_MIN_RATIO = 2


def column_major(tensor: Tensor) -> bool | None:
    """A weight's storage: False row-major (contiguous), True column-major, None neither."""
    if tensor.is_contiguous():
        return False
    return True if tensor.dim() == 2 and tensor.t().is_contiguous() else None


def store_by_column(weight: nn.Parameter) -> None:
    """Re-store a CPU fp32 weight [out, in] with out >= COLUMN_MAJOR_MIN_RATIO * in column-major (once, at load)."""
    if (weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype is torch.float32
            and weight.shape[0] >= COLUMN_MAJOR_MIN_RATIO * weight.shape[1] and weight.is_contiguous()):
        weight.data = weight.data.t().contiguous().t()


def store_linears_by_column(module: nn.Module) -> None:
    """store_by_column for every Linear's weight in `module`."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            store_by_column(layer.weight)


def tall_by_column() -> bool:
    """Whether the runtime stores tall CPU fp32 matrices column-major: only where decode takes numpy's path (the
    native kernels are not built; see above)."""
    return native_kernels.library() is None


def store_for_decode(weight: nn.Parameter) -> None:
    """A CPU fp32 weight in the layout this machine's decode reads fastest (store_by_column where tall_by_column)."""
    if tall_by_column():
        store_by_column(weight)


def store_linears_for_decode(module: nn.Module) -> None:
    """store_for_decode for every Linear's weight in `module` (a block after loading)."""
    if tall_by_column():
        store_linears_by_column(module)


# A decode step reads every weight once, block after block. Packed into one buffer in that order, the weights of a
# 125M model decoded 7-12% faster than in the separate allocations they were loaded into (bench/decode_resident.py;
# the same in 4 KiB and 2 MiB pages, so it is the layout, not the TLB): the step becomes one forward stream through
# memory instead of ~50 streams in scattered regions.
PACK_ALIGN_ELEMENTS = 16  # each tensor starts on a 64-byte cache line


def pack_in_order(modules) -> Tensor | None:
    """Move the CPU fp32 parameters of `modules` (each once, in order; row- or column-major, which they keep) into
    one buffer; returns it, or None when there is nothing to pack. The parameters stay the same objects (their .data
    is replaced); each is copied and its old memory freed in turn, so RAM grows by at most one tensor meanwhile."""
    params, seen = [], set()
    for module in modules:
        for param in module.parameters():
            if (id(param) not in seen and param.device.type == "cpu" and param.dtype is torch.float32
                    and column_major(param) is not None):
                seen.add(id(param))
                params.append(param)
    if not params:
        return None
    sizes = [-(-param.numel() // PACK_ALIGN_ELEMENTS) * PACK_ALIGN_ELEMENTS for param in params]
    arena = torch.empty(sum(sizes), dtype=torch.float32)
    offset = 0
    for param, size in zip(params, sizes):
        flat = arena[offset : offset + param.numel()]
        packed = flat.view(param.shape[1], param.shape[0]).t() if column_major(param) else flat.view(param.shape)
        packed.copy_(param.data)
        param.data = packed
        offset += size
    return arena


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `linear` (same parameters, same state_dict)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
