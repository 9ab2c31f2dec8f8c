"""int8 / nf4 blocks streamed from the quantized block store (core/runtime/quant/store.py), on CPU.

A plan that streams quantized blocks from disk, and one that holds them all in RAM (on a CPU, read from the store
too), must compute exactly what the blocks quantized in memory by `load_span` compute (same greedy tokens, same
logits: all use bitsandbytes' CPU quantization of the same weights); the store is written once and then only read;
a damaged store is detected and rebuilt; `hivekeeper generate` with an int8 plan file and a RAM budget smaller than
the model streams and gives the all-resident tokens. The CUDA path (pinned staging, copies
to the GPU) shares the buffers and the store but is not exercised here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from hivekeeper.core.runtime.checkpoint import load_embedding, load_head, load_span
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import place_model
from hivekeeper.core.runtime.model import KVCache, ModelConfig
from hivekeeper.core.runtime.quant.bnb import quantized_block_bytes, quantized_tensors
from hivekeeper.planner.costmodel import Placement, Policy
from hivekeeper.planner.errors import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread", "bnb")  # bnb: conftest.py, skips without it

PROMPT = [[1, 17, 42, 99, 7, 250]]
NEW_TOKENS = 5
MAX_LENGTH = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """4 blocks in two shards, so streamed blocks alternate with resident ones and come from both files."""
    return make_demo_checkpoint(tmp_path_factory.mktemp("qstream") / "m", layers=4, shard_size_mb=0.2, seed=5)


def plan_for(path, quant: str, weights, depth: int = 1):
    config = ModelConfig.from_folder(path)
    policy = Policy(quant, Placement(*weights), Placement(0, 1, 0), Placement(0, 1, 0), micro_batch_size=1,
                    prefetch_depth=depth)
    return place_model(config, policy, device="cpu", dtype=torch.float32, batch=1, max_length=MAX_LENGTH,
                       quant="none" if quant == "fp32" else quant)


@torch.inference_mode()
def greedy(model: OffloadedModel) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of every step (prefill's last position, then each decode step)."""
    cache = model.span.allocate_cache(1, MAX_LENGTH)
    logits = model.head(model.span(model.embedding(torch.tensor(PROMPT)), cache))[:, -1]
    tokens, steps = [], [logits]
    for _ in range(NEW_TOKENS):
        next_id = logits.argmax(-1)
        tokens.append(int(next_id))
        logits = model.head(model.span(model.embedding(next_id[:, None]), cache))[:, -1]
        steps.append(logits)
    return tokens, torch.cat(steps).float()


def run(path, plan, store_dir) -> tuple[list[int], torch.Tensor, OffloadedModel]:
    model = OffloadedModel(path, plan, quant_store_dir=store_dir)
    try:
        tokens, logits = greedy(model)
    finally:
        model.close()
    return tokens, logits, model


class InMemory:
    """The model with its blocks quantized in memory as they load (`load_span`, no store): the reference."""

    def __init__(self, path, quant: str):
        self.embedding, self.head = load_embedding(path), load_head(path)
        self.span = load_span(path, 0, ModelConfig.from_folder(path).num_layers, quant=quant)
        self.span.allocate_cache = lambda batch, max_length: KVCache.allocate(
            self.span.config, len(self.span.blocks), batch, max_length)


@pytest.fixture(scope="module")
def resident(checkpoint):
    """Greedy tokens and logits of the blocks quantized in memory: int8, nf4 and unquantized fp32."""
    return {quant: greedy(InMemory(checkpoint, "none" if quant == "fp32" else quant)) for quant in ("int8", "nf4",
                                                                                                  "fp32")}


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_resident_quantized_blocks_load_from_the_store_on_a_cpu(checkpoint, resident, quant, tmp_path):
    plan = plan_for(checkpoint, quant, (0, 1, 0))
    assert not plan.streamed_blocks
    tokens, logits, first = run(checkpoint, plan, tmp_path)
    assert first.quant_store.quantized == [0, 1, 2, 3]  # the first run quantizes every block once
    assert tokens == resident[quant][0]
    torch.testing.assert_close(logits, resident[quant][1], rtol=1e-5, atol=1e-5)
    tokens, logits, second = run(checkpoint, plan, tmp_path)
    assert second.quant_store.quantized == [] and second.quant_store.bytes_read > 0  # later runs only read
    assert tokens == resident[quant][0]
    torch.testing.assert_close(logits, resident[quant][1], rtol=1e-5, atol=1e-5)


def store_files(store_dir) -> dict[str, int]:
    """Every file of the store(s) under store_dir (name -> mtime_ns)."""
    return {str(p.relative_to(store_dir)): p.stat().st_mtime_ns for p in store_dir.rglob("*") if p.is_file()
            and p.name != ".lock"}


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_streamed_quantized_blocks_match_the_all_resident_plan(checkpoint, resident, quant, tmp_path, bnb):
    ref_tokens, ref_logits = resident[quant]
    # quantization is real: the quantized model's logits are not the fp32 model's
    assert (ref_logits - resident["fp32"][1]).abs().max().item() > 1e-3
    config = ModelConfig.from_folder(checkpoint)
    block_size = quantized_block_bytes(config, quant, torch.float32)
    for weights, depth in (((0, 0.5, 0.5), 1), ((0, 0, 1), 2)):
        plan = plan_for(checkpoint, quant, weights, depth)
        streamed = plan.streamed_blocks
        assert streamed and plan.quant == quant
        assert plan.ram_breakdown["stream_buffers"] == min(depth + 1, len(streamed)) * block_size
        model = OffloadedModel(checkpoint, plan, quant_store_dir=tmp_path)
        try:
            slot_block = model.streamer.free[0].block
            linears = [m for m in slot_block.modules() if isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))]
            assert len(linears) == 4
            assert {m.weight.dtype for m in linears} == {torch.int8 if quant == "int8" else torch.uint8}
            # the slot holds exactly the quantized size the plan counted
            assert sum(t.nbytes for t in quantized_tensors(slot_block).values()) == block_size
            tokens, logits = greedy(model)
            assert model.bytes_streamed > 0 and model.bytes_streamed % block_size == 0
        finally:
            model.close()
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    files = [name for name in store_files(tmp_path) if name.endswith(".safetensors")]
    assert len(files) == config.num_layers  # the half-disk run's blocks, then the others


def test_the_store_is_written_once_then_only_read(checkpoint, resident, tmp_path):
    plan = plan_for(checkpoint, "int8", (0, 0.5, 0.5))
    first_tokens, _, first = run(checkpoint, plan, tmp_path)
    assert plan.streamed_blocks and len(plan.streamed_blocks) < 4
    assert first.quant_store.quantized == [0, 1, 2, 3]  # streamed and (on a CPU) resident blocks alike
    written = store_files(tmp_path)
    assert sum(name.endswith(".safetensors") for name in written) == 4
    manifest = json.loads(next(tmp_path.rglob("manifest.json")).read_text())
    assert manifest["quant"] == "int8" and set(manifest["blocks"]) == {"0", "1", "2", "3"}

    tokens, _, second = run(checkpoint, plan, tmp_path)
    assert second.quant_store.quantized == []  # read, not quantized again
    assert store_files(tmp_path) == written  # nothing rewritten (same files, same mtimes)
    assert tokens == first_tokens == resident["int8"][0]


def test_a_damaged_block_file_is_rebuilt_when_the_store_opens(checkpoint, resident, tmp_path, caplog):
    plan = plan_for(checkpoint, "nf4", (0, 0, 1))
    run(checkpoint, plan, tmp_path)
    victim = sorted(tmp_path.rglob("block-00002.safetensors"))[0]
    with open(victim, "r+b") as handle:  # truncated (a crash outside our atomic writes, a full disk...)
        handle.truncate(victim.stat().st_size - 10)
    with caplog.at_level(logging.WARNING, logger="hivekeeper.core.runtime.quant.store"):
        tokens, logits, model = run(checkpoint, plan, tmp_path)
    assert model.quant_store.quantized == [2]
    assert any("block-00002.safetensors" in r.getMessage() and "re-quantizing block 2" in r.getMessage()
               for r in caplog.records)
    assert tokens == resident["nf4"][0]
    torch.testing.assert_close(logits, resident["nf4"][1], rtol=1e-5, atol=1e-5)


def flip_a_weight_byte(path) -> None:
    """Same size, valid header, one weight byte flipped: only the CRC can tell."""
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size - 100)
        byte = handle.read(1)
        handle.seek(size - 100)
        handle.write(bytes([byte[0] ^ 0x5A]))


def test_corrupted_bytes_are_caught_on_first_read_and_requantized_next_run(checkpoint, resident, tmp_path):
    plan = plan_for(checkpoint, "int8", (0, 0.5, 0.5))
    resident_layer, streamed_layer = plan.weight_tiers.index("cpu"), plan.streamed_blocks[0]
    run(checkpoint, plan, tmp_path)
    # a streamed block: the engine opens, the first step that reads it fails
    victim = sorted(tmp_path.rglob(f"block-{streamed_layer:05d}.safetensors"))[0]
    flip_a_weight_byte(victim)
    model = OffloadedModel(checkpoint, plan, quant_store_dir=tmp_path)
    try:
        assert model.quant_store.quantized == []  # size and header look fine
        with pytest.raises(InputError, match=rf"block-{streamed_layer:05d}\.safetensors: corrupt quantized block"):
            greedy(model)
    finally:
        model.close()
    assert not victim.exists()
    tokens, logits, again = run(checkpoint, plan, tmp_path)
    assert again.quant_store.quantized == [streamed_layer]
    assert tokens == resident["int8"][0]
    torch.testing.assert_close(logits, resident["int8"][1], rtol=1e-5, atol=1e-5)
    # a resident block is read while the engine loads: loading fails, naming the file, and the next run rebuilds it
    victim = sorted(tmp_path.rglob(f"block-{resident_layer:05d}.safetensors"))[0]
    flip_a_weight_byte(victim)
    with pytest.raises(InputError, match=rf"block-{resident_layer:05d}\.safetensors: corrupt quantized block"):
        OffloadedModel(checkpoint, plan, quant_store_dir=tmp_path)
    assert not victim.exists()
    tokens, _, again = run(checkpoint, plan, tmp_path)
    assert again.quant_store.quantized == [resident_layer] and tokens == resident["int8"][0]


def test_a_changed_checkpoint_or_a_garbled_manifest_rebuilds_the_store(tmp_path, caplog):
    path = make_demo_checkpoint(tmp_path / "m", layers=2, seed=1)
    plan = plan_for(path, "int8", (0, 0.5, 0.5))
    store = tmp_path / "store"
    first, _, model = run(path, plan, store)
    assert model.quant_store.quantized == [0, 1]
    manifest = next(store.rglob("manifest.json"))
    manifest.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="hivekeeper.core.runtime.quant.store"):
        tokens, _, model = run(path, plan, store)
    assert model.quant_store.quantized == [0, 1] and tokens == first
    assert any("corrupt quantized-store manifest" in r.getMessage() for r in caplog.records)

    weights = path / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # "re-downloaded"
    _, _, model = run(path, plan, store)
    assert model.quant_store.quantized == [0, 1]
    _, _, model = run(path, plan, store)
    assert model.quant_store.quantized == []


def test_generate_streams_int8_blocks_under_a_ram_budget(checkpoint, tmp_path, monkeypatch, capsys):
    from hivekeeper.core.cli.main import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # keeps `generate` from changing this process's thread count
    monkeypatch.setenv("HIVEKEEPER_DATA_DIR", str(tmp_path / "data"))
    plan_file = tmp_path / "int8.json"
    plan_file.write_text(json.dumps({"weight_format": "int8", "weights": {"gpu": 0, "cpu": 1, "disk": 0}}))
    common = ["generate", "--model", str(checkpoint), "--prompt", "The old mill", "--json",
              "--max-new-tokens", "6", "--ignore-eos", "--plan", str(plan_file)]

    def generate(*extra: str) -> dict:
        code = main(common + list(extra))
        out, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out)

    resident_run = generate()
    engine = resident_run["plan"]["engine"]
    assert engine["quant"] == "int8" and engine["blocks"] == {"cpu": 4} and resident_run["bytes_streamed"] == 0
    block = quantized_block_bytes(ModelConfig.from_folder(checkpoint), "int8", torch.float32)
    # half a block short of all four: 3 resident + 1 slot, or 2 + 2 slots, need as much; 1 + 2 slots fits
    budget_gb = (engine["ram_bytes"] - block // 2) / 1e9
    streamed_run = generate("--ram-budget-gb", f"{budget_gb:.9f}")
    engine = streamed_run["plan"]["engine"]
    assert engine["quant"] == "int8" and engine["blocks"] == {"cpu": 1, "disk": 3}
    assert engine["ram_bytes"] <= budget_gb * 1e9 and engine["ram_breakdown"]["stream_buffers"] == 2 * block
    assert streamed_run["bytes_streamed"] > 0
    assert streamed_run["text"] == resident_run["text"]  # greedy: the same tokens
    stored = sorted(p.name for p in (tmp_path / "data" / "quantized").glob("*-int8-float32/block-*"))
    assert stored == [f"block-{i:05d}.safetensors" for i in range(4)]  # the resident run stored every block


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_place_model_counts_quantized_blocks_and_streams_what_the_budget_leaves_out(quant):
    config = ModelConfig.from_hf_config({"model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
                                         "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "max_position_embeddings": 512})
    policy = Policy(quant, Placement(0, 1, 0), Placement(0, 1, 0), Placement(0, 1, 0), prefetch_depth=1)

    def place(budget=None):
        return place_model(config, policy, device="cpu", dtype=torch.float32, batch=1, max_length=64,
                           ram_budget_bytes=budget, quant=quant)

    block = quantized_block_bytes(config, quant, torch.float32)
    assert block < config.block_param_count() * (1.1 if quant == "int8" else 0.6)  # vs fp32's 4 bytes a weight
    everything = place()
    assert everything.ram_breakdown["resident_blocks"] == 8 * block and not everything.streamed_blocks
    squeezed = place(everything.ram_bytes - 3 * block)
    assert squeezed.weight_tiers.count("cpu") == 3 and squeezed.weight_tiers.count("disk") == 5
    assert squeezed.ram_breakdown["resident_blocks"] == 3 * block
    assert squeezed.ram_breakdown["stream_buffers"] == 2 * block and squeezed.ram_bytes <= everything.ram_bytes


def test_stores_of_checkpoints_that_are_gone_are_removed(tmp_path, caplog):
    kept, gone = (make_demo_checkpoint(tmp_path / name, layers=2, seed=3) for name in ("kept", "gone"))
    store = tmp_path / "store"
    plan = plan_for(kept, "int8", (0, 1, 0))
    run(kept, plan, store)
    run(gone, plan, store)
    assert len(list(store.glob("*/manifest.json"))) == 2
    (store / "not-a-store").mkdir()  # something else in the folder is left alone
    shutil.rmtree(gone)  # deleted (or an evicted hub cache)
    with caplog.at_level(logging.WARNING, logger="hivekeeper.core.runtime.quant.store"):
        _, _, model = run(kept, plan, store)
    assert model.quant_store.quantized == []  # its own store is still there
    assert [p.parent.name for p in store.glob("*/manifest.json")] == [model.quant_store.folder.name]
    assert (store / "not-a-store").is_dir()
    assert any("its checkpoint" in r.getMessage() and "is gone" in r.getMessage() for r in caplog.records)
