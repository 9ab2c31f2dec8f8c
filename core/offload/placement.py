"""Placement: a tier for every block's weights and KV cache, from a planner policy and a RAM budget.

`place_model` turns the policy's fractions into an `EnginePlan`: which blocks are resident on the compute device,
in CPU RAM (pinned when a GPU computes) or on disk, where each block's KV cache lives, and what the engine will hold
in RAM (`ram_breakdown`), checked against an optional budget. The sizes it counts (`block_bytes`,
`cache_bytes_per_block`, `workspace_bytes`, ...) are the ones the offloaded model (offloaded_model.py) allocates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hivekeeper.planner.costmodel import (TIERS, Policy, cpu_part_sequences, cpu_step_activation_bytes,
                                         cpu_step_values, largest_matrix_params, sixteen_bit_cpu_transient_bytes)
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.formats import packed_words

from hivekeeper.core.machine.cpu_dtype import runs_natively_on_cpu
from hivekeeper.core.runtime.checkpoint import quant_compute_dtype
from hivekeeper.core.runtime.model import ModelConfig
from hivekeeper.core.runtime.quant.bnb import check_quant, quantized_block_bytes

FLOAT_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class EnginePlan:
    """Where everything lives for one run. Tiers are "gpu", "cpu" (RAM) or "disk"; on a CPU-only machine the
    compute tier is "cpu". `ram_bytes` is what the engine holds in RAM by this plan (see `ram_breakdown`)."""

    weight_tiers: tuple[str, ...]  # per block
    cache_tiers: tuple[str, ...]  # per block
    device: str  # "cpu" or "cuda[:N]"
    dtype: torch.dtype
    quant: str = "none"  # "int8"/"nf4": streamed blocks come quantized from runtime/quant/store.py
    prefetch_depth: int = 1
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    ram_budget_bytes: int | None = None
    ram_breakdown: dict[str, int] = field(default_factory=dict)
    kv_recompute: bool = False  # the cache keeps each block's input hidden states; K, V recomputed every step
    attention_on_cpu: bool = False  # with a GPU: attention over a RAM/disk cache runs on the CPU
    activations_ram_fraction: float = 0.0  # the policy's activations.cpu: micro-batches kept in RAM between blocks
    packed_format: str = ""  # a GGUF's Q8_0/Q4_0/Q4_1 its loader keeps packed in these fp32 blocks (local_plan)
    # a plan that names a float format for a GGUF (a plan file made with --quant none): its blocks, head and
    # embedding are dequantized to that format rather than kept packed (local_plan.engine_plan)
    gguf_dequantized: bool = False

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
            "packed_format": self.packed_format,
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
        if self.packed_format:  # the blocks' linears stay as the file stores them, the rest is fp32
            dtype = packed_words(self.packed_format)
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
    return config.block_param_count() * itemsize(dtype)


def outside_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Embedding, final norm and LM head (one matrix when tied)."""
    matrices = 1 if config.tie_word_embeddings else 2
    return (matrices * config.vocab_size * config.hidden_size + config.hidden_size) * itemsize(dtype)


def cache_bytes_per_block(config: ModelConfig, batch: int, max_length: int, dtype: torch.dtype,
                          recompute: bool = False) -> int:
    """One block's cache: K and V, or with recompute the block's input hidden states."""
    per_token = config.hidden_size if recompute else 2 * config.kv_dim
    return batch * max_length * per_token * itemsize(dtype)


def recompute_buffer_bytes(config: ModelConfig, rows: int, max_length: int, dtype: torch.dtype) -> int:
    """On the compute device, with recompute: one micro-batch's K, V scratch for one block, plus what recomputing
    them over the whole prefix holds at its peak (normed inputs and K/V projections, or K/V and rotary temporaries)."""
    per_token = 2 * config.kv_dim + max(config.hidden_size + 2 * config.kv_dim, 4 * config.kv_dim)
    return rows * max_length * per_token * itemsize(dtype)


def micro_batch_rows(batch: int, micro_batch_size: int, num_micro_batches: int) -> int:
    """Rows of the largest micro-batch the engine runs for `batch` sequences (OffloadedModel._micro_batches)."""
    return batch if num_micro_batches <= 1 or micro_batch_size >= batch else micro_batch_size


def sixteen_bit_cpu_transients(config: ModelConfig, dtype: torch.dtype) -> int:
    """What a 16-bit plan computed on the CPU holds beyond its tensors (costmodel.sixteen_bit_cpu_transient_bytes,
    the planner's count). Measured: a bf16 plan over the fp32 file of a 190 MB model (hidden 512, intermediate
    2048) went ~9 MB past what the other terms count."""
    largest = largest_matrix_params(config.hidden_size, config.q_dim, config.kv_dim, config.intermediate_size)
    return sixteen_bit_cpu_transient_bytes(largest, itemsize(dtype))


def cpu_attention_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """CPU attention over a 16-bit cache runs in fp32 on a CPU without 16-bit math (FlexGen does the same)."""
    return torch.float32 if dtype != torch.float32 and not runs_natively_on_cpu(dtype, rows=None) else None


def _split_activations(fraction_in_ram: float, parts: int) -> list[str]:
    """"gpu" or "cpu" for each of `parts` micro-batches: the RAM share rounded to whole micro-batches, last."""
    f = min(1.0, max(0.0, fraction_in_ram))
    counts = tier_counts({"gpu": 1.0 - f, "cpu": f}, parts, ("gpu", "cpu"))
    return ["gpu"] * counts["gpu"] + ["cpu"] * counts["cpu"]


def workspace_bytes(config: ModelConfig, batch: int, tokens: int, dtype: torch.dtype, part: int | None = None) -> int:
    """Activations of a step of `tokens` new tokens a sequence over `batch` sequences run `part` of them at a time
    through each block (None: all at once): what is alive inside a block for one part, the other parts' hidden
    states between blocks, and fp32 logits of every sequence's last token (LOGIT_COPIES: with the head's temporaries):
    the planner's own rule (costmodel.cpu_step_activation_bytes), so that the batch it picks is the batch placed."""
    part = batch if part is None else max(1, min(part, batch))
    values = cpu_step_values(config.hidden_size, config.q_dim, config.kv_dim, config.intermediate_size)
    return int(cpu_step_activation_bytes(values, config.hidden_size, config.vocab_size, batch, part, tokens,
                                         itemsize(dtype)))


def cpu_step_part(batch: int, micro_batch_rows: int, tokens: int) -> int:
    """Sequences a CPU step with K/V kept runs through a block at once (OffloadedModel._step_rows): a decode step the
    whole batch, a prefill chunk whole micro-batches until a part holds CPU_PART_TOKENS token rows (planner's rule,
    costmodel.cpu_part_sequences, so that plan and engine count the same activations)."""
    return batch if tokens == 1 else int(cpu_part_sequences(batch, micro_batch_rows, tokens))


def tier_counts(fractions: dict[str, float], total: int, tiers: tuple[str, ...]) -> dict[str, int]:
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
                quant: str = "none", held_block_bytes: int | None = None,
                held_outside_bytes: int | None = None) -> EnginePlan:
    """A tier for every block's weights and KV cache from the policy's fractions, capped by a RAM budget.

    The budget counts what the engine holds in RAM: embeddings and LM head (when the CPU computes), RAM-resident
    blocks, the streaming slots, the KV cache kept in RAM and one step's activations. Without a budget the policy's
    RAM/disk split is followed; with one, every block not on the GPU goes to RAM while the budget holds and the rest
    stays on disk. The interpreter and torch themselves (the process baseline) are not part of the budget.
    With quant "int8"/"nf4" every block counts its quantized size; the streamed ones come from runtime/quant/store.py.
    held_block_bytes / held_outside_bytes: what a block (the largest) and the embedding, norm and head take as the
    engine holds them when that is not the dtype's size (a GGUF kept packed: packed_stream.packed_sizes).
    """
    device = str(torch.device(device))
    on_gpu = torch.device(device).type == "cuda"
    layers = config.num_layers
    if batch < 1 or max_length < 1:
        raise InputError(f"batch and max_length must be positive (got {batch}, {max_length})")
    w = policy.weights
    if on_gpu:
        weights = tier_counts({"gpu": w.gpu, "cpu": w.cpu, "disk": w.disk}, layers, TIERS)
    else:  # no GPU: the plan's GPU share (if any) is RAM
        weights = tier_counts({"cpu": w.gpu + w.cpu, "disk": w.disk}, layers, ("cpu", "disk"))
        weights["gpu"] = 0
    c = policy.kv_cache
    cache = tier_counts({"gpu": c.gpu, "cpu": c.cpu, "disk": c.disk}, layers, TIERS) if on_gpu else \
        {"gpu": 0, **tier_counts({"cpu": c.gpu + c.cpu, "disk": c.disk}, layers, ("cpu", "disk"))}
    cache_tiers = ["gpu"] * cache["gpu"] + ["cpu"] * cache["cpu"] + ["disk"] * cache["disk"]

    depth = policy.prefetch_depth
    quant = check_quant(quant)
    # int8/nf4 blocks are held quantized wherever they are: resident, pinned, or in a slot the store fills
    bb = block_bytes(config, dtype) if quant == "none" else \
        quantized_block_bytes(config, quant, quant_compute_dtype(dtype, device))
    bb = bb if held_block_bytes is None else int(held_block_bytes)
    recompute = policy.kv_recompute
    cache_ram = cache["cpu"] * cache_bytes_per_block(config, batch, max_length, dtype, recompute)
    fixed = {"kv_cache": cache_ram}
    if cache["disk"]:  # a disk-tier block's cache is mapped in for its turn (tiered_cache releases it after)
        fixed["kv_cache_in_turn"] = cache_bytes_per_block(config, batch, max_length, dtype, recompute)
    rows = micro_batch_rows(batch, policy.micro_batch_size, policy.num_micro_batches)
    if not on_gpu:
        fixed["embedding_and_head"] = outside_bytes(config, dtype) if held_outside_bytes is None \
            else int(held_outside_bytes)
        tokens = min(prefill_tokens, max_length)  # a prefill chunk, in parts (recompute: the plan's micro-batches)
        part = rows if recompute else cpu_step_part(batch, rows, tokens)
        fixed["activations"] = workspace_bytes(config, batch, tokens, dtype, part)
        if quant == "none" and dtype != torch.float32:
            fixed["conversion_buffers"] = sixteen_bit_cpu_transients(config, dtype)
        if recompute:
            fixed["recompute_buffers"] = recompute_buffer_bytes(config, rows, max_length, dtype)
    else:
        parts = -(-batch // rows)
        in_ram = _split_activations(policy.activations.cpu, parts).count("cpu") / parts
        # hidden states between blocks (in and out) of a prefill chunk, for the micro-batches kept in pinned RAM
        fixed["pinned_activations"] = round(in_ram * 2 * batch * min(prefill_tokens, max_length)
                                            * config.hidden_size * itemsize(dtype))
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


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
