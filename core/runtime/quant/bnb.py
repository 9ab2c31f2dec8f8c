"""8-bit and 4-bit (nf4) weights through bitsandbytes: the Linear layers of a block are replaced in place.

The same code runs on CUDA and on CPU: bitsandbytes quantizes a weight when its parameter is moved to a device
(`.to(device)`), whichever device that is. Its CPU kernels are much slower than a dense fp32 matmul (see
bench/quant_cpu.py); the planner accounts for that.

A quantized block can also be taken apart and rebuilt without quantizing again (for blocks streamed from
core/runtime/quant/store.py): `quantized_tensors` names every tensor it holds (int8 weight + per-row scales; nf4 packed
weight + absmax, nested statistics and code tables), `quantized_layout` the non-tensor fields, and
`empty_quantized_block` builds a block around fresh, unfilled tensors of those shapes, which a reader then fills in
place step after step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from hivekeeper.planner.errors import InputError

from hivekeeper.core.runtime.kernels.cpu_matmul import Linear
from hivekeeper.core.runtime.model import Block, ModelConfig, RotaryTable

QUANT_TYPES = ("none", "int8", "nf4")
# LLM.int8(): activation columns above this magnitude go through a 16-bit matmul (bitsandbytes' usual value)
INT8_OUTLIER_THRESHOLD = 6.0
# nf4 as bitsandbytes stores it by default: 64 weights share an absmax, and absmaxes are themselves 8-bit
# quantized in blocks of 256 (compress_statistics); two code tables (16 and 256 floats) and one offset per layer
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256


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


# ---------------------------------------------------------------------------------------------------------------
# Quantized blocks taken apart and rebuilt (no re-quantization)
# ---------------------------------------------------------------------------------------------------------------
def _linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of the fused linears of a block: qkv, o, gate_up, down."""
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_dim, config.kv_dim
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def quantized_block_bytes(config: ModelConfig, quant: str, dtype: torch.dtype) -> int:
    """Bytes one int8/nf4 block holds (packed weights, their statistics, and norms/biases in `dtype`)."""
    shapes = _linear_shapes(config)
    linear_params = sum(out * inp for out, inp in shapes)
    others = config.block_param_count() - linear_params  # norms and biases, kept in `dtype`
    total = others * torch.empty((), dtype=dtype).element_size()
    for out, inp in shapes:
        n = out * inp
        if quant == "int8":
            total += n + 4 * out  # int8 weight, one fp32 scale per output row
        elif quant == "nf4":
            blocks = math.ceil(n / NF4_BLOCK)
            total += (n + 1) // 2 + blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK) + 4 * (16 + 256 + 1)
        else:
            raise InputError(f"quantized_block_bytes: unknown quantization {quant!r}")
    return total


def quantized_tensors(block: nn.Module) -> dict[str, Tensor]:
    """Every tensor a quantized block computes with, by a stable name (`self_attn.qkv_proj.SCB`, ...).

    The tensors are the block's own storage: filling them in place changes the weights the block uses.
    """
    bnb = _bitsandbytes()
    tensors: dict[str, Tensor] = {}
    for name, module in block.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, bnb.nn.Linear8bitLt):
            weight = module.weight
            tensors[prefix + "weight"] = weight.data
            # bitsandbytes moves the scales from the parameter to the layer's state at the first forward
            tensors[prefix + "SCB"] = weight.SCB if getattr(weight, "SCB", None) is not None else module.state.SCB
        elif isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            if getattr(state, "packing_format_for_cpu", False):
                raise InputError(f"{name}: nf4 weights repacked for the CPU kernel cannot be stored")
            tensors[prefix + "weight"] = module.weight.data
            tensors[prefix + "absmax"] = state.absmax
            tensors[prefix + "quant_map"] = state.code
            if state.nested:
                tensors[prefix + "nested_absmax"] = state.state2.absmax
                tensors[prefix + "nested_quant_map"] = state.state2.code
                tensors[prefix + "offset"] = state.offset
        else:
            for param_name, param in module.named_parameters(recurse=False):
                tensors[prefix + param_name] = param.data
            continue
        if module.bias is not None:
            tensors[prefix + "bias"] = module.bias.data
    return tensors


def quantized_layout(block: nn.Module) -> dict[str, dict]:
    """The non-tensor fields of each quantized linear (JSON-ready), to rebuild it around stored tensors."""
    bnb = _bitsandbytes()
    layout = {}
    for name, module in block.named_modules():
        info = {"in_features": module.in_features, "out_features": getattr(module, "out_features", 0),
                "bias": getattr(module, "bias", None) is not None} if hasattr(module, "in_features") else {}
        if isinstance(module, bnb.nn.Linear8bitLt):
            layout[name] = {"quant": "int8", **info}
        elif isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            layout[name] = {"quant": state.quant_type, **info, "blocksize": state.blocksize,
                            "dtype": str(state.dtype).removeprefix("torch."), "shape": list(state.shape)}
            if state.nested:
                layout[name].update(nested_blocksize=state.state2.blocksize,
                                    nested_dtype=str(state.state2.dtype).removeprefix("torch."))
    return layout


def prequantized_linear(info: dict, tensors: dict[str, Tensor], cpu_repack: bool = True) -> nn.Module:
    """A bitsandbytes linear that computes with these already-quantized tensors (used as they are, not copied).

    tensors: the suffixes `quantized_tensors` names (weight, SCB or absmax/quant_map/..., bias). cpu_repack=False
    keeps bitsandbytes from converting nf4 weights to its AVX512-BF16 layout at the first forward (which replaces
    the tensors: a block refilled in place must keep them).
    """
    bnb = _bitsandbytes()
    has_bias = bool(info["bias"])
    if info["quant"] == "int8":
        new = bnb.nn.Linear8bitLt(info["in_features"], info["out_features"], bias=has_bias, has_fp16_weights=False,
                                  threshold=INT8_OUTLIER_THRESHOLD, device="meta")
        new.weight = bnb.nn.Int8Params(tensors["weight"], requires_grad=False, has_fp16_weights=False)
        # the state a quantized layer settles in after its first forward: weight and scales on the state
        new.state.CB, new.state.SCB = new.weight.data, tensors["SCB"]
    elif info["quant"] == "nf4":
        from bitsandbytes.functional import QuantState

        nested = None
        if "nested_absmax" in tensors:
            nested = QuantState(absmax=tensors["nested_absmax"], code=tensors["nested_quant_map"],
                                blocksize=info["nested_blocksize"], dtype=getattr(torch, info["nested_dtype"]))
        state = QuantState(absmax=tensors["absmax"], shape=torch.Size(info["shape"]), code=tensors["quant_map"],
                           blocksize=info["blocksize"], quant_type="nf4", dtype=getattr(torch, info["dtype"]),
                           offset=tensors.get("offset"), state2=nested)
        new = bnb.nn.Linear4bit(info["in_features"], info["out_features"], bias=has_bias, compute_dtype=state.dtype,
                                compress_statistics=nested is not None, quant_type="nf4", device="meta")
        new.weight = bnb.nn.Params4bit(tensors["weight"], requires_grad=False, quant_state=state,
                                       blocksize=state.blocksize, compress_statistics=nested is not None,
                                       quant_type="nf4", quant_storage=tensors["weight"].dtype, module=new,
                                       bnb_quantized=True)
        new.quant_state = state
        if not cpu_repack:
            new.support_avx512bf16_for_cpu = False
    else:
        raise InputError(f"prequantized_linear: unknown quantization {info['quant']!r}")
    if has_bias:
        new.bias = nn.Parameter(tensors["bias"], requires_grad=False)
    return new


def empty_quantized_block(config: ModelConfig, rotary: RotaryTable, layout: dict[str, dict],
                          tensor_specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], device: str | torch.device,
                          pin: bool = False, cpu_repack: bool = False) -> Block:
    """A quantized Block with unfilled tensors of these dtypes and shapes on `device` (pinned host memory when pin).

    layout: `quantized_layout` of a block of this model; tensor_specs: name -> (dtype, shape) of `quantized_tensors`.
    cpu_repack: let bitsandbytes repack nf4 weights for its AVX512-BF16 kernel at the first forward (a block that is
    filled once and kept; never for a streaming slot, which is refilled in the portable layout every step).
    """
    with torch.device("meta"):
        block = Block(config, 0, rotary)

    def fresh(name: str) -> Tensor:
        if name not in tensor_specs:
            raise InputError(f"quantized block layout has no tensor {name!r}")
        dtype, shape = tensor_specs[name]
        return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)

    for module_name, info in layout.items():
        parent_name, _, child_name = module_name.rpartition(".")
        prefix = module_name + "."
        own = {name[len(prefix):]: fresh(name) for name in tensor_specs if name.startswith(prefix)}
        setattr(block.get_submodule(parent_name), child_name, prequantized_linear(info, own, cpu_repack=cpu_repack))
    for module_name, module in block.named_modules():
        for param_name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                name = f"{module_name}.{param_name}" if module_name else param_name
                module._parameters[param_name] = nn.Parameter(fresh(name), requires_grad=False)
    block.rotary = rotary
    return block
