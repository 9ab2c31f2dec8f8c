"""Which shards a partial load fetches, for a model whose LM head is its own matrix (untied embeddings).

A swarm client and `generate` from a hub id fetch only the embedding, the final norm and the LM head; for an untied
model the head is a separate tensor, often in a shard of its own, and without it nothing can be decoded. The
expected shard sets are read from the checkpoint's own index, by tensor name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hivekeeper.core.runtime.checkpoint import INDEX_FILE, SIDE_FILES, load_config, load_head, shards_for
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

from ..hub_server import LoopbackHub
from .test_hub_download import hub_env, resolve

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = "user/untied"
OUTSIDE_BLOCKS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    """4 layers in shards of about 0.2 MB, embeddings not tied: the LM head is a tensor of its own."""
    return make_demo_checkpoint(tmp_path_factory.mktemp("untied") / "demo", layers=4, shard_size_mb=0.2,
                                tie_embeddings=False)


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / INDEX_FILE).read_text())["weight_map"]


def test_the_embeddings_of_an_untied_model_include_its_lm_head_shard(untied):
    index = weight_map(untied)
    head_shard = index["lm_head.weight"]
    assert head_shard != index["model.embed_tokens.weight"]  # the case that matters: the head has its own file
    config = load_config(untied)
    assert shards_for(config, index, (0, 0), embeddings=True) == {index[name] for name in OUTSIDE_BLOCKS}
    with_blocks = {index[name] for name in index if name.startswith(("model.layers.1.", "model.layers.2."))}
    assert shards_for(config, index, (1, 3), embeddings=True) == with_blocks | {index[n] for n in OUTSIDE_BLOCKS}
    assert head_shard not in shards_for(config, index, (0, 0), embeddings=False) | with_blocks


@pytest.mark.slow
def test_a_client_gets_the_untied_head_from_the_hub_and_decodes_like_the_original(untied, tmp_path):
    """What the swarm client asks for (no blocks, embeddings): the embedding, norm and head shards are fetched, and
    the head loaded from the download gives the original's logits."""
    index = weight_map(untied)
    with LoopbackHub({REPO: untied}) as hub:
        (result,) = resolve(hub_env(hub.endpoint, tmp_path / "hf"), {"model": REPO, "blocks": [0, 0],
                                                                     "embeddings": True})
        fetched = set(hub.downloaded(REPO))
    assert "error" not in result, result
    small_files = {"config.json", INDEX_FILE, *(f for f in SIDE_FILES if (untied / f).exists())}
    assert fetched == small_files | {index[name] for name in OUTSIDE_BLOCKS}
    folder = Path(result["folder"])
    hidden = torch.randn(1, 3, load_config(untied).hidden_size)
    with torch.inference_mode():
        downloaded = load_head(folder)(hidden)
        original = load_head(untied)(hidden)
    assert torch.equal(downloaded, original)
