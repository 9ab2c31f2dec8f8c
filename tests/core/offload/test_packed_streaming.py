"""Issue 22 item 1 / issue 16 item 4: a GGUF's blocks streamed from disk stay packed. On the real default model
(SmolLM2-135M-Instruct, Q4_1/Q8_0 GGUF) with every block on disk, the engine's slots hold the file's block bytes
(QuantizedLinear, about the packed size of a block, not fp32), each step reads each block's packed bytes once (the
bytes per token are the packed model's, a fraction of what an fp32 slot is filled with), and the greedy tokens equal
the resident packed run's."""

from __future__ import annotations

import pytest
import torch

from hivekeeper.planner.costmodel import Placement, Policy
from hivekeeper.planner.gguf_metadata import gguf_sizes

from hivekeeper.core.offload.local_plan import fallback_policy
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.packed_stream import PackedBlockReader, packed_slot_bytes
from hivekeeper.core.offload.placement import block_bytes, place_model
from hivekeeper.core.runtime.default_model import INSTALL_HINT, default_model_file
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.gguf import PACKED_ENV, GGUFCheckpoint, load_packed_block
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear
from hivekeeper.core.runtime.model import RotaryTable

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(default_model_file() is None,
                                 reason=f"the default model is not installed ({INSTALL_HINT})")]

PROMPT = "The three primary colors are"
NEW_TOKENS = 6
MAX_LENGTH = 32


def run(path, policy, new_tokens: int = NEW_TOKENS):
    """(greedy token ids, bytes streamed, the slots' blocks, the engine's packed reader) of one engine run."""
    checkpoint = GGUFCheckpoint(path)
    prompt = checkpoint.tokenizer().encode(PROMPT)
    plan = place_model(checkpoint.config, policy, device="cpu", dtype=torch.float32, batch=1, max_length=MAX_LENGTH)
    with OffloadedModel(path, plan) as model:
        result = generate(model, prompt, max_new_tokens=new_tokens, ignore_eos=True)
        slots = []
        if model.streamer is not None:  # the slots: free, or loading the next step's first blocks
            for _, slot, future in model.streamer.pending:
                future.result()
                slots.append(slot.block)
            slots += [slot.block for slot in model.streamer.free]
        return result.token_ids[0], model.bytes_streamed, slots, model.packed_reader, plan


def on_disk(depth: int) -> Policy:
    return Policy("fp32", Placement(0, 0, 1), Placement(0, 1, 0), Placement(0, 1, 0), prefetch_depth=depth)


def test_streamed_blocks_stay_packed_read_packed_bytes_and_decode_like_resident(monkeypatch):
    monkeypatch.setenv(PACKED_ENV, "1")
    path = default_model_file()
    checkpoint = GGUFCheckpoint(path)
    config, layers = checkpoint.config, checkpoint.config.num_layers
    packed_blocks = gguf_sizes(path).packed_block_bytes  # the one count of a packed block's bytes
    packed_model = sum(packed_blocks)

    resident, _, _, _, _ = run(path, fallback_policy("fp32", 1))
    tokens, streamed, slots, reader, plan = run(path, on_disk(1))
    assert plan.weight_tiers == ("disk",) * layers and len(slots) == 2
    assert tokens == resident
    # the slots are packed blocks: the file's bytes, about a block's packed size, a fraction of an fp32 block
    largest = max(packed_blocks)
    for block in slots:
        assert sum(isinstance(m, QuantizedLinear) for m in block.modules()) == 4
        assert packed_slot_bytes(block) <= 1.01 * largest < block_bytes(config, torch.float32) / 3
    assert reader.rebuilt == 0  # every SmolLM2 block is Q4_1: each read goes into the slot in place
    # each step reads every block's packed bytes once (the prefetch may read the first blocks once more)
    reads = [reader.reads[layer] for layer in range(layers)]
    assert all(NEW_TOKENS <= n <= NEW_TOKENS + 1 for n in reads), reads
    assert streamed == sum(n * reader.stored_bytes(layer) for layer, n in enumerate(reads))
    per_token = streamed / NEW_TOKENS
    assert packed_model <= per_token <= packed_model * (1 + 2 / NEW_TOKENS)
    assert per_token < layers * block_bytes(config, torch.float32) / 3  # what fp32 slots are filled with per token


def state(block) -> dict:
    return {name: tensor.clone() for name, tensor in {**dict(block.named_parameters()),
                                                      **dict(block.named_buffers())}.items()}


def test_a_fill_in_place_equals_a_block_loaded_for_the_layer_and_a_slot_that_does_not_fit_is_rebuilt():
    """The reader's positioned reads (Q/K rows unpermuted) put exactly load_packed_block's bytes into a slot made
    for another layer; a slot whose linear is in another format gets a block built for the layer instead."""
    checkpoint = GGUFCheckpoint(default_model_file())
    reader = PackedBlockReader(checkpoint, RotaryTable(checkpoint.config))
    try:
        slot = reader.empty_block(0)
        filled, read = reader.fill(slot, 7)
        assert filled is slot and read == reader.stored_bytes(7) and filled.layer_index == 7
        expected = state(load_packed_block(checkpoint, 7))
        got = state(filled)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[name], expected[name]) for name in expected)

        odd = reader.empty_block(0)  # its MLP down projection re-packed as Q8_0: the file's layers are Q4_1
        down = odd.mlp.down_proj
        odd.mlp.down_proj = QuantizedLinear.from_linear(
            torch.nn.Linear(down.in_features, down.out_features, bias=False), "q8_0")
        rebuilt, _ = reader.fill(odd, 7)
        assert rebuilt is not odd and reader.rebuilt == 1
        assert all(torch.equal(tensor, expected[name]) for name, tensor in state(rebuilt).items())
    finally:
        reader.close()
