"""Running a model that does not fit in fast memory, as a planner policy says.

- `engine`          placement of blocks by tier, the weight reader, the streamer, tiered KV caches, OffloadedModel.
- `block_variants`  the other ways to run a block that the policy's knobs ask for (CPU attention, recompute).
- `local_plan`      the policy for this machine (searched, or read from a plan file) turned into an EnginePlan.
"""
