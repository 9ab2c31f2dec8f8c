"""Block choice and rebalancing (Petals' rule): strengthen the swarm's weakest blocks.

Throughputs are per block: T[i] = sum of the throughputs of the JOINING/ONLINE servers covering block i.
- A new server with room for n blocks takes the window whose sorted throughputs are lexicographically smallest
  (ties -> lowest start).
- A running server simulates moving (itself first, then every server greedily) and moves when
  min(T before) / min(T after) < balance_quality.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One server's span [start, end) and its throughput, as the balancer sees it."""

    peer_id: str
    start: int
    end: int
    throughput: float


def choose_start(throughputs: list[float], num_blocks: int) -> int:
    """Start of the window of `num_blocks` blocks whose sorted throughputs are lexicographically smallest."""
    total = len(throughputs)
    if not 0 < num_blocks <= total:
        raise ValueError(f"cannot place {num_blocks} blocks in a model of {total}")
    windows = range(total - num_blocks + 1)
    # rounding keeps float noise from add/subtract cycles out of the comparison
    return min(windows, key=lambda start: (sorted(round(t, 6) for t in throughputs[start : start + num_blocks]), start))


def swarm_throughputs(placements: list[Placement], total_blocks: int) -> list[float]:
    per_block = [0.0] * total_blocks
    for p in placements:
        for i in range(max(0, p.start), min(total_blocks, p.end)):
            per_block[i] += p.throughput
    return per_block


def _moved(per_block: list[float], p: Placement, new_start: int) -> tuple[list[float], Placement]:
    length = p.end - p.start
    per_block = list(per_block)
    for i in range(p.start, p.end):
        per_block[i] -= p.throughput
    for i in range(new_start, new_start + length):
        per_block[i] += p.throughput
    return per_block, Placement(p.peer_id, new_start, new_start + length, p.throughput)


def should_move(me: str, placements: list[Placement], total_blocks: int, balance_quality: float = 0.75,
                max_rounds: int = 10) -> int | None:
    """The start this server should move to, or None to stay.

    Simulates this server taking its best window given everyone else, then everyone re-choosing greedily (until no
    one moves or max_rounds), and moves only when min throughput before / after < balance_quality.
    """
    placements = list(placements)
    mine = next((p for p in placements if p.peer_id == me), None)
    if mine is None:
        return None
    per_block = swarm_throughputs(placements, total_blocks)
    before = min(per_block)

    def best_start(per_block: list[float], p: Placement) -> int:
        without = list(per_block)
        for i in range(p.start, p.end):
            without[i] -= p.throughput
        return choose_start(without, p.end - p.start)

    my_start = best_start(per_block, mine)
    if my_start == mine.start:
        return None
    per_block, moved = _moved(per_block, mine, my_start)
    placements = [moved if p.peer_id == me else p for p in placements]
    for _ in range(max_rounds):
        changed = False
        for index, p in enumerate(placements):
            start = best_start(per_block, p)
            if start != p.start:
                per_block, placements[index] = _moved(per_block, p, start)
                changed = True
        if not changed:
            break
    after = min(per_block)
    if after <= 0:
        return None  # moving cannot close every gap; stay and let others fill
    return my_start if before / after < balance_quality else None
