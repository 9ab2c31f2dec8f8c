"""The offloading engine: runs a model's blocks where a planner policy puts them, streaming what does not fit.

Each block's weights live on one tier: resident on the compute device, in CPU RAM (pinned when a GPU computes), or
on disk, where they stay in the checkpoint's safetensors file and are read on demand into a small pool of block
buffers ("slots") that are reused, so a streamed block never stays in memory after its turn. While one block
computes, free slots are already loading the next streamed blocks — a reader thread from disk, an asynchronous copy
stream from RAM to the GPU — so the pool size (prefetch depth + 1) bounds the buffering. The KV cache gets a tier
per block too; batch and micro-batches follow the policy (each block's weights are fetched once per step and every
micro-batch runs through them, FlexGen's block schedule).

    plan = place_model(config, policy, device="cpu", dtype=torch.float32, batch=1, max_length=256,
                       ram_budget_bytes=500e6)
    model = OffloadedModel(path, plan)          # .embedding, .span, .head: the runner shape generation.py uses
    cache = model.span.allocate_cache(batch=1, max_length=256)
    logits = model.head(model.span(model.embedding(ids), cache))

Block weights are read with positioned reads (os.preadv) straight into the destination tensors, not through a memory
map: no page of a streamed block stays mapped into the process, so RSS holds only what the plan counts, and a read
lands in its final (fused) place with one copy. (Embeddings and LM head come from checkpoint.py's loaders.) `drop_page_cache=True` also evicts what was read from the OS page cache, for
benchmarks of the disk itself.

The CPU and CUDA paths share everything but the slot loader; CUDA adds pinned RAM blocks, a copy stream and events.
The policy's other knobs: `kv_recompute` keeps block inputs instead of K/V (RecomputeCache), `attention_on_cpu` runs
attention next to a RAM/disk cache, `activations` keeps micro-batches' hidden states in pinned RAM between blocks
(the block forwards for the first two are in block_variants.py; docs/local-inference.md has what runs where).
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import tempfile
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from hivekeeper.planner.costmodel import TIERS, Policy
from hivekeeper.planner.errors import InputError

from hivekeeper.core.runtime.kernels import cpu_decode
from hivekeeper.core.offload.block_variants import forward_recomputing_kv, forward_with_attention_at_cache
from hivekeeper.core.runtime.kernels.cpu_matmul import pack_in_order, store_tall_linears_by_column, use_blas_threads
from hivekeeper.core.runtime.checkpoint import Checkpoint, _quant_compute_dtype, block_tensor_names, load_block, load_embedding, load_head
from hivekeeper.core.runtime.checkpoint import open_checkpoint
from hivekeeper.core.runtime.gguf import GGUFBlockReader, GGUFCheckpoint
from hivekeeper.core.machine.cpu_dtype import runs_natively_on_cpu
from hivekeeper.core.runtime.model import Block, ModelConfig, RotaryTable
from hivekeeper.core.runtime.quant.bnb import check_quant, quantized_block_bytes, quantized_tensors

FLOAT_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_MAX_HEADER_BYTES = 100 << 20


def use_physical_cores() -> int:
    """Set the CPU thread layout for inference (see cpu_matmul.use_blas_threads); returns the matmul threads."""
    return use_blas_threads()


# ---------------------------------------------------------------------------------------------------------------
# Placement: a tier per block, from a policy and a RAM budget
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EnginePlan:
    """Where everything lives for one run. Tiers are "gpu", "cpu" (RAM) or "disk"; on a CPU-only machine the
    compute tier is "cpu". `ram_bytes` is what the engine holds in RAM by this plan (see `ram_breakdown`)."""

    weight_tiers: tuple[str, ...]  # per block
    cache_tiers: tuple[str, ...]  # per block
    device: str  # "cpu" or "cuda[:N]"
    dtype: torch.dtype
    quant: str = "none"  # "int8"/"nf4": streamed blocks come quantized from quant_store.py
    prefetch_depth: int = 1
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    ram_budget_bytes: int | None = None
    ram_breakdown: dict[str, int] = field(default_factory=dict)
    kv_recompute: bool = False  # the cache keeps each block's input hidden states; K, V recomputed every step
    attention_on_cpu: bool = False  # with a GPU: attention over a RAM/disk cache runs on the CPU
    activations_ram_fraction: float = 0.0  # the policy's activations.cpu: micro-batches kept in RAM between blocks

    @property
    def compute_tier(self) -> str:
        return "gpu" if torch.device(self.device).type == "cuda" else "cpu"

    def attention_tier(self, layer: int) -> str:
        """Where block `layer`'s attention runs: on the CPU next to its cache when attention_on_cpu and a GPU
        computes while the cache is in RAM or on disk; else on the compute device."""
        if self.attention_on_cpu and self.compute_tier == "gpu" and self.cache_tiers[layer] != "gpu":
            return "cpu"
        return self.compute_tier

    def activation_tiers(self, parts: int) -> list[str]:
        """Where each of `parts` micro-batches' hidden states live between blocks: the compute device, or pinned
        RAM for the policy's RAM share of them (rounded to whole micro-batches). Without a GPU both are RAM."""
        if self.compute_tier == "cpu":
            return ["cpu"] * parts
        return _split_activations(self.activations_ram_fraction, parts)

    def knob_notes(self) -> list[str]:
        """Policy knobs that have no effect in this plan, and why (so nothing is dropped silently)."""
        notes = []
        if self.compute_tier == "cpu":
            if self.attention_on_cpu:
                notes.append("attention_on_cpu has no effect without a GPU: attention already runs on the CPU")
            if self.activations_ram_fraction < 1.0:
                notes.append("activations on 'gpu' have no effect without a GPU: hidden states stay in RAM")
        elif self.attention_on_cpu and all(t == "gpu" for t in self.cache_tiers):
            notes.append("attention_on_cpu has no effect: the whole KV cache is on the GPU")
        return notes

    def _attention_text(self) -> str:
        if self.compute_tier == "cpu":
            return "cpu (no GPU)"
        on_cpu = sum(self.attention_tier(i) == "cpu" for i in range(len(self.cache_tiers)))
        if not on_cpu:
            return "gpu"
        if on_cpu == len(self.cache_tiers):
            return "cpu (next to the cache)"
        return f"cpu for {on_cpu} blocks (cache off the GPU), gpu for {len(self.cache_tiers) - on_cpu}"

    def _activations_text(self) -> str:
        if self.compute_tier == "cpu":
            return "cpu (no GPU)"
        tiers = self.activation_tiers(self.num_micro_batches)
        if "cpu" not in tiers:
            return "gpu"
        if "gpu" not in tiers:
            return "cpu (pinned RAM)"
        return f"cpu (pinned RAM) for {tiers.count('cpu')} of {len(tiers)} micro-batches, gpu for the rest"

    @property
    def streamed_blocks(self) -> tuple[int, ...]:
        """Blocks whose weights are copied in for every step (not resident on the compute device)."""
        return tuple(i for i, tier in enumerate(self.weight_tiers) if tier != self.compute_tier)

    @property
    def ram_bytes(self) -> int:
        return sum(self.ram_breakdown.values())

    def summary(self) -> dict:
        """JSON-ready description (for `generate --json` and the chat banner)."""
        count = {tier: self.weight_tiers.count(tier) for tier in TIERS}
        cache = {tier: self.cache_tiers.count(tier) for tier in TIERS}
        return {
            "device": self.device, "dtype": str(self.dtype).removeprefix("torch."), "quant": self.quant,
            "blocks": {tier: n for tier, n in count.items() if n},
            "disk_blocks": [i for i, tier in enumerate(self.weight_tiers) if tier == "disk"],
            "kv_cache_blocks": {tier: n for tier, n in cache.items() if n},
            "prefetch_depth": self.prefetch_depth, "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "ram_budget_bytes": self.ram_budget_bytes, "ram_bytes": self.ram_bytes,
            "ram_breakdown": dict(self.ram_breakdown),
            "kv_cache_mode": "recompute" if self.kv_recompute else "keep",
            "attention": self._attention_text(), "activations": self._activations_text(),
            "knob_notes": self.knob_notes(),
        }

    def describe(self) -> str:
        """One line for people: where the weights and the cache are."""
        names = {"gpu": "GPU", "cpu": "RAM", "disk": "disk"}
        blocks = ", ".join(f"{n} {names[t]}" for t, n in self.summary()["blocks"].items())
        cache = ", ".join(f"{n} {names[t]}" for t, n in self.summary()["kv_cache_blocks"].items())
        dtype = self.quant if self.quant != "none" else str(self.dtype).removeprefix("torch.")
        text = f"{dtype} blocks: {blocks}; KV cache blocks: {cache}"
        if self.kv_recompute:
            text += " (block inputs kept, K/V recomputed)"
        if self.compute_tier == "gpu":
            text += f"; attention {self._attention_text()}; activations {self._activations_text()}"
        if self.streamed_blocks:
            text += f"; prefetch depth {self.prefetch_depth}"
        batch = self.micro_batch_size * self.num_micro_batches
        text += f"; batch {batch}" + (f" ({self.micro_batch_size} x {self.num_micro_batches})"
                                      if self.num_micro_batches > 1 else "")
        if self.ram_budget_bytes is not None:
            text += f"; RAM {self.ram_bytes / 1e9:.2f} of {self.ram_budget_bytes / 1e9:.2f} GB budget"
        for note in self.knob_notes():
            text += f"; {note}"
        return text


def block_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    return config.block_param_count() * _itemsize(dtype)


def outside_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Embedding, final norm and LM head (one matrix when tied)."""
    matrices = 1 if config.tie_word_embeddings else 2
    return (matrices * config.vocab_size * config.hidden_size + config.hidden_size) * _itemsize(dtype)


def cache_bytes_per_block(config: ModelConfig, batch: int, max_length: int, dtype: torch.dtype,
                          recompute: bool = False) -> int:
    """One block's cache: K and V, or with recompute the block's input hidden states."""
    per_token = config.hidden_size if recompute else 2 * config.kv_dim
    return batch * max_length * per_token * _itemsize(dtype)


def recompute_buffer_bytes(config: ModelConfig, rows: int, max_length: int, dtype: torch.dtype) -> int:
    """On the compute device, with recompute: one micro-batch's K, V scratch for one block, plus what recomputing
    them over the whole prefix holds at its peak (normed inputs and K/V projections, or K/V and rotary temporaries)."""
    per_token = 2 * config.kv_dim + max(config.hidden_size + 2 * config.kv_dim, 4 * config.kv_dim)
    return rows * max_length * per_token * _itemsize(dtype)


def micro_batch_rows(batch: int, micro_batch_size: int, num_micro_batches: int) -> int:
    """Rows of the largest micro-batch the engine runs for `batch` sequences (OffloadedModel._micro_batches)."""
    return batch if num_micro_batches <= 1 or micro_batch_size >= batch else micro_batch_size


def cpu_attention_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """CPU attention over a 16-bit cache runs in fp32 on a CPU without 16-bit math (FlexGen does the same)."""
    return torch.float32 if dtype != torch.float32 and not runs_natively_on_cpu(dtype) else None


def _split_activations(fraction_in_ram: float, parts: int) -> list[str]:
    """"gpu" or "cpu" for each of `parts` micro-batches: the RAM share rounded to whole micro-batches, last."""
    f = min(1.0, max(0.0, fraction_in_ram))
    counts = _counts({"gpu": 1.0 - f, "cpu": f}, parts, ("gpu", "cpu"))
    return ["gpu"] * counts["gpu"] + ["cpu"] * counts["cpu"]


def workspace_bytes(config: ModelConfig, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """Activations alive inside one block for `tokens` new tokens per sequence, plus fp32 logits of the last ones."""
    per_token = 4 * config.hidden_size + config.q_dim + 2 * config.kv_dim + 3 * config.intermediate_size
    return batch * tokens * per_token * _itemsize(dtype) + 3 * batch * config.vocab_size * 4


def _counts(fractions: dict[str, float], total: int, tiers: tuple[str, ...]) -> dict[str, int]:
    """Split `total` blocks over `tiers` in proportion to fractions (largest remainders), in tier order."""
    raw = {t: max(0.0, fractions.get(t, 0.0)) * total for t in tiers}
    scale = sum(raw.values())
    if scale <= 0:
        return {t: (total if t == tiers[-1] else 0) for t in tiers}
    raw = {t: v * total / scale for t, v in raw.items()}
    counts = {t: math.floor(v + 1e-9) for t, v in raw.items()}
    for t in sorted(tiers, key=lambda t: raw[t] - counts[t], reverse=True)[: total - sum(counts.values())]:
        counts[t] += 1
    return counts


def _spread(n_marked: int, total: int) -> list[bool]:
    """n_marked of total positions, spread evenly (so streamed blocks alternate with resident ones and their reads
    overlap the resident blocks' compute)."""
    return [math.floor((i + 1) * n_marked / total) > math.floor(i * n_marked / total) for i in range(total)]


def place_model(config: ModelConfig, policy: Policy, *, device: str | torch.device, dtype: torch.dtype, batch: int,
                max_length: int, ram_budget_bytes: float | None = None, prefill_tokens: int = 256,
                quant: str = "none") -> EnginePlan:
    """A tier for every block's weights and KV cache from the policy's fractions, capped by a RAM budget.

    The budget counts what the engine holds in RAM: embeddings and LM head (when the CPU computes), RAM-resident
    blocks, the streaming slots, the KV cache kept in RAM and one step's activations. Without a budget the policy's
    RAM/disk split is followed; with one, every block not on the GPU goes to RAM while the budget holds and the rest
    stays on disk. The interpreter and torch themselves (the process baseline) are not part of the budget.
    With quant "int8"/"nf4" every block counts its quantized size; the streamed ones come from quant_store.py.
    """
    device = str(torch.device(device))
    on_gpu = torch.device(device).type == "cuda"
    layers = config.num_layers
    if batch < 1 or max_length < 1:
        raise InputError(f"batch and max_length must be positive (got {batch}, {max_length})")
    w = policy.weights
    if on_gpu:
        weights = _counts({"gpu": w.gpu, "cpu": w.cpu, "disk": w.disk}, layers, TIERS)
    else:  # no GPU: the plan's GPU share (if any) is RAM
        weights = _counts({"cpu": w.gpu + w.cpu, "disk": w.disk}, layers, ("cpu", "disk"))
        weights["gpu"] = 0
    c = policy.kv_cache
    cache = _counts({"gpu": c.gpu, "cpu": c.cpu, "disk": c.disk}, layers, TIERS) if on_gpu else \
        {"gpu": 0, **_counts({"cpu": c.gpu + c.cpu, "disk": c.disk}, layers, ("cpu", "disk"))}
    cache_tiers = ["gpu"] * cache["gpu"] + ["cpu"] * cache["cpu"] + ["disk"] * cache["disk"]

    depth = policy.prefetch_depth
    quant = check_quant(quant)
    # int8/nf4 blocks are held quantized wherever they are: resident, pinned, or in a slot the store fills
    bb = block_bytes(config, dtype) if quant == "none" else \
        quantized_block_bytes(config, quant, _quant_compute_dtype(dtype, device))
    recompute = policy.kv_recompute
    cache_ram = cache["cpu"] * cache_bytes_per_block(config, batch, max_length, dtype, recompute)
    fixed = {"kv_cache": cache_ram}
    rows = micro_batch_rows(batch, policy.micro_batch_size, policy.num_micro_batches)
    if not on_gpu:
        fixed["embedding_and_head"] = outside_bytes(config, dtype)
        fixed["activations"] = workspace_bytes(config, batch, min(prefill_tokens, max_length), dtype)
        if recompute:
            fixed["recompute_buffers"] = recompute_buffer_bytes(config, rows, max_length, dtype)
    else:
        parts = -(-batch // rows)
        in_ram = _split_activations(policy.activations.cpu, parts).count("cpu") / parts
        # hidden states between blocks (in and out) of a prefill chunk, for the micro-batches kept in pinned RAM
        fixed["pinned_activations"] = round(in_ram * 2 * batch * min(prefill_tokens, max_length)
                                            * config.hidden_size * _itemsize(dtype))
        if policy.attention_on_cpu and cache["gpu"] < layers and cpu_attention_dtype(dtype) is not None:
            # fp32 copies of one micro-batch's keys and values for one block's CPU attention
            fixed["cpu_attention_copies"] = 2 * rows * max_length * config.kv_dim * 4

    def slots(n_disk: int, n_ram: int) -> int:
        """RAM for streaming buffers: the CPU's slots, or on a GPU machine the pinned staging of disk reads."""
        streamed = n_disk + (n_ram if on_gpu else 0)
        if on_gpu and not n_disk:
            return 0
        return min(depth + 1, streamed) * bb

    n_rest = layers - weights["gpu"]  # blocks in RAM or on disk
    n_ram = weights["cpu"]

    def ram_needed(n_ram: int) -> int:
        return sum(fixed.values()) + n_ram * bb + slots(n_rest - n_ram, n_ram)

    if ram_budget_bytes is not None:
        # with a budget, RAM holds every block it can: a streamed block is never faster than a resident one
        n_ram = n_rest
        budget = float(ram_budget_bytes)
        if not on_gpu and ram_needed(n_ram) > budget and depth == 0 and weights["disk"] == 0:
            depth = 1  # the policy streams nothing, the budget makes it stream: overlap the reads
        while n_ram > 0 and ram_needed(n_ram) > budget:
            n_ram -= 1
        if ram_needed(n_ram) > budget:
            raise InputError(
                f"RAM budget {budget / 1e9:.3g} GB is too small for this model: it needs at least "
                f"{ram_needed(0) / 1e9:.3g} GB ({', '.join(f'{k} {v / 1e9:.3g} GB' for k, v in fixed.items() if v)}, "
                f"{depth + 1} block buffer(s) of {bb / 1e9:.3g} GB)")
    n_disk = n_rest - n_ram

    # GPU blocks first; among the rest, the disk blocks spread evenly between the RAM ones
    weight_tiers = ["gpu"] * weights["gpu"]
    for on_disk in _spread(n_disk, n_rest):
        weight_tiers.append("disk" if on_disk else "cpu")
    ram = dict(fixed)
    ram["resident_blocks" if not on_gpu else "pinned_blocks"] = n_ram * bb
    ram["stream_buffers"] = slots(n_disk, n_ram)
    return EnginePlan(
        weight_tiers=tuple(weight_tiers), cache_tiers=tuple(cache_tiers), device=device, dtype=dtype, quant=quant,
        prefetch_depth=depth, micro_batch_size=policy.micro_batch_size, num_micro_batches=policy.num_micro_batches,
        ram_budget_bytes=None if ram_budget_bytes is None else int(ram_budget_bytes),
        ram_breakdown={k: int(v) for k, v in ram.items()},
        kv_recompute=recompute, attention_on_cpu=policy.attention_on_cpu,
        activations_ram_fraction=policy.activations.cpu,
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------------------------
# Reading weights from safetensors files
# ---------------------------------------------------------------------------------------------------------------
class SafetensorsFile:
    """One safetensors file, read with positioned reads: tensor bytes go straight into a destination tensor."""

    dtypes = _FILE_DTYPES  # file dtypes it reads (others are listed with dtype None)

    def __init__(self, path: Path):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise InputError(f"{path}: cannot open ({exc.strerror})") from None
        try:
            self.entries = self._read_header()
        except BaseException:
            os.close(self.fd)
            raise

    def _read_header(self) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
        size = os.fstat(self.fd).st_size
        prefix = os.pread(self.fd, 8, 0)
        if len(prefix) < 8:
            raise InputError(f"{self.path}: truncated safetensors file (no header)")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_HEADER_BYTES, size - 8):
            raise InputError(f"{self.path}: corrupt safetensors header (length {length})")
        try:
            header = json.loads(os.pread(self.fd, length, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{self.path}: corrupt safetensors header ({exc})") from None
        data_start = 8 + length
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                start, end = (int(x) for x in info["data_offsets"])
                entries[name] = (self.dtypes.get(info["dtype"]), tuple(int(d) for d in info["shape"]),
                                 data_start + start, data_start + end)
            except (KeyError, TypeError, ValueError):
                raise InputError(f"{self.path}: corrupt safetensors header entry for {name!r}") from None
            if data_start + end > size:
                raise InputError(f"{self.path}: truncated: tensor {name!r} ends past the end of the file")
        return entries

    def read_into(self, name: str, dest: Tensor) -> int:
        """Read tensor `name` into `dest` (any device; converted to dest's dtype); returns the bytes read."""
        entry = self.entries.get(name)
        if entry is None:
            raise InputError(f"{self.path}: tensor {name!r} is missing")
        dtype, shape, start, end = entry
        if dtype is None:
            raise InputError(f"{self.path}: tensor {name!r} has an unsupported dtype (need F32, BF16 or F16)")
        if shape != tuple(dest.shape):
            raise InputError(f"{self.path}: tensor {name!r} has shape {shape}, expected {tuple(dest.shape)}")
        direct = dest.dtype == dtype and dest.device.type == "cpu" and dest.is_contiguous()
        target = dest if direct else torch.empty(shape, dtype=dtype)
        self._pread_into(target.view(-1).view(torch.uint8).numpy(), start, end - start, name)
        if not direct:
            dest.copy_(target)
        return end - start

    def _pread_into(self, buffer, offset: int, length: int, name: str) -> None:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < length:  # one preadv moves at most ~2 GB
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise InputError(f"{self.path}: short read of tensor {name!r} (file truncated?)")
            done += n

    def drop_from_page_cache(self, names: list[str]) -> None:
        """Ask the OS to forget these tensors' pages, so the next read comes from the disk itself."""
        if not hasattr(os, "posix_fadvise"):
            return
        for name in names:
            _, _, start, end = self.entries[name]
            os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def block_destinations(block: Block, config: ModelConfig) -> dict[str, Tensor]:
    """HF tensor name (within a layer) -> the tensor (or the rows of a fused one) of `block` it fills."""
    q, kv, inter = config.q_dim, config.kv_dim, config.intermediate_size
    attn, mlp = block.self_attn, block.mlp
    qkv, gate_up = attn.qkv_proj.weight, mlp.gate_up_proj.weight
    dest = {
        "input_layernorm.weight": block.input_layernorm.weight,
        "post_attention_layernorm.weight": block.post_attention_layernorm.weight,
        "self_attn.q_proj.weight": qkv[:q], "self_attn.k_proj.weight": qkv[q : q + kv],
        "self_attn.v_proj.weight": qkv[q + kv :], "self_attn.o_proj.weight": attn.o_proj.weight,
        "mlp.gate_proj.weight": gate_up[:inter], "mlp.up_proj.weight": gate_up[inter:],
        "mlp.down_proj.weight": mlp.down_proj.weight,
    }
    if config.qkv_bias:
        bias = attn.qkv_proj.bias
        dest.update({"self_attn.q_proj.bias": bias[:q], "self_attn.k_proj.bias": bias[q : q + kv],
                     "self_attn.v_proj.bias": bias[q + kv :]})
    if config.o_bias:
        dest["self_attn.o_proj.bias"] = attn.o_proj.bias
    if config.mlp_bias:
        bias = mlp.gate_up_proj.bias
        dest.update({"mlp.gate_proj.bias": bias[:inter], "mlp.up_proj.bias": bias[inter:],
                     "mlp.down_proj.bias": mlp.down_proj.bias})
    return dest


class BlockReader:
    """Fills Block modules with a layer's weights from the checkpoint's files (thread-safe: positioned reads)."""

    def __init__(self, checkpoint: Checkpoint, drop_page_cache: bool = False):
        self.checkpoint, self.config = checkpoint, checkpoint.config
        self.drop_page_cache = drop_page_cache
        self._files: dict[str, SafetensorsFile] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _file(self, file_name: str) -> SafetensorsFile:
        with self._lock:
            handle = self._files.get(file_name)
            if handle is None:
                path = self.checkpoint.path / file_name
                if not path.is_file():
                    raise InputError(f"{path}: missing shard (listed in the checkpoint's index)")
                handle = self._files[file_name] = SafetensorsFile(path)
            return handle

    def check_layer(self, layer: int) -> None:
        """Fail early (before any weight is read) on a tensor missing from the index or its file."""
        for name in block_tensor_names(self.config, layer):
            (file_name,) = self.checkpoint.files_for([name])
            if name not in self._file(file_name).entries:
                raise InputError(f"{self.checkpoint.path / file_name}: tensor {name!r} is missing")

    def fill(self, block: Block, layer: int) -> int:
        """Read layer `layer` into `block` (whose shapes match any layer); returns the bytes read."""
        prefix = f"model.layers.{layer}."
        total = 0
        read: dict[SafetensorsFile, list[str]] = {}
        for suffix, dest in block_destinations(block, self.config).items():
            name = prefix + suffix
            (file_name,) = self.checkpoint.files_for([name])
            handle = self._file(file_name)
            total += handle.read_into(name, dest)
            read.setdefault(handle, []).append(name)
        if self.drop_page_cache:
            for handle, names in read.items():
                handle.drop_from_page_cache(names)
        block.layer_index = layer
        block.self_attn.window = self.config.window_of(layer)
        self.bytes_read += total
        return total

    def close(self) -> None:
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()


def empty_block(config: ModelConfig, rotary: RotaryTable, dtype: torch.dtype, device: str | torch.device,
                pin: bool = False) -> Block:
    """A Block with uninitialised weights of `dtype` on `device` (pinned host memory when pin=True)."""
    with torch.device("meta"):
        block = Block(config, 0, rotary)
    # not Module.to_empty: it touches (and for a moment doubles) the memory it allocates
    for module in block.modules():
        for name, param in module.named_parameters(recurse=False):
            fresh = torch.empty(param.shape, dtype=dtype, device=device, pin_memory=pin)
            module._parameters[name] = torch.nn.Parameter(fresh, requires_grad=False)
    block.rotary = rotary
    return block


# ---------------------------------------------------------------------------------------------------------------
# Streaming: a pool of slots that load the next blocks while the current one computes
# ---------------------------------------------------------------------------------------------------------------
class _Slot:
    """A block buffer on the compute device; on CUDA also a pinned staging twin (for disk reads) and events."""

    def __init__(self, block: Block, staging: Block | None = None):
        self.block, self.staging = block, staging
        self.loaded = torch.cuda.Event() if staging is not None or _is_cuda(block) else None  # copy done
        self.released = torch.cuda.Event() if self.loaded is not None else None  # compute done with it
        self.has_released = False


def _is_cuda(block: Block) -> bool:
    return block.input_layernorm.weight.device.type == "cuda"


class BlockStreamer:
    """Loads streamed blocks into `depth + 1` slots, in the order the blocks run, cycling from step to step.

    acquire(layer) returns the block (waiting for its load); release(layer) hands the slot back, and every free
    slot immediately starts loading the next streamed block — the following step's first ones after the last.
    """

    def __init__(self, layers: tuple[int, ...], slots: list[_Slot], load):
        self.layers = layers
        self.free: deque[_Slot] = deque(slots)
        self.pending: deque[tuple[int, _Slot, Future]] = deque()
        self.in_use: _Slot | None = None
        self._load = load  # load(layer, slot): runs on the reader thread
        self._next = 0  # index into `layers` of the next block to request
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hivekeeper-reader")

    def _request_more(self) -> None:
        while self.free:
            layer = self.layers[self._next]
            self._next = (self._next + 1) % len(self.layers)
            slot = self.free.popleft()
            self.pending.append((layer, slot, self._executor.submit(self._load, layer, slot)))

    def _restart(self, layer: int) -> None:
        """Out of order (first use, or a step that failed halfway): drop what was prefetched, start at `layer`."""
        self._drain()
        self._next = self.layers.index(layer)

    def _drain(self) -> None:
        while self.pending:
            _, slot, future = self.pending.popleft()
            try:
                future.result()
            except BaseException:
                pass
            self.free.append(slot)
        if self.in_use is not None:
            self.free.append(self.in_use)
            self.in_use = None

    def acquire(self, layer: int) -> Block:
        if self.in_use is not None or not self.pending or self.pending[0][0] != layer:
            self._restart(layer)
            self._request_more()
        _, slot, future = self.pending.popleft()
        self.in_use = slot
        try:
            future.result()
        except BaseException:
            self._restart(layer)
            raise
        if slot.loaded is not None:
            torch.cuda.current_stream().wait_event(slot.loaded)
        self._request_more()
        return slot.block

    def release(self, layer: int) -> None:
        slot, self.in_use = self.in_use, None
        if slot is None:
            return
        if slot.released is not None:
            slot.released.record()
            slot.has_released = True
        self.free.append(slot)
        self._request_more()

    def close(self) -> None:
        self._drain()
        self._executor.shutdown(wait=True)


# ---------------------------------------------------------------------------------------------------------------
# KV cache with a tier per block
# ---------------------------------------------------------------------------------------------------------------
class _TieredStore:
    """Per-block tensors of one session, each block's on its own tier, pre-allocated for max_length tokens.

    "disk" tensors are memory-mapped files (deleted at once, so nothing is left behind); "cpu" ones are pinned when
    a GPU computes. `length` counts the tokens stored, as in KVCache.
    """

    def __init__(self, config: ModelConfig, tiers: tuple[str, ...], batch: int, max_length: int, dtype: torch.dtype,
                 device: str | torch.device, disk_dir: str | os.PathLike | None = None):
        if max_length > config.max_position_embeddings:
            raise InputError(f"max_length {max_length} exceeds the model's context (max_position_embeddings "
                             f"{config.max_position_embeddings})")
        self.device = torch.device(device)
        self.batch, self.max_length, self.length = batch, max_length, 0
        self.tiers, self.dtype, self.disk_dir = tiers, dtype, disk_dir
        self.blocks: list[tuple[Tensor, ...]] = []

    def _allocate(self, shape: tuple[int, ...], tier: str) -> Tensor:
        if tier == "disk":
            return _file_tensor(shape, self.dtype, self.disk_dir)
        if tier == "gpu":
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def _off_device(self, index: int) -> bool:
        return self.device.type == "cuda" and self.tiers[index] != "gpu"

    @property
    def nbytes(self) -> int:
        """Bytes of the per-block tensors on their tiers (scratch buffers on the compute device not counted)."""
        return sum(t.nbytes for block in self.blocks for t in block)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise InputError(f"cannot rewind the KV cache to {length} tokens: it holds {self.length}")
        self.length = length

    def close(self) -> None:
        self.blocks = []


class TieredKVCache(_TieredStore):
    """Keys and values of every block, each block's on its own tier.

    When a GPU computes, a block whose cache is in RAM or on disk is copied into a device scratch buffer for its
    turn and the new tokens written back — unless attention runs next to the cache (`attention_at_home`, the
    attention_on_cpu knob), which needs no scratch: block_variants.forward_with_attention_at_cache writes and reads
    the cache where it is.
    """

    def __init__(self, config: ModelConfig, tiers: tuple[str, ...], batch: int, max_length: int, dtype: torch.dtype,
                 device: str | torch.device, disk_dir: str | os.PathLike | None = None, *,
                 attention_at_home: bool = False):
        super().__init__(config, tiers, batch, max_length, dtype, device, disk_dir)
        shape = self.shape = (batch, config.num_kv_heads, max_length, config.head_dim)
        self.blocks = [(self._allocate(shape, tier), self._allocate(shape, tier)) for tier in tiers]
        needs_scratch = not attention_at_home and any(self._off_device(i) for i in range(len(tiers)))
        self._scratch = (torch.empty(shape, dtype=dtype, device=self.device),
                         torch.empty(shape, dtype=dtype, device=self.device)) if needs_scratch else None
        self.native_span = None  # OffloadedModel's PreparedSpan for these caches (False: they cannot take one)

    def load(self, index: int, position: int) -> tuple[Tensor, Tensor]:
        """(k, v) of block `index` on the compute device, holding the first `position` tokens."""
        if not self._off_device(index):
            return self.blocks[index]
        for home, scratch in zip(self.blocks[index], self._scratch):
            scratch[:, :, :position].copy_(home[:, :, :position], non_blocking=True)
        return self._scratch

    def store(self, index: int, position: int, tokens: int, rows: slice = slice(None)) -> None:
        """Write the new tokens' K/V (of these rows) back home when the block computed on a scratch copy."""
        if not self._off_device(index):
            return
        end = position + tokens
        for home, scratch in zip(self.blocks[index], self._scratch):
            home[rows, :, position:end].copy_(scratch[rows, :, position:end])

    def close(self) -> None:
        super().close()
        self._scratch = None


class RecomputeCache(_TieredStore):
    """kv_cache_mode "recompute": each block's INPUT hidden states [batch, max_length, hidden] instead of its K and
    V, on the block's cache tier. Every step recomputes K, V of the stored prefix into one scratch pair on the
    compute device (one micro-batch's rows) and runs the block on them; with a GPU, a prefix kept in RAM or on disk
    is first copied to a device buffer (hidden states, not K and V, cross the link).
    """

    def __init__(self, config: ModelConfig, tiers: tuple[str, ...], batch: int, max_length: int, dtype: torch.dtype,
                 device: str | torch.device, disk_dir: str | os.PathLike | None = None, *, rows: int | None = None):
        super().__init__(config, tiers, batch, max_length, dtype, device, disk_dir)
        shape = self.shape = (batch, max_length, config.hidden_size)
        self.blocks = [(self._allocate(shape, tier),) for tier in tiers]
        rows = min(rows or batch, batch)
        kv_shape = (rows, config.num_kv_heads, max_length, config.head_dim)
        self._keys = torch.empty(kv_shape, dtype=dtype, device=self.device)
        self._values = torch.empty(kv_shape, dtype=dtype, device=self.device)
        off = any(self._off_device(i) for i in range(len(tiers)))
        self._prefix = torch.empty((rows, max_length, config.hidden_size), dtype=dtype, device=self.device) \
            if off else None

    def run_block(self, index: int, block: Block, hidden: Tensor, rows: slice, position: int,
                  rope: tuple[Tensor, Tensor]) -> Tensor:
        """Block `index` on hidden [b, t, hidden] (the micro-batch `rows`) at `position`: store its inputs, then
        recompute K, V of the prefix and run the block."""
        b, t, _ = hidden.shape
        home = self.blocks[index][0][rows]  # [b, max_length, hidden]
        home[:, position : position + t].copy_(hidden)
        prefix = home[:, :position]
        if position and self._off_device(index):
            prefix = self._prefix[:b, :position].copy_(prefix, non_blocking=True)
        return forward_recomputing_kv(block, hidden, prefix, position, rope, self._keys[:b], self._values[:b])

    def close(self) -> None:
        super().close()
        self._keys = self._values = self._prefix = None


def keep_between_blocks(hidden: Tensor, home: torch.device) -> Tensor:
    """Hidden states moved to where they wait for the next block: pinned RAM when they leave a GPU (the
    activations knob), the device when they come from RAM, as they are when already there."""
    if hidden.device.type == home.type:
        return hidden
    if home.type == "cpu":
        pinned = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
        return pinned.copy_(hidden, non_blocking=True)
    return hidden.to(home, non_blocking=True)


def _file_tensor(shape: tuple[int, ...], dtype: torch.dtype, folder) -> Tensor:
    """A tensor backed by a shared memory-mapped file on disk; the file is unlinked at once (the mapping stays)."""
    numel = math.prod(shape)
    handle, path = tempfile.mkstemp(prefix="hivekeeper-kv-", dir=folder)
    try:
        os.ftruncate(handle, numel * _itemsize(dtype))
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    finally:
        os.close(handle)
        os.unlink(path)
    return tensor.view(shape)


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------
class OffloadedSpan:
    """All blocks of the model, run in order with the engine's placement: span(hidden, cache) -> hidden."""

    def __init__(self, model: "OffloadedModel"):
        self._model = model
        self.start, self.end = 0, model.config.num_layers

    def allocate_cache(self, batch: int, max_length: int) -> TieredKVCache | RecomputeCache:
        """The session's cache as the plan says: K and V (TieredKVCache) or block inputs (RecomputeCache)."""
        m, plan = self._model, self._model.plan
        args = (m.config, plan.cache_tiers, batch, max_length, plan.dtype, m.device, m.cache_dir)
        if plan.kv_recompute:
            rows = micro_batch_rows(batch, plan.micro_batch_size, plan.num_micro_batches)
            return RecomputeCache(*args, rows=rows)
        at_home = any(plan.attention_tier(i) != plan.compute_tier for i in range(len(plan.cache_tiers)))
        return TieredKVCache(*args, attention_at_home=at_home)

    def __call__(self, hidden: Tensor, cache: TieredKVCache) -> Tensor:
        return self._model.forward_blocks(hidden, cache)


class OffloadedModel:
    """A checkpoint run by an EnginePlan: `embedding`, `span` and `head`, the runner shape generation.py uses."""

    def __init__(self, path: str | Path, plan: EnginePlan, *, cache_dir: str | os.PathLike | None = None,
                 drop_page_cache: bool = False, quant_store_dir: str | os.PathLike | None = None):
        """quant_store_dir: where int8/nf4 blocks that stream (and, on a CPU, resident ones) are kept, quantized
        once (default: the data dir's quantized/ folder; see quant_store.py)."""
        self.path = Path(path)
        self.plan = plan
        self.device = torch.device(plan.device)
        self.cache_dir = cache_dir
        self.checkpoint = open_checkpoint(self.path)  # a checkpoint folder or a GGUF
        config = self.config = self.checkpoint.config
        if len(plan.weight_tiers) != config.num_layers:
            raise InputError(f"the plan places {len(plan.weight_tiers)} blocks; the model has {config.num_layers}")
        self.span = OffloadedSpan(self)
        self.reader = GGUFBlockReader(self.checkpoint) if isinstance(self.checkpoint, GGUFCheckpoint) \
            else BlockReader(self.checkpoint, drop_page_cache)
        for layer in range(config.num_layers):
            self.reader.check_layer(layer)
        self.rotary = RotaryTable(config)
        dtype, on_gpu = plan.dtype, self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if on_gpu and plan.streamed_blocks else None
        self.streamer: BlockStreamer | None = None
        self.bytes_streamed = 0  # weight bytes read from disk for streamed blocks (the reader thread adds)
        self.quant_store = None  # int8/nf4 blocks come from their quantized copies (see below)
        self._stream_reader = self.reader
        try:
            # int8/nf4 blocks that stream, and on a CPU the resident ones too (bitsandbytes quantizes slowly there:
            # ~6 s for a 125M model at every start), come from the quantized store, built once
            stored = tuple(range(config.num_layers)) if self.device.type == "cpu" else plan.streamed_blocks
            if plan.quant != "none" and stored and isinstance(self.checkpoint, GGUFCheckpoint):
                raise InputError(f"{self.path}: a GGUF's weights are already quantized; run it without --quant "
                                 f"{plan.quant} (int8/nf4 re-quantize safetensors checkpoints)")
            if plan.quant != "none" and stored:
                from hivekeeper.core.runtime.quant.store import QuantStore  # it imports this module

                norm_dtype = _quant_compute_dtype(dtype, self.device)
                self.quant_store = QuantStore.open(self.checkpoint, plan.quant, norm_dtype, stored,
                                                   root=quant_store_dir, drop_page_cache=drop_page_cache)
                if plan.streamed_blocks:
                    self._stream_reader = self.quant_store
            self.embedding = load_embedding(self.path, dtype=dtype, device=self.device)
            self.head = load_head(self.path, dtype=dtype, device=self.device,
                                  embedding=self.embedding if config.tie_word_embeddings else None,
                                  tall_by_column=not plan.streamed_blocks)
            self.resident: dict[int, Block] = {}  # on the compute device
            self.pinned: dict[int, Block] = {}  # RAM blocks streamed to the GPU
            for layer, tier in enumerate(plan.weight_tiers):
                if tier == plan.compute_tier:
                    self.resident[layer] = self._load_resident(layer)
                elif tier == "cpu":
                    self.pinned[layer] = self._stream_buffer("cpu", pin=True)
                    self._stream_reader.fill(self.pinned[layer], layer)
            if self.device.type == "cpu" and plan.quant == "none" and not plan.streamed_blocks:
                # in the order a decode step reads them (not under a RAM budget: packing holds a tensor twice)
                pack_in_order([self.resident[layer] for layer in sorted(self.resident)] + [self.head])
            streamed = plan.streamed_blocks
            if streamed:
                disk = any(plan.weight_tiers[i] == "disk" for i in streamed)
                slots = [_Slot(self._stream_buffer(self.device),
                               self._stream_buffer("cpu", pin=True) if on_gpu and disk else None)
                         for _ in range(min(plan.prefetch_depth + 1, len(streamed)))]
                self.streamer = BlockStreamer(streamed, slots, self._load_slot)
        except BaseException:
            self.close()
            raise

    def _stream_buffer(self, device: str | torch.device, pin: bool = False) -> Block:
        """An unfilled block for streamed weights: quantized like the store's blocks, or of the plan's dtype."""
        if self.quant_store is not None:
            return self.quant_store.empty_block(self.rotary, device, pin=pin)
        return empty_block(self.config, self.rotary, self.plan.dtype, device, pin=pin)

    def _stream_tensors(self, block: Block) -> list[Tensor]:
        """The tensors a streamed block's weights occupy, in the same order for every buffer of this model."""
        if self.quant_store is not None:
            return list(quantized_tensors(block).values())
        return list(block.parameters())

    def _load_resident(self, layer: int) -> Block:
        if self.plan.quant != "none" and self.device.type == "cpu":
            block = self.quant_store.empty_block(self.rotary, self.device, cpu_repack=True)  # kept: may repack
            self.quant_store.fill(block, layer)
            return block
        if self.plan.quant != "none":  # quantized on the GPU as it is loaded (fast there)
            return load_block(self.checkpoint, layer, dtype=self.plan.dtype, device=self.device,
                              quant=self.plan.quant, rotary=self.rotary)
        block = empty_block(self.config, self.rotary, self.plan.dtype, self.device)
        self.reader.fill(block, layer)
        if not self.plan.streamed_blocks:  # CPU fp32 only: faster decode matmuls; not under a RAM budget that
            store_tall_linears_by_column(block)  # streams blocks (the re-store briefly holds a matrix twice)
        return block

    def _load_slot(self, layer: int, slot: _Slot) -> None:
        """Runs on the reader thread: bring block `layer` into `slot` (disk read and/or copy to the GPU)."""
        if slot.loaded is None:  # the CPU computes: read from disk straight into the slot
            self.bytes_streamed += self._stream_reader.fill(slot.block, layer)
            return
        if self.plan.weight_tiers[layer] == "disk":
            slot.loaded.synchronize()  # the previous copy out of the staging buffer is finished
            self.bytes_streamed += self._stream_reader.fill(slot.staging, layer)
            source = slot.staging
        else:
            source = self.pinned[layer]
        with torch.cuda.stream(self._copy_stream):
            if slot.has_released:
                self._copy_stream.wait_event(slot.released)  # compute is done with the old weights
            for dest, src in zip(self._stream_tensors(slot.block), self._stream_tensors(source), strict=True):
                dest.copy_(src, non_blocking=True)
            slot.loaded.record(self._copy_stream)
            slot.block.layer_index, slot.block.self_attn.window = layer, self.config.window_of(layer)

    def _micro_batches(self, batch: int) -> list[slice]:
        size = self.plan.micro_batch_size
        if self.plan.num_micro_batches <= 1 or size >= batch:
            return [slice(0, batch)]
        return [slice(i, min(i + size, batch)) for i in range(0, batch, size)]

    def _block_runner(self, layer: int, block: Block, cache: TieredKVCache | RecomputeCache, position: int,
                      rope: tuple[Tensor, Tensor]):
        """run(x, rows) -> block `layer`'s output for one micro-batch's hidden states x (the cache's `rows`), with
        the cache where the plan keeps it (K/V or block inputs) and the attention where the plan runs it."""
        if isinstance(cache, RecomputeCache):
            return lambda x, rows: cache.run_block(layer, block, x, rows, position, rope)
        if self.plan.attention_tier(layer) != self.plan.compute_tier:
            k, v = cache.blocks[layer]
            dtype = cpu_attention_dtype(self.plan.dtype)
            return lambda x, rows: forward_with_attention_at_cache(block, x, k[rows], v[rows], position, rope, dtype)
        k, v = cache.load(layer, position)

        def run(x: Tensor, rows: slice) -> Tensor:
            out = block(x, k[rows], v[rows], position, rope)
            cache.store(layer, position, x.shape[1], rows)
            return out

        return run

    def forward_blocks(self, hidden: Tensor, cache: TieredKVCache | RecomputeCache) -> Tensor:
        """hidden [batch, new_tokens, hidden] through every block; new tokens at positions cache.length, ..."""
        batch, t, width = hidden.shape
        position = cache.length
        if width != self.config.hidden_size or batch != cache.batch:
            raise InputError(f"hidden states {tuple(hidden.shape)} do not match the cache (batch {cache.batch}) "
                             f"or the model (hidden {self.config.hidden_size})")
        if position + t > cache.max_length:
            raise InputError(f"{position + t} tokens exceed the KV cache's max_length {cache.max_length}")
        hidden = hidden.to(device=self.device, dtype=self.plan.dtype)
        rope = self.rotary.get(position, t, hidden.device, hidden.dtype)
        native = self._native_decode(hidden, cache, position, rope)
        if native is not None:
            cache.length = position + t
            return native
        rows = self._micro_batches(batch)
        # between blocks, each micro-batch's hidden states live where the plan says: the device or pinned RAM
        homes = [self.device if tier == "gpu" else torch.device("cpu")
                 for tier in self.plan.activation_tiers(len(rows))]
        parts = [keep_between_blocks(hidden[r], home) for r, home in zip(rows, homes)]
        for layer in range(self.config.num_layers):
            block = self.resident.get(layer)
            streamed = block is None
            if streamed:
                block = self.streamer.acquire(layer)
            try:
                run = self._block_runner(layer, block, cache, position, rope)
                for i, (r, home) in enumerate(zip(rows, homes)):
                    parts[i] = keep_between_blocks(run(parts[i].to(self.device, non_blocking=True), r), home)
            finally:
                if streamed:
                    self.streamer.release(layer)
        cache.length = position + t
        if len(parts) == 1:
            return parts[0].to(self.device)
        return torch.cat([part.to(self.device, non_blocking=True) for part in parts])

    def _native_decode(self, hidden: Tensor, cache: TieredKVCache | RecomputeCache, position: int,
                       rope: tuple[Tensor, Tensor]) -> Tensor | None:
        """One token per row through every block in one call of the C kernels (cpu_decode.PreparedSpan) when all
        blocks are resident in RAM with their K/V caches and the batch is one micro-batch of at most
        native_kernels.MAX_ROWS rows, else None (the layer-by-layer loop runs)."""
        if (hidden.shape[1] != 1 or self.device.type != "cpu" or not isinstance(cache, TieredKVCache)
                or len(self.resident) != self.config.num_layers or len(self._micro_batches(hidden.shape[0])) != 1):
            return None
        prepared = cache.native_span
        if prepared is None:  # first step with this cache
            layers = range(self.config.num_layers)
            if any(self.plan.attention_tier(i) != self.plan.compute_tier or cache._off_device(i) for i in layers):
                prepared = False
            else:
                prepared = cpu_decode.PreparedSpan.prepare([self.resident[i] for i in layers], cache.blocks, hidden)
            cache.native_span = prepared or False  # False: not this cache (None would ask again every step)
        return prepared(cache.blocks, hidden, position, rope) if prepared else None

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        if getattr(self, "quant_store", None) is not None:
            self.quant_store.close()
        self.reader.close()
        self.checkpoint.close()

    def __enter__(self) -> "OffloadedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
