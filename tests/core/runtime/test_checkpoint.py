"""Loading block ranges from real HF checkpoints (single file and sharded), and every kind of bad input."""

from __future__ import annotations

import json
import shutil

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from hivekeeper.core.runtime.checkpoint import (Checkpoint, block_tensor_names, load_config, load_embedding, load_head,
                                        load_span, resolve_checkpoint)
from hivekeeper.core.runtime.model import KVCache
from hivekeeper.planner.errors import InputError

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


LAYERS = 6
TOL = 1e-5


def save_reference(path, **save_kwargs):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.1)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return model


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A checkpoint split into many small shards (about one per layer), and its reference layer outputs."""
    path = tmp_path_factory.mktemp("sharded")
    model = save_reference(path, max_shard_size="100KB")
    token_ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        hidden = model(token_ids, output_hidden_states=True).hidden_states
    return path, hidden


def shards_of(path, layers) -> set[str]:
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    return {file for name, file in weight_map.items() if any(name.startswith(f"model.layers.{i}.") for i in layers)}


def test_a_range_loads_from_its_shards_alone(sharded, tmp_path):
    source, hidden = sharded
    path = tmp_path / "copy"
    shutil.copytree(source, path)
    needed = shards_of(path, [2, 3])
    all_shards = {p.name for p in path.glob("model-*.safetensors")}
    unneeded = sorted(all_shards - needed)
    assert len(all_shards) >= 4 and len(unneeded) >= 2
    (path / unneeded[0]).unlink()  # deleted
    (path / unneeded[1]).write_bytes(b"\x00garbage" * 10)  # corrupted
    span = load_span(path, 2, 4)
    with torch.inference_mode():
        out = span(hidden[2])
    assert (out - hidden[4]).abs().max().item() <= TOL
    # a range that needs the deleted shard names it
    victim = unneeded[0]
    layer = next(i for i in range(LAYERS) if victim in shards_of(path, [i]))
    with pytest.raises(InputError, match=victim):
        load_span(path, layer, layer + 1)


def test_truncated_needed_shard_is_named(sharded, tmp_path):
    source, _ = sharded
    path = tmp_path / "copy"
    shutil.copytree(source, path)
    shard = sorted(shards_of(path, [1]))[0]
    data = (path / shard).read_bytes()
    (path / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=f"{shard}.*(corrupt|truncated)"):
        load_span(path, 1, 2)
    load_span(path, 4, 5)  # other shards are untouched


def test_single_file_checkpoint_every_piece(tmp_path):
    model = save_reference(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / "model.safetensors.index.json").exists()
    token_ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        reference = model(token_ids, output_hidden_states=True)
    config = load_config(tmp_path)
    assert (config.family, config.num_layers, config.num_kv_heads, config.head_dim) == ("llama", LAYERS, 2, 16)
    embedding = load_embedding(tmp_path)
    head = load_head(tmp_path)
    spans = [load_span(tmp_path, 0, 2), load_span(tmp_path, 2, 5), load_span(tmp_path, 5, 6)]  # a chain of nodes
    caches = [KVCache.allocate(config, len(s.blocks), batch=2, max_length=8) for s in spans]
    with torch.inference_mode():
        hidden = embedding(token_ids)
        assert (hidden - reference.hidden_states[0]).abs().max().item() <= TOL
        for span, cache in zip(spans, caches):
            hidden = span(hidden, cache)
        logits = head(hidden)
    assert (logits - reference.logits).abs().max().item() <= TOL
    assert not any(p.requires_grad for s in spans for p in s.parameters())


def test_span_reads_only_its_share_of_memory(tmp_path):
    """A 1-block span of a ~170 MB single-file checkpoint adds far less than the file to this process's RSS."""
    hidden, inter, layers = 512, 1536, 12
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": 8, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
              **{f"self_attn.{p}_proj.weight": (hidden, hidden) for p in "qkvo"},
              "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
              "mlp.down_proj.weight": (hidden, inter)}
    tensors = {f"model.layers.{i}.{n}": torch.ones(s) for i in range(layers) for n, s in shapes.items()}
    tensors.update({"model.embed_tokens.weight": torch.ones(256, hidden), "model.norm.weight": torch.ones(hidden),
                    "lm_head.weight": torch.ones(256, hidden)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    file_bytes = (tmp_path / "model.safetensors").stat().st_size
    block_bytes = sum(t.nbytes for n, t in tensors.items() if n.startswith("model.layers.0."))
    del tensors
    load_span(tmp_path, 0, 1)  # warm up allocator and lazy imports
    before = psutil.Process().memory_info().rss
    span = load_span(tmp_path, 7, 8)
    grown = psutil.Process().memory_info().rss - before
    assert sum(p.nbytes for p in span.parameters()) == block_bytes
    assert file_bytes > 12 * block_bytes
    assert grown < 4 * block_bytes, f"RSS grew by {grown / 2**20:.0f} MiB for a {block_bytes / 2**20:.0f} MiB block"


def test_missing_tensor_is_named(tmp_path):
    save_reference(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match="model.layers.1.mlp.up_proj.weight"):
        load_span(tmp_path, 0, 2)
    load_span(tmp_path, 2, 3)


def test_wrong_tensor_shape_is_named(tmp_path):
    save_reference(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="mlp.gate_proj.weight.*shape"):
        load_span(tmp_path, 0, 1)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(model_type="gpt2"), "'gpt2' is not supported; supported: llama, mistral, qwen2"),
    (lambda c: c.pop("num_hidden_layers"), "field 'num_hidden_layers' is missing"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda c: c.update(num_attention_heads="four"), "num_attention_heads"),
])
def test_bad_config_is_named(tmp_path, edit, message):
    save_reference(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="config.json") as info:
        load_span(tmp_path, 0, 1)
    assert message in str(info.value)


def test_other_bad_folders(tmp_path):
    with pytest.raises(InputError, match="config.json"):
        load_span(tmp_path, 0, 1)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_config(tmp_path)
    save_reference(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(InputError, match="only safetensors"):
        load_span(tmp_path, 0, 1)
    (tmp_path / "pytorch_model.bin").rename(tmp_path / "model.safetensors")
    with pytest.raises(InputError, match=r"\[3, 9\)"):
        load_span(tmp_path, 3, 9)


def test_block_names_follow_hf():
    config = load_config_dict({"model_type": "qwen2"})
    names = block_tensor_names(config, 3)
    assert "model.layers.3.self_attn.q_proj.bias" in names and "model.layers.3.mlp.down_proj.weight" in names
    assert len(names) == 12


def load_config_dict(overrides):
    from hivekeeper.core.runtime.model import ModelConfig

    base = dict(model_type="llama", vocab_size=10, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4)
    return ModelConfig.from_hf_config({**base, **overrides})


def test_resolve_local_folder_and_bad_paths(tmp_path):
    save_reference(tmp_path / "model")
    assert resolve_checkpoint(str(tmp_path / "model"), blocks=(0, 2)) == tmp_path / "model"
    assert Checkpoint(resolve_checkpoint(str(tmp_path / "model"))).config.num_layers == LAYERS
    with pytest.raises(InputError, match="no such checkpoint folder"):
        resolve_checkpoint(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json"):
        resolve_checkpoint(str(tmp_path / "empty"))


def test_resolve_hub_id_offline_says_what_to_do(tmp_path):
    import huggingface_hub.constants

    if not huggingface_hub.constants.HF_HUB_OFFLINE:  # never touch the network from tests
        pytest.skip("HF_HUB_OFFLINE is not set")
    with pytest.raises(InputError) as info:
        resolve_checkpoint("some-org/Some-Model-7B", blocks=(0, 4), cache_dir=tmp_path)
    message = str(info.value)
    assert "'some-org/Some-Model-7B'" in message and "hivekeeper demo-model" in message
    assert "network access" in message
    assert not any(tmp_path.rglob("*.safetensors"))


def test_bad_dtype_device_and_cache_are_named(tmp_path):
    save_reference(tmp_path)
    with pytest.raises(InputError, match="fp64"):
        load_span(tmp_path, 0, 1, dtype="fp64")
    with pytest.raises(InputError, match="non-empty"):
        load_span(tmp_path, 2, 2)
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA is not available"):
            load_span(tmp_path, 0, 1, device="cuda")
    span = load_span(tmp_path, 0, 1)
    cache = KVCache.allocate(span.config, 1, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="bfloat16"), torch.inference_mode():
        span(torch.randn(1, 2, 64), cache)


def test_resolve_hub_id_from_the_offline_cache_fetches_only_needed_shards(sharded, tmp_path):
    """A hub id whose files sit in the HF cache resolves offline; a block range needs only its shards."""
    import huggingface_hub.constants

    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        pytest.skip("HF_HUB_OFFLINE is not set")
    source, hidden = sharded
    repo = tmp_path / "models--some-org--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    needed = shards_of(source, [2, 3])
    for name in ["config.json", "model.safetensors.index.json", *needed]:
        shutil.copy(source / name, snapshot / name)
    folder = resolve_checkpoint("some-org/tiny-llama", blocks=(2, 4), cache_dir=tmp_path)
    assert folder == snapshot
    with torch.inference_mode():
        assert (load_span(folder, 2, 4)(hidden[2]) - hidden[4]).abs().max().item() <= TOL
    # the next range's shards are not cached: the error names the shard and what to do
    missing = sorted(shards_of(source, [5]) - needed)[0]
    with pytest.raises(InputError, match=f"{missing}.*demo-model"):
        resolve_checkpoint("some-org/tiny-llama", blocks=(5, 6), cache_dir=tmp_path)


def test_shards_for_a_range():
    from hivekeeper.core.runtime.checkpoint import shards_for

    config = load_config_dict({"num_hidden_layers": 3, "tie_word_embeddings": True})
    weight_map = {n: f"s{layer}" for layer in range(3) for n in block_tensor_names(config, layer)}
    weight_map.update({"model.embed_tokens.weight": "s0", "model.norm.weight": "s9"})
    assert shards_for(config, weight_map, (1, 3), embeddings=False) == {"s1", "s2"}
    assert shards_for(config, weight_map, (1, 2), embeddings=True) == {"s0", "s1", "s9"}
    assert shards_for(config, weight_map, None, embeddings=False) == {"s0", "s1", "s2", "s9"}
    with pytest.raises(InputError, match=r"\[2, 5\)"):
        shards_for(config, weight_map, (2, 5), embeddings=False)
