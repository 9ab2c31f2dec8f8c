"""What --quant becomes for a model on a machine: the formats the runtime can run it in there, and why.

The runtime keeps a GGUF's Q8_0/Q4_0/Q4_1 linears packed on a CPU (its native kernels multiply them as stored) and
dequantizes every other GGUF type; it never re-quantizes a GGUF, and packs no other checkpoint. So a plan for a GGUF
of those types on a CPU is in that format (the speed and bytes `generate` will see), and a packed --quant for
anything else is refused. `hivekeeper plan`, the app's Plan page and model fits, and the engine's own planning
(core/offload/local_plan.py) all ask here: `plan_constraints` turns --quant into the search's Constraints, and
`quant_options` lists the --quant values that apply to a model on a machine (the Plan page's choices).
`plan_model_server` sizes a swarm server for a model file the way the server loads it (a GGUF's span packed on a
CPU: swarm.PackedSpan), for `hivekeeper serve` and the Swarm page.
`runtime_packs` is the runtime's switch (`packed_by_default`: HIVEKEEPER_GGUF_PACKED=0 turns it off). It is read
here, torch-free, so the app plans what the runtime runs without importing torch; core/runtime/gguf.py uses it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .efficiency import MachineEfficiency
from .errors import InputError
from .formats import BITSANDBYTES_FORMATS, PACKED_FORMATS
from .gguf_metadata import gguf_sizes, is_gguf
from .hardware import HardwareSpec
from .model_catalog import load_model_spec
from .policy import Constraints
from .swarm import PackedSpan, ServerPlan, plan_server

PACKED_ENV = "HIVEKEEPER_GGUF_PACKED"  # "0" turns packed GGUF blocks off where they are the default


def packed_by_default() -> bool:
    """Whether the runtime loads GGUF blocks packed where nothing says otherwise (CPU fp32 spans, and the local
    engine's CPU fp32 blocks): yes, unless HIVEKEEPER_GGUF_PACKED=0, so that a swarm's spans and a local run of the
    same file compute the same thing (tests/core/swarm/test_real_model_swarm.py)."""
    return os.environ.get(PACKED_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


@dataclass(frozen=True)
class FormatChoice:
    """What --quant becomes for this model on this machine: the search's quant and packed formats, the format the
    model's file stores, and why (the plan's "format" row)."""

    quant: str
    packed_formats: tuple[str, ...] = ()
    file_format: str | None = None
    why: str = ""


def gguf_packed_type(model: str) -> str | None:
    """The GGUF's main tensor type when it is one the runtime keeps packed (q8_0, q4_0, q4_1), else None."""
    main = (gguf_sizes(model).main_type or "").lower()
    return main if main in PACKED_FORMATS else None


def format_choice(model: str, quant: str, *, on_cpu: bool, runtime_packs: bool = True) -> FormatChoice:
    """--quant for this model on this machine. A GGUF runs as its file says: on a CPU its own Q8_0/Q4_0/Q4_1 type
    packed (unless the runtime's packing is off), else dequantized to a float format; int8/nf4 and another packed
    type are refused (the runtime does not re-quantize a GGUF). Other models run unpacked: a packed --quant is
    refused, and auto picks among 16-bit and fp32 (and int8/nf4 on a GPU) by predicted speed."""
    if not is_gguf(model):
        if quant in PACKED_FORMATS:
            raise InputError(f"--quant {quant}: the runtime keeps only a GGUF file's own Q8_0/Q4_0/Q4_1 tensors "
                             f"packed; {model} is not a GGUF (use auto, none, or int8/nf4 on a GPU)")
        why = ("auto: the fastest predicted of the 16-bit format and fp32 (bitsandbytes int8/nf4 are for GPUs; the "
               "runtime packs only GGUF files)" if on_cpu else
               "auto: the fastest predicted of 16 bits, int8 and nf4 (those two must win by 11% and 25%)")
        return FormatChoice(quant, why=why if quant == "auto" else f"--quant {quant}")
    if quant in ("int8", "nf4"):
        raise InputError(f"--quant {quant}: {model} is a GGUF, whose weights are already quantized; the runtime runs "
                         f"them as the file stores them (--quant auto)")
    own = gguf_packed_type(model)
    if quant in PACKED_FORMATS and not on_cpu:
        raise InputError(f"--quant {quant} is a CPU format (hivekeeper's native kernels); a GPU runs {model} "
                         f"dequantized (--quant auto)")
    if quant in PACKED_FORMATS and quant != own:
        raise InputError(f"--quant {quant}: {model} stores {own or 'no Q8_0/Q4_0/Q4_1'} weights, and the runtime "
                         f"does not re-quantize a GGUF (--quant auto)")
    if own is None or not on_cpu or quant == "none" or not runtime_packs:
        if own is None:
            why = "the GGUF's tensor types are not ones the CPU kernels keep packed: the runtime dequantizes them"
        elif not on_cpu:
            why = f"a GPU runs the GGUF's {own} weights dequantized to 16 bits (the packed kernels are the CPU's)"
        elif quant == "none":
            why = (f"--quant none: the GGUF's {own} weights dequantized to a float format, as `generate` runs this "
                   f"plan (auto keeps them packed)")
        else:
            why = f"HIVEKEEPER_GGUF_PACKED=0: the runtime dequantizes the GGUF's {own} weights"
        return FormatChoice("none", why=why)
    return FormatChoice(own, (own,), own, why=f"the GGUF's own {own} weights, kept packed in RAM and multiplied by the "
                                              f"CPU's {own} kernels, as `generate` runs them")


def plan_constraints(model: str, quant: str, hardware: HardwareSpec, goal: str, *, batch_size: int | None = None,
                     reserve_bytes: dict[str, float] | None = None,
                     runtime_packs: bool | None = None) -> tuple[Constraints, FormatChoice]:
    """The search's Constraints for --quant on this model and machine, and the format choice behind them (the plan's
    "format" row): the one way `hivekeeper plan`, the Plan page and the model library's fits plan a model. A serving
    goal sizes a GGUF's server span packed as the server loads it (Constraints.packed_span, serve_packed_span) and
    plans the local run beside it packed too, as `generate` runs it and a chat plan plans it (planned dequantized, a
    serve plan said "does not fit locally: needs 0.043 GB more memory" of a model whose chat plan ran here).
    runtime_packs: None reads packed_by_default(). InputError when --quant does not apply (format_choice)."""
    packs = packed_by_default() if runtime_packs is None else runtime_packs
    choice = format_choice(model, quant, on_cpu=not hardware.has_gpu, runtime_packs=packs)
    span = None
    if goal == "serve" and choice.quant in PACKED_FORMATS:
        span = serve_packed_span(model, hardware, "auto", packs)
        choice = FormatChoice(choice.quant, choice.packed_formats, choice.file_format,
                              why=f"serve: the server keeps the span's {choice.quant} weights packed as the file "
                                  f"stores them (sized by its bytes per block), as does a local run")
    constraints = Constraints(quant=choice.quant, batch_size=batch_size, reserve_bytes=dict(reserve_bytes or {}),
                              packed_formats=choice.packed_formats, file_format=choice.file_format, packed_span=span)
    return constraints, choice


def quant_options(model: str, hardware: HardwareSpec, runtime_packs: bool | None = None) -> tuple[str, ...]:
    """The --quant values that mean something for this model on this machine, in the order a menu lists them: auto;
    a GGUF's own Q8_0/Q4_0/Q4_1 on a CPU where the runtime packs it; none (16-bit or fp32, a GGUF dequantized);
    bitsandbytes int8 and nf4 for a checkpoint (not a GGUF) on a CUDA GPU (not Apple's unified memory)."""
    packs = packed_by_default() if runtime_packs is None else runtime_packs
    options = ["auto"]
    if is_gguf(model):
        own = gguf_packed_type(model)
        if own is not None and packs and not hardware.has_gpu:
            options.append(own)
        return (*options, "none")
    options.append("none")
    if any(not gpu.unified_memory for gpu in hardware.gpus):
        options += BITSANDBYTES_FORMATS
    return tuple(options)


def serve_packed_span(model: str, hardware: HardwareSpec, quant: str = "auto",
                      runtime_packs: bool | None = None) -> PackedSpan | None:
    """The span a server of `model` keeps packed on this machine, or None: a GGUF of Q8_0/Q4_0/Q4_1 blocks on a CPU
    without bitsandbytes (quant auto or none, as load_span packs it) where the runtime packs; its bytes per block are
    the file's (gguf_metadata.GGUFSizes.packed_block_bytes, the largest block)."""
    packs = packed_by_default() if runtime_packs is None else runtime_packs
    if hardware.has_gpu or not packs or quant not in ("auto", "none") or not is_gguf(model):
        return None
    sizes = gguf_sizes(model)
    own = (sizes.main_type or "").lower()
    if own not in PACKED_FORMATS or not sizes.packed_block_bytes:
        return None
    return PackedSpan(own, max(sizes.packed_block_bytes))


def plan_model_server(model: str, hardware: HardwareSpec, quant: str = "auto", *, cache_tokens: int | None = None,
                      efficiency: MachineEfficiency | None = None, runtime_packs: bool | None = None) -> ServerPlan:
    """swarm.plan_server for the model at `model` (a path or catalog id) as the server will load it: a GGUF's span
    packed in its own format on a CPU (serve_packed_span), else the format plan_server chooses. quant: auto, or
    serve's --quant (none, int8, nf4)."""
    packed = serve_packed_span(model, hardware, quant, runtime_packs)
    return plan_server(load_model_spec(model), hardware, quant, cache_tokens, efficiency=efficiency, packed=packed)
