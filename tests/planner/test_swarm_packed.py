"""Issue 16 item 4, the planning side: a swarm server's GGUF span is planned as the server loads it, packed.

The real default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) on a CPU: plan_model_server sizes its span in q4_1 by
the file's bytes per block (GGUFSizes.packed_block_bytes), so on a machine whose RAM holds the packed span but not
an fp32 one it recommends more blocks than the fp32 plan; its 1-token steps are timed at the slower of the packed
reads and the kernels' measured rate. Packing off, a GPU, or bitsandbytes plan as before; `plan --goal serve`
(policy.search with plan_constraints) sizes the server the same way.
"""

from __future__ import annotations

import dataclasses

import gguf
import pytest

from hivekeeper.core.runtime.default_model import default_model_file
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.format_choice import plan_constraints, plan_model_server, serve_packed_span
from hivekeeper.planner.formats import PACKED_BLOCK_BYTES, BLOCK_WEIGHTS
from hivekeeper.planner.gguf_metadata import gguf_sizes
from hivekeeper.planner.hardware_catalog import resolve_hardware
from hivekeeper.planner.model_catalog import load_model_spec
from hivekeeper.planner.policy import search
from hivekeeper.planner.swarm import PackedSpan, plan_server

from ..core.cli.test_models import write_gguf


@pytest.fixture(scope="module")
def model() -> str:
    return str(default_model_file())


def with_ram(hardware, memory_bytes: float, **cpu_fields):
    return dataclasses.replace(hardware, cpu=dataclasses.replace(hardware.cpu, memory_bytes=int(memory_bytes),
                                                                 **cpu_fields))


def machine_between(model: str):
    """cpu-generic with RAM for the whole packed span (and 5 MB more) beside the server's workspace and caches."""
    roomy = plan_model_server(model, resolve_hardware("cpu-generic"))
    assert roomy.num_blocks == roomy.total_blocks == 30
    need = roomy.workspace_bytes + 30 * (roomy.block_bytes + roomy.cache_bytes_per_block)
    return with_ram(resolve_hardware("cpu-generic"), need + 5e6)


def test_a_gguf_span_is_sized_by_the_files_packed_bytes_and_covers_more_blocks_than_fp32(model):
    hardware = machine_between(model)
    packed = plan_model_server(model, hardware)
    fp32 = plan_server(load_model_spec(model), hardware)
    sizes = gguf_sizes(model)
    assert packed.weight_format == "q4_1" and packed.packed and packed.span_words() == "30 blocks, q4_1 packed"
    assert packed.block_bytes == max(sizes.packed_block_bytes)  # the file's, not a formula's
    assert fp32.weight_format == "fp32" and fp32.block_bytes > 5 * packed.block_bytes
    assert fp32.num_blocks < packed.num_blocks == 30  # fp32 would under-count what fits
    assert packed.peak_memory_bytes <= packed.capacity_bytes
    # the file's bytes: Q4_1 linears at 20 bytes per 32 weights, norms in fp32 (4 bytes each)
    block_weights = sizes.block_weights[0]
    norms = 2 * 576
    assert packed.block_bytes == (block_weights - norms) * PACKED_BLOCK_BYTES["q4_1"] // BLOCK_WEIGHTS + 4 * norms


def test_the_packed_kernels_measured_rate_times_the_span(model):
    hardware = resolve_hardware("cpu-generic")
    fast = plan_model_server(model, with_ram(hardware, hardware.cpu.memory_bytes, packed_kernels={"q4_1": 1e12}))
    slow = plan_model_server(model, with_ram(hardware, hardware.cpu.memory_bytes, packed_kernels={"q4_1": 1e8}))
    fp32 = plan_server(load_model_spec(model), hardware)
    assert fast.inference_rps > fp32.inference_rps  # fewer bytes read per step
    assert fast.inference_bound != "cpu 4-bit kernel compute"
    assert slow.inference_bound == "cpu 4-bit kernel compute"
    # slow kernels: a step multiplies the block's 3.5 M weights at 1e8 weights/s (~35 ms)
    assert slow.inference_rps < 1 / 0.035 < fast.inference_rps
    assert slow.num_blocks == fast.num_blocks  # the kernels' speed does not change what fits


def test_packing_off_a_gpu_or_bitsandbytes_plan_the_span_unpacked(model):
    cpu = resolve_hardware("cpu-generic")
    assert serve_packed_span(model, cpu) == PackedSpan("q4_1", max(gguf_sizes(model).packed_block_bytes))
    assert plan_model_server(model, cpu, runtime_packs=False).weight_format == "fp32"  # HIVEKEEPER_GGUF_PACKED=0
    assert serve_packed_span(model, cpu, "nf4") is None
    assert serve_packed_span(model, resolve_hardware("rtx-3090")) is None
    assert plan_model_server(model, resolve_hardware("rtx-3090")).weight_format in ("fp16", "bf16")
    assert serve_packed_span("meta-llama/Llama-2-7b-hf", cpu) is None  # a catalog model has no file


def test_a_packed_span_needs_a_packed_format_bytes_and_a_cpu(model):
    with pytest.raises(InputError, match="packed span needs"):
        PackedSpan("fp32", 100)
    with pytest.raises(InputError, match="packed span needs"):
        PackedSpan("q4_0", 0)
    with pytest.raises(InputError, match="served on a CPU only"):
        plan_server(load_model_spec(model), resolve_hardware("rtx-3090"), packed=PackedSpan("q4_1", 10**6))


def test_plan_goal_serve_sizes_the_server_span_as_serve_does(model):
    hardware = machine_between(model)
    constraints, choice = plan_constraints(model, "auto", hardware, "serve", runtime_packs=True)
    plan = search(load_model_spec(model), hardware, "serve", constraints)
    assert plan.server == plan_model_server(model, hardware, runtime_packs=True)
    assert "30 of 30 blocks in q4_1 packed" in plan.reason and "packed" in choice.why
    assert constraints.quant == "q4_1"  # the local plan beside it packed too, as `generate` runs it


def test_a_q8_0_files_span_is_sized_by_its_own_bytes_and_an_f16_one_unpacked(tmp_path):
    q8 = str(write_gguf(tmp_path / "small-q8.gguf", gguf.GGMLQuantizationType.Q8_0))
    f16 = str(write_gguf(tmp_path / "small-f16.gguf", gguf.GGMLQuantizationType.F16))
    cpu = resolve_hardware("cpu-generic")
    spec = load_model_spec(q8)
    linears, norms = spec.block_params() - spec.norm_params(), spec.norm_params()
    span = serve_packed_span(q8, cpu, runtime_packs=True)
    assert span == PackedSpan("q8_0", linears * 34 // 32 + 4 * norms)  # Q8_0: 34 bytes per 32 weights
    assert plan_model_server(q8, cpu, runtime_packs=True).span_words() == "1 blocks, q8_0 packed"
    assert serve_packed_span(f16, cpu, runtime_packs=True) is None  # F16 is dequantized: fp32 bytes
    assert plan_model_server(f16, cpu, runtime_packs=True).block_bytes == 4 * spec.block_params()
