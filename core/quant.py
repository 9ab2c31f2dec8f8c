"""8-bit and 4-bit (nf4) weights through bitsandbytes: the Linear layers of a block are replaced in place.

The same code runs on CUDA and on CPU: bitsandbytes quantizes a weight when its parameter is moved to a device
(`.to(device)`), whichever device that is. Its CPU kernels are much slower than a dense fp32 matmul (see
bench/quant_cpu.py); the planner accounts for that.
"""

from __future__ import annotations

import torch
from torch import nn

from hivekeeper.planner.errors import InputError

from .cpu_matmul import Linear

QUANT_TYPES = ("none", "int8", "nf4")
# LLM.int8(): activation columns above this magnitude go through a 16-bit matmul (bitsandbytes' usual value)
INT8_OUTLIER_THRESHOLD = 6.0


def check_quant(quant: str) -> str:
    """Validate a quantization name ('none', 'int8', 'nf4')."""
    name = (quant or "none").lower()
    if name not in QUANT_TYPES:
        raise InputError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANT_TYPES)}")
    return name


def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as exc:
        raise InputError(
            f"int8/nf4 weights need bitsandbytes, which is not importable ({exc}); "
            "install it with `pip install bitsandbytes` or use --quant none"
        ) from None
    return bitsandbytes


def quantized_linear(linear: nn.Linear, quant: str, device: str | torch.device) -> nn.Module:
    """A bitsandbytes copy of `linear` (weights on CPU), quantized on `device`."""
    bnb = _bitsandbytes()
    weight = linear.weight.detach()
    has_bias = linear.bias is not None
    if quant == "int8":
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False,
                                  threshold=INT8_OUTLIER_THRESHOLD, device="meta")
        # Int8Params quantize (per output row, to int8 with an fp32 scale) when moved off the CPU tensor
        new.weight = bnb.nn.Int8Params(weight.to("cpu"), requires_grad=False, has_fp16_weights=False)
    elif quant == "nf4":
        new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias, compute_dtype=weight.dtype,
                                compress_statistics=True, quant_type="nf4", device="meta")
        new.weight = bnb.nn.Params4bit(weight.to("cpu"), requires_grad=False, compress_statistics=True,
                                       quant_type="nf4", module=new)
    else:
        raise InputError(f"quantized_linear: unknown quantization {quant!r}")
    if has_bias:
        new.bias = nn.Parameter(linear.bias.detach().to("cpu"), requires_grad=False)
    return new.to(device)


def quantize_block(block: nn.Module, quant: str, device: str | torch.device) -> nn.Module:
    """Replace every nn.Linear inside `block` by its int8/nf4 bitsandbytes version; the rest moves to `device`.

    The block's norms (and any biases) keep their dtype, which is the dtype activations are computed in.
    """
    quant = check_quant(quant)
    if quant == "none":
        return block.to(device)
    for module in list(block.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) in (nn.Linear, Linear):
                setattr(module, child_name, quantized_linear(child, quant, device))
    return block.to(device)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers as stored (quantized weights count their packed size + stats)."""
    total = 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        total += tensor.numel() * tensor.element_size()
        state = getattr(tensor, "quant_state", None)  # nf4: absmax (+ nested statistics)
        if state is not None:
            total += state.absmax.numel() * state.absmax.element_size()
            if state.state2 is not None:
                total += state.state2.absmax.numel() * state.state2.absmax.element_size()
        scales = getattr(tensor, "SCB", None)  # int8: one scale per output row
        if scales is not None:
            total += scales.numel() * scales.element_size()
    for linear in module.modules():  # int8 keeps its scales on the layer's state after the first forward
        state = getattr(linear, "state", None)
        scales = getattr(state, "SCB", None) if state is not None else None
        if scales is not None and getattr(getattr(linear, "weight", None), "SCB", None) is None:
            total += scales.numel() * scales.element_size()
    return total
