"""Loading honours what was asked (docs/testing.md, found by a mutation run): the dtype of every weight of a span,
the embedding and the head; weights that are not trainable; an index that does not list a tensor a range needs, and
an embedding or final norm of another shape than the config says, are named; a tied head shares the embedding. The
demo checkpoint is stored in fp32, so a bf16 load must convert."""

from __future__ import annotations

import json

import pytest
import torch

from hivekeeper.core.runtime.checkpoint import INDEX_FILE, load_config, load_embedding, load_head, load_span, shards_for
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.planner.errors import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_demo_checkpoint(tmp_path_factory.mktemp("dtypes") / "demo", layers=3, shard_size_mb=0.2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_loaded_weight_has_the_dtype_asked_for_and_none_is_trainable(sharded, dtype):
    parts = {"span": load_span(sharded, 1, 3, dtype=dtype), "embedding": load_embedding(sharded, dtype=dtype),
             "head": load_head(sharded, dtype=dtype)}
    for part, module in parts.items():
        parameters = list(module.parameters()) + list(module.buffers())
        weights = [p for p in parameters if p.is_floating_point() and p.dim() >= 1 and p.numel() > 1]
        assert weights, part
        assert {p.dtype for p in weights if p.dim() == 2} == {dtype}, part  # every matrix
        assert not any(p.requires_grad for p in parameters), part


def test_a_tensor_the_index_does_not_list_is_named(sharded):
    index = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    del index["model.layers.2.self_attn.o_proj.weight"]
    config = load_config(sharded)
    with pytest.raises(InputError, match=r"the index: tensor 'model.layers.2.self_attn.o_proj.weight' is not listed"):
        shards_for(config, index, (1, 3), embeddings=False, source="the index")
    assert shards_for(config, index, (0, 2), embeddings=False)  # a range that does not need it still resolves


def test_an_embedding_of_another_shape_than_the_config_says_is_named(tmp_path):
    folder = make_demo_checkpoint(tmp_path / "demo", layers=1)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] += 1  # the file's embedding has one row fewer than the config says
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="model.embed_tokens.weight.*shape"):
        load_embedding(folder)


def test_a_tied_head_shares_the_embedding_or_reads_it(tmp_path):
    """Tied embeddings: the head given the loaded embedding uses that very matrix (no copy); without it, it reads the
    embedding tensor. Either way the logits are the normed hidden states times the embedding, in the dtype asked."""
    folder = make_demo_checkpoint(tmp_path / "tied", layers=1, tie_embeddings=True)
    embedding = load_embedding(folder)
    shared, read = load_head(folder, embedding=embedding), load_head(folder, dtype=torch.bfloat16)
    assert shared.weight is embedding.weight and not shared.weight.requires_grad
    assert read.weight.dtype == torch.bfloat16 and torch.equal(read.weight.float(),
                                                              embedding.weight.bfloat16().float())
    assert not any(p.requires_grad for p in read.parameters())
    hidden = torch.randn(1, 2, load_config(folder).hidden_size)
    with torch.inference_mode():
        logits, normed = shared(hidden), shared.norm(hidden)
    assert logits.shape == (1, 2, load_config(folder).vocab_size)
    assert torch.allclose(logits, normed @ embedding.weight.T, atol=1e-5)


def test_a_final_norm_of_another_shape_is_named(tmp_path):
    folder = make_demo_checkpoint(tmp_path / "demo", layers=1)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"], config["head_dim"] = config["hidden_size"] * 2, config.get("head_dim", 16)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="model.norm.weight.*shape"):
        load_head(folder)


def rewrite_weights(folder, change) -> None:
    """Apply change(tensors) to the demo checkpoint's single weights file."""
    from safetensors.torch import load_file, save_file

    (path,) = folder.glob("*.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_tied_head_ignores_a_stored_lm_head_and_an_untied_one_must_be_stored(tmp_path):
    """Tied embeddings win over an `lm_head.weight` the file also holds (some exports keep a copy; here a different
    one); an untied model whose file lacks the head is named as such."""
    tied = make_demo_checkpoint(tmp_path / "tied", layers=1, tie_embeddings=True)
    config = load_config(tied)
    rewrite_weights(tied, lambda tensors: tensors.update({"lm_head.weight": torch.zeros(config.vocab_size,
                                                                                         config.hidden_size)}))
    embedding = load_embedding(tied)
    assert load_head(tied, embedding=embedding).weight is embedding.weight
    assert torch.equal(load_head(tied).weight, embedding.weight)  # read from the embedding, not the zeros
    untied = make_demo_checkpoint(tmp_path / "untied", layers=1)
    rewrite_weights(untied, lambda tensors: tensors.pop("lm_head.weight"))
    with pytest.raises(InputError, match=r"tensor 'lm_head.weight' is missing \(and the embeddings are not tied\)"):
        load_head(untied)
