"""The former one-file offloading engine, kept importable for code written against it: it is five modules now.

- placement.py        EnginePlan, place_model and the sizes it counts (block_bytes, cache_bytes_per_block, ...).
- weights.py          BlockReader, block_destinations, empty_block (core/runtime/safetensors_file.py reads files).
- streaming.py        BlockStreamer and its Slots.
- tiered_cache.py     TieredKVCache, RecomputeCache, keep_between_blocks.
- offloaded_model.py  OffloadedModel, OffloadedSpan, use_physical_cores.

New code imports from the modules above (everything in the repository does); delete this one once no branch
in flight does.
"""

from __future__ import annotations

from hivekeeper.core.offload.offloaded_model import OffloadedModel, OffloadedSpan, use_physical_cores
from hivekeeper.core.offload.placement import (FLOAT_FORMATS, EnginePlan, block_bytes, cache_bytes_per_block,
                                               cpu_attention_dtype, micro_batch_rows, outside_bytes, place_model,
                                               recompute_buffer_bytes, workspace_bytes)
from hivekeeper.core.offload.streaming import BlockStreamer, Slot
from hivekeeper.core.offload.tiered_cache import RecomputeCache, TieredKVCache, keep_between_blocks
from hivekeeper.core.offload.weights import BlockReader, block_destinations, empty_block
from hivekeeper.core.runtime.safetensors_file import FILE_DTYPES, SafetensorsFile

__all__ = ["FILE_DTYPES", "FLOAT_FORMATS", "BlockReader", "BlockStreamer", "EnginePlan", "OffloadedModel",
           "OffloadedSpan", "RecomputeCache", "SafetensorsFile", "Slot", "TieredKVCache", "block_bytes",
           "block_destinations", "cache_bytes_per_block", "cpu_attention_dtype", "empty_block", "keep_between_blocks",
           "micro_batch_rows", "outside_bytes", "place_model", "recompute_buffer_bytes", "use_physical_cores",
           "workspace_bytes"]
