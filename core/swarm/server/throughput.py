"""How fast this node serves a block: measured once per model shape / device / dtype / quantization, then cached.

- inference_rps: tokens/s of one block for 1-token steps with a KV cache (what a chat session sees);
- forward_rps: tokens/s of one block for a long forward (up to 1024 tokens, fewer where that would take long);
- network_rps: min(download, upload) bit/s / (16 × hidden_size), from the link speed the operator declares;
- throughput (what the server advertises for its span), Petals' formula:
  min(forward_rps / ((num_blocks + 1) / 2), network_rps × (0.2 if relayed else 1)).

The measurement uses one block with random weights of the real shapes, so it runs before the span is chosen.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hivekeeper.core.atomic_file import write_json_atomic
from hivekeeper.core.machine.cpu_features import cpu_model_name
from hivekeeper.core.runtime.model import Block, KVCache, ModelConfig
from hivekeeper.planner.swarm import span_throughput as planner_span_throughput

CACHE_FILE = "swarm_throughput.json"
_FORWARD_TOKENS = 1024
_MEASURE_SECONDS = 1.0  # time budget per measurement


@dataclass(frozen=True)
class BlockSpeed:
    inference_rps: float  # tokens/s per block, 1-token steps with a cache
    forward_rps: float  # tokens/s per block, long forward
    device_name: str
    measured_at: float  # unix time


def span_throughput(speed: BlockSpeed, num_blocks: int, network_rps: float | None, using_relay: bool = False) -> float:
    """The throughput a server advertises for a span of num_blocks blocks (Petals' formula, from the planner)."""
    return planner_span_throughput(speed.forward_rps, num_blocks, network_rps, using_relay)


def network_rps_for(bandwidth_bps: float | None, hidden_size: int) -> float | None:
    """Requests/s the link carries: bit/s over the bits of one token's hidden state (16 × hidden_size)."""
    if bandwidth_bps is None:
        return None
    return bandwidth_bps / (16 * hidden_size)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model_name()} ({torch.get_num_threads()} threads)"


def _cache_key(config: ModelConfig, device: torch.device, dtype: torch.dtype, quant: str) -> str:
    shape = (config.family, config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
             config.head_dim, config.qkv_bias)
    digest = hashlib.sha1(repr(shape).encode()).hexdigest()[:12]
    return f"{config.family}-{config.hidden_size}-{digest}|{device_name(device)}|{dtype}|{quant}"


def _cache_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("hivekeeper")) / CACHE_FILE


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def get_block_speed(config: ModelConfig, device: str | torch.device, dtype: torch.dtype, quant: str = "none",
                    *, force_measure: bool = False, log=None) -> tuple[BlockSpeed, bool]:
    """(speed, from_cache): the cached measurement for this model shape/device/dtype/quant, or a new one."""
    device = torch.device(device)
    key = _cache_key(config, device, dtype, quant)
    path = _cache_path()
    cached = _read_cache(path).get(key)
    if cached and not force_measure:
        try:
            return BlockSpeed(**cached), True
        except TypeError:
            pass  # an entry from another version: measure again
    if log:
        log(f"measuring block throughput on {device_name(device)} ({dtype}, quant {quant})...")
    speed = measure_block_speed(config, device, dtype, quant)
    data = _read_cache(path)  # re-read: another server may have written meanwhile
    data[key] = asdict(speed)
    write_json_atomic(path, data)
    return speed, False


def _random_block(config: ModelConfig, device: torch.device, dtype: torch.dtype, quant: str) -> Block:
    """A block of the real shapes with nn.Linear's random init: speed depends on shapes, not on values."""
    torch.manual_seed(0)
    block = Block(config, 0).requires_grad_(False)
    if quant != "none":
        from hivekeeper.core.runtime.quant.bnb import quantize_block

        return quantize_block(block.to(dtype), quant, device)
    return block.to(device=device, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_block_speed(config: ModelConfig, device: torch.device, dtype: torch.dtype, quant: str = "none",
                        seconds: float = _MEASURE_SECONDS) -> BlockSpeed:
    """Time one block: 1-token cached steps, then a long forward; each within about `seconds`."""
    block = _random_block(config, device, dtype, quant)
    generator = torch.Generator().manual_seed(1)

    def hidden(tokens: int) -> torch.Tensor:
        return torch.randn(1, tokens, config.hidden_size, generator=generator).to(device=device, dtype=dtype)

    # inference: 1-token steps into a cache, after a short warm-up prefix
    steps_max = 512
    cache = KVCache.allocate(config, 1, 1, steps_max + 8, dtype, device)
    k, v = cache.block(0)
    token = hidden(1)
    for position in range(4):  # warm-up: allocator, kernels
        block(token, k, v, position)
    _sync(device)
    steps, start = 0, time.perf_counter()
    while steps < steps_max and (steps < 8 or time.perf_counter() - start < seconds / 2):
        block(token, k, v, 4 + steps)
        steps += 1
    _sync(device)
    inference_rps = steps / (time.perf_counter() - start)

    # forward: grow the length until one pass takes a noticeable time (or reaches 1024 tokens)
    tokens, elapsed = 16, 0.0
    while True:
        x = hidden(tokens)
        block(x)  # warm-up at this size
        _sync(device)
        start = time.perf_counter()
        block(x)
        _sync(device)
        elapsed = time.perf_counter() - start
        if tokens >= _FORWARD_TOKENS or elapsed > seconds / 8:
            break
        tokens = min(_FORWARD_TOKENS, tokens * 4)
    forward_rps = tokens / elapsed
    return BlockSpeed(inference_rps, forward_rps, device_name(device), time.time())
