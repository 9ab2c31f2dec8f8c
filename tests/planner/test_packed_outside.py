"""Issue 22: a packed (GGUF) plan counts the embedding and LM head as the engine holds them: the matrices packed at
the head format's bytes (Q8_0, 34 bytes a block of 32), the final norm in fp32 (core/offload/packed_stream
.outside_held_bytes); a tied embedding is one matrix. Unpacked formats keep their vector bytes (fp32: 4, 16-bit: 2)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hivekeeper.planner.costmodel import format_traits, machine_view, model_numbers, outside_bytes
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.models import ModelSpec

SMOLLM2 = ModelSpec(name="smol", family="llama", num_layers=30, hidden_size=576, intermediate_size=1536,
                    num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                    max_position_embeddings=2048, torch_dtype="bf16")
CPU = ComputeDevice(kind="cpu", name="c", memory_bytes=8 * 10**9, memory_bandwidth=20e9, flops={"fp32": 1e11},
                    power_watts=65.0, cores=2)
MACHINE = machine_view(HardwareSpec(id="t", gpus=(), cpu=CPU, disk=DiskSpec(10**12, 1e9, 1e9),
                                    network=NetworkSpec(1e9, 1e9, 0.01)))


def outside(model: ModelSpec, fmt: str) -> float:
    return float(outside_bytes(model_numbers(model), [format_traits(MACHINE, fmt)], np.array([0]))[0])


@pytest.mark.parametrize("tied", [True, False])
def test_a_packed_plan_holds_the_head_and_embedding_packed(tied):
    model = dataclasses.replace(SMOLLM2, tie_word_embeddings=tied)
    matrix = 49152 * 576
    norm = 576 * 4
    packed = (1 if tied else 2) * matrix * 34 / 32 + norm
    for fmt in ("q4_1", "q4_0", "q8_0"):
        assert outside(model, fmt) == pytest.approx(packed)
    assert outside(model, "fp32") == pytest.approx(model.outside_block_params() * 4.0)
    assert outside(model, "bf16") == pytest.approx(model.outside_block_params() * 2.0)
    # SmolLM2's tied Q8_0 head: the 30.08 MB its GGUF stores (and the engine holds), not fp32's 113 MB
    if tied:
        assert 30.0e6 < packed < 30.2e6 and model.outside_block_params() * 4.0 > 113e6
