"""Spot checks of servers' outputs (issue 17 item 9). A server can return well-formed but wrong hidden states, and
neither Petals nor its peers would notice; volunteer computing (BOINC) validates work by redundancy. So a client
re-runs a sampled fraction of its inference steps elsewhere and compares:

- every `1 / rate`-th step of a session (the first one always), each server's outputs since its last check are
  recomputed from the inputs it was sent (kept for replays anyway), by a referee that keeps its own cache between
  checks (so a check costs the positions since the last one, not the whole history): locally when the client has the weights and the
  span is small (`LocalReferee`: up to 4 blocks and 256 MiB of fp32 weights), else on another server covering the
  same blocks;
- outputs agree when, at every position, the largest difference is within atol + rtol × the largest reference value,
  the tolerance of the less precise dtype of the two sides (`tolerance`);
- a mismatch bans the server for good, replays its inputs on a replacement, recomputes the servers after it from the
  first wrong position, and is recorded like a failover (`generate --json` lists it under "failovers", with a
  "spot_check" entry). SwarmModel.generate also rewinds the tokens chosen from wrong outputs and generates them again.

A remote referee that disagrees is believed over the checked server: the checked one was chosen by routing, which a
liar can attract by claiming speed; the referee is whichever other server answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

# (atol, rtol) of hidden states computed in a dtype, against a reference computed in fp32 (or the same dtype)
TOLERANCES = {"float32": (1e-4, 1e-3), "float16": (2e-3, 1e-2), "bfloat16": (1e-2, 4e-2)}
LOCAL_REFEREE_MAX_BYTES = 256 * 2**20  # fp32 weights a client loads to check a span itself (SmolLM2: 4 blocks, 56 MB)


@dataclass(frozen=True)
class SpotCheckConfig:
    rate: float = 0.125  # fraction of steps checked: every 8th (and the first); 0 = off
    local_max_blocks: int = 4  # recompute locally spans up to this long, when the client has the weights

    def due(self, step: int) -> bool:
        return self.rate > 0 and step % max(1, round(1 / min(self.rate, 1.0))) == 0


def tolerance(*dtype_names: str | None) -> tuple[float, float]:
    """(atol, rtol) for outputs computed in these dtypes: the loosest (an unknown dtype counts as bfloat16)."""
    picked = [TOLERANCES.get(name or "float32", TOLERANCES["bfloat16"]) for name in dtype_names] or [TOLERANCES["float32"]]
    return max(p[0] for p in picked), max(p[1] for p in picked)


def first_mismatch(outputs: torch.Tensor, reference: torch.Tensor, atol: float,
                   rtol: float) -> tuple[int | None, float]:
    """(the first position where outputs [batch, positions, hidden] differ from the reference beyond tolerance, or
    None; the largest difference)."""
    outputs, reference = outputs.float(), reference.float()
    diff = (outputs - reference).abs().amax(dim=(0, 2))
    bound = atol + rtol * reference.abs().amax(dim=(0, 2))
    bad = (diff > bound) | ~torch.isfinite(diff)
    largest = float(diff.max()) if diff.numel() else 0.0
    return (int(bad.nonzero()[0, 0]) if bool(bad.any()) else None), largest


class LocalReferee:
    """Recomputes blocks [start, end) here from a checkpoint's weights (loaded once per span, fp32), incrementally:
    a KV cache per checked server holds what was recomputed, so a check runs only the positions since the last one.
    Spans of up to max_blocks blocks whose fp32 weights fit in LOCAL_REFEREE_MAX_BYTES (larger ones go remote)."""

    def __init__(self, checkpoint: Path, config, max_blocks: int):
        self.checkpoint, self.config, self.max_blocks = checkpoint, config, max_blocks
        self.block_bytes = 4 * config.block_param_count()
        self._spans: dict[tuple[int, int], object] = {}

    def covers(self, start: int, end: int) -> bool:
        return end - start <= self.max_blocks and (end - start) * self.block_bytes <= LOCAL_REFEREE_MAX_BYTES

    def allocate(self, start: int, end: int, batch: int, max_length: int):
        from hivekeeper.core.runtime.model import KVCache

        return KVCache.allocate(self.config, end - start, batch, max_length, torch.float32, "cpu")

    @torch.inference_mode()
    def extend(self, start: int, end: int, cache, position: int, inputs: torch.Tensor,
               prompts: torch.Tensor | None = None) -> torch.Tensor:
        """The outputs of blocks [start, end) for `inputs` at positions position, position + 1, ... (the cache is
        rewound to `position` first); prompts: the deep prompts the server was sent with them, added as it adds
        them (server.handler.run_blocks)."""
        from hivekeeper.core.runtime.checkpoint import load_span
        from hivekeeper.core.swarm.server.handler import run_blocks

        if (start, end) not in self._spans:
            self._spans[(start, end)] = load_span(self.checkpoint, start, end, dtype=torch.float32, device="cpu")
        cache.truncate(position)
        return run_blocks(self._spans[(start, end)], inputs.float(), cache, prompts)
