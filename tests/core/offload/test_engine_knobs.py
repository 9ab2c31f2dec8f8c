"""The engine honours every knob of a planner Policy: kv_cache_mode "recompute", attention_on_cpu and the
activations placement.

Recompute and the attention split run here for real and must match the KV-keeping path (greedy tokens, logits
within fp32 tolerance). The GPU-only parts (attention on the CPU while a GPU computes, hidden states in pinned RAM)
are the same functions with two devices: they are checked here with both devices "cpu", and the plan's decisions for
a GPU are checked as data. The last tests run `hivekeeper generate --plan FILE` with each knob.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hivekeeper.core.offload.block_variants import forward_recomputing_kv, forward_with_attention_at_cache
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import EnginePlan, cache_bytes_per_block, place_model, recompute_buffer_bytes
from hivekeeper.core.offload.tiered_cache import RecomputeCache, keep_between_blocks
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.model import Block, ModelConfig, RotaryTable
from hivekeeper.planner.costmodel import Placement, Policy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 17, 42, 99, 7, 250, 3], [1, 300, 5, 5, 81, 12, 9], [1, 2, 3, 4, 5, 6, 7]]
NEW_TOKENS = 8
MAX_LENGTH = 24


def knob_policy(weights=(0, 1, 0), cache=(0, 1, 0), activations=(0, 1, 0), micro=1, count=1, depth=1,
                recompute=False, cpu_attention=False, fmt="fp32") -> Policy:
    return Policy(fmt, Placement(*weights), Placement(*cache), Placement(*activations), micro_batch_size=micro,
                  num_micro_batches=count, prefetch_depth=depth, kv_recompute=recompute,
                  attention_on_cpu=cpu_attention)


def engine_tokens(path, policy: Policy, prompts, prefill_chunk=256):
    """Greedy tokens and every step's logits through the engine and the real generation loop."""
    config = ModelConfig.from_folder(path)
    plan = place_model(config, policy, device="cpu", dtype=torch.float32, batch=len(prompts), max_length=MAX_LENGTH)
    logits = []
    with OffloadedModel(path, plan) as model:
        head = model.head
        model.head = lambda hidden: _record(logits, head(hidden))
        result = generate(model, prompts, max_new_tokens=NEW_TOKENS, prefill_chunk=prefill_chunk, ignore_eos=True)
    return plan, result.token_ids, torch.stack([step[:, -1] for step in logits])


def _record(store: list, logits: torch.Tensor) -> torch.Tensor:
    store.append(logits.clone())
    return logits


@pytest.fixture(scope="module")
def mha_checkpoint(tmp_path_factory):
    """Multi-head attention (kv heads = heads), 3 blocks: where recompute pays off (K and V wider than a hidden
    state), sharded so streamed blocks come from several files."""
    return make_demo_checkpoint(tmp_path_factory.mktemp("knobs") / "mha", layers=3, heads=4, kv_heads=4, seed=7,
                                shard_size_mb=0.1)


# ---- kv_cache_mode "recompute" ------------------------------------------------------------------------------------
RECOMPUTE_CASES = {
    "cache-in-ram": dict(),
    "cache-on-disk-weights-streamed": dict(weights=(0, 0.34, 0.66), cache=(0, 0.34, 0.66), depth=2),
    "micro-batches": dict(micro=2, count=2),
}


@pytest.mark.parametrize("case", list(RECOMPUTE_CASES))
def test_recompute_gives_the_tokens_of_the_kv_keeping_path(mha_checkpoint, case):
    prompts = PROMPTS if "micro" in case else PROMPTS[:1]
    kwargs = RECOMPUTE_CASES[case]
    _, keep_tokens, keep_logits = engine_tokens(mha_checkpoint, knob_policy(**kwargs), prompts, prefill_chunk=4)
    plan, tokens, logits = engine_tokens(mha_checkpoint, knob_policy(recompute=True, **kwargs), prompts,
                                         prefill_chunk=4)  # a second prefill chunk recomputes a prefix too
    assert plan.kv_recompute and plan.summary()["kv_cache_mode"] == "recompute"
    assert tokens == keep_tokens
    torch.testing.assert_close(logits, keep_logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_recompute_and_cpu_attention_on_other_families(tmp_path, family):
    """Qwen2's q/k/v biases and Mistral's sliding window go through both variants."""
    path = make_demo_checkpoint(tmp_path / family, layers=2, family=family, seed=11)
    _, keep_tokens, keep_logits = engine_tokens(path, knob_policy(), PROMPTS[:2])
    for knobs in (dict(recompute=True, cache=(0, 0.5, 0.5)), dict(cpu_attention=True)):
        _, tokens, logits = engine_tokens(path, knob_policy(**knobs), PROMPTS[:2], prefill_chunk=3)
        assert tokens == keep_tokens
        torch.testing.assert_close(logits, keep_logits, rtol=0, atol=1e-4)


def test_recompute_cache_holds_block_inputs_and_the_plan_counts_its_real_size(mha_checkpoint, tmp_path):
    config = ModelConfig.from_folder(mha_checkpoint)
    batch = 2
    keep = place_model(config, knob_policy(cache=(0, 0.67, 0.33)), device="cpu", dtype=torch.float32,
                       batch=batch, max_length=MAX_LENGTH)
    plan = place_model(config, knob_policy(cache=(0, 0.67, 0.33), recompute=True), device="cpu",
                       dtype=torch.float32, batch=batch, max_length=MAX_LENGTH)
    assert plan.cache_tiers == keep.cache_tiers == ("cpu", "cpu", "disk")  # tiers follow kv_cache placement
    with OffloadedModel(mha_checkpoint, plan, cache_dir=tmp_path) as model:
        cache = model.span.allocate_cache(batch, MAX_LENGTH)
        assert isinstance(cache, RecomputeCache)
        in_ram = sum(t.nbytes for tier, block in zip(cache.tiers, cache.blocks) if tier == "cpu" for t in block)
        scratch = cache._keys.nbytes + cache._values.nbytes
        with torch.inference_mode():
            hidden = model.embedding(torch.tensor(PROMPTS[:batch]))
            model.span(hidden, cache)
            # block 0's stored input is the embedding output itself (the input norm is recomputed, not stored)
            torch.testing.assert_close(cache.blocks[0][0][:, : hidden.shape[1]], hidden, rtol=0, atol=0)
        cache.close()
    assert plan.ram_breakdown["kv_cache"] == in_ram == 2 * cache_bytes_per_block(config, batch, MAX_LENGTH,
                                                                                 torch.float32, recompute=True)
    assert scratch <= plan.ram_breakdown["recompute_buffers"] == recompute_buffer_bytes(config, batch, MAX_LENGTH,
                                                                                        torch.float32)
    # hidden 64 per token instead of K and V (2 x 64): half the keeping cache's RAM here
    assert 2 * plan.ram_breakdown["kv_cache"] == keep.ram_breakdown["kv_cache"]
    assert "recompute_buffers" not in keep.ram_breakdown
    # the total a RAM budget is checked against includes both (and the disk block's cache mapped in for its turn,
    # also half the size)
    assert 2 * plan.ram_breakdown["kv_cache_in_turn"] == keep.ram_breakdown["kv_cache_in_turn"] > 0
    assert plan.ram_bytes == keep.ram_bytes - (keep.ram_breakdown["kv_cache"] + keep.ram_breakdown["kv_cache_in_turn"]) \
        // 2 + plan.ram_breakdown["recompute_buffers"]


# ---- attention where the cache lives --------------------------------------------------------------------------------
CONFIGS = {
    "llama-gqa": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen2-bias": {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2},
    "mistral-window-4": {"model_type": "mistral", "num_attention_heads": 4, "num_key_value_heads": 4,
                         "sliding_window": 4},
}


def random_block(name: str, dtype=torch.float32) -> tuple[Block, ModelConfig]:
    config = ModelConfig.from_hf_config({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
                                         "num_hidden_layers": 1, "max_position_embeddings": 64, **CONFIGS[name]})
    torch.manual_seed(0)
    block = Block(config, 0, RotaryTable(config))
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    return block.to(dtype), config


def kv_buffers(config: ModelConfig, batch=2, length=16, dtype=torch.float32):
    shape = (batch, config.num_kv_heads, length, config.head_dim)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


# a prefill in two chunks, then decode steps (past the window of 4 for Mistral)
SCHEDULE = [(0, 5), (5, 3), (8, 1), (9, 1), (10, 1)]


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.inference_mode()
def test_attention_at_the_cache_equals_the_block_forward(name):
    block, config = random_block(name)
    k_ref, v_ref = kv_buffers(config)
    k_split, v_split = kv_buffers(config)
    torch.manual_seed(1)
    for position, t in SCHEDULE:
        hidden = torch.randn(2, t, config.hidden_size)
        rope = block.rotary.get(position, t, hidden.device, hidden.dtype)
        expected = block(hidden, k_ref, v_ref, position, rope)
        got = forward_with_attention_at_cache(block, hidden, k_split, v_split, position, rope)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        end = position + t
        torch.testing.assert_close(k_split[:, :, :end], k_ref[:, :, :end], rtol=0, atol=1e-6)
        torch.testing.assert_close(v_split[:, :, :end], v_ref[:, :, :end], rtol=0, atol=1e-6)


@torch.inference_mode()
def test_attention_at_the_cache_in_fp32_over_a_16_bit_cache():
    """What a GPU machine does with a bf16 cache in RAM on a CPU without 16-bit math: attention upcast to fp32."""
    block, config = random_block("llama-gqa", torch.bfloat16)
    k_ref, v_ref = kv_buffers(config, dtype=torch.bfloat16)
    k_split, v_split = kv_buffers(config, dtype=torch.bfloat16)
    torch.manual_seed(2)
    for position, t in SCHEDULE:
        hidden = torch.randn(2, t, config.hidden_size, dtype=torch.bfloat16)
        rope = block.rotary.get(position, t, hidden.device, hidden.dtype)
        expected = block(hidden, k_ref, v_ref, position, rope)
        got = forward_with_attention_at_cache(block, hidden, k_split, v_split, position, rope, torch.float32)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.02, atol=0.05)


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.inference_mode()
def test_recomputing_kv_from_block_inputs_equals_the_block_forward(name):
    block, config = random_block(name)
    k_ref, v_ref = kv_buffers(config)
    keys, values = kv_buffers(config)
    inputs = torch.zeros(2, 16, config.hidden_size)  # what RecomputeCache keeps for this block
    torch.manual_seed(3)
    for position, t in SCHEDULE:
        hidden = torch.randn(2, t, config.hidden_size)
        rope = block.rotary.get(position, t, hidden.device, hidden.dtype)
        expected = block(hidden, k_ref, v_ref, position, rope)
        keys.fill_(float("nan"))  # nothing may survive from the previous step: all of K, V is recomputed
        values.fill_(float("nan"))
        got = forward_recomputing_kv(block, hidden, inputs[:, :position], position, rope, keys, values)
        inputs[:, position : position + t] = hidden
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


class AttentionElsewhere(EnginePlan):
    """A CPU plan that takes the engine's GPU branch for attention_on_cpu (attention where the cache is, no
    scratch copy, no write-back), so that branch's wiring runs here with both devices "cpu"."""

    def attention_tier(self, layer: int) -> str:
        return "elsewhere"


def test_the_engines_attention_at_the_cache_branch_gives_the_same_tokens(mha_checkpoint):
    config = ModelConfig.from_folder(mha_checkpoint)
    _, keep_tokens, keep_logits = engine_tokens(mha_checkpoint, knob_policy(cache=(0, 0.67, 0.33)), PROMPTS,
                                                prefill_chunk=4)
    plan = place_model(config, knob_policy(cache=(0, 0.67, 0.33), micro=2, count=2), device="cpu",
                       dtype=torch.float32, batch=len(PROMPTS), max_length=MAX_LENGTH)
    forced = AttentionElsewhere(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)})
    logits = []
    with OffloadedModel(mha_checkpoint, forced) as model:
        head = model.head
        model.head = lambda hidden: _record(logits, head(hidden))
        result = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, prefill_chunk=4, ignore_eos=True)
    assert result.token_ids == keep_tokens
    torch.testing.assert_close(torch.stack([step[:, -1] for step in logits]), keep_logits, rtol=0, atol=1e-5)


def test_a_cpu_plan_with_attention_on_cpu_runs_and_says_it_changes_nothing(tiny_checkpoint):
    _, keep_tokens, keep_logits = engine_tokens(tiny_checkpoint, knob_policy(cache=(0, 0.5, 0.5)), PROMPTS[:1])
    plan, tokens, logits = engine_tokens(tiny_checkpoint, knob_policy(cache=(0, 0.5, 0.5), cpu_attention=True),
                                         PROMPTS[:1])
    assert tokens == keep_tokens
    torch.testing.assert_close(logits, keep_logits, rtol=0, atol=1e-5)
    summary = plan.summary()
    assert summary["attention"] == "cpu (no GPU)" and summary["activations"] == "cpu (no GPU)"
    assert any("attention_on_cpu has no effect without a GPU" in note for note in summary["knob_notes"])
    assert "attention_on_cpu has no effect" in plan.describe()


def test_activations_between_blocks_go_where_they_are_told(tiny_checkpoint):
    x = torch.randn(2, 3, 8)
    assert keep_between_blocks(x, torch.device("cpu")) is x  # already home: no copy
    # a CPU plan that asks for hidden states on the GPU runs as before and says the knob has no effect
    _, keep_tokens, _ = engine_tokens(tiny_checkpoint, knob_policy(), PROMPTS)
    plan, tokens, _ = engine_tokens(tiny_checkpoint, knob_policy(activations=(1, 0, 0), micro=2, count=2), PROMPTS)
    assert tokens == keep_tokens
    assert plan.activation_tiers(2) == ["cpu", "cpu"]
    assert any("activations on 'gpu' have no effect" in note for note in plan.knob_notes())


# ---- the plan's decisions for a GPU (data only: no CUDA here) ------------------------------------------------------
def _gpu_plan(**knobs):
    config = ModelConfig.from_hf_config({"model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
                                         "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                                         "num_key_value_heads": 4, "max_position_embeddings": 512})
    return config, place_model(config, knob_policy(fmt="fp16", **knobs), device="cuda", dtype=torch.float16,
                               batch=4, max_length=128, prefill_tokens=64)


def test_gpu_plan_runs_attention_next_to_an_off_gpu_cache():
    _, plan = _gpu_plan(weights=(1, 0, 0), cache=(0.5, 0.25, 0.25), cpu_attention=True)
    assert plan.cache_tiers == ("gpu", "gpu", "cpu", "disk")
    assert [plan.attention_tier(i) for i in range(4)] == ["gpu", "gpu", "cpu", "cpu"]
    assert plan.summary()["attention"] == "cpu for 2 blocks (cache off the GPU), gpu for 2"
    _, plain = _gpu_plan(weights=(1, 0, 0), cache=(0.5, 0.25, 0.25))
    assert [plain.attention_tier(i) for i in range(4)] == ["gpu"] * 4 and plain.summary()["attention"] == "gpu"
    _, useless = _gpu_plan(weights=(1, 0, 0), cache=(1, 0, 0), cpu_attention=True)
    assert useless.knob_notes() == ["attention_on_cpu has no effect: the whole KV cache is on the GPU"]


def test_gpu_plan_keeps_the_policys_share_of_activations_in_pinned_ram():
    config, plan = _gpu_plan(activations=(0.5, 0.5, 0), micro=1, count=4)
    assert plan.activation_tiers(4) == ["gpu", "gpu", "cpu", "cpu"]
    assert plan.summary()["activations"] == "cpu (pinned RAM) for 2 of 4 micro-batches, gpu for the rest"
    # in and out of a block, for the 2 of 4 sequences kept in RAM, over a 64-token prefill chunk, fp16
    assert plan.ram_breakdown["pinned_activations"] == 2 * 2 * 64 * config.hidden_size * 2
    _, on_gpu = _gpu_plan(activations=(1, 0, 0), micro=1, count=4)
    assert on_gpu.activation_tiers(4) == ["gpu"] * 4 and on_gpu.ram_breakdown["pinned_activations"] == 0
    _, all_ram = _gpu_plan(activations=(0, 1, 0))
    assert all_ram.activation_tiers(1) == ["cpu"] and all_ram.summary()["activations"] == "cpu (pinned RAM)"


def test_gpu_plan_counts_a_recompute_cache_in_ram_by_hidden_states():
    config, plan = _gpu_plan(weights=(1, 0, 0), cache=(0.5, 0.5, 0), recompute=True)
    assert plan.ram_breakdown["kv_cache"] == 2 * 4 * 128 * config.hidden_size * 2
    assert "recompute_buffers" not in plan.ram_breakdown  # the K/V scratch is on the GPU
    assert "K/V recomputed" in plan.describe()


# ---- the real command ------------------------------------------------------------------------------------------------
@pytest.fixture
def in_process(monkeypatch, capsys):
    from hivekeeper.core.cli.main import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_generate_with_each_knob_in_a_plan_file(mha_checkpoint, tmp_path, in_process):
    common = ["generate", "--model", str(mha_checkpoint), "--prompt", "The old mill stood by the river", "--json",
              "--max-new-tokens", "6", "--ignore-eos"]
    base = {"weight_format": "fp32", "weights": {"gpu": 0, "cpu": 0.67, "disk": 0.33},
            "kv_cache": {"gpu": 0, "cpu": 0.67, "disk": 0.33}, "prefetch_depth": 1}
    variants = {"keep": {}, "recompute": {"kv_cache_mode": "recompute"}, "cpu-attention": {"attention_on_cpu": True},
                "activations-gpu": {"activations": {"gpu": 1, "cpu": 0, "disk": 0}}}
    reports = {}
    for name, extra in variants.items():
        plan_file = tmp_path / f"{name}.json"
        plan_file.write_text(json.dumps({"policy": {**base, **extra}}))
        code, out, err = in_process(*common, "--plan", str(plan_file))
        assert code == 0, err
        reports[name] = json.loads(out)
    texts = {name: report["text"] for name, report in reports.items()}
    assert len(set(texts.values())) == 1, texts
    engines = {name: report["plan"]["engine"] for name, report in reports.items()}
    assert engines["keep"]["kv_cache_mode"] == "keep" and engines["recompute"]["kv_cache_mode"] == "recompute"
    assert engines["recompute"]["ram_breakdown"]["kv_cache"] < engines["keep"]["ram_breakdown"]["kv_cache"]
    assert reports["recompute"]["plan"]["policy"]["kv_cache_mode"] == "recompute"
    assert engines["cpu-attention"]["attention"] == "cpu (no GPU)" and engines["cpu-attention"]["knob_notes"]
    assert engines["activations-gpu"]["activations"] == "cpu (no GPU)" and engines["activations-gpu"]["knob_notes"]
    assert engines["keep"]["knob_notes"] == []


def test_generate_text_output_names_the_knobs(mha_checkpoint, tmp_path, in_process):
    plan_file = tmp_path / "recompute.json"
    plan_file.write_text(json.dumps({"weight_format": "fp32", "kv_cache_mode": "recompute",
                                     "attention_on_cpu": False}))
    code, out, err = in_process("generate", "--model", str(mha_checkpoint), "--prompt", "hello", "--plan",
                                str(plan_file), "--max-new-tokens", "3")
    assert code == 0, err
    assert "K/V recomputed" in out
    bad = tmp_path / "both.json"
    bad.write_text(json.dumps({"kv_cache_mode": "recompute", "attention_on_cpu": True}))
    code, _, err = in_process("generate", "--model", str(mha_checkpoint), "--prompt", "hello", "--plan", str(bad))
    assert code == 2 and "cannot be combined" in err and "Traceback" not in err
