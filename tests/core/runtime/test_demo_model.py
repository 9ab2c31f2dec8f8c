"""`hivekeeper demo-model`: the checkpoint it writes loads in transformers and in our runtime, deterministically."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hivekeeper.core.runtime import demo_model
from hivekeeper.core.cli.main import main
from hivekeeper.core.runtime.demo_model import DemoSpec, make_demo_checkpoint, tensor_plan, write_demo_checkpoint

transformers = pytest.importorskip("transformers")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _load_hf(folder: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    return model.eval(), info


def test_tiny_checkpoint_loads_in_transformers(tiny_checkpoint):
    model, info = _load_hf(tiny_checkpoint)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    assert len(tokenizer) == model.config.vocab_size == 512
    ids = torch.tensor([tokenizer("The keeper of the hive").input_ids])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()
    # what transformers loaded is what the file holds (nothing re-initialized behind our back)
    stored = _tensors(tiny_checkpoint)
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(model.state_dict()[name], stored[name])
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["hivekeeper_demo"] is True and config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert "RANDOM" in (tiny_checkpoint / "README.md").read_text()


@pytest.mark.parametrize(
    "sizes, architecture",
    [
        (dict(family="mistral", dtype="bf16"), "MistralForCausalLM"),
        (dict(family="qwen2", tie_embeddings=True, dtype="fp16"), "Qwen2ForCausalLM"),
    ],
)
def test_other_families_and_dtypes_load(tmp_path, sizes, architecture):
    folder = make_demo_checkpoint(tmp_path / "m", layers=1, vocab=300, **sizes)
    model, info = _load_hf(folder)
    assert type(model).__name__ == architecture
    assert not info["missing_keys"] and not info["unexpected_keys"]
    stored = _tensors(folder)
    expected_dtype = demo_model.DTYPES[sizes["dtype"]]
    assert {t.dtype for t in stored.values()} == {expected_dtype}
    if sizes.get("tie_embeddings"):
        assert "lm_head.weight" not in stored
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if sizes["family"] == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in stored


def test_activations_stay_sane_over_many_layers(tmp_path):
    folder = make_demo_checkpoint(tmp_path / "deep", layers=24, hidden=64, vocab=300)
    model, _ = _load_hf(folder)
    with torch.no_grad():
        out = model(torch.arange(3, 40)[None], output_hidden_states=True)
    rms = [h.pow(2).mean().sqrt().item() for h in out.hidden_states[:-1]]  # the last one is after the final norm
    assert all(0.5 < r < 2.0 for r in rms), rms
    probs = out.logits.softmax(-1)
    assert probs.max() < 0.5  # random, but not collapsed onto one token


def test_sharded_checkpoint_has_a_correct_index(tmp_path):
    limit_mb = 0.05
    sharded = make_demo_checkpoint(tmp_path / "sharded", shard_size_mb=limit_mb, layers=3)
    single = make_demo_checkpoint(tmp_path / "single", layers=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted(p.name for p in sharded.glob("*.safetensors"))
    n = len(shard_files)
    assert n > 3 and not (sharded / "model.safetensors").exists()
    assert shard_files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]

    weight_map = index["weight_map"]
    assert set(weight_map) == {t.name for t in tensor_plan(DemoSpec(layers=3).resolved())}
    assert set(weight_map.values()) == set(shard_files)
    total = 0
    for file in shard_files:
        with safe_open(str(sharded / file), "pt") as f:
            names = list(f.keys())
            sizes = [f.get_tensor(name).nbytes for name in names]
        assert all(weight_map[name] == file for name in names)
        assert sum(sizes) <= limit_mb * 2**20 or len(names) == 1  # only a lone oversized tensor may exceed it
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total

    # same seed: the same weights whether sharded or not, and transformers reads both alike
    single_tensors, sharded_tensors = _tensors(single), _tensors(sharded)
    assert single_tensors.keys() == sharded_tensors.keys()
    assert all(torch.equal(single_tensors[k], sharded_tensors[k]) for k in single_tensors)
    model, info = _load_hf(sharded)
    assert not info["missing_keys"]
    reference, _ = _load_hf(single)
    ids = torch.tensor([[1, 50, 60, 70]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_seed_gives_identical_bytes_even_in_another_process(tmp_path):
    here = make_demo_checkpoint(tmp_path / "a", seed=5, shard_size_mb=0.2, dtype="bf16")
    again = make_demo_checkpoint(tmp_path / "b", seed=5, shard_size_mb=0.2, dtype="bf16")
    assert _file_bytes(here) == _file_bytes(again)
    # a fresh interpreter (other hash seeds, a tokenizer trained from scratch) writes the very same files
    subprocess.run(
        [sys.executable, "-m", "hivekeeper.core.cli.main", "demo-model", str(tmp_path / "c"), "--seed", "5",
         "--shard-size-mb", "0.2", "--dtype", "bf16"],
        check=True, capture_output=True, timeout=120,
    )
    assert _file_bytes(tmp_path / "c") == _file_bytes(here)
    other = make_demo_checkpoint(tmp_path / "d", seed=6, shard_size_mb=0.2, dtype="bf16")
    different = [name for name, data in _file_bytes(other).items() if _file_bytes(here)[name] != data]
    assert any(name.endswith(".safetensors") for name in different)
    assert "tokenizer.json" not in different


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--layers", "-1"], r"--layers must be a positive integer, got -1"),
        (["--hidden", "64", "--heads", "5"], r"--heads 5 must divide --hidden 64"),
        (["--heads", "4", "--kv-heads", "3"], r"--kv-heads 3 must divide --heads 4"),
        (["--vocab", "100"], r"--vocab 100 is too small.*at least 262"),
        (["--hidden", "60", "--heads", "4"], r"head size .* = 15 must be even"),
        (["--shard-size-mb", "0"], r"--shard-size-mb must be > 0"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(tmp_path, capsys, flags, message):
    assert main(["demo-model", str(tmp_path / "m"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hivekeeper demo-model: error:")
    assert re.search(message, err), err
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_says_random_and_refuses_to_clobber(tmp_path, capsys):
    dest = tmp_path / "m"
    assert main(["demo-model", str(dest), "--layers", "3", "--hidden", "32", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "RANDOM" in out and "gibberish" in out
    config = json.loads((dest / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (3, 32, 2)
    assert config["num_key_value_heads"] == 1  # derived from the new head count, not the preset's

    assert main(["demo-model", str(dest)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["demo-model", str(dest), "--force", "--layers", "1"]) == 0  # an earlier demo may be replaced
    assert json.loads((dest / "config.json").read_text())["num_hidden_layers"] == 1

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    assert main(["demo-model", str(precious), "--force"]) == 2
    assert "not a demo checkpoint" in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "precious"]  # no temporary folders left


def test_a_failure_midway_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(demo_model, "_generation_config", broken)  # after the weights are written
    with pytest.raises(OSError, match="simulated"):
        write_demo_checkpoint(tmp_path / "m", DemoSpec(layers=2))
    assert list(tmp_path.iterdir()) == []


def test_loads_with_our_runtime(tmp_path):
    checkpoint = pytest.importorskip("hivekeeper.core.runtime.checkpoint")
    folder = make_demo_checkpoint(tmp_path / "m", layers=3, shard_size_mb=0.1)
    reference, _ = _load_hf(folder)
    ids = torch.tensor([[1, 40, 41, 300, 7, 9]])
    with torch.no_grad():
        expected = reference(ids, output_hidden_states=True)
        states = expected.hidden_states  # the embedding, each block's output, the last one after the final norm
        torch.testing.assert_close(checkpoint.load_span(folder, 1, 2)(states[1]), states[2], rtol=1e-5, atol=1e-5)
        embedding = checkpoint.load_embedding(folder)
        hidden = checkpoint.load_span(folder, 0, 3)(embedding(ids))
        logits = checkpoint.load_head(folder, embedding=embedding)(hidden)
    torch.testing.assert_close(logits, expected.logits, rtol=1e-5, atol=1e-5)
