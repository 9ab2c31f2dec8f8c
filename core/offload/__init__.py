"""Running a model that does not fit in fast memory, as a planner policy says.

- `local_plan`       the policy for this machine (searched, or read from a plan file) turned into an EnginePlan;
                     the one choice `hivekeeper generate`/`chat` and the app's chat make.
- `placement`        EnginePlan and place_model: a tier per block's weights and KV cache, under a RAM budget.
- `offloaded_model`  OffloadedModel: the blocks run where the plan puts them, streaming what does not fit.
- `weights`          the block reader: a layer's tensors from the checkpoint's files into a reused Block.
- `streaming`        the slots that load the next streamed blocks while the current one computes.
- `half_store`       a 16-bit plan's streamed blocks of an fp32 checkpoint, written once in that dtype and streamed
                     from there (half the bytes, no conversion while reading).
- `packed_stream`    a GGUF kept packed: its Q8_0/Q4_0/Q4_1 bytes read with pread into slots, resident blocks, head
                     and embedding (none through the memory map), and their sizes for a RAM budget's placement.
- `tiered_cache`     KV caches (or recompute inputs) with a tier per block.
- `batch_run`        a batch over a prompts file with a given policy, reporting each step (the app's "Run this plan";
                     `generate --prompts-file` reads and tokenizes its prompts file here).
- `block_variants`   the other ways to run a block that the policy's knobs ask for (CPU attention, recompute).
"""
