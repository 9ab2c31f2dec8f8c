"""A block's KV cache on the disk tier leaves the process's RSS after the block's turn (TieredKVCache.release): the
cache is a shared file mapping, and its touched pages counted in RSS block after block (issue 22: 151 MB at the
offload bench's batch 512, 1.59x its RAM budget). The values stay in the file."""

from __future__ import annotations

import psutil
import torch

from hivekeeper.core.offload.tiered_cache import TieredKVCache
from hivekeeper.core.runtime.model import ModelConfig

CONFIG = ModelConfig.from_hf_config({"model_type": "llama", "vocab_size": 512, "hidden_size": 512,
                                     "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
                                     "num_key_value_heads": 8, "max_position_embeddings": 2048})


def test_a_disk_tier_blocks_cache_leaves_rss_after_its_turn_and_keeps_its_values(tmp_path):
    cache = TieredKVCache(CONFIG, ("disk", "cpu"), 8, 2048, torch.float32, "cpu", tmp_path)  # 32 MiB per K or V
    try:
        k, v = cache.blocks[0]
        k.fill_(1.5), v.fill_(-2.0)  # every page touched: mapped into this process
        process = psutil.Process()
        touched = process.memory_info().rss
        cache.release(0)
        released = process.memory_info().rss
        assert touched - released >= 0.9 * (k.nbytes + v.nbytes)
        assert bool((k == 1.5).all()) and bool((v == -2.0).all())  # refaulted from the file
        ram_k = cache.blocks[1][0]
        ram_k.fill_(3.0)
        before = process.memory_info().rss
        cache.release(1)  # a RAM-tier block's cache stays
        assert process.memory_info().rss >= before - (1 << 20) and bool((ram_k == 3.0).all())
    finally:
        cache.close()
