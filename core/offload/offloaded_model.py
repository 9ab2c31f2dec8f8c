"""The offloaded model: a checkpoint's blocks run where an EnginePlan (placement.py) puts them.

Each block's weights live on one tier: resident on the compute device, in CPU RAM (pinned when a GPU computes), or
on disk, where they stay in the checkpoint's files and are read on demand into the streamer's slots (streaming.py)
by the block reader (weights.py). The KV cache gets a tier per block too (tiered_cache.py); batch and micro-batches
follow the policy (each block's weights are fetched once per step and every micro-batch runs through them,
FlexGen's block schedule; on a CPU with K/V kept, a decode step runs the whole batch at once and a prefill
chunk larger parts, see _step_rows).

    plan = place_model(config, policy, device="cpu", dtype=torch.float32, batch=1, max_length=256,
                       ram_budget_bytes=500e6)
    model = OffloadedModel(path, plan)          # .embedding, .span, .head: the runner shape generation.py uses
    cache = model.span.allocate_cache(batch=1, max_length=256)
    logits = model.head(model.span(model.embedding(ids), cache))

Embeddings and LM head come from checkpoint.py's loaders. The CPU and CUDA paths share everything but the slot
loader; CUDA adds pinned RAM blocks, a copy stream and events. The policy's other knobs: `kv_recompute` keeps block
inputs instead of K/V (RecomputeCache), `attention_on_cpu` runs attention next to a RAM/disk cache, `activations`
keeps micro-batches' hidden states in pinned RAM between blocks (the block forwards for the first two are in
block_variants.py; docs/local-inference.md has what runs where).
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import torch
from torch import Tensor

from hivekeeper.planner.errors import InputError

from hivekeeper.core.machine.cpu_dtype import runs_natively_on_cpu
from hivekeeper.core.offload import half_store
from hivekeeper.core.offload.block_variants import forward_with_attention_at_cache
from hivekeeper.core.offload.packed_stream import PackedBlockReader, load_outside, release_mapped_pages
from hivekeeper.core.offload.placement import (EnginePlan, cpu_attention_dtype, cpu_step_part,
                                                  micro_batch_rows, workspace_bytes)
from hivekeeper.core.offload.streaming import BlockStreamer, Slot
from hivekeeper.core.offload.tiered_cache import RecomputeCache, TieredKVCache, keep_between_blocks
from hivekeeper.core.offload.weights import BlockReader, empty_block
from hivekeeper.core.runtime.checkpoint import (load_block, load_embedding, load_head, open_checkpoint,
                                                quant_compute_dtype)
from hivekeeper.core.runtime.gguf import GGUFBlockReader, GGUFCheckpoint, packed_by_default
from hivekeeper.core.runtime.kernels import cpu_decode
from hivekeeper.core.runtime.kernels.cpu_matmul import (linear, pack_in_order, store_linears_for_decode,
                                                        use_blas_threads)
from hivekeeper.core.runtime.model import Block, ModelConfig, RotaryTable, add_prompt
from hivekeeper.core.runtime.quant.bnb import quantized_tensors
from hivekeeper.core.runtime.quant.store import QuantStore


def use_physical_cores() -> int:
    """Set the CPU thread layout for inference (see cpu_matmul.use_blas_threads); returns the matmul threads."""
    return use_blas_threads()


def warm_up_runtime() -> None:
    """Run a small decoder block once (a prefill chunk, then a decode step of a few rows) on scratch weights, in the
    thread layout set, in fp32 and in each 16-bit dtype this CPU computes natively, so that what the engine's first
    step would add to the process is there now: the code pages of the torch and numpy kernels it calls (~14 MB of
    libtorch_cpu.so measured for fp32, more for the bf16 kernels), torch's thread pool, OpenBLAS's per-thread buffers.
    They are runtime, counted in the baseline a RAM budget is measured from, not in the budget; taken after the
    baseline, they showed as ~15 MB over it. Also sets how freed memory is returned (keep_heap_small)."""
    keep_heap_small()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        if runs_natively_on_cpu(dtype, rows=None):  # at any rows: a batch plan computes bf16 where a chat one does not
            _run_small_block(dtype)
    _return_freed_memory()


def _run_small_block(dtype: torch.dtype) -> None:
    config = ModelConfig.from_hf_config({"model_type": "llama", "vocab_size": 512, "hidden_size": 512,
                                         "intermediate_size": 1024, "num_hidden_layers": 1,
                                         "num_attention_heads": 8, "num_key_value_heads": 4,
                                         "max_position_embeddings": 64})
    rotary, cpu = RotaryTable(config), torch.device("cpu")
    block = empty_block(config, rotary, dtype, cpu)
    for param in block.parameters():
        param.fill_(0.01)
    shape = (4, config.num_kv_heads, 32, config.head_dim)
    k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    with torch.inference_mode():
        hidden = block(torch.ones(4, 16, config.hidden_size, dtype=dtype), k, v, 0, rotary.get(0, 16, cpu, dtype))
        hidden = block(hidden[:, -1:], k, v, 16, rotary.get(16, 1, cpu, dtype))
        torch.softmax(linear(hidden, torch.ones(config.vocab_size, config.hidden_size, dtype=dtype)), -1).argmax(-1)


# glibc's mallopt parameter: allocations from this size up get their own memory map, unmapped when freed
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20
# ... once a model is loaded: activations below it come from the heaps and are reused step after step. Issue 23,
# session 16: at 1 MiB every activation of SmolLM2's batch-64 prefill (576 wide: 1 MiB from ~455 rows) was mapped
# fresh and page-faulted in every block, 17,600-29,600 faults and 34-49 ms a block against 0 and 27 ms
RUN_MMAP_THRESHOLD_BYTES = 32 << 20


def set_mmap_threshold(nbytes: int) -> None:
    """Allocations of `nbytes` or more get their own memory map, returned to the OS when freed (glibc's fixed mmap
    threshold; no-op where the C library is not glibc)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, nbytes)
    except (OSError, AttributeError):
        pass


def reuse_activations() -> None:
    """After loading: allocations below RUN_MMAP_THRESHOLD_BYTES come from glibc's heaps (the conversion temporaries
    that keep_heap_small is for are gone by then; the heaps then hold what a step's activations need)."""
    set_mmap_threshold(RUN_MMAP_THRESHOLD_BYTES)


def keep_heap_small() -> None:
    """Have every allocation of 1 MiB or more returned to the OS when freed (glibc: a fixed mmap threshold).

    By default glibc raises its threshold to the largest block freed so far (up to 32 MB), and from then on keeps
    freed blocks of that size in its heaps. A 16-bit plan over an fp32 checkpoint converts every tensor it reads
    through a temporary of the file's dtype (tens of MB for an embedding), so the heaps kept ~25 MB of freed
    temporaries, part of what put a bf16 run 17% over its RAM budget (with the bf16 kernels' code, see
    warm_up_runtime). No-op where the C library is not glibc. Loading sets it (OffloadedModel); once loaded, the
    model runs with reuse_activations's."""
    set_mmap_threshold(MMAP_THRESHOLD_BYTES)


def _return_freed_memory() -> None:
    """Give memory just freed back to the OS (glibc keeps freed heap memory): after the warm-up, so that a baseline
    taken then holds the runtime only, and after loading, for the conversion temporaries."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


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


class StageSeconds:
    """Where a run's block passes spent their time, by phase ("prefill": steps of several tokens, "decode": one
    token): the whole pass through the blocks, waiting for a streamed block's read (disk -> RAM, or RAM -> GPU), and
    the KV cache's own traffic (loading a disk-tier cache, storing the new K, V, releasing it); the rest of a pass is
    the blocks' compute. Seconds of the host's clock: exact on a CPU, where the compute is synchronous; on a GPU
    they say where the host waited. bench/offload_throughput.py writes the plan's predicted terms beside them
    (issue 22: which term of a batch plan's prediction is off)."""

    KEYS = ("passes", "blocks_s", "waiting_for_reads_s", "kv_cache_s")

    def __init__(self):
        self.by_phase: dict[str, dict[str, float]] = {}

    def add(self, phase: str, key: str, seconds: float) -> None:
        totals = self.by_phase.setdefault(phase, dict.fromkeys(self.KEYS, 0.0))
        totals[key] += seconds

    def as_dict(self) -> dict[str, dict[str, float]]:
        """Per phase: the sums, and the compute (blocks less waiting for reads and the cache's traffic)."""
        return {phase: {**{k: round(v, 6) for k, v in totals.items()},
                        "compute_s": round(totals["blocks_s"] - totals["waiting_for_reads_s"]
                                           - totals["kv_cache_s"], 6)}
                for phase, totals in self.by_phase.items()}


class OffloadedModel:
    """A checkpoint run by an EnginePlan: `embedding`, `span` and `head`, the runner shape generation.py uses."""

    def __init__(self, path: str | Path, plan: EnginePlan, *, cache_dir: str | os.PathLike | None = None,
                 drop_page_cache: bool = False, quant_store_dir: str | os.PathLike | None = None):
        """quant_store_dir: where int8/nf4 blocks that stream (and, on a CPU, resident ones) are kept, quantized
        once (default: the data dir's quantized/ folder; see runtime/quant/store.py)."""
        keep_heap_small()
        self.path = Path(path)
        self.plan = plan
        self.device = torch.device(plan.device)
        self.cache_dir = cache_dir
        # a checkpoint folder or a GGUF (whose resident CPU fp32 blocks keep Q8_0/Q4_0/Q4_1 linears packed, as a
        # swarm server's span does: gguf.packed_by_default; not where the plan names a float format)
        self.checkpoint = open_checkpoint(self.path, packed=packed_by_default() and not plan.gguf_dequantized)
        config = self.config = self.checkpoint.config
        if len(plan.weight_tiers) != config.num_layers:
            raise InputError(f"the plan places {len(plan.weight_tiers)} blocks; the model has {config.num_layers}")
        self.span = OffloadedSpan(self)
        self.reader = GGUFBlockReader(self.checkpoint) if isinstance(self.checkpoint, GGUFCheckpoint) \
            else BlockReader(self.checkpoint, drop_page_cache)
        for layer in range(config.num_layers):
            self.reader.check_layer(layer)
        dtype, on_gpu = plan.dtype, self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if on_gpu and plan.streamed_blocks else None
        self.streamer: BlockStreamer | None = None
        self.bytes_streamed = 0  # weight bytes read from disk for streamed blocks (the reader thread adds)
        self.stage_seconds = StageSeconds()  # where the block passes spent their time, by phase
        self.quant_store = None  # int8/nf4 blocks come from their quantized copies (see below)
        self.half_store = None  # a 16-bit plan's streamed blocks over an fp32 file: their 16-bit copies (half_store)
        self._stream_reader = self.reader
        self.rotary = RotaryTable(config)
        # a GGUF kept packed (CPU fp32): resident blocks, slots, head and embedding hold the file's packed bytes,
        # read with pread into buffers of their own (the memory map's pages would count in RSS a second time)
        self.packed_reader = PackedBlockReader(self.checkpoint, self.rotary, drop_page_cache) \
            if self._packed() else None
        try:
            # int8/nf4 blocks that stream, and on a CPU the resident ones too (bitsandbytes quantizes slowly there:
            # ~6 s for a 125M model at every start), come from the quantized store, built once
            stored = tuple(range(config.num_layers)) if self.device.type == "cpu" else plan.streamed_blocks
            if plan.quant != "none" and stored and isinstance(self.checkpoint, GGUFCheckpoint):
                raise InputError(f"{self.path}: a GGUF's weights are already quantized; run it without --quant "
                                 f"{plan.quant} (int8/nf4 re-quantize safetensors checkpoints)")
            if plan.quant != "none" and stored:
                norm_dtype = quant_compute_dtype(dtype, self.device)
                self.quant_store = QuantStore.open(self.checkpoint, plan.quant, norm_dtype, stored,
                                                   root=quant_store_dir, drop_page_cache=drop_page_cache)
                if plan.streamed_blocks:
                    self._stream_reader = self.quant_store
            if (plan.streamed_blocks and plan.quant == "none" and isinstance(self.reader, BlockReader)
                    and half_store.wanted(self.checkpoint, dtype)):  # a 16-bit plan over an fp32 file
                self.half_store = half_store.HalfStore.open(self.checkpoint, dtype, plan.streamed_blocks,
                                                            drop_page_cache=drop_page_cache)
                self._stream_reader = self.half_store
            outside = load_outside(self.packed_reader) if self.packed_reader is not None else None
            if outside is not None:
                self.embedding, self.head = outside
            else:
                self.embedding = load_embedding(self.path, dtype=dtype, device=self.device)
                self.head = load_head(self.path, dtype=dtype, device=self.device,
                                      embedding=self.embedding if config.tie_word_embeddings else None,
                                      decode_layout=not plan.streamed_blocks,
                                      packed=getattr(self.checkpoint, "packed", False))
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
                slots = [Slot(self._stream_buffer(self.device, layer=streamed[0]),
                               self._stream_buffer("cpu", pin=True) if on_gpu and disk else None)
                         for _ in range(min(plan.prefetch_depth + 1, len(streamed)))]
                self.streamer = BlockStreamer(streamed, slots, self._load_slot)
        except BaseException:
            self.close()
            raise
        if isinstance(self.checkpoint, GGUFCheckpoint):
            release_mapped_pages(self.checkpoint)  # what small reads (norms, biases) left mapped
        _return_freed_memory()  # the temporaries of converting reads (a 16-bit plan over an fp32 file)
        reuse_activations()

    def _stream_buffer(self, device: str | torch.device, pin: bool = False, layer: int = 0) -> Block:
        """An unfilled block for streamed weights: quantized like the store's blocks, packed like a GGUF's layer
        `layer` (packed_stream), or of the plan's dtype."""
        if self.packed_reader is not None:
            return self.packed_reader.empty_block(layer)
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
        if self.packed_reader is not None:  # a GGUF's CPU fp32 block with its linears packed, read with pread
            return self.packed_reader.load_block(layer)
        if self.plan.quant != "none":  # quantized on the GPU as it is loaded (fast there)
            return load_block(self.checkpoint, layer, dtype=self.plan.dtype, device=self.device,
                              quant=self.plan.quant, rotary=self.rotary)
        block = empty_block(self.config, self.rotary, self.plan.dtype, self.device)
        self.reader.fill(block, layer)
        if not self.plan.streamed_blocks:  # CPU fp32 only: faster decode matmuls; not under a RAM budget that
            store_linears_for_decode(block)  # streams blocks (the re-store briefly holds a matrix twice)
        return block

    def _packed(self) -> bool:
        """Whether resident blocks keep a GGUF's block-quantized linears packed (CPU, fp32, no --quant)."""
        return (isinstance(self.checkpoint, GGUFCheckpoint) and self.checkpoint.packed and self.plan.quant == "none"
                and self.device.type == "cpu" and self.plan.dtype == torch.float32)

    def _load_slot(self, layer: int, slot: Slot) -> None:
        """Runs on the reader thread: bring block `layer` into `slot` (disk read and/or copy to the GPU)."""
        if self.packed_reader is not None:  # packed bytes into the packed slot (or a block built for the layer)
            slot.block, read = self.packed_reader.fill(slot.block, layer)
            self.bytes_streamed += read
            return
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

    def _step_rows(self, batch: int, tokens: int, position: int, cache: TieredKVCache | RecomputeCache) -> list[slice]:
        """The micro-batches one step runs through each block. On a GPU, or with recompute, the plan's. On a CPU with
        K/V kept, a decode step runs the whole batch at once (its activations are a few MB; 128 rows multiply in
        about the time of 32), and a prefill chunk merges the plan's micro-batches until each part holds at least
        CPU_PART_TOKENS token rows (placement.cpu_step_part): below that a CPU multiplies few rows poorly (bf16, AMX,
        one thread, a block of the 350 MB bench model over 128 prompts of 17 tokens: 195 ms of CPU in 4 parts, 174
        in 2, 176 in 1; busy machine), above it a part only adds activations (the whole batch at once went 12.7%
        over that bench's RAM budget, two parts stay within it). Only where the attention scores of a part's rows
        fit the activations the placement counts for that part (placement.workspace_bytes); else the plan's."""
        plan = self._micro_batches(batch)
        if self.device.type != "cpu" or not isinstance(cache, TieredKVCache):
            return plan
        config = self.config
        part = cpu_step_part(batch, plan[0].stop - plan[0].start, tokens)
        scores = part * config.num_heads * tokens * (position + tokens) * 4  # fp32 at most
        if scores > workspace_bytes(config, batch, tokens, self.plan.dtype, part):
            return plan
        return [slice(i, min(i + part, batch)) for i in range(0, batch, part)]

    def _micro_batches(self, batch: int) -> list[slice]:
        size = self.plan.micro_batch_size
        if self.plan.num_micro_batches <= 1 or size >= batch:
            return [slice(0, batch)]
        return [slice(i, min(i + size, batch)) for i in range(0, batch, size)]

    def _block_runner(self, layer: int, block: Block, cache: TieredKVCache | RecomputeCache, position: int,
                      rope: tuple[Tensor, Tensor], phase: str):
        """run(x, rows) -> block `layer`'s output for one micro-batch's hidden states x (the cache's `rows`), with
        the cache where the plan keeps it (K/V or block inputs) and the attention where the plan runs it (a K/V
        cache's load and stores timed into stage_seconds under `phase`)."""
        if isinstance(cache, RecomputeCache):
            return lambda x, rows: cache.run_block(layer, block, x, rows, position, rope)
        if self.plan.attention_tier(layer) != self.plan.compute_tier:
            k, v = cache.blocks[layer]
            dtype = cpu_attention_dtype(self.plan.dtype)
            return lambda x, rows: forward_with_attention_at_cache(block, x, k[rows], v[rows], position, rope, dtype)
        loading = time.perf_counter()
        k, v = cache.load(layer, position)
        self.stage_seconds.add(phase, "kv_cache_s", time.perf_counter() - loading)

        def run(x: Tensor, rows: slice) -> Tensor:
            out = block(x, k[rows], v[rows], position, rope)
            storing = time.perf_counter()
            cache.store(layer, position, x.shape[1], rows)
            self.stage_seconds.add(phase, "kv_cache_s", time.perf_counter() - storing)
            return out

        return run

    def forward_blocks(self, hidden: Tensor, cache: TieredKVCache | RecomputeCache,
                       prompts: Tensor | None = None) -> Tensor:
        """hidden [batch, new_tokens, hidden] through every block; new tokens at positions cache.length, ...
        prompts: deep prompts [blocks, batch, prefix, hidden] added to each block's input (model.add_prompt; the
        trained prompts of core/finetune, run once at the start of a cache)."""
        batch, t, width = hidden.shape
        position = cache.length
        if width != self.config.hidden_size or batch != cache.batch:
            raise InputError(f"hidden states {tuple(hidden.shape)} do not match the cache (batch {cache.batch}) "
                             f"or the model (hidden {self.config.hidden_size})")
        if position + t > cache.max_length:
            raise InputError(f"{position + t} tokens exceed the KV cache's max_length {cache.max_length}")
        hidden = hidden.to(device=self.device, dtype=self.plan.dtype)
        rope = self.rotary.get(position, t, hidden.device, hidden.dtype)
        native = self._native_decode(hidden, cache, position, rope) if prompts is None else None
        if native is not None:
            cache.length = position + t
            return native
        rows = self._step_rows(batch, t, position, cache)
        # between blocks, each micro-batch's hidden states live where the plan says: the device or pinned RAM
        homes = [self.device if tier == "gpu" else torch.device("cpu")
                 for tier in self.plan.activation_tiers(len(rows))]
        parts = [keep_between_blocks(hidden[r], home) for r, home in zip(rows, homes)]
        phase, started = ("decode" if t == 1 else "prefill"), time.perf_counter()
        for layer in range(self.config.num_layers):
            self._run_layer(layer, parts, rows, homes, cache, position, rope, prompts, phase)
        self.stage_seconds.add(phase, "blocks_s", time.perf_counter() - started)
        self.stage_seconds.add(phase, "passes", 1)
        cache.length = position + t
        if len(parts) == 1:
            return parts[0].to(self.device)
        return torch.cat([part.to(self.device, non_blocking=True) for part in parts])

    def _run_layer(self, layer: int, parts: list[Tensor], rows: list[slice], homes: list[torch.device],
                   cache: TieredKVCache | RecomputeCache, position: int, rope: tuple[Tensor, Tensor],
                   prompts: Tensor | None, phase: str) -> None:
        """Block `layer` (resident, or acquired from the streamer) over every micro-batch's hidden states in
        `parts`, replaced by its outputs: the zig-zag schedule's inner loop. Its waits for the block's read and the
        cache's traffic go into stage_seconds under `phase`."""
        block = self.resident.get(layer)
        streamed = block is None
        if streamed:
            waited = time.perf_counter()
            block = self.streamer.acquire(layer)
            self.stage_seconds.add(phase, "waiting_for_reads_s", time.perf_counter() - waited)
        try:
            run = self._block_runner(layer, block, cache, position, rope, phase)
            for i, (r, home) in enumerate(zip(rows, homes)):
                x = parts[i].to(self.device, non_blocking=True)
                x = x if prompts is None else add_prompt(x, prompts[layer, r])
                parts[i] = keep_between_blocks(run(x, r), home)
            released = time.perf_counter()
            cache.release(layer)  # a disk-tier cache leaves RSS after its block's turn
            self.stage_seconds.add(phase, "kv_cache_s", time.perf_counter() - released)
        finally:
            if streamed:
                self.streamer.release(layer)

    def _native_decode(self, hidden: Tensor, cache: TieredKVCache | RecomputeCache, position: int,
                       rope: tuple[Tensor, Tensor]) -> Tensor | None:
        """One token per row through every block in one call of the C kernels (cpu_decode.PreparedSpan) when all
        blocks are resident in RAM with their K/V caches and the step runs its batch as one part (_step_rows: a CPU
        decode step does, whatever the plan's micro-batches) of at most native_kernels.MAX_ROWS rows, else None (the
        layer-by-layer loop runs). Issue 23 (session 22): a plan of 2 micro-batches of 4 rows took the loop, 23.5 ms
        a step of the built-in model against 21 for one call of its 8 rows."""
        if (hidden.shape[1] != 1 or self.device.type != "cpu" or not isinstance(cache, TieredKVCache)
                or len(self.resident) != self.config.num_layers
                or len(self._step_rows(hidden.shape[0], 1, position, cache)) != 1):
            return None
        prepared = cache.native_span
        if prepared is None:  # first step with this cache
            layers = range(self.config.num_layers)
            if any(self.plan.attention_tier(i) != self.plan.compute_tier or cache.off_device(i) for i in layers):
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
        if getattr(self, "packed_reader", None) is not None:
            self.packed_reader.close()
        if getattr(self, "half_store", None) is not None:
            self.half_store.close()
        self.reader.close()
        self.checkpoint.close()

    def __enter__(self) -> "OffloadedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
