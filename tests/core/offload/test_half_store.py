"""A bf16 plan over an fp32 checkpoint streams its blocks from a bf16 copy written once (half_store): half the bytes
of the converting reader, the same tokens, and later runs reuse the copy; a damaged block file is rewritten."""

from __future__ import annotations

import pytest
import torch

from hivekeeper.core.offload.half_store import HALF_STORE_ENV, HalfStore
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import block_bytes, place_model
from hivekeeper.core.runtime.checkpoint import open_checkpoint
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.model import ModelConfig
from hivekeeper.planner.costmodel import Placement, Policy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 17, 42, 99, 7, 250], [1, 300, 5, 5, 81, 12]]
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_demo_checkpoint(tmp_path_factory.mktemp("half") / "m", layers=3, seed=5)


def run(checkpoint, monkeypatch, store_on: bool) -> tuple[list[list[int]], float, HalfStore | None]:
    """Every block streamed from disk in bf16: (tokens, bytes read from disk per block read, the half store)."""
    monkeypatch.setenv(HALF_STORE_ENV, "1" if store_on else "0")
    config = ModelConfig.from_folder(checkpoint)
    policy = Policy("bf16", Placement(0, 0, 1), Placement(0, 1, 0), Placement(0, 1, 0), prefetch_depth=1)
    plan = place_model(config, policy, device="cpu", dtype=torch.bfloat16, batch=len(PROMPTS), max_length=16)
    assert plan.streamed_blocks == (0, 1, 2)
    with OffloadedModel(checkpoint, plan) as model:
        result = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        reads = sum((model.half_store or model.reader).reads.values())
        return result.token_ids, model.bytes_streamed / reads, model.half_store


def test_a_bf16_plan_streams_half_the_bytes_from_its_copy_with_the_same_tokens(checkpoint, monkeypatch):
    config = ModelConfig.from_folder(checkpoint)
    converted, fp32_read, none = run(checkpoint, monkeypatch, store_on=False)
    assert none is None and fp32_read == block_bytes(config, torch.float32)  # the file's fp32 bytes, converted
    tokens, half_read, store = run(checkpoint, monkeypatch, store_on=True)
    assert tokens == converted
    assert store.built == [0, 1, 2]  # written by this first run
    assert half_read == block_bytes(config, torch.bfloat16) == fp32_read / 2
    again, _, reused = run(checkpoint, monkeypatch, store_on=True)
    assert again == converted and reused.built == []  # the copy is reused


def test_a_damaged_block_file_is_rewritten_when_the_store_opens(checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("HIVEKEEPER_DATA_DIR", str(tmp_path))
    source = open_checkpoint(checkpoint)
    try:
        store = HalfStore.open(source, torch.bfloat16, [0, 1])
        store.close()
        damaged = store.folder / "block-00001.safetensors"
        damaged.write_bytes(damaged.read_bytes()[:-10])
        store = HalfStore.open(source, torch.bfloat16, [0, 1, 2])
        store.close()
        assert store.built == [1, 2]
    finally:
        source.close()


def flip_a_byte_inside_a_tensor(path) -> None:
    """Damage a block file without changing its size or header: one byte in the middle of its tensor data."""
    from hivekeeper.core.runtime.safetensors_file import SafetensorsFile

    handle = SafetensorsFile(path)
    _, _, start, end = max(handle.entries.values(), key=lambda entry: entry[3] - entry[2])
    handle.close()
    data = bytearray(path.read_bytes())
    data[(start + end) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_block_failing_its_crc_is_read_from_the_checkpoint_and_rewritten(checkpoint, monkeypatch, tmp_path):
    """Same size, same header, one byte changed: never read silently. The run's tokens are the converting
    reader's, the file is written again, and the next run reads it without rebuilding."""
    monkeypatch.setenv("HIVEKEEPER_DATA_DIR", str(tmp_path))
    converted, _, _ = run(checkpoint, monkeypatch, store_on=False)
    _, _, store = run(checkpoint, monkeypatch, store_on=True)  # builds the store
    damaged = store.folder / "block-00001.safetensors"
    flip_a_byte_inside_a_tensor(damaged)
    tokens, _, store = run(checkpoint, monkeypatch, store_on=True)
    assert tokens == converted
    assert store.built == [] and store.rebuilt == [1]  # found when read, not when opened (size and header fine)
    again, _, store = run(checkpoint, monkeypatch, store_on=True)
    assert again == converted and store.rebuilt == [] and store.built == []


def test_stores_whose_checkpoint_is_gone_or_changed_are_removed(checkpoint, tmp_path, caplog):
    import logging
    import os
    import shutil

    root = tmp_path / "half-blocks"
    folders = {}
    for name in ("gone", "changed", "kept"):
        other = make_demo_checkpoint(tmp_path / name, layers=1, seed=3)
        source = open_checkpoint(other)
        try:
            store = HalfStore.open(source, torch.bfloat16, [0], root=root)
            store.close()
        finally:
            source.close()
        folders[name] = store.folder
    shutil.rmtree(tmp_path / "gone")  # deleted (or an evicted hub cache)
    weights = tmp_path / "changed" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # rewritten since
    source = open_checkpoint(checkpoint)
    try:
        with caplog.at_level(logging.WARNING):
            HalfStore.open(source, torch.bfloat16, [0], root=root).close()
    finally:
        source.close()
    assert not folders["gone"].exists() and not folders["changed"].exists()
    assert (folders["kept"] / "block-00000.safetensors").is_file()
    messages = [r.getMessage() for r in caplog.records if "removed the 16-bit block store" in r.getMessage()]
    assert any("is gone" in m for m in messages) and any("changed since the store was made" in m for m in messages)
