"""How fast this node serves a block: measured on one block as the server holds it, then cached.

Petals' definitions (shared/protocol/petals-wire.md), one each:
- inference_rps: tokens/s of one block for 1-token steps with a KV cache (what a chat session sees);
- forward_rps: tokens/s of one block for a 1024-token forward (fewer only where one pass would take seconds);
- network_rps: min(download, upload) bit/s / (16 × hidden_size), from the link speed the operator declares;
- throughput (what the server advertises for its span), Petals' formula, planner.swarm.span_throughput:
  min(forward_rps / ((num_blocks + 1) / 2), network_rps × (0.2 if relayed else 1)).

"As the server holds it" matters: a GGUF's span on a CPU is packed (its Q4_1/Q8_0 linears run in the native
kernels), a CPU fp32 span is laid out for the BLAS path. So the block timed is the checkpoint's first block loaded
the way `load_span` loads the span (real weights: speed depends on shapes and format, not values); a checkpoint
whose weights are not here yet (a hub model, fetched once the span is chosen) gets a random block of its shapes.

The cache (`swarm_throughput.json`, `cache_path`: in the data folder where HIVEKEEPER_DATA_DIR is set, else in the
config folder where HIVEKEEPER_CONFIG_DIR is, else in the user's cache folder) is keyed by the block's shapes, the
device type and the served format, and each entry records when it was measured and at what load (a busy one is used,
and said so: `--throughput eval` measures again). `measured_block_speed` reads it for a planner's ServerPlan
(torch-free): the app's Swarm page, `hivekeeper plan --goal serve` and `hivekeeper swarm models` show the figure
`serve` advertises beside the planner's estimate and say where it comes from.

The block is timed in the thread layout the server serves in (the same process, after serve set it): torch's own
ops on one thread, the matmuls on the native kernels' pool or numpy's BLAS over the cores
(cpu_matmul.use_blas_threads); `device_name` says both (it said "(1 threads)", torch's alone).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hivekeeper.core.atomic_file import write_json_atomic
from hivekeeper.core.machine.cpu_features import cpu_model_name
from hivekeeper.planner.swarm import FORWARD_TOKENS
from hivekeeper.planner.words import counted
from hivekeeper.planner.swarm import span_throughput as planner_span_throughput

CACHE_FILE = "swarm_throughput.json"
CACHE_VERSION = "v2"  # v1 entries timed a random fp32 block for every span and are measured again
_MEASURE_SECONDS = 1.0  # time budget per measurement
_FORWARD_REPEATS = 3  # passes of the forward, median taken (fewer where one pass takes most of the budget)


@dataclass(frozen=True)
class BlockSpeed:
    inference_rps: float  # tokens/s per block, 1-token steps with a cache
    forward_rps: float  # tokens/s per block, a forward of forward_tokens tokens
    device_name: str
    measured_at: float  # unix time
    forward_tokens: int = FORWARD_TOKENS
    loadavg: float = 0.0  # 1-minute load average, the larger of before and after
    cpus: int = 1  # logical CPUs of the machine it ran on

    @property
    def busy(self) -> bool:
        """Measured while other programs held the cores (load above the CPU count): a slow moment's figure."""
        return self.loadavg > self.cpus

    def source_words(self, now: bool = False) -> str:
        """'measured by `serve` on 02 Dec 07:41 (load 1.2)', or with now=True 'measured now (load 3.5, busy: 2
        CPUs)': where an advertised figure comes from."""
        when = "now" if now else f"by `serve` on {time.strftime('%d %b %H:%M', time.localtime(self.measured_at))}"
        busy = f", busy: {self.cpus} CPUs" if self.busy else ""
        return f"measured {when} (load {self.loadavg:.1f}{busy})"


def span_throughput(speed: BlockSpeed, num_blocks: int, network_rps: float | None, using_relay: bool = False) -> float:
    """The throughput a server advertises for a span of num_blocks blocks (Petals' formula, from the planner)."""
    return planner_span_throughput(speed.forward_rps, num_blocks, network_rps, using_relay)


def network_rps_for(bandwidth_bps: float | None, hidden_size: int) -> float | None:
    """Requests/s the link carries: bit/s over the bits of one token's hidden state (16 × hidden_size)."""
    if bandwidth_bps is None:
        return None
    return bandwidth_bps / (16 * hidden_size)


def device_name(device) -> str:
    """The GPU's name, or the CPU's with the threads a block runs on: torch's (its own ops, and the matmuls where they
    stay in torch) and the native kernels' pool (the packed matmuls; numpy's BLAS takes as many for fp32 ones)."""
    import torch

    from hivekeeper.core.runtime.kernels.native_kernels import default_threads

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return (f"{cpu_model_name()} (torch on {counted(torch.get_num_threads(), 'thread')}, "
            f"native kernels on {counted(default_threads(), 'thread')})")


def served_format(checkpoint: str | Path | None, device, dtype, quant: str) -> str:
    """The format the span is served in, in the planner's words ('q4_1 packed', 'fp32', 'nf4'): a GGUF's own packed
    type on a CPU in fp32 (as load_span keeps it), the bitsandbytes quantization, else the dtype."""
    from hivekeeper.core.machine.cpu_dtype import dtype_name
    from hivekeeper.planner.format_choice import gguf_packed_type, packed_by_default
    from hivekeeper.planner.gguf_metadata import is_gguf

    name = dtype_name(dtype)
    if quant != "none":
        return quant
    if checkpoint is not None and str(device).startswith("cpu") and name == "fp32" and packed_by_default() \
            and is_gguf(checkpoint):
        packed = gguf_packed_type(str(checkpoint))
        if packed:
            return f"{packed} packed"
    return name


def cache_key(config, device_type: str, fmt: str) -> str:
    """The cache's key: the block's shapes (a ModelConfig or the planner's ModelSpec: both carry them), the device
    type ('cpu', 'cuda') and the served format."""
    shape = (config.family, config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
             config.head_dim, config.qkv_bias)
    digest = hashlib.sha1(repr(shape).encode()).hexdigest()[:12]
    return f"{CACHE_VERSION}|{config.family}-{config.hidden_size}-{digest}|{device_type}|{fmt}"


def cache_path() -> Path:
    """The cache file: in HIVEKEEPER_DATA_DIR where it is set (the folder of models and caches), else in
    HIVEKEEPER_CONFIG_DIR where that is (a private config folder, as tests and benchmarks use, holds this machine's
    measured profile: its measured block speeds go with it), else in the user's cache folder. serve, the app and the
    CLI all read this one path, so a private folder isolates them together."""
    import platformdirs

    for variable in ("HIVEKEEPER_DATA_DIR", "HIVEKEEPER_CONFIG_DIR"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser() / CACHE_FILE
    return Path(platformdirs.user_cache_dir("hivekeeper")) / CACHE_FILE


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def cached_block_speed(config, device_type: str, fmt: str) -> BlockSpeed | None:
    """The cached measurement of a block of this shape, device type and served format, or None (never measured, or
    an entry of another version). Torch-free: the app's Swarm page reads it."""
    entry = _read_cache(cache_path()).get(cache_key(config, device_type, fmt))
    try:
        return BlockSpeed(**entry) if isinstance(entry, dict) else None
    except TypeError:
        return None


def plan_format(server) -> str:
    """A planner ServerPlan's span format in served_format's words ('q4_1 packed', 'fp32', 'nf4')."""
    return f"{server.weight_format}{' packed' if server.packed else ''}"


def measured_block_speed(model, server) -> BlockSpeed | None:
    """`serve`'s cached measurement of a block of `model` (a path or catalog id, or its ModelSpec) in the format of the
    planned span `server` (a planner ServerPlan), on its kind of device; None where serve has not timed one here.
    The one reading of the cache for a plan: the app's Swarm page, `plan --goal serve` and `swarm models`."""
    from hivekeeper.planner.model_catalog import load_model_spec

    spec = load_model_spec(model) if isinstance(model, (str, Path)) else model
    return cached_block_speed(spec, "cuda" if server.tier == "gpu" else "cpu", plan_format(server))


def measured_report(speed: BlockSpeed, num_blocks: int) -> dict:
    """A measurement as `plan --goal serve --json` and `swarm models --json` report it: the block's rates, what serve
    advertises for a span of num_blocks blocks (compute only, as serve without --network-mbps), and its source."""
    return {"inference_rps": speed.inference_rps, "forward_rps": speed.forward_rps,
            "throughput": span_throughput(speed, num_blocks, None), "source": speed.source_words(),
            "device_name": speed.device_name}


def get_block_speed(config, device, dtype, quant: str = "none", *, checkpoint: str | Path | None = None,
                    force_measure: bool = False, log=None) -> tuple[BlockSpeed, bool]:
    """(speed, from_cache): the cached measurement for this block shape / device / served format, or a new one
    (force_measure: `--throughput eval`). checkpoint: where the block's weights are (None: not here yet, a random
    block is timed). A cached figure measured busy is used as it is (servers of one machine then advertise alike);
    its source words say it was busy, and `log` says how to measure again."""
    import torch

    device = torch.device(device)
    fmt = served_format(checkpoint, device, dtype, quant)
    cached = None if force_measure else cached_block_speed(config, device.type, fmt)
    if cached is not None:
        if log and cached.busy:
            log(f"the block throughput advertised was {cached.source_words()}: `--throughput eval` measures again")
        return cached, True
    if log:
        log(f"measuring block throughput on {device_name(device)} ({fmt})...")
    speed = measure_block_speed(served_span(checkpoint, config, device, dtype, quant), device)
    path = cache_path()
    data = _read_cache(path)  # re-read: another server may have written meanwhile
    data[cache_key(config, device.type, fmt)] = asdict(speed)
    write_json_atomic(path, data)
    return speed, False


def served_span(checkpoint: str | Path | None, config, device, dtype, quant: str):
    """A one-block Span as load_span holds the server's span: the checkpoint's first block where its weights are
    here, else a random block of the real shapes laid out the same way."""
    from hivekeeper.core.runtime.checkpoint import load_span

    if checkpoint is not None:
        return load_span(checkpoint, 0, 1, dtype=dtype, device=device, quant=quant)
    return _random_span(config, device, dtype, quant)


def _random_span(config, device, dtype, quant: str):
    """A one-block Span of random weights (nn.Linear's init): the real shapes, the runtime's layout."""
    import torch

    from hivekeeper.core.runtime.kernels.cpu_matmul import pack_in_order, store_linears_for_decode
    from hivekeeper.core.runtime.model import Block, Span

    torch.manual_seed(0)
    block = Block(config, 0).requires_grad_(False)
    if quant != "none":
        from hivekeeper.core.runtime.quant.bnb import quantize_block

        return Span(config, 0, 1, [quantize_block(block.to(dtype), quant, device)])
    block = block.to(device=device, dtype=dtype)
    store_linears_for_decode(block)
    pack_in_order([block])
    return Span(config, 0, 1, [block])


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_block_speed(span, device, seconds: float = _MEASURE_SECONDS) -> BlockSpeed:
    """Time a one-block span: 1-token cached steps, then a forward of up to FORWARD_TOKENS tokens (median of a few
    passes); each within about `seconds`."""
    import torch

    from hivekeeper.core.machine.measure import load_average

    load = load_average()
    with torch.inference_mode():
        inference_rps = _inference_rps(span, device, seconds / 2)
        tokens, forward_rps = _forward_rps(span, device, seconds)
    return BlockSpeed(inference_rps, forward_rps, device_name(device), time.time(), tokens,
                      max(load, load_average()), os.cpu_count() or 1)


def _hidden(span, tokens: int, device):
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randn(1, tokens, span.config.hidden_size, generator=generator).to(device=device, dtype=span.dtype)


def _inference_rps(span, device, seconds: float) -> float:
    """1-token steps into a cache (the runtime's decode path), after a short warm-up prefix."""
    from hivekeeper.core.runtime.model import KVCache

    steps_max = 512
    cache = KVCache.allocate(span.config, 1, 1, steps_max + 8, span.dtype, device)
    cache.k.zero_()
    cache.v.zero_()
    token = _hidden(span, 1, device)
    for _ in range(4):  # warm-up: allocator, kernels
        span(token, cache)
    _sync(device)
    steps, start = 0, time.perf_counter()
    while steps < steps_max and (steps < 8 or time.perf_counter() - start < seconds):
        span(token, cache)
        steps += 1
    _sync(device)
    return steps / (time.perf_counter() - start)


def _forward_rps(span, device, seconds: float) -> tuple[int, float]:
    """(tokens, tokens/s): grow the forward to FORWARD_TOKENS unless one pass already takes `seconds`; then the
    median of up to _FORWARD_REPEATS passes at that length."""
    tokens = 16
    while True:
        x = _hidden(span, tokens, device)
        span(x)  # warm-up at this size
        elapsed = _timed_pass(span, x, device)
        if tokens >= FORWARD_TOKENS or elapsed > seconds:
            break
        tokens = min(FORWARD_TOKENS, tokens * 4)
    passes = [elapsed]
    while len(passes) < _FORWARD_REPEATS and sum(passes) + elapsed <= 2 * seconds:
        passes.append(_timed_pass(span, x, device))
    return tokens, tokens / statistics.median(passes)


def _timed_pass(span, x, device) -> float:
    _sync(device)
    start = time.perf_counter()
    span(x)
    _sync(device)
    return time.perf_counter() - start
