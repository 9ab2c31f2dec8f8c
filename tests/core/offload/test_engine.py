"""The offloading engine against plain all-resident generation, on real (tiny, sharded) demo checkpoints.

Every placement — all in RAM, part or all of the blocks streamed from disk at each prefetch depth, the KV cache in
RAM or in memory-mapped files, micro-batches — must produce the same greedy tokens (and logits) as the model run
with load_span / KVCache and nothing offloaded.
"""

from __future__ import annotations

import os

import pytest
import torch

from hivekeeper.core.runtime.checkpoint import load_embedding, load_head, load_span
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import (EnginePlan, block_bytes, cache_bytes_per_block, outside_bytes,
                                               place_model, workspace_bytes)
from hivekeeper.core.runtime.model import KVCache, ModelConfig
from hivekeeper.planner.costmodel import Placement, Policy
from hivekeeper.planner.errors import InputError

PROMPTS = [[1, 17, 42, 99, 7, 250], [1, 300, 5, 5, 81, 12], [1, 2, 3, 4, 5, 6]]
NEW_TOKENS = 8
MAX_LENGTH = 32


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest (and steadiest on a shared machine) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """6 blocks in shards of ~0.3 MB (a block is ~0.2 MB), so blocks are read from several files."""
    return make_demo_checkpoint(tmp_path_factory.mktemp("engine") / "sharded", layers=6, shard_size_mb=0.3, seed=3)


def policy(weights=(0, 1, 0), cache=(0, 1, 0), depth=1, micro=1, count=1) -> Policy:
    return Policy("fp32", Placement(*weights), Placement(*cache), Placement(0, 1, 0), micro_batch_size=micro,
                  num_micro_batches=count, prefetch_depth=depth)


@torch.inference_mode()
def reference_greedy(path, prompts, steps=NEW_TOKENS):
    """Plain generation: every block resident (load_span), one KVCache, argmax."""
    config = ModelConfig.from_folder(path)
    span, embedding, head = load_span(path, 0, config.num_layers), load_embedding(path), load_head(path)
    cache = KVCache.allocate(config, config.num_layers, len(prompts), MAX_LENGTH)
    logits = head(span(embedding(torch.tensor(prompts)), cache))[:, -1]
    tokens, all_logits = [], []
    for _ in range(steps):
        next_ids = logits.argmax(-1)
        tokens.append(next_ids)
        all_logits.append(logits)
        logits = head(span(embedding(next_ids[:, None]), cache))[:, -1]
    return torch.stack(tokens, 1), torch.stack(all_logits, 1)


@torch.inference_mode()
def engine_greedy(model: OffloadedModel, prompts, steps=NEW_TOKENS):
    cache = model.span.allocate_cache(len(prompts), MAX_LENGTH)
    logits = model.head(model.span(model.embedding(torch.tensor(prompts)), cache))[:, -1]
    tokens, all_logits = [], []
    for _ in range(steps):
        next_ids = logits.argmax(-1)
        tokens.append(next_ids)
        all_logits.append(logits)
        logits = model.head(model.span(model.embedding(next_ids[:, None]), cache))[:, -1]
    cache.close()
    return torch.stack(tokens, 1), torch.stack(all_logits, 1)


def run_engine(path, pol: Policy, prompts, **place_kwargs):
    config = ModelConfig.from_folder(path)
    plan = place_model(config, pol, device="cpu", dtype=torch.float32, batch=len(prompts), max_length=MAX_LENGTH,
                       **place_kwargs)
    model = OffloadedModel(path, plan)
    try:
        return plan, model, engine_greedy(model, prompts)
    finally:
        model.close()


PLACEMENTS = {
    "all-ram": policy(depth=0),
    "half-disk-depth1": policy(weights=(0, 0.5, 0.5), depth=1),
    "all-disk-depth0-cache-half-disk": policy(weights=(0, 0, 1), cache=(0, 0.5, 0.5), depth=0),
    "all-disk-depth2-cache-disk": policy(weights=(0, 0, 1), cache=(0, 0, 1), depth=2),
    "third-disk-micro-batches": policy(weights=(0, 0.67, 0.33), depth=1, micro=2, count=2),
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_engine_matches_plain_generation(sharded, name):
    prompts = PROMPTS if "micro" in name else PROMPTS[:1]
    ref_tokens, ref_logits = reference_greedy(sharded, prompts)
    plan, model, (tokens, logits) = run_engine(sharded, PLACEMENTS[name], prompts)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    disk = plan.weight_tiers.count("disk")
    if "disk" in name:
        assert disk > 0
        # every step reads each disk block once (+ at most one prefetch per slot into the next step)
        steps = NEW_TOKENS + 1
        one = block_bytes(model.config, torch.float32)
        slots = min(plan.prefetch_depth + 1, disk)
        assert steps * disk * one <= model.bytes_streamed <= (steps * disk + slots) * one
    else:
        assert disk == 0 and model.bytes_streamed == 0


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_engine_matches_plain_generation_other_families(tmp_path, family):
    path = make_demo_checkpoint(tmp_path / family, layers=3, family=family, seed=5)
    ref_tokens, ref_logits = reference_greedy(path, PROMPTS[:2])
    _, _, (tokens, logits) = run_engine(path, policy(weights=(0, 0.34, 0.66), cache=(0, 0, 1)), PROMPTS[:2])
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)


def test_a_ram_budget_puts_what_does_not_fit_on_disk_and_still_matches(sharded):
    config = ModelConfig.from_folder(sharded)
    one = block_bytes(config, torch.float32)
    fixed = outside_bytes(config, torch.float32) + config.num_layers * cache_bytes_per_block(config, 1, MAX_LENGTH,
                                                                                             torch.float32)
    fixed += workspace_bytes(config, 1, MAX_LENGTH, torch.float32)
    # room for the fixed part, two stream buffers and 2.5 blocks: 2 resident, 4 on disk
    budget = fixed + 2 * one + 2.5 * one
    ref_tokens, _ = reference_greedy(sharded, PROMPTS[:1])
    plan, _, (tokens, _) = run_engine(sharded, policy(depth=0), PROMPTS[:1], ram_budget_bytes=budget)
    assert plan.weight_tiers.count("cpu") == 2 and plan.weight_tiers.count("disk") == 4
    assert plan.prefetch_depth == 1  # the policy streamed nothing; streaming forced by the budget overlaps reads
    assert plan.ram_bytes <= budget
    assert torch.equal(tokens, ref_tokens)


def _config(layers=8) -> ModelConfig:
    return ModelConfig.from_hf_config({"model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
                                       "intermediate_size": 512, "num_hidden_layers": layers,
                                       "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "max_position_embeddings": 512})


def test_place_model_follows_the_policy_fractions_and_spreads_disk_blocks():
    config = _config(8)
    plan = place_model(config, policy(weights=(0, 0.5, 0.5), cache=(0, 0.75, 0.25), depth=2), device="cpu",
                       dtype=torch.float32, batch=2, max_length=64)
    assert plan.weight_tiers == ("cpu", "disk") * 4  # alternating: reads overlap resident blocks' compute
    assert plan.cache_tiers.count("cpu") == 6 and plan.cache_tiers.count("disk") == 2
    assert plan.streamed_blocks == (1, 3, 5, 7)
    assert plan.ram_breakdown["stream_buffers"] == 3 * block_bytes(config, torch.float32)
    assert plan.ram_breakdown["resident_blocks"] == 4 * block_bytes(config, torch.float32)
    # a GPU share on a machine without a GPU becomes RAM
    cpu_plan = place_model(config, policy(weights=(0.5, 0.5, 0), cache=(1, 0, 0)), device="cpu",
                           dtype=torch.float32, batch=1, max_length=64)
    assert set(cpu_plan.weight_tiers) == {"cpu"} and set(cpu_plan.cache_tiers) == {"cpu"}


def test_place_model_budget_errors_name_the_budget_and_what_is_needed():
    config = _config(8)
    with pytest.raises(InputError, match=r"RAM budget 0\.001 GB is too small.*needs at least"):
        place_model(config, policy(), device="cpu", dtype=torch.float32, batch=1, max_length=64,
                    ram_budget_bytes=1e6)


def test_prompt_past_the_cache_or_context_is_refused(sharded):
    config = ModelConfig.from_folder(sharded)
    plan = place_model(config, policy(), device="cpu", dtype=torch.float32, batch=1, max_length=8)
    model = OffloadedModel(sharded, plan)
    try:
        with torch.inference_mode():
            cache = model.span.allocate_cache(1, 8)
            with pytest.raises(InputError, match="exceed the KV cache's max_length 8"):
                model.span(model.embedding(torch.ones(1, 9, dtype=torch.long)), cache)
        with pytest.raises(InputError, match="max_position_embeddings 2048"):
            model.span.allocate_cache(1, 4096)
    finally:
        model.close()


def test_disk_kv_cache_leaves_no_files(sharded, tmp_path):
    config = ModelConfig.from_folder(sharded)
    plan = place_model(config, policy(cache=(0, 0, 1)), device="cpu", dtype=torch.float32, batch=1,
                       max_length=MAX_LENGTH)
    model = OffloadedModel(sharded, plan, cache_dir=tmp_path)
    try:
        with torch.inference_mode():
            cache = model.span.allocate_cache(1, MAX_LENGTH)
            model.span(model.embedding(torch.tensor(PROMPTS[:1])), cache)
            assert cache.length == len(PROMPTS[0])
            assert os.listdir(tmp_path) == []  # mapped, but already unlinked
            cache.close()
    finally:
        model.close()


def test_missing_or_truncated_shard_is_an_error_naming_the_file(sharded, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    shards = sorted(broken.glob("model-*.safetensors"))
    config = ModelConfig.from_folder(broken)
    plan = place_model(config, policy(weights=(0, 0, 1)), device="cpu", dtype=torch.float32, batch=1,
                       max_length=MAX_LENGTH)
    victim = shards[len(shards) // 2]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(InputError, match=victim.name):
        OffloadedModel(broken, plan)
    victim.unlink()
    with pytest.raises(InputError, match=f"{victim.name}.*missing"):
        OffloadedModel(broken, plan)


def test_engine_plan_summary_is_json_ready(sharded):
    import json

    plan = place_model(ModelConfig.from_folder(sharded), policy(weights=(0, 0.5, 0.5)), device="cpu",
                       dtype=torch.float32, batch=1, max_length=16, ram_budget_bytes=None)
    assert isinstance(plan, EnginePlan)
    summary = json.loads(json.dumps(plan.summary()))
    assert summary["blocks"] == {"cpu": 3, "disk": 3} and summary["dtype"] == "float32"
    assert "3 RAM, 3 disk" in plan.describe()
