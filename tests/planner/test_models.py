"""Model catalog and config.json parsing: parameter counts against published totals, hand-computed shapes, errors."""

from __future__ import annotations

import json

import pytest

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.model_catalog import get_model, load_model_spec, model_ids, spec_from_hf_config

# Published parameter totals. Exact integers are the counts the checkpoints' safetensors hold (shown on the hub) or
# the model card's figure; rounded ones are the model card's or paper's.
PUBLISHED_PARAMS = {
    "meta-llama/Llama-2-7b-hf": 6_738_415_616,
    "meta-llama/Llama-2-13b-hf": 13_015_864_320,
    "meta-llama/Llama-2-70b-hf": 68_976_648_192,
    "huggyllama/llama-7b": 6.7e9,  # LLaMA paper, table 2
    "huggyllama/llama-65b": 65.2e9,  # LLaMA paper, table 2
    "meta-llama/Meta-Llama-3.1-8B-Instruct": 8_030_261_248,
    "meta-llama/Meta-Llama-3.1-70B-Instruct": 70_553_706_496,
    "meta-llama/Meta-Llama-3.1-405B-Instruct": 405_853_388_800,
    "meta-llama/Llama-3.2-1B": 1.23e9,  # model card
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,
    "mistralai/Mixtral-8x7B-v0.1": 46_702_792_704,
    "Qwen/Qwen2.5-7B": 7.61e9,  # model card: 7.61B
    "Qwen/Qwen2.5-0.5B": 0.49e9,  # model card: 0.49B
    # Model card "180B"; transformers ties lm_head to the embedding (config has no tie_word_embeddings=false),
    # which gives 178.56B unique parameters (179.52B if the head were counted separately).
    "tiiuae/falcon-180B": 180e9,
    "bigscience/bloom": 176_247_271_424,  # BLOOM model card
    "facebook/opt-6.7b": 6_658_473_984,
    "facebook/opt-30b": 29_974_540_288,
    "facebook/opt-175b": 175e9,  # OPT paper
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": 1_100_048_384,
}


def test_catalog_holds_every_required_model():
    assert set(PUBLISHED_PARAMS) <= set(model_ids())


@pytest.mark.parametrize("model_id", sorted(PUBLISHED_PARAMS))
def test_total_params_within_one_percent_of_published(model_id):
    total = get_model(model_id).total_params()
    published = PUBLISHED_PARAMS[model_id]
    assert abs(total - published) / published < 0.01, f"{model_id}: {total:,} vs published {published:,.0f}"


@pytest.mark.parametrize("model_id", model_ids())
def test_every_catalog_model_parses_and_is_consistent(model_id):
    spec = get_model(model_id)
    assert spec.name == model_id
    assert spec.num_heads * spec.head_dim >= spec.hidden_size // 2
    assert spec.num_heads % spec.num_kv_heads == 0
    assert spec.total_params() == spec.num_layers * spec.block_params() + spec.outside_block_params()
    assert spec.active_block_params() <= spec.block_params()
    assert spec.torch_dtype in ("fp16", "bf16", "fp32")


def test_llama_2_7b_hand_computed():
    spec = get_model("meta-llama/Llama-2-7b-hf")
    h, i = 4096, 11008
    attention = 4 * h * h  # q, k, v, o: 32 heads of 128, no GQA, no biases
    mlp = 3 * h * i  # gate, up, down
    norms = 2 * h  # two RMSNorm weights
    assert spec.block_params() == attention + mlp + norms == 202_383_360
    # KV cache: K and V, 32 heads × 128 dims, fp16
    assert spec.kv_bytes_per_token_per_block(2) == 2 * 32 * 128 * 2 == 16384
    assert spec.outside_block_params() == 2 * 32000 * h + h  # embedding, untied head, final norm


def test_mixtral_hand_computed_total_and_active():
    spec = get_model("mistralai/Mixtral-8x7B-v0.1")
    h, i = 4096, 14336
    attention = h * h + 2 * h * 1024 + h * h  # 8 KV heads of 128
    expert = 3 * h * i
    router = h * 8
    norms = 2 * h
    assert spec.block_params() == attention + 8 * expert + router + norms
    assert spec.active_block_params() == attention + 2 * expert + router + norms
    assert spec.kv_bytes_per_token_per_block(2) == 2 * 8 * 128 * 2 == 4096
    # the published "12.9B active" of Mixtral: 32 active blocks plus embedding and head
    active_total = spec.num_layers * spec.active_block_params() + spec.outside_block_params()
    assert abs(active_total - 12.9e9) / 12.9e9 < 0.01


def test_bloom_hand_computed():
    spec = get_model("bigscience/bloom")
    h = 14336
    qkv = h * 3 * h + 3 * h  # fused query_key_value with bias
    dense = h * h + h
    mlp = h * 4 * h + 4 * h + 4 * h * h + h  # dense_h_to_4h, dense_4h_to_h, biases
    norms = 2 * 2 * h  # two LayerNorms, weight and bias
    assert spec.block_params() == qkv + dense + mlp + norms
    assert spec.kv_bytes_per_token_per_block(2) == 2 * h * 2
    # tied head; the embedding has its own LayerNorm, plus the final LayerNorm
    assert spec.outside_block_params() == 250880 * h + 2 * h + 2 * h


def test_llama_2_70b_block_matches_petals_note():
    """published.md: a Llama-2-70B block has ≈ 0.856 B params and 2 × 8 × 128 × 2 bytes of KV per token."""
    spec = get_model("meta-llama/Llama-2-70b-hf")
    assert abs(spec.block_params() - 0.856e9) / 0.856e9 < 0.001
    assert spec.kv_bytes_per_token_per_block(2) * 16384 == 64 * 2**20


def test_catalog_lookup_is_forgiving_but_exact():
    assert get_model("meta-llama/llama-2-7b-hf").name == "meta-llama/Llama-2-7b-hf"
    assert get_model("opt-6.7b").name == "facebook/opt-6.7b"
    with pytest.raises(InputError, match="unknown model 'gpt-5'"):
        get_model("gpt-5")


def _write_config(tmp_path, config, folder="my-model"):
    model_dir = tmp_path / folder
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


TINY_LLAMA_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
                     "max_position_embeddings": 256, "torch_dtype": "float32"}


def test_load_from_folder_and_file(tmp_path):
    model_dir = _write_config(tmp_path, TINY_LLAMA_CONFIG)
    from_dir = load_model_spec(str(model_dir))
    from_file = load_model_spec(str(model_dir / "config.json"))
    assert from_dir == from_file
    assert from_dir.name == "my-model"
    assert (from_dir.head_dim, from_dir.num_kv_heads, from_dir.torch_dtype) == (16, 2, "fp32")
    h, i = 64, 172
    assert from_dir.block_params() == h * h + 2 * h * 32 + h * h + 3 * h * i + 2 * h
    assert from_dir.total_params() == 2 * from_dir.block_params() + 2 * 1000 * h + h


def test_load_catalog_id_through_load_model_spec():
    assert load_model_spec("Qwen/Qwen2.5-7B") == get_model("Qwen/Qwen2.5-7B")


def test_llama_biases_and_explicit_head_dim(tmp_path):
    config = dict(TINY_LLAMA_CONFIG, attention_bias=True, mlp_bias=True, head_dim=32)
    spec = load_model_spec(str(_write_config(tmp_path, config)))
    h, i, q, kv = 64, 172, 4 * 32, 2 * 32
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv) + h
    mlp = 3 * h * i + 2 * i + h
    assert spec.block_params() == attention + mlp + 2 * h


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "mixtral"])
def test_biases_agree_with_transformers_and_the_runtime(model_type):
    """attention_bias and mlp_bias set in every config: transformers builds the biases each family has (Llama: all
    of them; Qwen2: q/k/v only; Mistral, Mixtral: none), and the planner's ModelSpec and the runtime's ModelConfig,
    both built by the one config.json reader, count and name the same tensors."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hivekeeper.core.runtime.checkpoint import block_tensor_names
    from hivekeeper.core.runtime.model import ModelConfig

    config = dict(TINY_LLAMA_CONFIG, model_type=model_type, attention_bias=True, mlp_bias=True)
    if model_type == "mixtral":
        config.update(num_local_experts=4, num_experts_per_tok=2)
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        layer = transformers.AutoModelForCausalLM.from_config(hf_config).model.layers[0]
    hf_biases = sorted(name for name, _ in layer.named_parameters() if name.endswith(".bias"))
    spec = spec_from_hf_config(config, model_type)
    assert spec.block_params() == sum(p.numel() for p in layer.parameters())
    assert bool(hf_biases) == (model_type in ("llama", "qwen2"))
    if model_type != "mixtral":  # the runtime runs llama, mistral and qwen2
        runtime = ModelConfig.from_hf_config(config)
        names = [name.removeprefix("model.layers.0.") for name in block_tensor_names(runtime, 0)]
        assert sorted(name for name in names if name.endswith(".bias")) == hf_biases
        assert runtime.block_param_count() == spec.block_params()
        assert (runtime.qkv_bias, runtime.o_bias, runtime.mlp_bias) == (spec.qkv_bias, spec.out_bias, spec.mlp_bias)


def test_falcon_7b_old_architecture(tmp_path):
    """Falcon-7B: multi-query attention (query_key_value 4544 -> 4672), one LayerNorm per parallel block."""
    config = {"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32,
              "multi_query": True, "parallel_attn": True, "new_decoder_architecture": False, "bias": False,
              "vocab_size": 65024, "alibi": False}
    spec = spec_from_hf_config(config, "falcon-7b")
    h = 4544
    assert spec.num_kv_heads == 1
    assert spec.block_params() == h * 4672 + h * h + 2 * h * 4 * h + 2 * h
    assert spec.total_params() == 32 * spec.block_params() + 65024 * h + 2 * h  # tied head, final LayerNorm


def test_falcon_new_architecture_has_two_norms_and_gqa():
    spec = get_model("tiiuae/falcon-180B")
    h = 14848
    assert (spec.num_kv_heads, spec.head_dim, spec.norms_per_block) == (8, 64, 2)
    assert spec.block_params() == h * h + 2 * h * 512 + h * h + 2 * h * 4 * h + 2 * 2 * h


def test_opt_350m_projection_and_no_final_norm():
    """OPT-350m projects 512-wide embeddings to 1024 and has no final LayerNorm: 331,196,416 params in transformers."""
    config = {"model_type": "opt", "hidden_size": 1024, "ffn_dim": 4096, "num_hidden_layers": 24,
              "num_attention_heads": 16, "vocab_size": 50272, "max_position_embeddings": 2048,
              "word_embed_proj_dim": 512, "do_layer_norm_before": False}
    assert spec_from_hf_config(config, "opt-350m").total_params() == 331_196_416


def test_unknown_model_type_names_file_and_field(tmp_path):
    model_dir = _write_config(tmp_path, dict(TINY_LLAMA_CONFIG, model_type="t5"))
    with pytest.raises(InputError) as info:
        load_model_spec(str(model_dir))
    assert str(model_dir / "config.json") in str(info.value)
    assert "'model_type'" in str(info.value) and "'t5'" in str(info.value)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"])
def test_missing_field_names_file_and_field(tmp_path, field):
    config = {k: v for k, v in TINY_LLAMA_CONFIG.items() if k != field}
    model_dir = _write_config(tmp_path, config)
    with pytest.raises(InputError) as info:
        load_model_spec(str(model_dir))
    assert str(model_dir / "config.json") in str(info.value)
    assert f"'{field}' is missing" in str(info.value)


@pytest.mark.parametrize("bad", [
    {"hidden_size": "4096"},  # a string
    {"hidden_size": -64},
    {"num_hidden_layers": 2.5},
    {"num_key_value_heads": 3},  # does not divide 4 heads
    {"tie_word_embeddings": "yes"},
    {"torch_dtype": "float8"},
])
def test_bad_values_are_refused(tmp_path, bad):
    model_dir = _write_config(tmp_path, dict(TINY_LLAMA_CONFIG, **bad))
    with pytest.raises(InputError) as info:
        load_model_spec(str(model_dir))
    assert f"'{next(iter(bad))}'" in str(info.value)


def test_mixtral_needs_experts(tmp_path):
    config = dict(TINY_LLAMA_CONFIG, model_type="mixtral")
    with pytest.raises(InputError, match="'num_local_experts' is missing"):
        load_model_spec(str(_write_config(tmp_path, config)))


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_model_spec(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no config.json"):
        load_model_spec(str(empty))
    with pytest.raises(InputError, match="no such file"):
        load_model_spec(str(tmp_path / "absent" / "config.json"))


def test_hub_id_found_in_local_cache(tmp_path, monkeypatch):
    """A model downloaded earlier is read from the HF cache layout, offline; refs/main picks the snapshot."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--someone--tiny-llama"
    for commit, layers in (("aaa", 3), ("bbb", 2)):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text(
            json.dumps(dict(TINY_LLAMA_CONFIG, num_hidden_layers=layers)))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb")
    spec = load_model_spec("someone/tiny-llama")
    assert (spec.name, spec.num_layers) == ("someone/tiny-llama", 2)
    with pytest.raises(InputError, match="unknown model 'someone/other'"):
        load_model_spec("someone/other")
